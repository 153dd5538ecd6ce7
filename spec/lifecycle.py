"""The request lifecycle as data: states, events and the transition table.

One request moves ``queued -> prefilling -> decoding -> done``; under KV pressure a resident
request is preempted by recompute (its blocks freed, its tokens kept) and later resumes with
a fresh prefill of prompt plus generated tokens. ``aborted`` is the end of a cancelled
request. A request whose prompt can never fit is refused at ``submit`` and never enters.

``new_machine()`` builds the one shared ``transitions.Machine`` (``model=None``,
``auto_transitions=False``) the scheduler fires events through; requests are never registered
with it (see ``../shared/guides/style.md``).
"""
from __future__ import annotations

from typing import Any

QUEUED = "queued"
PREFILLING = "prefilling"
DECODING = "decoding"
PREEMPTED = "preempted"
DONE = "done"
ABORTED = "aborted"

#: Every state a request can be in, in lifecycle order.
STATES: tuple[str, ...] = (QUEUED, PREFILLING, DECODING, PREEMPTED, DONE, ABORTED)
#: States whose requests wait for admission and hold no KV blocks.
WAITING_STATES = frozenset({QUEUED, PREEMPTED})
#: States whose requests hold KV blocks (``running`` in vLLM's terms).
RESIDENT_STATES = frozenset({PREFILLING, DECODING})
#: States a request never leaves.
FINAL_STATES = frozenset({DONE, ABORTED})

#: The transition table: ``(event, sources, destination)``.
TRANSITIONS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    # Admission: blocks for the whole prompt (plus one lookahead slot) are granted.
    ("admit", (QUEUED,), PREFILLING),
    # Re-admission after preemption: recompute prompt + generated tokens.
    ("resume", (PREEMPTED,), PREFILLING),
    # The final prefill chunk ran and its token was appended; the request continues.
    ("prefill_done", (PREFILLING,), DECODING),
    # Preemption by recompute: blocks freed, num_computed_tokens reset, tokens kept.
    ("preempt", (PREFILLING, DECODING), PREEMPTED),
    # EOS, max_tokens or the model length was reached; blocks freed in the same tick.
    ("finish", (PREFILLING, DECODING), DONE),
    # Cancelled by the caller, from any live state; blocks (if any) freed at once.
    ("abort", (QUEUED, PREFILLING, DECODING, PREEMPTED), ABORTED),
)
#: Event names, in table order.
EVENTS: tuple[str, ...] = tuple(e for e, _, _ in TRANSITIONS)


def new_machine(**kwargs: Any):
    """A ``transitions.Machine`` built from ``STATES`` and ``TRANSITIONS``.

    Args:
        **kwargs: passed on to the machine class (for example ``graph_engine="mermaid"``
            together with a diagrams class through ``machine_cls``, and a ``model`` to draw).

    Returns:
        A machine with ``model=None``, ``auto_transitions=False`` and ``initial="queued"``:
        fire an event on a record with ``machine.events[name].trigger(record)``; an event
        fired from a state the table does not list raises ``transitions.MachineError``.
    """
    machine_cls = kwargs.pop("machine_cls", None)
    if machine_cls is None:
        from transitions import Machine as machine_cls
    return machine_cls(
        model=kwargs.pop("model", None),
        states=list(STATES),
        transitions=[{"trigger": e, "source": list(src), "dest": dst} for e, src, dst in TRANSITIONS],
        initial=QUEUED,
        auto_transitions=False,
        **kwargs,
    )
