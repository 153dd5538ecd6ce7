"""Stateful property tests: Hypothesis drives the real Scheduler beside a deliberately simple
reference model and checks every spec invariant after every step.

Each run is a program of submits (valid, refused, duplicate), aborts, ticks and runs of
ticks, over a small KV cache (8-16 blocks) so preemption is frequent, with a backend that
returns EOS at a chosen output position or never, under FCFS as the proofs model it or under
the scheduler's default policy (VTC with isolation, pinning and aging). A failure prints the
program as replayable Python (``state = SchedulerMachine(); state.setup(...); ...``).

Steps per run and runs: ``BATCH_STATEFUL_STEPS`` (200) and ``BATCH_STATEFUL_EXAMPLES`` (50);
``make verify`` raises both.
"""
from __future__ import annotations

import os
import zlib

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from batch.core.backfill import budget_never_binds
from batch.core.isolation import Isolation
from batch.policies.policy import VTCPolicy
from conftest import StepClock
from inference_stub import Request
from scheduler import DuplicateRequestError, InvalidRequestError, PromptTooLongError, Scheduler
from spec import invariants as inv
from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import model, rules
from spec.verify import fcfs_kwargs

STEPS = int(os.environ.get("BATCH_STATEFUL_STEPS", "200"))
#: A drain under the default policy may take this many times the FCFS bound (plus a constant):
#: a generous liveness check; the policy's own bounds are spec/verify_fairness.py's.
DRAIN_SLACK = 4
EXAMPLES = int(os.environ.get("BATCH_STATEFUL_EXAMPLES", "50"))
EOS = 0
USERS = ("a", "b", "c")
#: ``submit_burst`` runs only while at most this many requests are in flight (keeps runs short).
MAX_IN_FLIGHT_FOR_BURST = 12
WAITING = lc.WAITING_STATES


def token_at(rid: str, k: int) -> int:
    """The backend's k-th output token (1-based) for ``rid`` when it is not EOS: in 1..63."""
    return 1 + zlib.crc32(f"{rid}:{k}".encode()) % 63


def worst_case_iterations(prompt_tokens: int, max_tokens: int, chunk_tokens: int) -> int:
    """The most iterations a request can need, across preemptions: recomputing at most
    ``prompt + max_tokens`` tokens in chunks, then its outputs (the bound's ``L``)."""
    return -(-(prompt_tokens + max_tokens) // chunk_tokens) + max_tokens


def row_dest(event: str, state: str) -> str | None:
    """The state ``event`` leads to from ``state`` by ``spec.lifecycle.TRANSITIONS``, or None."""
    for e, sources, dest in lc.TRANSITIONS:
        if e == event and state in sources:
            return dest
    return None


def tick_changes(state: str) -> set[str]:
    """The states one tick can take a request in ``state`` to, by the table's rows: a grant
    (``admit`` or ``resume``), then ``prefill_done``, then ``finish``, each optional (a request
    admitted with a one-chunk prompt may decode or finish in the tick that admits it), or a lone
    ``preempt`` (a request admitted this tick is not a victim; admission does not run in a tick
    that preempted, so a preempted request does not come back in it)."""
    out = set()
    for granted in (state, row_dest("admit", state), row_dest("resume", state)):
        if granted is None:
            continue
        for decoded in (granted, row_dest("prefill_done", granted)):
            if decoded is None:
                continue
            out |= {decoded, row_dest("finish", decoded)}
    out.add(row_dest("preempt", state))
    out.discard(None)
    return out


class RecordingBackend:
    """Deterministic model: EOS as the ``eos_at[rid]``-th output token (never when absent),
    else ``token_at``. Records, per tick, the number of calls and each batch's KV blocks by
    ``kv_blocks_for`` (at the scheduler's block size) as ``forward`` received it."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.eos_at: dict[str, int] = {}
        self.calls = 0
        self.batch_blocks: list[int] = []

    def __call__(self, batch: list[Request]) -> list[int]:
        self.calls += 1
        self.batch_blocks.append(sum(rules.blocks_for(len(r.prompt) + len(r.generated), self.block_tokens)
                                     for r in batch))
        return [EOS if self.eos_at.get(r.request_id) == len(r.generated) + 1
                else token_at(r.request_id, len(r.generated) + 1) for r in batch]


class SchedulerMachine(RuleBasedStateMachine):
    """The real Scheduler (runtime invariant checking on) against a reference model.

    Reference model: the set of accepted request ids, the ids returned so far, and per request
    the submit tick and the FCFS deadline ``D_r`` (``docs/spec.md``): nothing else.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.step_failed = False  # a step raised: teardown must not tick a broken scheduler

    @initialize(cap_blocks=st.integers(8, 16), block_tokens=st.sampled_from([4, 16]),
                chunk_tokens=st.sampled_from([8, 0]), budget_tokens=st.sampled_from([0, 24]),
                max_running=st.sampled_from([256, 3]), policy=st.sampled_from(["fcfs", "default", "packed"]),
                short_bounds=st.booleans())
    def setup(self, cap_blocks: int, block_tokens: int, chunk_tokens: int, budget_tokens: int,
              max_running: int, policy: str, short_bounds: bool) -> None:
        """``chunk_tokens=0`` means the default chunk, which must be the spec's
        (``rules.PREFILL_CHUNK_TOKENS``, the problem's 64); ``budget_tokens=0`` the default budget
        (the cache's capacity in tokens).
        ``policy``: ``fcfs`` is FCFS as the proofs model it (``spec.verify.FCFS_SOURCE``);
        ``default`` the scheduler's defaults (VTC with isolation, EASY backfilling, the admission
        headroom, pinning and aging); ``packed`` VTC with plain backfill and no headroom, which
        packs the cache and so preempts often, with ``max_preemptions=1`` so that pinned requests
        sit among the candidates (the defaults preempt rarely in these programs,
        and user ``a`` weighs 3, so its share is larger and it is often a light user,
        and the victim choice would go untested). ``short_bounds``: the VTC policies with
        ``aging_ticks=2`` and ``max_sit_out_ticks=1`` (so that runs of a few hundred ticks reach
        the reservation and the sit-out cap)."""
        self.step_failed = True  # until set up: teardown must not drain a half-built machine
        self.backend = RecordingBackend(block_tokens)
        self.fcfs = fcfs = policy == "fcfs"
        knobs = fcfs_kwargs() if fcfs else (
            {"aging_ticks": 2, "isolation": Isolation(max_sit_out_ticks=1)} if short_bounds else {})
        if policy == "packed":
            knobs["policy"] = VTCPolicy(backfill=True, admission_headroom=False, easy_backfill=False, weights={"a": 3})
            knobs["max_preemptions"] = 1
        if chunk_tokens:
            knobs["prefill_chunk_tokens"] = chunk_tokens
        self.sched = Scheduler(kv_cap_blocks=cap_blocks, block_tokens=block_tokens,
                               token_budget_tokens=budget_tokens or None, max_running=max_running,
                               backend=self.backend, clock=StepClock(), check_invariants=True, **knobs)
        if not chunk_tokens:
            chunk_tokens = self.sched.prefill_chunk_tokens
            assert chunk_tokens == rules.PREFILL_CHUNK_TOKENS, \
                f"the default chunk is {chunk_tokens} tokens, the spec's {rules.PREFILL_CHUNK_TOKENS}"
        s = self.sched
        self.chunk_eff = min(chunk_tokens, s.token_budget_tokens)
        # The default policy's admission bound (docs/fairness.md section 4) holds where every
        # resident request runs in every iteration it does not sit out: the budget never binds.
        self.wait_bound_applies = not fcfs and budget_never_binds(
            s.token_budget_tokens, cap_blocks, block_tokens, max_running, chunk_tokens) and (
            s.isolation is None or s.isolation.iteration_target_s is None)
        self.sit_out_cap = s.isolation.max_sit_out_ticks if s.isolation is not None else 0
        self.max_work = 0  # the most iterations any accepted request can need (L), so far
        self.holder: object | None = None  # the reservation holder, the tick it took it, its bound
        self.holder_since = self.holder_bound = 0
        self.blocked: dict[int, int] = {}  # id(record) -> ticks it was the plan's first not to fit, while waiting
        self.seq_of: dict[str, object] = {}  # rid -> the scheduler's record, for the lifecycle check
        self.state_of: dict[str, str] = {}  # rid -> its state after the last step
        self.charged: dict[str, list[int]] = {}  # user -> [prompt, output] tokens charged this tick
        self.activated: set[str] = set()  # users that became backlogged this tick (a lift may apply)
        if not fcfs:  # record what the scheduler charges VTC, and when a user's counter may be lifted
            policy = self.sched.policy
            on_service, activate = policy.on_service, policy._activate

            def recording_on_service(user_id: str, prompt_tokens: int, output_tokens: int) -> None:
                acc = self.charged.setdefault(user_id, [0, 0])
                acc[0] += prompt_tokens
                acc[1] += output_tokens
                on_service(user_id, prompt_tokens, output_tokens)

            def recording_activate(user_id: str, *a, **kw):
                self.activated.add(user_id)
                return activate(user_id, *a, **kw)

            def checked_choose_victim(running):
                victim = choose_victim(running)
                self._check_victim(victim, running)
                return victim

            choose_victim = policy.choose_victim
            policy.on_service, policy._activate = recording_on_service, recording_activate
            policy.choose_victim = checked_choose_victim
        self.ticks = 0
        self.next_id = 0
        self.accepted: dict[str, Request] = {}
        self.returned: set[str] = set()
        self.deadline: dict[str, int] = {}  # rid -> tick by whose end it must have finished
        self.step_failed = False

    # ------------------------------------------------------------ steps

    @rule(user=st.sampled_from(USERS),
          prompt_tokens=st.one_of(st.integers(1, 40), st.integers(41, 300)),
          max_tokens=st.one_of(st.integers(0, 12), st.integers(13, 64)),
          eos_at=st.one_of(st.just(0), st.integers(1, 14), st.integers(15, 70)))
    def submit(self, user: str, prompt_tokens: int, max_tokens: int, eos_at: int) -> None:
        """``eos_at``: the output position at which the backend returns EOS (0: never)."""
        s = self.sched
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(user_id=user, prompt=[1 + i % 63 for i in range(prompt_tokens)], max_tokens=max_tokens,
                      request_id=rid)
        before = self._observable()
        if max_tokens < 1:
            with pytest.raises(InvalidRequestError):
                s.submit(req)
        elif not rules.prompt_fits(prompt_tokens, s.kv_cap_blocks, s.block_tokens):
            with pytest.raises(PromptTooLongError):
                s.submit(req)
        else:
            if eos_at:
                self.backend.eos_at[rid] = eos_at
            older = sum(model.fcfs_service_ticks(len(r.prompt), r.max_tokens, self.chunk_eff)
                        for q, r in self.accepted.items() if q not in self.returned)
            s.submit(req)
            self.accepted[rid] = req
            self.seq_of[rid] = s._by_obj[id(req)]
            self.state_of[rid] = lc.QUEUED
            self.max_work = max(self.max_work, worst_case_iterations(prompt_tokens, max_tokens, self.chunk_eff))
            self.deadline[rid] = self.ticks + older + model.fcfs_service_ticks(prompt_tokens, max_tokens,
                                                                                self.chunk_eff) - 1
            return
        assert self._observable() == before, "a refused request changed the scheduler"

    @precondition(lambda self: self.sched is not None and len(self.accepted) - len(self.returned) <= MAX_IN_FLIGHT_FOR_BURST)
    @rule(user=st.sampled_from(USERS), n=st.integers(2, 8), prompt_tokens=st.integers(1, 40),
          max_tokens=st.integers(8, 64), light=st.booleans())
    def submit_burst(self, user: str, n: int, prompt_tokens: int, max_tokens: int, light: bool) -> None:
        """``n`` requests of one user at once, running to ``max_tokens`` (no EOS): the cache fills,
        requests grow into each other and are preempted (the A/B burst in small); with ``light``,
        then one short request of the next user, which holds few blocks among them (a light user:
        the victim rule's shield). Only while at most ``MAX_IN_FLIGHT_FOR_BURST`` are in flight:
        every tick checks every request."""
        for _ in range(n):
            self.submit(user, prompt_tokens, max_tokens, 0)
        if light:
            self.submit(USERS[(USERS.index(user) + 1) % len(USERS)], 1, max_tokens, 0)

    @precondition(lambda self: self.sched is not None and any(q not in self.returned for q in self.accepted))
    @rule(data=st.data())
    def submit_duplicate(self, data: st.DataObject) -> None:
        live = sorted(q for q in self.accepted if q not in self.returned)
        rid = data.draw(st.sampled_from(live), label="rid")
        before = self._observable()
        # The same object again, in any state: refused as a duplicate, changing nothing.
        with pytest.raises(DuplicateRequestError):
            self.sched.submit(self.accepted[rid])
        assert self._observable() == before

    @precondition(lambda self: self.sched is not None and any(q not in self.returned for q in self.accepted))
    @rule(data=st.data(), by_id=st.booleans())
    def abort(self, data: st.DataObject, by_id: bool) -> None:
        live = sorted(q for q in self.accepted if q not in self.returned)
        rid = data.draw(st.sampled_from(live), label="rid")
        req = self.accepted[rid]
        assert self.sched.abort(rid if by_id else req) is req
        assert self.seq_of[rid].state == lc.ABORTED, f"{rid} aborted, in state {self.seq_of[rid].state}"
        self.returned.add(rid)
        g = req.generated
        assert EOS not in g and g == [token_at(rid, k) for k in range(1, len(g) + 1)]
        assert self.sched.abort(rid) is None  # once only

    @rule()
    def tick(self) -> None:
        calls = self.backend.calls
        vtc = not self.fcfs
        if vtc:  # what each request had before the tick, for the charges the spec implies
            policy = self.sched.policy
            before = {q: (q.num_computed_tokens, q.num_prompt_tokens_served, len(q.req.generated))
                      for q in self.sched._by_obj.values()}
            counters = {u: policy.counter(u) for u in USERS}
            self.charged, self.activated = {}, set()
        self.step_failed = True
        finished = self.sched.tick()
        self.step_failed = False
        if vtc:
            self._check_vtc_charges(before, counters)
        assert inv.one_forward_per_tick(self.backend.calls - calls)
        if self.backend.calls > calls:
            assert inv.batch_kv_within_cap([self.backend.batch_blocks[-1]], self.sched.kv_cap_blocks)
        for r in finished:
            self._check_finished(r)
        self._count_blocked()
        self.ticks += 1
        # the per-tick properties, after every tick (not only after a rule: a run of ticks is many steps)
        self._check_lifecycle(in_tick=True)
        self.default_policy_admission_bound()
        self.preemption_cap_and_aging_hold()

    @rule(n=st.integers(2, 30))
    def ticks(self, n: int) -> None:
        for _ in range(n):
            self.tick()

    # ------------------------------------------------------------ invariants after every step

    @invariant()
    def spec_invariants_hold(self) -> None:
        if self.sched is not None:
            inv.check_state(self.sched)

    @invariant()
    def reference_model_agrees(self) -> None:
        if self.sched is None:
            return
        in_flight = {q for q in self.accepted if q not in self.returned}
        assert self.sched.has_active() == bool(in_flight)
        assert {s.request_id for s in self.sched._by_obj.values()} == in_flight
        for q in in_flight:  # tokens so far are the backend's tokens, in order, none lost or repeated
            g = self.accepted[q].generated
            assert g == [token_at(q, k) for k in range(1, len(g) + 1)], q

    @invariant()
    def preemption_cap_and_aging_hold(self) -> None:
        """No request is preempted more than ``max_preemptions`` times (then it is pinned), and
        a waiting request blocked for ``aging_ticks`` ticks has made someone hold the reservation."""
        s = self.sched
        if s is None:
            return
        for q in s._by_obj.values():
            assert q.num_preemptions <= s.max_preemptions, f"{q.request_id} preempted {q.num_preemptions} times"
            blocked = self.blocked.get(id(q), 0)
            if q.state in WAITING and blocked >= s.aging_ticks:
                assert s._reserved is not None, f"{q.request_id} blocked {blocked} ticks, no reservation"

    @invariant()
    def default_policy_admission_bound(self) -> None:
        """The default policy's no-starvation bound, on the code (``docs/fairness.md`` section 4,
        proved on the abstraction by ``no_starvation_aging``): with ``T = aging_ticks``,
        ``K = max_sit_out_ticks`` and ``L`` the most iterations an accepted request can need, no
        waiting request is the first that does not fit in more than ``admission_wait_bound(T, K,
        L)`` ticks, and a reservation holder is admitted within ``ticks_to_drain_bound(K, L) + 1``
        ticks of taking the reservation. Where the token budget can bind the bound does not apply
        (a resident request may not run for lack of budget); the drain in ``teardown`` remains."""
        s = self.sched
        if s is None or not self.wait_bound_applies:
            return
        bound = fr.admission_wait_bound(s.aging_ticks, self.sit_out_cap, self.max_work)
        for q in s._by_obj.values():
            blocked = self.blocked.get(id(q), 0)
            if q.state in WAITING:
                assert blocked <= bound, f"{q.request_id} was the first not to fit in {blocked} ticks, bound {bound}"
        h = s._reserved
        if h is not self.holder:
            self.holder, self.holder_since = h, self.ticks
            self.holder_bound = fr.ticks_to_drain_bound(self.sit_out_cap, self.max_work) + 1
        if h is not None and h.state in WAITING:
            assert self.ticks - self.holder_since <= self.holder_bound, \
                f"{h.request_id} has held the reservation {self.ticks - self.holder_since} ticks, bound {self.holder_bound}"

    @invariant()
    def vtc_admission_order(self) -> None:
        """The default policy's admission order is VTC's, as the spec states it: every waiting
        request exactly once; each pick's user is ``vtc_eligible`` (its local counter within the
        tolerance of the least local counter among users with requests left); outside the drain
        phase the pick is the oldest arrival among the eligible users' waiting requests; after a
        pick its user's local counter is charged the request's uncharged prompt at the prompt
        price (``charged_counter``), so picks interleave users."""
        s = self.sched
        if s is None or self.fcfs:
            return
        policy = s.policy
        left: dict[str, list] = {}
        for q in s._by_obj.values():
            if q.state in WAITING:
                left.setdefault(q.user_id, []).append(q)
        for qs in left.values():
            qs.sort(key=lambda q: q.arrival_no)
        local = {u: policy.counter(u) for u in left}
        tol = policy.tolerance_tokens * fr.COUNTER_SCALE
        order = list(policy.admission_order())
        assert sorted(q.arrival_no for q in order) == sorted(q.arrival_no for qs in left.values() for q in qs), \
            "the admission order is not the waiting requests, each once"
        for q in order:
            u = q.user_id
            least = min(local.values())
            assert fr.vtc_eligible(local[u], least, tol), \
                f"{q.request_id} of {u} picked at local counter {local[u]}, least {least}: {local}"
            if not policy._drain:
                eligible = [v for v in left if fr.vtc_eligible(local[v], least, tol)]
                oldest = min((left[v][0] for v in eligible), key=lambda r: r.arrival_no)
                assert q is oldest, f"picked {q.request_id}, the oldest eligible is {oldest.request_id}"
            left[u].remove(q)
            local[u] = fr.charged_counter(local[u], policy.prompt_price * (q.num_prompt_tokens - q.num_prompt_tokens_served),
                                          policy.weight_of(u))
            if not left[u]:
                del left[u], local[u]

    @invariant()
    def lifecycle_follows_the_table(self) -> None:
        """Outside a tick (submit, abort) a state changes only by ``abort``; see ``_check_lifecycle``."""
        self._check_lifecycle(in_tick=False)

    def _check_lifecycle(self, *, in_tick: bool) -> None:
        """Every state change is allowed by ``spec.lifecycle.TRANSITIONS``: in one tick, a grant
        (``admit``/``resume``), then ``prefill_done``, then ``finish``, each optional, or a lone
        ``preempt`` (``tick_changes``); outside a tick only ``abort``. A returned request is
        final (``done`` from ``tick()``, ``aborted`` from ``abort()``) and a final state never changes."""
        if self.sched is None:
            return
        for rid, seq in self.seq_of.items():
            prev, cur = self.state_of[rid], seq.state
            if cur != prev:
                assert prev not in lc.FINAL_STATES, f"{rid} left the final state {prev} for {cur}"
                allowed = tick_changes(prev) if in_tick else {row_dest("abort", prev)}
                assert cur in allowed, f"{rid}: {prev} -> {cur} {'in one tick' if in_tick else 'outside a tick'} " \
                                       f"is not allowed by the lifecycle table (allowed: {sorted(x for x in allowed if x)})"
                self.state_of[rid] = cur
            if rid in self.returned:
                assert cur in lc.FINAL_STATES, f"{rid} was returned in state {cur}"

    @invariant()
    def fcfs_order_and_deadlines(self) -> None:
        if self.sched is None or not self.fcfs:
            return
        order = [s.arrival_no for s in self.sched.running] + [s.arrival_no for s in self.sched.policy.admission_order()]
        assert inv.arrival_ordered(order), f"running + waiting not in arrival order: {order}"
        for q, d in self.deadline.items():
            if q not in self.returned:
                assert self.ticks <= d, f"{q} not finished by tick {d} (FCFS bound D_r, docs/spec.md)"

    def teardown(self) -> None:
        if self.sched is None or self.step_failed:
            return
        limit = self.ticks + 1000 + DRAIN_SLACK * sum(
            model.fcfs_service_ticks(len(r.prompt), r.max_tokens, self.chunk_eff)
            for q, r in self.accepted.items() if q not in self.returned)
        while self.sched.has_active():  # drain: the FCFS deadlines bound how long this takes
            assert self.ticks < limit, f"did not drain by tick {limit}"
            self.tick()
            self.fcfs_order_and_deadlines()
        assert self.returned == set(self.accepted), "an accepted request was never returned"

    # ------------------------------------------------------------ helpers

    def _check_finished(self, r: Request) -> None:
        rid = r.request_id
        assert rid in self.accepted and self.accepted[rid] is r, f"{rid} returned but never accepted"
        assert rid not in self.returned, f"{rid} returned twice"
        assert self.seq_of[rid].state == lc.DONE, f"{rid} returned by tick() in state {self.seq_of[rid].state}"
        self.returned.add(rid)
        g, e = r.generated, self.backend.eos_at.get(rid, 0)
        assert 1 <= len(g) <= r.max_tokens
        if e and e <= len(g):
            assert len(g) == e and g[-1] == EOS, f"{rid}: EOS at {e} but {len(g)} tokens"
        else:
            assert EOS not in g
            assert len(g) == r.max_tokens or len(r.prompt) + len(g) >= self.sched.max_model_len_tokens
        assert g[:len(g) - (g[-1] == EOS)] == [token_at(rid, k) for k in range(1, len(g) + 1 - (g[-1] == EOS))]
        assert r.submitted_at <= r.started_at <= r.completed_at

    def _check_vtc_charges(self, before: dict, counters: dict[str, int]) -> None:
        """VTC is charged what the spec says for the tick that just ran: per user, the first-time
        prompt tokens (``new_prompt_tokens``) and one output per token produced, at the spec's
        prices (``service_units``, ``charged_counter``); a counter rises further only by a lift
        of a user that became backlogged in the tick."""
        plan = self.sched._last_tick[0]
        want: dict[str, list[int]] = {}
        if plan is not None:
            for e in plan.batch:
                q = e.seq
                if q not in before:
                    continue
                nc, served, gen = before[q]
                acc = want.setdefault(q.user_id, [0, 0])
                if nc < q.num_prompt_tokens:
                    acc[0] += fr.new_prompt_tokens(nc, e.num_new_tokens, q.num_prompt_tokens, served)
                acc[1] += len(q.req.generated) - gen
        want = {u: v for u, v in want.items() if v != [0, 0]}
        got = {u: v for u, v in self.charged.items() if v != [0, 0]}
        assert got == want, f"VTC charged {got}, the tick served {want}"
        policy = self.sched.policy
        for u in USERS:
            p, o = want.get(u, [0, 0])
            expect = fr.charged_counter(counters[u], fr.service_units(p, o, fr.PROMPT_PRICE, fr.OUTPUT_PRICE),
                                        policy.weight_of(u))
            c = policy.counter(u)
            assert c == expect or (c > expect and u in self.activated), \
                f"{u}: counter {c}, the spec's charge gives {expect} (served {p} prompt, {o} output)"

    def _count_blocked(self) -> None:
        """Count, from each tick's plan (``plan.blocked``), the ticks a waiting request was the
        first candidate that did not fit, since it last became resident: the aging checks use
        this count, not the scheduler's own ``blocked_ticks``, so a scheduler that stops
        counting cannot switch them off."""
        plan = self.sched._last_tick[0]
        b = plan.blocked if plan is not None else None
        if b is not None and b.state in WAITING:
            self.blocked[id(b)] = self.blocked.get(id(b), 0) + 1
        for q in self.sched.running:
            self.blocked.pop(id(q), None)

    def _check_victim(self, victim, running) -> None:
        """The victim is first by ``victim_before``: light users (``light_user`` by the KV blocks
        ``running`` holds) last, then fewest preemptions, fewest computed tokens, latest admitted;
        and no candidate is pinned (``fr.pinned``: the preemption cap)."""
        policy = self.sched.policy
        blocks: dict[str, int] = {}
        for q in running:
            blocks[q.user_id] = blocks.get(q.user_id, 0) + len(q.block_table)
        total, total_w = sum(blocks.values()), sum(policy.weight_of(u) for u in blocks)
        light = {u for u, b in blocks.items() if fr.light_user(b, policy.weight_of(u), total, total_w)}
        assert victim in running, "the victim is not a candidate"
        cap = self.sched.max_preemptions
        for q in running:  # pinned requests are never victims: not even offered as candidates
            assert not fr.pinned(q.num_preemptions, cap), \
                f"{q.request_id} (preempted {q.num_preemptions} times, cap {cap}) offered as a victim"
        for q in running:
            assert not fr.victim_before(q.user_id in light, q.num_preemptions, q.num_computed_tokens, q.admit_no,
                                        victim.user_id in light, victim.num_preemptions,
                                        victim.num_computed_tokens, victim.admit_no), \
                f"victim {victim.request_id}, but {q.request_id} comes before it (light users {sorted(light)})"

    def _observable(self) -> tuple:
        s = self.sched
        return (s.has_active(), s.pool.num_free, len(s.running), len(s.policy), len(s._by_obj))


def stateful_settings(steps: int = STEPS, examples: int = EXAMPLES, **kw) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], **kw)


TestScheduler = pytest.mark.slow(SchedulerMachine.TestCase)
TestScheduler.settings = stateful_settings()


def run_machine(steps: int = 200, examples: int = 30) -> None:
    """Run the machine without shrinking or the example database (for the planted-bug tests).

    Derandomized: the same programs every run, so whether a planted bug is caught does not
    depend on the run's random seed (with random seeds, one full-suite run let the "admission
    needs a spare block" plant through: 0 misses in 20 runs of it alone, 1 in that suite run).
    """
    run_state_machine_as_test(SchedulerMachine, settings=stateful_settings(
        steps, examples, phases=[Phase.generate], database=None, print_blob=False, derandomize=True))
