"""The invariants of Batch as pure integer functions, and a runtime checker that evaluates them.

Every predicate below uses only ``+ - <= ==`` and ``spec.logic``, so the same function runs on
Python ints (``InvariantChecker``, the stateful tests) and on ``z3.Int`` terms (the proofs in
``spec/verify.py``). They deliberately do not call the rules they police (``can_allocate``,
``growth_blocks``, ``chunk_tokens``, ``reached_length``): a bug planted in a rule must not
change the invariant that catches it. The one shared definition is ``blocks_for`` (what a
block holds), and ``kv_within_cap`` / ``ledger_consistent`` / ``resident_covered``, which
live in ``spec.rules`` because ``Scheduler.check_integrity`` already uses them.

Terms: ``n = num_tokens = len(prompt) + len(generated)``; ``nc = num_computed_tokens``;
``g = len(generated)``; ``M = max_tokens``; ``h`` = KV blocks a request holds; ``C`` the cap
in blocks; ``B`` tokens per block. State codes are ``STATE_CODE`` (ints, so z3 can hold them).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Sequence

from spec import lifecycle as lc
from spec.logic import And, Implies, Not, Or, Sum
from spec.rules import blocks_for, kv_within_cap, ledger_consistent, resident_covered

Int = Any  # a Python int or a z3 integer term
Bool = Any  # a Python bool or a z3 boolean term

__all__ = ["STATE_CODE", "ABSENT", "InvariantViolation", "InvariantChecker", "check_state",
           "kv_within_cap", "ledger_consistent", "resident_covered", "kv_used_is_sum_held",
           "waiting_holds_nothing", "final_holds_nothing", "exactly_one_state", "state_agrees",
           "computed_within_known", "resident_has_work", "generated_within_max", "live_below_limits",
           "none_after_eos", "chunk_within_limit", "batch_within_budget", "batch_kv_within_cap",
           "one_forward_per_tick", "one_token_per_tick", "request_invariants", "request_ok", "fcfs_order",
           "arrival_ordered", "user_counts_agree", "plan_within_free"]

#: Integer codes of the lifecycle states (0 is "not submitted yet", used by the models only).
ABSENT = 0
STATE_CODE: dict[str, int] = {s: i + 1 for i, s in enumerate(lc.STATES)}
_Q, _PF, _DEC, _PRE, _DONE, _AB = (STATE_CODE[s] for s in lc.STATES)


def is_waiting(st: Int) -> Bool:
    """``st`` is queued or preempted (waits for admission, holds no blocks)."""
    return Or(st == _Q, st == _PRE)


def is_resident(st: Int) -> Bool:
    """``st`` is prefilling or decoding (holds blocks, ``running`` in vLLM's terms)."""
    return Or(st == _PF, st == _DEC)


def is_final(st: Int) -> Bool:
    """``st`` is done or aborted."""
    return Or(st == _DONE, st == _AB)


# ---------------------------------------------------------------- the KV ledger


def kv_used_is_sum_held(used_blocks: Int, held_blocks: Sequence[Int]) -> Bool:
    """Blocks in use equal the sum over resident requests of the blocks each holds.

    ``used = sum_r h_r``: no block is leaked (in use, held by nobody) or invented.
    """
    return used_blocks == Sum(held_blocks)


def waiting_holds_nothing(held_blocks: Int, num_computed_tokens: Int) -> Bool:
    """A queued or preempted request holds no block and has no computed token (``h = 0, nc = 0``).

    Preemption by recompute frees every block and resets ``num_computed_tokens``.
    """
    return And(held_blocks == 0, num_computed_tokens == 0)


def final_holds_nothing(held_blocks: Int) -> Bool:
    """A finished or aborted request holds no block (``h = 0``): freed in the same tick."""
    return held_blocks == 0


def plan_within_free(granted_blocks: Int, free_blocks: Int, freed_blocks: Int) -> Bool:
    """A plan grants at most the free blocks plus those its victims free (checked before the
    blocks are committed, so an over-granting plan is named here, not by the pool refusing)."""
    return granted_blocks <= free_blocks + freed_blocks


def user_counts_agree(kept: dict[str, int], actual: dict[str, int]) -> bool:
    """The per-user counts the scheduler keeps (resident, waiting: what isolation and the fair
    share of the batch read in O(1)) equal the counts of its running list and waiting queue,
    with no zero entries (a user with none is absent)."""
    return kept == actual and all(kept.values())


# ---------------------------------------------------------------- states


def exactly_one_state(places: Sequence[Int]) -> Bool:
    """A request is in exactly one place: ``sum(places) == 1`` with every count ``>= 0``.

    Args:
        places: how many times the request appears in each place; at runtime
            ``[entries in the waiting queue, entries in the running list, 1 if final else 0]``.
    """
    return And(*(p >= 0 for p in places), Sum(places) == 1)


def state_agrees(st: Int, in_waiting: Int, in_running: Int, num_generated: Int, num_preemptions: Int) -> Bool:
    """The recorded state matches the place: waiting <-> queued/preempted, running <->
    prefilling/decoding, and a ``queued`` request has never run (``g = 0``, no preemption)."""
    return And(Implies(in_waiting >= 1, is_waiting(st)), Implies(in_running >= 1, is_resident(st)),
               Implies(Or(in_waiting >= 1, in_running >= 1), Or(is_waiting(st), is_resident(st))),
               Implies(st == _Q, And(num_generated == 0, num_preemptions == 0)))


# ---------------------------------------------------------------- tokens of one request


def computed_within_known(num_computed_tokens: Int, num_tokens: Int) -> Bool:
    """``0 <= nc <= n``: KV is never computed for a token that is not known yet."""
    return And(0 <= num_computed_tokens, num_computed_tokens <= num_tokens)


def resident_has_work(num_computed_tokens: Int, num_tokens: Int) -> Bool:
    """A live request always has a token to compute (``nc < n``): after every iteration its
    last known token (the one just produced, or the rest of the prompt) is uncomputed, so the
    next iteration can always make progress."""
    return num_computed_tokens < num_tokens


def generated_within_max(num_generated: Int, max_tokens: Int) -> Bool:
    """``0 <= g <= M``: never more output tokens than ``max_tokens``."""
    return And(0 <= num_generated, num_generated <= max_tokens)


def live_below_limits(num_generated: Int, max_tokens: Int, num_tokens: Int, max_model_len_tokens: Int) -> Bool:
    """A request still in flight has not reached a length limit: ``g < M`` and ``n < C*B``
    (it would have finished with reason ``length`` in the tick it got there). Hence a waiting
    request always fits an empty cache: ``ceil((n + 1) / B) <= C``."""
    return And(num_generated < max_tokens, num_tokens < max_model_len_tokens)


def none_after_eos(num_generated: Int, eos_position: Int, finished: Bool) -> Bool:
    """No token follows EOS, and EOS ends the request in the tick it appears.

    Args:
        num_generated: ``g``.
        eos_position: 1-based position of the first EOS in ``generated``, 0 when there is none.
        finished: whether the request has finished.

    Returns:
        ``eos_position > 0  ->  (g == eos_position and finished)``.
    """
    return Implies(eos_position > 0, And(num_generated == eos_position, finished))


def request_invariants(st: Int, num_prompt_tokens: Int, num_generated: Int, num_computed_tokens: Int,
                       held_blocks: Int, max_tokens: Int, eos_position: Int, block_tokens: Int,
                       max_model_len_tokens: Int) -> list[tuple[str, Bool]]:
    """Every per-request invariant for a request in state code ``st``, as ``(name, predicate)``."""
    n = num_prompt_tokens + num_generated
    live = Or(is_waiting(st), is_resident(st))
    return [
        ("prompt_nonempty", num_prompt_tokens >= 1),
        ("computed_within_known", computed_within_known(num_computed_tokens, n)),
        ("generated_within_max", generated_within_max(num_generated, max_tokens)),
        ("none_after_eos", none_after_eos(num_generated, eos_position, is_final(st))),
        ("live_below_limits", Implies(live, live_below_limits(num_generated, max_tokens, n, max_model_len_tokens))),
        ("resident_covered", Implies(is_resident(st), resident_covered(held_blocks, n, block_tokens))),
        ("resident_has_work", Implies(is_resident(st), resident_has_work(num_computed_tokens, n))),
        ("waiting_holds_nothing", Implies(is_waiting(st), waiting_holds_nothing(held_blocks, num_computed_tokens))),
        ("queued_never_ran", Implies(st == _Q, num_generated == 0)),
        ("final_holds_nothing", Implies(is_final(st), final_holds_nothing(held_blocks))),
    ]


def request_ok(st: Int, num_prompt_tokens: Int, num_generated: Int, num_computed_tokens: Int, held_blocks: Int,
               max_tokens: Int, eos_position: Int, block_tokens: Int, max_model_len_tokens: Int) -> Bool:
    """The conjunction of ``request_invariants``."""
    return And(*(p for _, p in request_invariants(st, num_prompt_tokens, num_generated, num_computed_tokens,
                                                  held_blocks, max_tokens, eos_position, block_tokens,
                                                  max_model_len_tokens)))


# ---------------------------------------------------------------- FCFS order (FCFSPolicy only)


def fcfs_order(states: Sequence[Int]) -> Bool:
    """Under ``FCFSPolicy``, with requests listed by arrival: no waiting request arrived before
    a running one, and no unsubmitted (``ABSENT``) one before a submitted one.

    It holds because admission moves the head of the waiting queue to the tail of the running
    list and preemption moves the tail of the running list to the head of the queue.
    """
    n = len(states)
    return And(*(Not(And(is_waiting(states[i]), is_resident(states[j]))) for i in range(n) for j in range(i + 1, n)),
               *(Implies(states[i] == ABSENT, states[j] == ABSENT) for i in range(n) for j in range(i + 1, n)))


def arrival_ordered(arrival_nos: Sequence[Int]) -> Bool:
    """Strictly increasing: under ``FCFSPolicy`` the running list followed by the waiting queue
    is sorted by arrival (so the models may process requests in arrival order)."""
    return And(*(arrival_nos[i] < arrival_nos[i + 1] for i in range(len(arrival_nos) - 1)))


# ---------------------------------------------------------------- one iteration


def chunk_within_limit(num_new_tokens: Int, chunk_tokens_max: Int) -> Bool:
    """A request in the batch processes between 1 and the chunk size (64) tokens."""
    return And(1 <= num_new_tokens, num_new_tokens <= chunk_tokens_max)


def batch_within_budget(num_new_tokens: Sequence[Int], budget_tokens: Int) -> Bool:
    """The iteration's tokens, all requests together, stay within the token budget."""
    return Sum(num_new_tokens) <= budget_tokens


def batch_kv_within_cap(kv_blocks: Sequence[Int], cap_blocks: Int) -> Bool:
    """The import contract's cap: ``sum(kv_blocks_for(r) for r in batch) <= MAX_KV_BLOCKS``,
    counted on the batch as ``forward`` receives it."""
    return Sum(kv_blocks) <= cap_blocks


def one_forward_per_tick(num_forward_calls: Int) -> Bool:
    """A tick runs at most one model iteration (none when the batch is empty)."""
    return And(0 <= num_forward_calls, num_forward_calls <= 1)


def one_token_per_tick(delta_generated: Int, in_batch: Bool) -> Bool:
    """A request gains at most one output token per tick, and only if it was in the batch."""
    return And(0 <= delta_generated, delta_generated <= 1, Implies(Not(in_batch), delta_generated == 0))


# ---------------------------------------------------------------- runtime checking


class InvariantViolation(AssertionError):
    """A spec invariant does not hold on a live scheduler: a scheduler bug.

    Attributes:
        property: the name of the violated predicate in this module (e.g. ``"kv_within_cap"``).
        detail: which request or quantity broke it.
        state: a summary of the scheduler at the check (tick, pool, every in-flight request).
    """

    def __init__(self, prop: str, detail: str, state: dict[str, Any]) -> None:
        super().__init__(f"invariant {prop} violated: {detail}\n  state: {state}")
        self.property = prop
        self.detail = detail
        self.state = state


def _eos_position(generated: Sequence[int], eos_token_id: int | None) -> int:
    for i, t in enumerate(generated):
        if t == eos_token_id:
            return i + 1
    return 0


def _row(seq: Any) -> tuple:
    return (seq.request_id, seq.state, seq.num_prompt_tokens, len(seq.req.generated), seq.num_computed_tokens,
            len(seq.block_table), seq.req.max_tokens)


def _summary(sched: Any, tick_no: int | None) -> dict[str, Any]:
    return {"tick": tick_no, "cap_blocks": sched.kv_cap_blocks, "free_blocks": sched.pool.num_free,
            "columns": "(request_id, state, prompt, generated, computed, blocks, max_tokens)",
            "running": [_row(s) for s in sched.running],
            "waiting": [_row(s) for s in sched.policy.admission_order()]}


def check_state(sched: Any, *, finished: Iterable[Any] = (), tick_no: int | None = None) -> None:
    """Evaluate every state invariant against a live ``Scheduler``; valid at any idle point.

    Args:
        sched: a ``scheduler.Scheduler`` (reads its pool, running list, policy queue and
            in-flight records; changes nothing).
        finished: scheduler records (``_Seq``) that finished in the last tick.
        tick_no: for the report.

    Raises:
        InvariantViolation: naming the first violated property and the state.
    """
    def fail(prop: str, detail: str) -> None:
        raise InvariantViolation(prop, detail, _summary(sched, tick_no))

    cap, B = sched.kv_cap_blocks, sched.block_tokens
    used = sched.pool.num_used
    held = [len(s.block_table) for s in sched.running]
    if not kv_within_cap(used, cap):
        fail("kv_within_cap", f"{used} blocks in use, cap {cap}")
    if not kv_used_is_sum_held(used, held):
        fail("kv_used_is_sum_held", f"{used} blocks in use, resident requests hold {sum(held)}")
    if not ledger_consistent(sched.pool.num_free, held, cap):
        fail("ledger_consistent", f"free {sched.pool.num_free} + held {sum(held)} != cap {cap}")
    waiting = list(sched.policy.admission_order())
    in_waiting = Counter(id(s) for s in waiting)
    in_running = Counter(id(s) for s in sched.running)
    records = list(sched._by_obj.values())
    known = {id(s) for s in records}
    for s in (*waiting, *sched.running):
        if id(s) not in known:
            fail("exactly_one_state", f"{s.request_id}: queued or running but not in flight ({s.state})")
    eos = sched.eos_token_id
    for s in (*records, *finished):
        final = 1 if s.state in lc.FINAL_STATES else 0
        w, r = in_waiting[id(s)], in_running[id(s)]
        if not exactly_one_state([w, r, final]):
            fail("exactly_one_state", f"{s.request_id}: {w}x waiting, {r}x running, final={bool(final)}, "
                                      f"state {s.state}")
        g = len(s.req.generated)
        if not state_agrees(STATE_CODE[s.state], w, r, g, s.num_preemptions):
            fail("state_agrees", f"{s.request_id}: state {s.state} but {w}x waiting, {r}x running, g={g}")
        _check_request(fail, s, eos, B, sched.max_model_len_tokens)
    for kept, rows in (("_resident_by_user", sched.running), ("_waiting_by_user", waiting)):
        counts = getattr(sched, kept, None)
        if counts is not None and not user_counts_agree(counts, Counter(s.user_id for s in rows)):
            fail("user_counts_agree", f"{kept} {dict(counts)}, the {'running list' if 'res' in kept else 'queue'} "
                                      f"has {dict(Counter(s.user_id for s in rows))}")


def _check_request(fail: Callable[[str, str], None], s: Any, eos: int | None, B: int, max_len: int) -> None:
    """Per-request invariants, each reported under its own name."""
    st, req = s.state, s.req
    g, n, nc, h = len(req.generated), s.num_tokens, s.num_computed_tokens, len(s.block_table)
    rid = s.request_id
    if not computed_within_known(nc, n):
        fail("computed_within_known", f"{rid}: num_computed_tokens {nc}, tokens known {n}")
    if not generated_within_max(g, req.max_tokens):
        fail("generated_within_max", f"{rid}: {g} generated, max_tokens {req.max_tokens}")
    if not none_after_eos(g, _eos_position(req.generated, eos), st in lc.FINAL_STATES):
        fail("none_after_eos", f"{rid}: EOS at {_eos_position(req.generated, eos)} of {g}, state {st}")
    if st in lc.RESIDENT_STATES or st in lc.WAITING_STATES:
        if not live_below_limits(g, req.max_tokens, n, max_len):
            fail("live_below_limits", f"{rid}: in flight with {g}/{req.max_tokens} tokens, length {n}/{max_len}")
    if st in lc.RESIDENT_STATES:
        if not resident_covered(h, n, B):
            fail("resident_covered", f"{rid}: holds {h} blocks for {n} tokens ({B} per block)")
        if not resident_has_work(nc, n):
            fail("resident_has_work", f"{rid}: num_computed_tokens {nc} of {n}: nothing left to compute")
    elif st in lc.WAITING_STATES:
        if not waiting_holds_nothing(h, nc):
            fail("waiting_holds_nothing", f"{rid}: {st} but holds {h} blocks, {nc} computed")
    elif not final_holds_nothing(h):
        fail("final_holds_nothing", f"{rid}: {st} but holds {h} blocks")


class InvariantChecker:
    """Runtime checking for ``Scheduler(check_invariants=True)``: every spec invariant after every tick.

    Besides the state invariants (``check_state``) it checks the iteration itself: one forward
    per tick, each chunk within ``prefill_chunk_tokens``, the token budget, the batch's KV by
    ``kv_blocks_for`` as ``forward`` saw it, one token per request per tick. For that it keeps
    ``len(generated)`` of every in-flight request from the previous tick (O(requests) memory;
    O(requests) time per tick).
    """

    __slots__ = ("ticks", "forward_calls", "_gen_before", "validator")

    def __init__(self) -> None:
        self.ticks = 0
        self.forward_calls = 0
        self._gen_before: dict[Any, int] = {}  # record -> tokens; keyed by the object: an id() is reused
        from spec.refinement import TraceValidator  # noqa: PLC0415 - spec.refinement imports this module

        self.validator = TraceValidator()

    def before_tick(self, sched: Any) -> None:
        """Called at the start of every tick (before ``schedule()``): the trace validator's snapshot."""
        self.validator.before_tick(sched)

    def before_commit(self, sched: Any, plan: Any) -> None:
        """Called after ``schedule()``, before its blocks are committed: ``plan_within_free``.

        Raises:
            InvariantViolation: the plan grants more blocks than are free once its victims' are
                freed (nothing has changed yet: the tick is not applied).
        """
        granted = sum(s.new_blocks for s in plan.batch)
        freed = sum(len(v.block_table) for v in plan.preempted)
        if not plan_within_free(granted, sched.pool.num_free, freed):
            raise InvariantViolation("plan_within_free", f"plan grants {granted} blocks; {sched.pool.num_free} free, "
                                     f"its victims free {freed}", _summary(sched, self.ticks))

    def count_forward(self, backend: Callable[[list], Any]) -> Callable[[list], Any]:
        """Wrap the backend for one tick so its calls are counted (``one_forward_per_tick``).

        Called once per tick that has a batch; restarts the count, so a tick whose ``forward``
        raised (and was rolled back) does not count against its retry.
        """
        self.forward_calls = 0

        def counted(batch: list) -> Any:
            self.forward_calls += 1
            return backend(batch)
        return counted

    def after_tick(self, sched: Any, plan: Any, finished: Sequence[Any]) -> None:
        """Check everything after ``sched.tick()`` applied ``plan``.

        Args:
            sched: the scheduler (its lock held by the caller).
            plan: the ``SchedulePlan`` the tick ran.
            finished: the ``Request`` objects the tick returned.

        Raises:
            InvariantViolation: naming the violated property and the state.
        """
        tick_no, calls = self.ticks, self.forward_calls
        self.ticks += 1
        self.forward_calls = 0
        before = self._gen_before  # the next tick compares with now, even if this check raises
        self._gen_before = {s: len(s.req.generated) for s in sched._by_obj.values()}

        def fail(prop: str, detail: str) -> None:
            raise InvariantViolation(prop, detail, _summary(sched, tick_no))

        if not one_forward_per_tick(calls):
            fail("one_forward_per_tick", f"forward called {calls} times")
        batch = [s.seq for s in plan.batch]
        by_req = {id(s.req): s for s in batch}
        done = [by_req[id(r)] for r in finished if id(r) in by_req]
        if len(done) != len(finished):
            fail("exactly_one_state", "tick returned a request that was not in its batch")
        for s in plan.batch:
            if not chunk_within_limit(s.num_new_tokens, sched.prefill_chunk_tokens):
                fail("chunk_within_limit", f"{s.seq.request_id}: {s.num_new_tokens} tokens in one iteration, "
                                           f"chunk {sched.prefill_chunk_tokens}")
        new_tokens = [s.num_new_tokens for s in plan.batch]
        if not batch_within_budget(new_tokens, sched.token_budget_tokens):
            fail("batch_within_budget", f"{plan.num_batched_tokens} tokens, budget {sched.token_budget_tokens}")
        if plan.num_batched_tokens != sum(new_tokens):  # the plan counts them from the budget it spent
            fail("batch_within_budget", f"plan says {plan.num_batched_tokens} tokens, its batch has {sum(new_tokens)}")
        in_batch = {id(s) for s in batch}
        kv_at_forward = []
        for s in (*sched._by_obj.values(), *done):
            delta = len(s.req.generated) - before.get(s, 0)
            if not one_token_per_tick(delta, id(s) in in_batch):
                fail("one_token_per_tick", f"{s.request_id}: {delta} tokens this tick, in batch: {id(s) in in_batch}")
            if id(s) in in_batch:
                kv_at_forward.append(blocks_for(s.num_tokens - delta, sched.block_tokens))
        if len(kv_at_forward) != len(batch):
            fail("exactly_one_state", "a request in the batch is neither in flight nor finished")
        if not batch_kv_within_cap(kv_at_forward, sched.kv_cap_blocks):
            fail("batch_kv_within_cap", f"batch of {len(batch)} holds {sum(kv_at_forward)} blocks by "
                                        f"kv_blocks_for, cap {sched.kv_cap_blocks}")
        check_state(sched, finished=done, tick_no=tick_no)
        from spec.refinement import RefinementError  # noqa: PLC0415 - spec.refinement imports this module

        try:
            self.validator.after_tick(sched, plan, {s: s.finish_reason for s in done})
        except RefinementError as e:
            fail("refines_model_tick", str(e))
