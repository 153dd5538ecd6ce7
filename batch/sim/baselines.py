"""Baseline schedulers that Batch is measured against, on the same simulator and interface.

Each baseline is a ``Scheduler`` (``submit`` / ``tick`` / ``has_active`` / ``metrics``), so
``simulate.run_workload(make_scheduler=...)`` runs it exactly as it runs Batch: same chunked
prefill of 64 tokens, same KV ledger and cap, same metrics. Only admission, reservation and
the victim rule differ:

* ``StaticBatchScheduler``: static batching, the naive server of the problem statement.
* ``ReservationScheduler``: FCFS continuous batching that reserves prompt + ``max_tokens`` at
  admission and so never preempts (TGI's and TensorRT-LLM's default admission).
* ``fcfs_recompute``: FCFS continuous batching with preemption by recompute, newest victim
  first (vLLM V1); this is ``Scheduler(policy=FCFSPolicy())``.
* ``round_robin``: continuous batching whose admission takes turns across users.

``BASELINES`` maps the names used in ``docs/benchmarks.md`` to factories.
"""
from __future__ import annotations

from typing import Any, Callable

import scheduler as _scheduler_module
from batch.core import step
import dataclasses

from batch.policies.policy import FCFSPolicy
from batch.policies.roundrobin import RoundRobinPolicy
from inference_stub import Request
from scheduler import Scheduler

__all__ = ["ReservationScheduler", "StaticBatchScheduler", "RoundRobinPolicy", "fcfs_recompute",
           "round_robin", "BASELINES", "STATIC_BATCH_SIZE"]

#: Default requests per static batch (the naive server's batch size).
STATIC_BATCH_SIZE = 32


class ReservationScheduler(Scheduler):
    """FCFS continuous batching with worst-case KV reservation; never preempts.

    At admission a request reserves blocks for ``len(prompt) + max_tokens`` tokens (capped at
    the cache length), so its block table never grows and no running request is ever
    preempted. The cost is memory held for tokens that are never generated when a request
    stops at EOS early, hence fewer requests resident.

    Takes the ``Scheduler`` keywords; ``policy`` defaults to ``FCFSPolicy()``. It is
    ``Scheduler(max_preemptions=0)``: every request is pinned at admission, which grants its
    worst case (``spec.fairness_rules.worst_case_blocks``) and makes it no victim.

    Source: TGI's router admits a request only when blocks for its prompt plus
    ``max_new_tokens`` are free; TensorRT-LLM's default capacity policy
    (``GUARANTEED_NO_EVICT``) reserves the same worst case.
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("policy") is None:
            kwargs["policy"] = FCFSPolicy()
        kwargs["max_preemptions"] = 0
        super().__init__(**kwargs)


class StaticBatchScheduler(ReservationScheduler):
    """Static batching: admit up to ``batch_size`` waiting requests, run them all to completion, repeat.

    No request joins a batch that has started. Admission is FCFS with worst-case reservation
    (a static batch's KV is allocated for its full length up front), so nothing is preempted.
    The next batch starts as soon as the previous one is done, with whatever is waiting (the
    server does not wait to fill ``batch_size``: the generous reading).

    With ``pad_finished`` (default) a finished request stays in the forward pass as padding
    until its batch ends, as in a padded batch of a naive server (Hugging Face ``generate``
    keeps finished rows): each padded row costs the per-request iteration time. Its tokens are
    discarded and its KV blocks are freed at once (which only lowers the reported KV use:
    nothing can be admitted before the batch ends anyway).

    Args:
        batch_size: most requests per batch (``STATIC_BATCH_SIZE`` = 32).
        pad_finished: keep finished requests in the forward pass until the batch ends.
        **kwargs: ``Scheduler`` keywords.

    Raises:
        ValueError: ``batch_size`` is not a positive int (and as ``Scheduler``).
    """

    #: its admission departs from the rules on purpose: the spec's reference tick does not model it
    reference_models = False

    def __init__(self, *, batch_size: int = STATIC_BATCH_SIZE, pad_finished: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        self.pad_finished = pad_finished
        self._padding: list[Request] = []  # finished members of the current batch
        self._inner_backend = self._backend
        self._backend = self._padded_forward

    def _padded_forward(self, batch: list[Request]) -> list[int]:
        inner = self._inner_backend or _scheduler_module.forward  # looked up now, as Scheduler does
        if not self._padding:
            return inner(batch)
        tokens = inner(list(batch) + self._padding)
        if isinstance(tokens, (list, tuple)) and len(tokens) == len(batch) + len(self._padding):
            return list(tokens[:len(batch)])  # padding rows' tokens are discarded
        return tokens  # malformed: let Scheduler's check raise BackendError

    def schedule(self):  # Scheduler.schedule with admission only into an empty batch
        cap = min(self.config.max_running, self.batch_size) if not self.running else len(self.running)
        return step.schedule(self.state, self.policy, dataclasses.replace(self.config, max_running=cap))

    def update_from_output(self, plan, tokens, **kwargs):  # plus the padding bookkeeping
        finished = super().update_from_output(plan, tokens, **kwargs)
        if not self.running:
            self._padding = []
        elif self.pad_finished:
            self._padding.extend(finished)
        return finished


def fcfs_recompute(**kwargs: Any) -> Scheduler:
    """FCFS continuous batching with preemption by recompute, newest victim first (vLLM V1).

    ``Scheduler(policy=FCFSPolicy(), **kwargs)``: admission reserves the prompt only, blocks
    grow as tokens are generated, and under KV pressure the most recently admitted request is
    preempted and later recomputed. Source: vLLM V1 ``Scheduler.schedule``.
    """
    return Scheduler(policy=FCFSPolicy(), **kwargs)


def round_robin(**kwargs: Any) -> Scheduler:
    """Continuous batching with ``RoundRobinPolicy`` admission (preemption by recompute)."""
    return Scheduler(policy=RoundRobinPolicy(), **kwargs)


#: Baselines by the names the benchmark tables use; each takes ``Scheduler`` keywords.
BASELINES: dict[str, Callable[..., Scheduler]] = {
    "Static": StaticBatchScheduler,
    "FCFS-reserve": ReservationScheduler,
    "FCFS-recompute": fcfs_recompute,
    "Round-robin": round_robin,
}
