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

from spec import fairness_rules as fr
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
    st = sched.state
    return {"tick": tick_no, "cap_blocks": sched.config.kv_cap_blocks, "free_blocks": st.pool.num_free,
            "columns": "(request_id, state, prompt, generated, computed, blocks, max_tokens)",
            "running": [_row(s) for s in st.running],
            "waiting": [_row(s) for s in st.by_obj.values() if s.state in lc.WAITING_STATES]}


def check_state(sched: Any, *, finished: Iterable[Any] = (), tick_no: int | None = None) -> None:
    """Evaluate every state invariant against a live ``Scheduler``; valid at any idle point.

    Args:
        sched: a ``scheduler.Scheduler`` (reads its state and the policy's queue; changes nothing).
        finished: scheduler records that finished in the last tick.
        tick_no: for the report.

    Raises:
        InvariantViolation: naming the first violated property and the state.
    """
    def fail(prop: str, detail: str) -> None:
        raise InvariantViolation(prop, detail, _summary(sched, tick_no))

    st, cfg = sched.state, sched.config
    cap, B = cfg.kv_cap_blocks, cfg.block_tokens
    used = st.pool.num_used
    held = [len(s.block_table) for s in st.running]
    if cfg.prefix_caching:  # a block shared by several block tables is one block (kv_used_distinct)
        held = [len({b for s in st.running for b in s.block_table})]
    if not kv_within_cap(used, cap):
        fail("kv_within_cap", f"{used} blocks in use, cap {cap}")
    if not kv_used_is_sum_held(used, held):
        fail("kv_used_is_sum_held", f"{used} blocks in use, resident requests hold {sum(held)}")
    if not ledger_consistent(st.pool.num_free, held, cap):
        fail("ledger_consistent", f"free {st.pool.num_free} + held {sum(held)} != cap {cap}")
    try:
        st.pool.check([s.block_table for s in st.running])
    except Exception as e:  # noqa: BLE001 - the pool's own ledger: a block free and held, or held twice
        fail("ledger_consistent", str(e))
    if cfg.prefix_caching:  # a cached block holds computed KV: each holder has computed all of it
        for s in st.running:
            for i, b in enumerate(s.block_table):
                if b in st.pool.key_of and s.num_computed_tokens < (i + 1) * B:
                    fail("cached_blocks_computed", f"{s.request_id}: block {i} ({b}) is cached but only "
                                                   f"{s.num_computed_tokens} of its tokens are computed")
    waiting = list(sched.policy.order())
    if len(waiting) != len(sched.policy):
        fail("exactly_one_state", f"the policy orders {len(waiting)} requests but holds {len(sched.policy)}")
    in_waiting = Counter(id(s) for s in waiting)
    in_running = Counter(id(s) for s in st.running)
    records = list(st.by_obj.values())
    known = {id(s) for s in records}
    for s in (*waiting, *st.running):
        if id(s) not in known:
            fail("exactly_one_state", f"{s.request_id}: queued or running but not in flight ({s.state})")
    eos = cfg.eos_token_id
    for s in (*records, *finished):
        final = 1 if s.state in lc.FINAL_STATES else 0
        w, r = in_waiting[id(s)], in_running[id(s)]
        if not exactly_one_state([w, r, final]):
            fail("exactly_one_state", f"{s.request_id}: {w}x waiting, {r}x running, final={bool(final)}, "
                                      f"state {s.state}")
        g = len(s.req.generated)
        if not state_agrees(STATE_CODE[s.state], w, r, g, s.num_preemptions):
            fail("state_agrees", f"{s.request_id}: state {s.state} but {w}x waiting, {r}x running, g={g}")
        _check_request(fail, s, eos, B, cfg.max_model_len_tokens)
    if st.reserved is not None and (id(st.reserved) not in in_waiting or st.reserved.state not in lc.WAITING_STATES):
        fail("reservation_waiting", f"the reservation is held by {st.reserved.request_id} in state "
                                    f"{st.reserved.state}, not a waiting request")
    p = sched.policy
    if hasattr(p, "_counter"):  # VTC: a user with a live request is never forgotten (its counter is kept)
        live_users = {s.user_id for s in records if s.state not in lc.FINAL_STATES}
        lost = sorted(u for u in live_users if u not in p._counter)
        if lost:
            fail("active_users_counted", f"users {lost} have live requests but no VTC counter (forgotten)")
    for name, counts, rows in (("resident", st.resident_by_user, st.running), ("waiting", st.waiting_by_user, waiting)):
        if not user_counts_agree(counts, Counter(s.user_id for s in rows)):
            fail("user_counts_agree", f"{name} counts {dict(counts)}, the {name} requests' users "
                                      f"{dict(Counter(s.user_id for s in rows))}")


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
    """Runtime checking for ``Scheduler(check_invariants=True)``, around every tick:

    * before the blocks are committed: the plan fits the free blocks (``plan_within_free``) and
      is the plan the rules give (``spec.reference.reference_plan``, for ``FCFSPolicy``,
      ``RoundRobinPolicy``, ``VTCPolicy`` and the scale-out's ``GlobalVTCPolicy`` on its view of
      the counters, any number of requests in flight);
    * after the tick: one forward, each chunk within the limit, the budget, the batch's KV as
      ``forward`` saw it, one token per request, every state invariant (``check_state``), the
      tick as a step of the proved model (``spec.refinement``), and the state the rules leave
      (``spec.reference.reference_apply``): each request, the queue, VTC's counters and floor,
      the reservation, the isolation streak, and the timestamps and counts of the metrics.

    With prefix caching, ``prefix_cache_reference`` (``spec.prefix_reference``): the cache's
    bookkeeping against the checker's own model of the rules (which blocks are cached, which is
    evicted, each admission's hits), around every tick; off when ``prefix_reference`` is False.

    A tick the reference does not check is counted by reason in ``skips``: ``policy`` (a policy
    it does not model), ``subclass`` (a scheduler subclass that plans otherwise,
    ``reference_models = False``), ``prefix_caching`` (hits and shared blocks are not modelled;
    the pool and the blocks' content are checked every tick by ``check_state`` and
    ``block_holds_prefix``, the cache's bookkeeping by ``prefix_cache_reference``), ``outside`` (a
    request submitted or aborted during ``forward``, by another thread or ``forward`` itself: not
    one tick alone), ``requests`` (over ``max_requests``, when one is given). ``stats()`` gives
    these and the trace validator's counts (``Scheduler.check_stats()``).
    """

    #: Check the prefix cache's bookkeeping (``spec.prefix_reference``) with prefix caching.
    prefix_reference = True

    def __init__(self, max_requests: int | None = None) -> None:
        self.ticks = 0
        self.forward_calls = 0
        self.max_requests = max_requests
        self.checked = 0
        self.skips: Counter[str] = Counter()
        self._gen_before: dict[Any, int] = {}  # record -> tokens; keyed by the object: an id() is reused
        self._snap: Any = None
        self._ref: Any = None
        self._stats_before: tuple = ()
        self._outside = 0  # aborts at the start of the tick
        self._known: set = set()  # the records in flight at the start of the tick
        self._why: str | None = None  # why the reference does not check the tick in progress
        # block_holds_prefix's ghost state: physical block -> (the checker's own chained hash of
        # the tokens before the block, the tokens whose KV the block holds so far)
        self._kv: dict[int, tuple[Any, tuple[int, ...]]] = {}
        self._chains: dict[Any, list[int]] = {}  # record -> its prefix chain, memoised (tokens only grow)
        self._writes: list[tuple[Any, list[int], int, int]] = []  # (record, table, start, end) at forward
        self._prefix: Any = None  # spec.prefix_reference.PrefixCacheModel, with prefix caching
        from spec.refinement import TraceValidator  # spec.refinement imports this module

        self.validator = TraceValidator()

    @property
    def skipped(self) -> int:
        """Ticks the reference did not check, all reasons together."""
        return sum(self.skips.values())

    def stats(self) -> dict[str, Any]:
        """``{"ticks", "reference_checked", "reference_skipped": {reason: n}, "trace_checked",
        "trace_skipped": {reason: n}}``: ticks checked, and the ticks each of the two tick
        checks (``spec.reference``, ``spec.refinement``) did not validate, by reason."""
        v = self.validator
        out = {"ticks": self.ticks, "reference_checked": self.checked, "reference_skipped": dict(self.skips),
               "trace_checked": v.checked, "trace_skipped": dict(v.skips)}
        if self._prefix is not None:  # with prefix caching: ticks prefix_cache_reference checked
            out["prefix_cache_checked"] = self._prefix.ticks
        return out

    def before_tick(self, sched: Any) -> None:
        """At the start of every tick (before ``schedule()``): the snapshots, and the policy's
        victim choice watched (``victim_candidates``)."""
        from spec import reference

        p = sched.policy
        vars(p)["_checked_by"] = sched  # the scheduler ticking with this policy now
        if "victim" not in vars(p):  # once per policy object: every candidate offered must be preemptible
            # (the protected request only alone: growth's last resort when every other one is pinned)
            choose = p.victim

            def victim(cands: Sequence[Any]) -> Any:
                ticking = vars(p)["_checked_by"]
                cfg, state = ticking.config, ticking.state
                for q in cands:
                    prot = fr.protected(q.holder, q.admit_tick, state.tick_no, cfg.quantum_ticks)
                    if q.pinned or (prot and len(cands) > 1) or not fr.may_preempt(q.num_preemptions, cfg.max_preemptions, q.admit_tick,
                                                              state.tick_no):
                        raise InvariantViolation("victim_candidates", f"{q.request_id} offered as a victim (pinned "
                                                 f"{q.pinned}, protected {prot}, preempted {q.num_preemptions} "
                                                 f"times, admitted at tick {q.admit_tick}, now {state.tick_no})",
                                                 _summary(ticking, None))
                return choose(cands)
            p.victim = victim

        self.validator.before_tick(sched)
        if sched.config.prefix_caching and self.prefix_reference:
            if self._prefix is None:
                from spec.prefix_reference import PrefixCacheModel

                self._prefix = PrefixCacheModel(sched.config.kv_cap_blocks, sched.config.block_tokens)
            self._prefix.before_tick(sched, self._failer(sched))
        why = None
        if not getattr(type(sched), "reference_models", True):  # a subclass that plans otherwise opts out
            why = "subclass"
        elif sched.config.prefix_caching:
            why = "prefix_caching"
        elif self.max_requests is not None and len(sched.state.by_obj) > self.max_requests:
            why = "requests"
        self._snap = snapshot(sched) if why is None else None
        if why is None and self._snap is None:
            why = "policy"
        self._ref = None
        s = sched.state.stats
        self._stats_before = (s.ticks, s.nonempty_ticks, s.preemptions, s.finished, len(s.itl_s))
        self._outside = s.finish_reasons["abort"]
        self._known = set(sched.state.by_obj.values())
        self._why = why  # counted when the tick completes (a failed tick is redone, not skipped)
        if self._snap is not None:
            try:
                self._ref = reference.reference_plan(self._snap)
            except reference.NoVictim as e:
                raise InvariantViolation("reference_plan", str(e), _summary(sched, self.ticks)) from e

    def before_commit(self, sched: Any, plan: Any) -> None:
        """After ``schedule()``, before its blocks are committed: ``plan_within_free`` and the
        reference plan (nothing has changed yet: the tick is not applied).

        Raises:
            InvariantViolation: naming the property.
        """
        granted = sum(plan.new_blocks)
        freed = sum(len(v.block_table) for v in plan.preempted)
        st = sched.state
        if sched.config.prefix_caching:  # shared blocks: freed when the last holder goes; a hit on a
            refs = st.pool.refs            # block nobody else holds takes a free one
            drop = Counter(b for v in plan.preempted for b in v.block_table)
            freed = sum(1 for b in drop if refs[b] - drop[b] == 0)
            granted += sum(1 for b in {b for hs in plan.hits.values() for b in hs} if refs[b] - drop[b] == 0)
        if not plan_within_free(granted, st.pool.num_free, freed):
            raise InvariantViolation("plan_within_free", f"plan grants {granted} blocks; {st.pool.num_free} free, "
                                     f"its victims free {freed}", _summary(sched, self.ticks))
        if self._prefix is not None and sched.config.prefix_caching:
            self._prefix.before_commit(sched, plan, self._failer(sched))
        ref = self._ref
        if ref is None:
            return
        got = ([(e.seq, e.num_new_tokens, e.new_blocks, e.admitted) for e in plan.batch], list(plan.preempted),
               list(plan.sat_out), plan.blocked, plan.admission_stop, plan.isolated)
        want = (ref.batch, ref.preempted, ref.sat_out, ref.blocked, ref.stop, ref.isolated)
        names = ("batch", "preempted", "sat_out", "blocked", "admission_stop", "isolated")
        for name, g, w in zip(names, got, want):
            if not _same(g, w):
                raise InvariantViolation("reference_plan", f"{name}: the rules give {_show(w)}, the scheduler "
                                         f"planned {_show(g)}", _summary(sched, self.ticks))

    def after_commit(self, sched: Any, plan: Any) -> None:
        """After ``commit`` (hits shared, blocks granted), before ``forward``: the KV each batch row
        writes, ``(record, block table, first position, end)``, applied when the tick completes."""
        self._writes = [(s, list(s.block_table), s.num_computed_tokens, s.num_computed_tokens + k)
                        for s, k in zip(plan.seqs, plan.num_new_tokens)]
        if self._prefix is not None and sched.config.prefix_caching:
            self._prefix.after_commit(sched, plan, self._failer(sched))

    def _failer(self, sched: Any) -> Callable[[str, str], None]:
        def fail(prop: str, detail: str) -> None:
            raise InvariantViolation(prop, detail, _summary(sched, self.ticks))
        return fail

    def _chain(self, seq: Any, toks: Sequence[int], n_blocks: int, B: int) -> list[int]:
        """``seq``'s chain ``c_0 .. c_{n_blocks - 1}`` (at least): ``c_0`` a root, ``c_{i+1} =
        hash((c_i, tokens of block i))``, recomputed from the request's own tokens (not
        ``prefix_cache.block_keys``). ``c_i`` reads only blocks before ``i``, which are full (so a
        memoised entry never goes stale as tokens are appended)."""
        c = self._chains.get(seq)
        if c is None:
            c = self._chains[seq] = [hash(("block_holds_prefix", B))]
        while len(c) < n_blocks:
            i = len(c) - 1
            c.append(hash((c[i], tuple(toks[i * B:(i + 1) * B]))))
        return c

    def _apply_writes(self, B: int, fail: Callable[[str, str], None]) -> None:
        """The ghost KV after ``forward``. First what each row read: the blocks before its first
        position must hold its own prefix (``block_holds_prefix``, so a request that hit a wrong
        block and finished in the same tick is caught too). Then what it wrote: its tokens
        ``start .. end - 1`` into its table's blocks; a block written from its first position
        holds the writer's prefix, one written further on extends what it held (if that was not
        the writer's, the mix shows)."""
        kv = self._kv
        rows = []
        for s, table, start, end in self._writes:
            toks = [*s.req.prompt, *s.req.generated]
            chain = self._chain(s, toks, -(-end // B), B)
            self._check_table(s.request_id, table, toks, chain, start, B, fail)
            rows.append((table, start, end, toks, chain))
        for table, start, end, toks, chain in rows:
            for i in range(start // B, -(-end // B)):
                lo, hi = max(start, i * B), min(end, (i + 1) * B)
                new = tuple(toks[lo:hi])
                if lo == i * B:
                    kv[table[i]] = (chain[i], new)
                else:
                    old = kv.get(table[i], ("never written", ()))
                    kv[table[i]] = (old[0], old[1] + new) if len(old[1]) == lo - i * B else ("mixed", ())
        self._writes = []

    def _check_table(self, rid: str, table: Sequence[int], toks: Sequence[int], chain: list[int], nc: int, B: int,
                     fail: Callable[[str, str], None]) -> None:
        """The blocks of ``table`` covering positions ``0 .. nc - 1`` hold exactly those tokens,
        each after its own prefix (``block_holds_prefix``)."""
        kv = self._kv
        for i in range(-(-nc // B)):
            b = table[i]
            want = (chain[i], tuple(toks[i * B:min((i + 1) * B, nc)]))
            got = kv.get(b)
            if got != want:
                what = "nothing" if got is None else "another prefix's KV" if got[0] != want[0] else \
                    f"tokens {list(got[1])}"
                fail("block_holds_prefix", f"{rid}: block {i} ({b}) of its table should hold its tokens "
                                           f"{i * B}..{min((i + 1) * B, nc) - 1} {list(want[1])} after its own "
                                           f"prefix; it holds {what}")

    def _check_block_contents(self, sched: Any, fail: Callable[[str, str], None]) -> None:
        """``block_holds_prefix``: every resident request's block at position ``i`` holds the KV of
        exactly its own tokens ``[i*B, min((i+1)*B, nc))`` after its own tokens ``[0, i*B)`` (the
        chain), for every block it has computed into or shared. A chaining, position or eviction
        bug in prefix caching (a hit on a block of another prefix) fails it. O(resident tokens)."""
        B = sched.config.block_tokens
        for s in sched.state.running:
            nc = s.num_computed_tokens
            if nc:
                toks = [*s.req.prompt, *s.req.generated]
                self._check_table(s.request_id, s.block_table, toks, self._chain(s, toks, -(-nc // B), B), nc, B,
                                  fail)
        final = lc.FINAL_STATES  # a record that left is not kept alive by the memo
        self._chains = {k: v for k, v in self._chains.items() if k.state not in final}

    def count_forward(self, execute_model: Any, backend: Any) -> tuple[Any, Any]:
        """Wrap the backend for one tick so its calls are counted (``one_forward_per_tick``);
        restarts the count, so a tick whose ``forward`` raised does not count against its retry."""
        self.forward_calls = 0

        def counted(f: Any) -> Any:
            if f is None:
                return None

            def call(batch: list) -> Any:
                self.forward_calls += 1
                return f(batch)
            return call
        return counted(execute_model), counted(backend)

    def after_tick(self, sched: Any, plan: Any, finished: Sequence[Any], tokens: Sequence[int] = (),
                   now_s: float | None = None) -> None:
        """Check everything after ``sched.tick()`` applied ``plan`` (see the class docstring).

        Args:
            sched: the scheduler (its lock held by the caller). plan: the ``Plan`` it ran.
            finished: the ``Request`` objects the tick returned. tokens: what ``forward`` returned.
            now_s: the clock reading the tick stamped its tokens and finishes with.

        Raises:
            InvariantViolation: naming the violated property and the state.
        """
        tick_no, calls = self.ticks, self.forward_calls
        self.ticks += 1
        self.forward_calls = 0
        st, cfg = sched.state, sched.config
        before = self._gen_before  # the next tick compares with now, even if this check raises
        self._gen_before = {s: len(s.req.generated) for s in st.by_obj.values()}

        def fail(prop: str, detail: str) -> None:
            raise InvariantViolation(prop, detail, _summary(sched, tick_no))

        if not one_forward_per_tick(calls if plan.seqs else 1):
            fail("one_forward_per_tick", f"forward called {calls} times")
        batch = list(plan.seqs)
        by_req = {id(s.req): s for s in batch}
        done = [by_req[id(r)] for r in finished if id(r) in by_req]
        if len(done) != len(finished):
            fail("exactly_one_state", "tick returned a request that was not in its batch")
        for s, k in zip(plan.seqs, plan.num_new_tokens):
            if not chunk_within_limit(k, cfg.prefill_chunk_tokens):
                fail("chunk_within_limit", f"{s.request_id}: {k} tokens in one iteration, "
                                           f"chunk {cfg.prefill_chunk_tokens}")
        if not batch_within_budget(list(plan.num_new_tokens), cfg.token_budget_tokens):
            fail("batch_within_budget", f"{plan.num_batched_tokens} tokens, budget {cfg.token_budget_tokens}")
        in_batch = {id(s) for s in batch}
        kv_at_forward = []
        for s in (*st.by_obj.values(), *done):
            delta = len(s.req.generated) - before.get(s, 0)
            if not one_token_per_tick(delta, id(s) in in_batch):
                fail("one_token_per_tick", f"{s.request_id}: {delta} tokens this tick, in batch: {id(s) in in_batch}")
            if id(s) in in_batch:
                kv_at_forward.append(blocks_for(s.num_tokens - delta, cfg.block_tokens))
        if len(kv_at_forward) != len(batch):
            fail("exactly_one_state", "a request in the batch is neither in flight nor finished")
        if cfg.prefix_caching:  # shared blocks count once: the cap is over distinct physical blocks
            kv_at_forward = [st.pool.num_used]
        if not batch_kv_within_cap(kv_at_forward, cfg.kv_cap_blocks):
            fail("batch_kv_within_cap", f"batch of {len(batch)} holds {sum(kv_at_forward)} blocks by "
                                        f"kv_blocks_for, cap {cfg.kv_cap_blocks}")
        check_state(sched, finished=done, tick_no=tick_no)
        self._apply_writes(cfg.block_tokens, fail)
        self._check_block_contents(sched, fail)
        if self._prefix is not None and cfg.prefix_caching and self._prefix.journal is not None:
            self._prefix.after_tick(sched, plan, fail, st.stats.finish_reasons["abort"] != self._outside)
        if self._snap is None:
            self.skips[self._why] += 1
        elif self._ref is not None:
            # submitted (a record the snapshot lacks) or aborted while forward ran: not the reference's tick
            if st.stats.finish_reasons["abort"] != self._outside or any(s not in self._known for s in st.by_obj.values()):
                self.skips["outside"] += 1
            else:
                self._check_reference(sched, plan, tokens, now_s, fail)
                self.checked += 1
        from spec.refinement import RefinementError  # spec.refinement imports this module

        try:
            self.validator.after_tick(sched, plan, {s: s.finish_reason for s in done})
        except RefinementError as e:
            fail("refines_model_tick", str(e))

    def _check_reference(self, sched: Any, plan: Any, tokens: Sequence[int], now_s: float | None,
                         fail: Callable[[str, str], None]) -> None:
        """The state the tick left against ``reference_apply`` (``reference_state``)."""
        from spec import reference

        snap, st = self._snap, sched.state
        want = reference.reference_apply(snap, self._ref, tokens)
        for key, r in want.reqs.items():
            got = reference.req_of(key)
            if got != r:
                fail("reference_state", f"{key.request_id}: the rules leave {_diff(r, got)}")
        if want.reserved is not st.reserved:
            fail("reference_state", f"reservation: the rules give {_show(want.reserved)}, the scheduler "
                                    f"{_show(st.reserved)}")
        if want.protected is not st.protected:
            fail("reference_state", f"protected holder: the rules give {_show(want.protected)}, the scheduler "
                                    f"{_show(st.protected)}")
        if want.arrivals != st.arrivals:
            fail("reference_state", f"arrival numbers handed out: the rules give {want.arrivals}, the scheduler "
                                    f"{st.arrivals}")
        if want.streak != st.streak or want.admissions != st.admissions or st.tick_no != snap.tick + 1:
            fail("reference_state", f"streak/admissions/tick: the rules give {want.streak}/{want.admissions}/"
                                    f"{snap.tick + 1}, the scheduler {st.streak}/{st.admissions}/{st.tick_no}")
        p = sched.policy
        if snap.policy == "fcfs" and not _same(list(p.order()), want.queue):
            fail("reference_state", f"FCFS queue: the rules give {_show(want.queue)}, the policy "
                                    f"{_show(list(p.order()))}")
        if snap.policy == "rr":
            turns = [(u, list(q)) for u, q in p._queues.items()]
            left = sorted((s for s in st.by_obj.values() if s.state in lc.WAITING_STATES), key=lambda s: s.arrival_no)
            want_turns = [(u, [s for s in left if s.user_id == u]) for u in want.turns]
            if not _same(turns, want_turns):
                fail("reference_state", f"round robin's queues: the rules give {_show(want_turns)}, the policy "
                                        f"{_show(turns)}")
        if snap.policy == "vtc" and (_counters(p) != want.counters or p.floor != want.floor):
            fail("reference_state", f"VTC counters/floor: the rules give {want.counters}/{want.floor}, the "
                                    f"policy {_counters(p)}/{p.floor}")
        if now_s is not None:
            for key in want.first_token:
                if not _same_time(key.req.started_at, now_s):
                    fail("reference_timestamps", f"{key.request_id}: first token at {now_s}, started_at "
                                                 f"{key.req.started_at}")
            for key in want.produced:
                if not _same_time(key.last_token_s, now_s):
                    fail("reference_timestamps", f"{key.request_id}: token at {now_s}, last_token_s {key.last_token_s}")
            for key, why in want.finished:
                if not _same_time(key.req.completed_at, now_s) or key.finish_reason != why:
                    fail("reference_timestamps", f"{key.request_id}: finished ({why}) at {now_s}, completed_at "
                                                 f"{key.req.completed_at} ({key.finish_reason})")
        ticks, nonempty, pre, n_e2e, n_itl = self._stats_before
        s = st.stats
        n_fin = len(want.finished)
        itl = sum(1 for k in want.produced if k not in want.first_token) if s.record_itl else 0
        got_c = (s.ticks - ticks, s.nonempty_ticks - nonempty, s.preemptions - pre, s.finished - n_e2e,
                 len(s.itl_s) - n_itl)
        want_c = (1, 1 if want.produced or self._ref.batch else 0, len(self._ref.preempted), n_fin, itl)
        if got_c != want_c:
            fail("reference_metrics", f"(ticks, non-empty ticks, preemptions, completions, ITL gaps) this tick: the "
                                      f"rules give {want_c}, the recorder {got_c}")
        tail = list(s.e2e_s)[-n_fin:] if n_fin else []  # fewer when ``max_samples`` trimmed this tick
        for (key, _), e2e in zip(want.finished[n_fin - len(tail):], tail):
            if not _same_time(e2e, key.req.completed_at - key.req.submitted_at):
                fail("reference_metrics", f"{key.request_id}: e2e recorded {e2e}, completed_at - submitted_at "
                                          f"{key.req.completed_at - key.req.submitted_at}")


def snapshot(sched: Any) -> Any:
    """The scheduler's state as ``spec.reference.Snapshot``, or ``None`` for a policy the
    reference does not model (the refinement mapping: it reads the records, not the plan)."""
    from batch.policies.policy import Policy
    from batch.policies.roundrobin import RoundRobinPolicy
    from batch.policies.vtc import VTCPolicy
    from spec import reference

    p, st, c = sched.policy, sched.state, sched.config
    try:
        from batch.scaleout.counters import GlobalVTCPolicy
    except ImportError:  # pragma: no cover - the module needs nothing beyond the core
        GlobalVTCPolicy = None
    glob = GlobalVTCPolicy is not None and type(p) is GlobalVTCPolicy
    kind = "fcfs" if type(p) is Policy else "vtc" if type(p) is VTCPolicy or glob else \
        "rr" if type(p) is RoundRobinPolicy else None
    if kind is None or c.prefix_caching:  # shared blocks: checked on the pool (check_state), not modelled
        return None
    cfg = reference.Cfg(c.kv_cap_blocks, c.block_tokens, c.prefill_chunk_tokens, c.token_budget_tokens,
                        c.max_running, c.max_preemptions, c.aging_ticks, c.headroom, c.isolation, c.resume_first,
                        c.max_sit_out_ticks, c.eos_token_id, c.quantum_ticks, c.hold_ticks)
    waiting = sorted((s for s in st.by_obj.values() if s.state in lc.WAITING_STATES), key=lambda s: s.arrival_no)
    snap = reference.Snapshot(cfg, st.pool.num_free, st.tick_no, st.streak, st.admissions, st.reserved,
                              [reference.req_of(s) for s in st.running], [reference.req_of(s) for s in waiting], kind,
                              arrivals=st.arrivals, protected=st.protected)
    if kind == "fcfs":
        snap.queue = list(p.order())
    elif kind == "rr":
        snap.turns = list(p._queues)
    else:
        snap.counters, snap.floor, snap.weights = _counters(p), p.floor, dict(p.weights)
        snap.forgets = not glob
        snap.tol, snap.prices = p.tolerance_tokens * fr.COUNTER_SCALE, (p.prompt_price, p.output_price)
    return snap


def _counters(p: Any) -> dict[str, int]:
    """VTC's counters as the policy reads them (``counter(u)``), for every user it keeps a counter
    for or, under ``GlobalVTCPolicy``, adds others' service to."""
    return {u: p.counter(u) for u in (*p._counter, *getattr(p, "_add", ()))}


def _same_time(a: Any, b: Any) -> bool:
    """Equal clock readings; two NaNs count as equal (a clock may read NaN: nothing but the
    latency figures depends on it)."""
    return a == b or (a != a and b != b)


def _same(a: Any, b: Any) -> bool:
    """Equal, comparing records by identity (lists and tuples element-wise)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b if hasattr(a, "req") or hasattr(b, "req") else a == b


def _show(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_show(y) for y in x]
    return getattr(x, "request_id", x)


def _diff(want: Any, got: Any) -> str:
    return ", ".join(f"{f}={getattr(want, f)!r} (scheduler: {getattr(got, f)!r})"
                     for f in want.__dataclass_fields__ if f != "key" and getattr(want, f) != getattr(got, f))


class ProductionChecker:
    """The cheap subset of the checks, for production (``Scheduler(production_checks=True)``,
    on by default in ``batch-llm serve``): O(batch + victims) per tick, nothing that walks every
    request or the whole pool.

    * before ``forward`` (after ``commit``): ``batch_kv_within_cap`` (blocks in use, and without
      prefix caching the batch's block tables, at most the cap) and, without prefix caching,
      ``ledger_delta``: blocks in use changed by exactly the blocks granted less those the victims
      held. A violation here raises ``PlanPastCapError`` (a ``BackendError``): the scheduler rolls
      the tick back, so such a plan never reaches the backend, and its retry policy applies
      (``max_backend_tries``: the batch fails with ``"error"`` and serving goes on).
    * after the tick: ``ledger_delta`` again (blocks in use fell by what the finished rows held;
      not compared in a tick during whose ``forward`` another thread aborted a request),
      ``resident_covered`` / ``waiting_holds_nothing`` / ``final_holds_nothing`` for each row and
      victim, and with prefix caching ``refcount_held`` (each block a row took this tick, granted
      or hit, has a reference count and is not free). A violation here is logged and counted, and
      serving goes on.

    Every violation is logged (logger ``batch.checks``, at ERROR) and counted by property in
    ``violations`` (``/metrics``: ``batch:invariant_violations_total{property}``).
    """

    def __init__(self) -> None:
        import logging

        self.log = logging.getLogger("batch.checks")
        self.ticks = 0
        self.violations: Counter[str] = Counter()
        self._used = 0  # blocks in use before commit, then after it
        self._victims = 0  # blocks the plan's victims held
        self._pre: list[int] = []  # each row's table length before commit (prefix caching)
        self._held: list[int] = []  # each row's table length at forward
        self._aborts = 0  # aborts counted at forward (one during forward frees blocks outside the plan)

    def _violation(self, prop: str, detail: str) -> str:
        self.violations[prop] += 1
        self.log.error("invariant %s violated: %s", prop, detail)
        return f"invariant {prop} violated: {detail}"

    def before_commit(self, sched: Any, plan: Any) -> None:
        """Before ``commit``: what the ledger is to be compared with."""
        self._used = sched.state.pool.num_used
        self._victims = sum(len(v.block_table) for v in plan.preempted)
        if sched.config.prefix_caching:
            self._pre = [len(s.block_table) for s in plan.seqs]

    def before_forward(self, sched: Any, plan: Any) -> str | None:
        """After ``commit``, before ``forward``: the message of the first violation, or ``None``."""
        cfg, pool = sched.config, sched.state.pool
        cap = cfg.kv_cap_blocks
        used = pool.num_used
        self._held = held = [len(s.block_table) for s in plan.seqs]
        kv = used if cfg.prefix_caching else sum(held)
        if not (kv_within_cap(used, cap) and batch_kv_within_cap([kv], cap)):
            return self._violation("batch_kv_within_cap", f"{used} blocks in use, the batch's tables hold {kv}, "
                                                          f"cap {cap}")
        if not cfg.prefix_caching and used != self._used + sum(plan.new_blocks) - self._victims:
            return self._violation("ledger_delta", f"{used} blocks in use after commit; {self._used} before, "
                                                   f"{sum(plan.new_blocks)} granted, victims held {self._victims}")
        self._used = used
        self._aborts = sched.state.stats.finish_reasons["abort"]
        return None

    def after_tick(self, sched: Any, plan: Any) -> None:
        """After ``apply``: log and count what does not hold (the tick stays applied)."""
        self.ticks += 1
        cfg, pool = sched.config, sched.state.pool
        B, prefix = cfg.block_tokens, cfg.prefix_caching
        final, resident = lc.FINAL_STATES, lc.RESIDENT_STATES
        if not prefix and sched.state.stats.finish_reasons["abort"] == self._aborts:  # another thread's abort
            gone = sum(h for s, h in zip(plan.seqs, self._held) if s.state in final)
            if pool.num_used != self._used - gone:
                self._violation("ledger_delta", f"{pool.num_used} blocks in use after the tick; {self._used} at "
                                                f"forward, the finished held {gone}")
        for i, s in enumerate(plan.seqs):
            h = len(s.block_table)
            if s.state in resident:
                if not resident_covered(h, s.num_tokens, B):
                    self._violation("resident_covered", f"{s.request_id}: holds {h} blocks for {s.num_tokens} tokens")
                if prefix:
                    bad = [b for b in s.block_table[self._pre[i]:] if pool.refs[b] < 1 or pool._is_free[b]]
                    if bad:
                        self._violation("refcount_held", f"{s.request_id}: took blocks {bad} that are free or have "
                                                         f"no reference count")
            elif s.state in final and h:
                self._violation("final_holds_nothing", f"{s.request_id}: {s.state} with {h} blocks")
        for s in plan.preempted:
            if s.state in lc.WAITING_STATES and not waiting_holds_nothing(len(s.block_table), s.num_computed_tokens):
                self._violation("waiting_holds_nothing", f"{s.request_id}: {s.state} with {len(s.block_table)} blocks")
