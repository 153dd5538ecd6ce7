"""Batch: a fair, formally specified continuous-batching scheduler for LLM inference.

The contract modules stay at the project root (``scheduler``, ``inference_stub``,
``request_gen``); this package holds what they and the main job are built from:

* ``batch.core``: what runs inside ``Scheduler.tick`` besides ``scheduler.py`` (the state, the
  tick's steps, KV blocks, metrics, the backend interface);
* ``batch.policies``: the policy interface, FCFS, VTC, round robin, the clairvoyant oracle;
* ``batch.sim``: arrival replay on the simulated GPU, benchmark workloads, trace loading;
* ``batch.backends``: a real model under the scheduler (the optional ``model`` extra);
* ``batch.cli``: the main job's command line (``python -m batch``, ``batch-sim``).

Nothing is imported here: ``import scheduler`` needs only the standard library and
``transitions``, and each sub-package imports no more than its modules ask for. ``batch.__version__``
is looked up when first read (``batch.version``: the installed distribution's, else
``pyproject.toml``'s).
"""
from __future__ import annotations

__version__: str  # declared, not set: __getattr__ answers it on first read


def __getattr__(name: str) -> str:
    if name == "__version__":
        from batch.version import version  # only when asked for

        return version()
    raise AttributeError(f"module 'batch' has no attribute {name!r}")
