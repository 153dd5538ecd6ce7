"""The scheduler's records and its plan: what one iteration decides, as data.

``Seq`` is the scheduler's record of a request (state lives here, never on the caller's
``Request``). ``PlanDraft`` is the plan while the steps of ``Scheduler.schedule`` build it
(running requests, then admission, then isolation); ``SchedulePlan`` the frozen result that
``tick()`` commits, and ``ScheduledSeq`` one request's share of the iteration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from inference_stub import Request
from spec import lifecycle as lc

#: The one shared lifecycle machine (``spec.lifecycle.new_machine``, ``model=None``): every state
#: change of a request record fires one of its ``EVENTS`` (``EVENTS["admit"].trigger(seq)``).
MACHINE = lc.new_machine()
EVENTS = MACHINE.events


@dataclass(slots=True, eq=False)
class Seq:
    """The scheduler's record of one request (compares by identity).

    ``num_tokens`` = prompt + generated tokens known; ``num_computed_tokens`` of them have KV
    in the cache (vLLM's terms); ``block_table`` lists the block ids held.
    """

    req: Request
    user_id: str
    arrival_no: int
    num_prompt_tokens: int
    state: str = lc.QUEUED
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    admit_no: int = -1
    admit_tick: int = -1
    num_prompt_tokens_served: int = 0  # most prompt tokens ever computed: prompts are charged once
    blocked_ticks: int = 0  # ticks as the first waiting request that did not fit (aging)
    pinned: bool = False  # admitted with worst-case blocks after MAX_PREEMPTIONS; never a victim
    admitted_s: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None
    decode_entry: ScheduledSeq | None = None  # ScheduledSeq(self, 1, 0, False), built at admission, reused
    rid: str = ""  # request_id at submit: the key in Scheduler._by_id, even if the caller changes the field

    @property
    def num_output_tokens(self) -> int:
        return len(self.req.generated)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.req.generated)

    @property
    def request_id(self) -> str:
        return self.req.request_id


class ScheduledSeq(NamedTuple):
    """One request's share of an iteration (immutable; a ``NamedTuple``, cheap to build per
    request per tick).

    Attributes:
        seq: the scheduler's record.
        num_new_tokens: tokens processed this iteration (a prefill chunk, or 1 for a decode).
        new_blocks: blocks granted before the iteration (whole prompt at admission, growth after).
        admitted: the request enters from the waiting queue in this iteration.
    """

    seq: Seq
    num_new_tokens: int
    new_blocks: int
    admitted: bool


@dataclass(frozen=True, slots=True)
class SchedulePlan:
    """The decision for one iteration (vLLM V1's ``SchedulerOutput``, reduced).

    Attributes:
        batch: the participating requests, in ``forward`` order.
        preempted: resident requests preempted by recompute before this iteration.
        num_batched_tokens: sum of ``num_new_tokens``, tokens.
        free_blocks_after: free blocks once the plan is applied.
        admission_stop: why admission stopped: ``"empty"`` (nothing waiting), ``"kv"``,
            ``"budget"``, ``"max_running"`` or ``"preempted"`` (no admission in a tick that
            preempted).
        sat_out: resident requests that sit out this iteration, keeping their KV (TTFT
            isolation, ``isolation.py``).
        blocked: the first waiting request that did not fit (its aging count grows), or None.
        reserve: the request that holds the reservation after this iteration (room was made
            for it by preemption), or None.
        isolated: whether this iteration is isolated (``sat_out`` or deferred admissions).
        trimmed: whether ``sat_out`` sit out to meet ``Isolation.iteration_target_s`` (then not isolated).
        revised: isolation took grants back after admission (sit-outs, deferred admissions): the
            admissions' chunks were sized before the budget came back.
        protected_updates: user -> protected (TTFT protection hysteresis states to commit).
    """

    batch: tuple[ScheduledSeq, ...]
    preempted: tuple[Seq, ...]
    num_batched_tokens: int
    free_blocks_after: int
    admission_stop: str
    sat_out: tuple[Seq, ...] = ()
    blocked: Seq | None = None
    reserve: Seq | None = None
    isolated: bool = False
    protected_updates: dict[str, bool] = field(default_factory=dict)
    trimmed: bool = False
    revised: bool = False

    @property
    def requests(self) -> list[Request]:
        """The ``Request`` objects passed to ``forward``, in batch order."""
        return [s.seq.req for s in self.batch]


DECODE_GRANT = (1, 0)  # (num_new_tokens, new_blocks) of a decode on the fast path (rules.decode_ready)


def first_not_in(xs: list[Any], ys: list[Any]) -> Any:
    """The first of ``xs`` not in ``ys`` (by identity), or None."""
    if not xs:
        return None
    seen = {id(y) for y in ys}
    return next((x for x in xs if id(x) not in seen), None)


@dataclass(slots=True, eq=False)
class PlanDraft:
    """The scheduler's plan while it is being built (``Scheduler.schedule``); mutable.

    Attributes:
        live: resident requests not preempted, admission order.
        order: resident requests scheduled this iteration.
        admitted: waiting requests admitted this iteration.
        grants: request -> ``(num_new_tokens, new_blocks)`` for ``order`` and ``admitted`` (a
            tuple or list; read it, never change it in place: decodes share one tuple).
        preempted: requests preempted by recompute before this iteration.
        free_blocks: free blocks once the plan is applied.
        budget_tokens: token budget left.
        blocked: waiting candidates that did not fit, in the order tried.
        stop: why admission stopped.
        pending: scheduled requests with no output token yet (prefilling toward the first token).
        aging_due: ``blocked[0]`` reaches the aging bound with this iteration: room is made
            for no one else (its reservation comes first).
        sat_out: resident requests that sit out this iteration (output).
        reserve: a request that gets the reservation after this iteration (output).
        isolated: whether over-served requests sit out (output).
        trimmed: whether they sit out to meet the iteration target (output; never with ``isolated``).
        protected_updates: user -> protected, the hysteresis states to commit (output).
        revised: grants were taken back after admission (``drop``: sit-outs, deferrals).
    """

    live: list[Any]
    order: list[Any]
    admitted: list[Any]
    grants: dict[Any, Sequence[int]]
    preempted: list[Any]
    free_blocks: int
    budget_tokens: int
    blocked: list[Any]
    stop: str
    pending: list[Any]
    aging_due: bool = False
    sat_out: list[Any] = field(default_factory=list)
    reserve: Any = None
    isolated: bool = False
    trimmed: bool = False
    protected_updates: dict[str, bool] = field(default_factory=dict)
    revised: bool = False

    def freeze(self, token_budget_tokens: int) -> SchedulePlan:
        """The ``SchedulePlan`` of this draft (``token_budget_tokens``: the budget it started
        from; the batch's tokens are what the grants spent of it)."""
        g, decode = self.grants, DECODE_GRANT
        # a decode's entry is the same every tick: built once, at admission (Scheduler._admit)
        entries = [(s.decode_entry or ScheduledSeq(s, 1, 0, False)) if g[s] is decode
                   else ScheduledSeq(s, g[s][0], g[s][1], False) for s in self.order]
        entries += [ScheduledSeq(s, g[s][0], g[s][1], True) for s in self.admitted]
        return SchedulePlan(batch=tuple(entries), preempted=tuple(self.preempted),
                            num_batched_tokens=token_budget_tokens - self.budget_tokens,
                            free_blocks_after=self.free_blocks, admission_stop=self.stop, sat_out=tuple(self.sat_out),
                            blocked=first_not_in(self.blocked, self.admitted), reserve=self.reserve,
                            isolated=self.isolated, protected_updates=self.protected_updates, trimmed=self.trimmed,
                            revised=self.revised)

    def drop(self, seqs: list[Any]) -> None:
        """Take ``seqs`` out of this iteration (sit out / defer): their grants go back."""
        gone = set(seqs)
        self.revised = self.revised or bool(seqs)
        for q in seqs:
            n, blocks = self.grants.pop(q)
            self.free_blocks += blocks
            self.budget_tokens += n
        self.order = [q for q in self.order if q not in gone]
        self.admitted = [q for q in self.admitted if q not in gone]
