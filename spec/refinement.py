"""Trace validation: each tick the real scheduler takes is a step of the spec's tick relation.

``spec.model.tick`` is the relation the z3 proofs reason about: over request slots, with the
policy's freedom left as ``Choices`` (the victim, a running request left out, extra blocks at
admission, a late preemption by isolation). Refinement checking, as TLA+ users validate an
implementation's traces against a spec: before a tick, the scheduler's records are taken as
slots (the running requests in their order, then the waiting ones in the order the plan admits
them); the choices are read off the plan the scheduler made (its victims in the order it
preempted them, its sit-outs, the blocks it granted); the model then runs on those ints, and
every slot's state, ``generated`` count, ``num_computed_tokens``, blocks held and preemption
count, the free blocks, the batch and the tick's named facts must equal what the scheduler
did. A change to ``schedule()`` or ``update_from_output`` that the model does not allow (a
wrong fit, a block not freed at EOS, a preempted request keeping its blocks, an admission in a
tick that preempted) fails here, in whatever scenario exercises it, not only in the test
written for it.

``Scheduler(check_invariants=True)`` (the test suite's default) runs it every tick, of any
width (the model is quadratic in the slots on ints: a test-time cost). Each tick not validated is
counted by reason in ``TraceValidator.skips``: ``isolated`` (``Plan.isolated``: grants taken
back after admission; the model's sit-outs come before admission, so it has no such step;
``spec.reference`` checks those ticks exactly), ``prefix_caching`` (the model's blocks are per
request; shared blocks are checked on the pool and by content, ``spec.invariants.check_state``),
and ``wide`` (more slots than a ``max_slots`` given to the constructor; none by default).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from spec import model
from spec import rules
from spec.invariants import STATE_CODE

#: Default ``max_slots``: no limit (every width is validated). Kept for callers that set one.
MAX_SLOTS: int | None = None


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's records before a tick: ``record -> model.Req`` (E left 0), the running
    order, the free blocks."""

    reqs: dict[Any, model.Req]
    running: tuple[Any, ...]
    free_blocks: int


def _req(seq: Any, e: int = 0) -> model.Req:
    return model.Req(st=STATE_CODE[seq.state], P=seq.num_prompt_tokens, M=seq.req.max_tokens, E=e,
                     g=len(seq.req.generated), nc=seq.num_computed_tokens, h=len(seq.block_table),
                     pre=seq.num_preemptions)


class RefinementError(AssertionError):
    """A tick the model does not allow: ``field`` of slot ``request_id`` (or ``"free_blocks"``,
    ``"batch"``, a fact's name) differs; ``want`` is the model's value, ``got`` the scheduler's."""

    def __init__(self, what: str, request_id: str, want: Any, got: Any) -> None:
        super().__init__(f"tick not allowed by spec.model.tick: {what} of {request_id}: model {want!r}, "
                         f"scheduler {got!r}")
        self.what, self.request_id, self.want, self.got = what, request_id, want, got


class TraceValidator:
    """Checks ticks against ``spec.model.tick`` (see the module docstring).

    Attributes:
        checked: ticks validated.
        skips: ticks not validated, by reason (module docstring): ``isolated`` (grants taken back
            after admission: the model sizes admissions' chunks with the budget those grants
            had, the scheduler did not get it back in time, and the model has no such step),
            ``prefix_caching``, ``wide`` (over ``max_slots``, when one is given).
        skipped: ``skips["wide"]``. unmodelled: ``skips["isolated"] + skips["prefix_caching"]``.
    """

    __slots__ = ("max_slots", "checked", "skips", "_before")

    def __init__(self, max_slots: int | None = MAX_SLOTS) -> None:
        self.max_slots = max_slots
        self.checked = 0
        self.skips: Counter[str] = Counter()
        self._before: Snapshot | None = None

    @property
    def skipped(self) -> int:
        return self.skips["wide"]

    @property
    def unmodelled(self) -> int:
        return self.skips["isolated"] + self.skips["prefix_caching"]

    def before_tick(self, sched: Any) -> None:
        """Record the scheduler's state at the start of a tick (before ``schedule()``)."""
        st = sched.state
        self._before = Snapshot({s: _req(s) for s in st.by_obj.values()}, tuple(st.running), st.pool.num_free)

    def after_tick(self, sched: Any, plan: Any, finished_reasons: dict[Any, str]) -> None:
        """Validate the tick that ran ``plan`` (before deferred aborts are applied).

        Args:
            sched: the scheduler. plan: the ``SchedulePlan`` it ran.
            finished_reasons: record -> finish reason, for the requests the tick finished.

        Raises:
            RefinementError: the model's step differs from the scheduler's.
        """
        before, self._before = self._before, None
        if before is None:
            return
        if sched.config.prefix_caching or plan.isolated:
            self.skips["prefix_caching" if sched.config.prefix_caching else "isolated"] += 1
            return
        admitted = [e.seq for e in plan.batch if e.admitted]
        slots = [s for s in before.running if s in before.reqs] + admitted
        if self.max_slots is not None and len(slots) > self.max_slots:
            self.skips["wide"] += 1
            return
        index = {s: i for i, s in enumerate(slots)}
        eos = {s: len(s.req.generated) for s, why in finished_reasons.items() if why == "stop"}
        reqs = []
        for s in slots:
            r = before.reqs[s]
            reqs.append(r if s not in eos else model.Req(r.st, r.P, r.M, eos[s], r.g, r.nc, r.h, r.pre))
        entry = {e.seq: e for e in plan.batch}
        preempted = [index[v] for v in plan.preempted if v in index]

        def victim(i: int, attempt: int, alive: list) -> int:  # the scheduler's victims, in its order
            return next((j for j in preempted if alive[j]), -1)

        sat_out = set(plan.sat_out)
        c = sched.config
        B = c.block_tokens
        extra = [entry[s].new_blocks - rules.blocks_needed(reqs[i].n, B) if s in entry and entry[s].admitted else 0
                 for i, s in enumerate(slots)]
        # admission runs only in a tick whose running step preempted nothing, so victims beside
        # admissions made room for them (in the order they were preempted)
        room = preempted if admitted and preempted else None
        choices = model.Choices(victim=victim, skip=[s in sat_out for s in slots], extra_blocks=extra, room=room)
        cfg = model.Cfg(cap_blocks=c.kv_cap_blocks, block_tokens=B, chunk_tokens=c.prefill_chunk_tokens,
                        budget_tokens=c.token_budget_tokens, max_running=c.max_running)
        out = model.tick(reqs, before.free_blocks, cfg, choices)
        for name, holds in out.facts:
            if not holds:
                raise RefinementError(name, "the tick", True, holds)
        for i, s in enumerate(slots):
            want, got = out.reqs[i], _req(s, reqs[i].E)
            if bool(out.in_batch[i]) != (s in entry):
                raise RefinementError("in batch", s.request_id, bool(out.in_batch[i]), s in entry)
            if s in entry and out.num_new_tokens[i] != entry[s].num_new_tokens:
                raise RefinementError("num_new_tokens", s.request_id, out.num_new_tokens[i], entry[s].num_new_tokens)
            for f in ("st", "g", "nc", "h", "pre"):
                if getattr(want, f) != getattr(got, f):
                    raise RefinementError(f, s.request_id, getattr(want, f), getattr(got, f))
        if out.free_blocks != sched.state.pool.num_free:
            raise RefinementError("free_blocks", "the cache", out.free_blocks, sched.state.pool.num_free)
        self.checked += 1
