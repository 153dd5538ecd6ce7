"""Issue 6: bad input, cancellation (abort), backend faults and the retry policy, threads, load.

The hypothesis fuzzer is in ``test_fuzz.py``. ``docs/reliability.md`` maps each failure kind
to the test here that covers it.
"""
import gc
import math
import sys
import threading
import time
import weakref

import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req

from batch.policies.policy import FCFSPolicy
from inference_stub import Request
from scheduler import (BackendError, DuplicateRequestError, InvalidRequestError, PromptTooLongError,
                       RequestError, Scheduler)
from spec import lifecycle as lc


def new(backend=None, **kw):
    return Scheduler(backend=backend or ScriptedBackend(), clock=StepClock(), **kw)


def assert_idle_and_empty(s):
    """Nothing live, nothing retained: every container of the scheduler is empty."""
    assert not s.has_active()
    assert s.pool.num_used == 0 and s.pool.num_free == s.config.kv_cap_blocks
    assert s.running == [] and len(s.policy) == 0 and s.state.by_obj == {} and s.state.by_id == {}
    assert s._pending_aborts == [] and s._inflight is None
    s.check_integrity()


class Gate:
    """A backend that blocks inside ``forward`` until released (to hold a tick in flight)."""

    def __init__(self, inner=None):
        self.inner = inner or ScriptedBackend()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.armed = True
        self.fail = False

    def __call__(self, batch):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(10), "gate never released"
            if self.fail:
                raise RuntimeError("device lost")
        return self.inner(batch)


def wait_for(pred, what, limit_s=10.0):
    """Poll until ``pred()`` (bounded; fails the test instead of hanging)."""
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.001)


# ---------------------------------------------------------------- bad input at submit


GOOD = dict(user_id="u1", prompt=[1, 2, 3], max_tokens=4, request_id="x")


@pytest.mark.parametrize("bad, field", [
    (dict(prompt=None), "prompt"), (dict(prompt="abc"), "prompt"), (dict(prompt={1, 2}), "prompt"),
    (dict(prompt=[True]), "prompt"), (dict(prompt=[1.0]), "prompt"), (dict(prompt=[-2 ** 70]), "prompt"),
    (dict(prompt=[1, None]), "prompt"), (dict(prompt=[[1]]), "prompt"),
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens="5"), "max_tokens"), (dict(max_tokens=None), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"), (dict(user_id=None), "user_id"), (dict(user_id=b"u1"), "user_id"),
    (dict(request_id=None), "request_id"), (dict(request_id=5), "request_id"),
])
def test_more_bad_fields_refused_typed_and_request_untouched(bad, field):
    s = new()
    kw = dict(GOOD, submitted_at=123.0)
    kw.update(bad)
    r = Request(**kw)
    with pytest.raises(InvalidRequestError, match=field) as e:
        s.submit(r)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RequestError)
    assert r.submitted_at == 123.0 and r.started_at is None and r.completed_at is None
    assert_idle_and_empty(s)
    m = s.metrics()
    assert m["refusals"] == 1 and m["refusals_by_reason"] == {"InvalidRequestError": 1}
    s.submit(Request(**GOOD))  # the same id is free: the refusal registered nothing
    assert len(drain(s)) == 1


@pytest.mark.parametrize("obj", [None, 42, "r1", {"user_id": "u1", "prompt": [1], "max_tokens": 1}])
def test_non_request_objects_refused(obj):
    s = new()
    with pytest.raises(InvalidRequestError):
        s.submit(obj)
    assert_idle_and_empty(s)


def test_refusals_counted_by_kind_and_valid_traffic_unaffected():
    s = new(kv_cap_blocks=4)
    live = make_req("live", max_tokens=3)
    s.submit(live)
    for bad in (dict(prompt=[]), dict(max_tokens=0), dict(user_id="")):
        with pytest.raises(InvalidRequestError):
            s.submit(Request(**dict(GOOD, **bad)))
    with pytest.raises(PromptTooLongError):
        s.submit(make_req("big", n_prompt=64))
    with pytest.raises(DuplicateRequestError):
        s.submit(live)
    m = s.metrics()
    assert m["refusals"] == 5
    assert m["refusals_by_reason"] == {"InvalidRequestError": 3, "PromptTooLongError": 1,
                                       "DuplicateRequestError": 1}
    assert m["waiting"] == 1 and drain(s) == [live]


def test_tuple_prompt_accepted_and_vocab_check_can_be_disabled():
    s = new(vocab_size=None)
    a = Request(user_id="u1", prompt=(1, 2, 3), max_tokens=2, request_id="t")
    b = Request(user_id="u1", prompt=[10 ** 6, 0], max_tokens=2, request_id="big-id")
    s.submit(a)
    s.submit(b)
    assert sorted(r.request_id for r in drain(s)) == ["big-id", "t"]


def test_prompt_plus_max_tokens_over_the_cap_is_accepted_and_stops_at_the_cap_with_length():
    s = new(kv_cap_blocks=4)  # 64 tokens of KV
    r = make_req("edge", n_prompt=50, max_tokens=1000)
    s.submit(r)
    done = []
    while s.has_active():
        done += s.last_finished if s.tick() else []
    assert done == [(r, "length")]
    assert len(r.prompt) + len(r.generated) == 64 == s.config.kv_cap_blocks * s.config.block_tokens


def test_an_aborted_queued_request_object_can_be_resubmitted_and_starts_afresh():
    s = new(max_running=1)
    a, b = make_req("a", max_tokens=2), make_req("b", max_tokens=2)
    s.submit(a)
    s.submit(b)
    s.tick()
    assert s.abort(b) is b and b.completed_at is not None and b.generated == []
    s.submit(b)
    assert b.completed_at is None and b.started_at is None
    assert drain(s) == [a, b] and b.completed_at is not None


def test_resubmitting_a_finished_request_object_starts_it_afresh():
    s = new()
    r = make_req("a", max_tokens=2)
    s.submit(r)
    drain(s)
    first = r.generated
    s.submit(r)  # it still carries its output: cleared at acceptance, into a new list
    assert r.generated == [] and r.started_at is None and r.completed_at is None
    assert first is not r.generated and len(first) == 2  # the caller's copy of the old output is kept
    assert drain(s) == [r] and len(r.generated) == 2


# ---------------------------------------------------------------- abort in every state


def seq_of(s, r):
    return s.state.by_obj[id(r)]


def test_abort_queued_by_id_and_by_object_returns_it_once():
    s = new(max_running=1)
    a, b, c = make_req("a"), make_req("b"), make_req("c")
    for r in (a, b, c):
        s.submit(r)
    s.tick()  # a admitted; b, c queued
    sb = seq_of(s, b)
    assert sb.state == lc.QUEUED
    assert s.abort("b") is b
    assert sb.state == lc.ABORTED and sb.finish_reason == "abort"
    assert b.completed_at is not None and b.generated == [] and b.started_at is None
    assert s.abort("b") is None and s.abort(b) is None  # once
    assert s.abort(c) is c
    assert s.metrics()["waiting"] == 0
    assert drain(s) == [a]  # tick never returns an aborted request
    m = s.metrics()
    assert m["finish_reasons"] == {"length": 1, "abort": 2} and m["requests_finished"] == 1
    assert_idle_and_empty(s)


def test_abort_mid_prefill_frees_blocks_in_the_same_call():
    be = ScriptedBackend()
    s = new(be)
    long_ = make_req("long", n_prompt=200, max_tokens=5)  # 4 chunks of <= 64 tokens
    other = make_req("other", user="u2", n_prompt=20, max_tokens=6)
    s.submit(long_)
    s.submit(other)
    s.tick()
    s.tick()
    q = seq_of(s, long_)
    assert q.state == lc.PREFILLING and 0 < q.num_computed_tokens < 200
    held = len(q.block_table)
    used = s.pool.num_used
    assert s.abort("long") is long_
    assert s.pool.num_used == used - held  # freed in the call, not at the next tick
    assert long_.generated == [] and q.block_table == []
    s.check_integrity()
    assert drain(s) == [other] and len(other.generated) == 6
    assert be.iterations_with("long") == 2
    assert_idle_and_empty(s)


def test_abort_decoding_keeps_its_tokens():
    s = new()
    r = make_req("d", max_tokens=20)
    s.submit(r)
    for _ in range(4):
        s.tick()
    assert seq_of(s, r).state == lc.DECODING
    tokens = list(r.generated)
    assert len(tokens) == 4
    assert s.abort(r) is r and r.generated == tokens
    assert r.submitted_at < r.started_at < r.completed_at
    assert_idle_and_empty(s)


def test_abort_on_the_tick_it_would_finish():
    be = ScriptedBackend()
    s = new(be)
    a, b = make_req("a", max_tokens=3), make_req("b", user="u2", max_tokens=3)
    s.submit(a)
    s.submit(b)
    s.tick()
    s.tick()
    assert len(a.generated) == 2  # the next tick would give its last token and finish it
    assert s.abort("a") is a
    assert s.tick() == [b]
    assert len(a.generated) == 2 and be.iterations_with("a") == 2
    assert s.metrics()["finish_reasons"] == {"abort": 1, "length": 1}
    assert_idle_and_empty(s)


def test_abort_while_preempted():
    s = new(kv_cap_blocks=8)
    reqs = [make_req(f"r{i}", user=f"u{i}", n_prompt=31, max_tokens=20) for i in range(4)]
    for r in reqs:
        s.submit(r)
    victim = None
    for _ in range(20):
        s.tick()
        victim = next((r for r in reqs if id(r) in s.state.by_obj and seq_of(s, r).state == lc.PREEMPTED), None)
        if victim is not None:
            break
    assert victim is not None, "the scenario must preempt"
    kept = list(victim.generated)
    used = s.pool.num_used
    assert s.abort(victim.request_id) is victim
    assert victim.generated == kept and s.pool.num_used == used  # a preempted request holds no blocks
    s.check_integrity()
    done = drain(s)
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs if r is not victim)
    assert_idle_and_empty(s)


@pytest.mark.parametrize("target", ["nope", "", None, 17, Request(user_id="u1", prompt=[1], max_tokens=1)])
def test_abort_unknown_is_a_noop_returning_none(target):
    s = new()
    r = make_req("a", max_tokens=3)
    s.submit(r)
    s.tick()
    before = (s.pool.num_used, list(r.generated))
    assert s.abort(target) is None
    assert (s.pool.num_used, list(r.generated)) == before and s.has_active()
    assert s.metrics()["finish_reasons"] == {}


def test_abort_finished_id_is_a_noop_and_id_can_be_reused():
    s = new()
    r = make_req("a", max_tokens=2)
    s.submit(r)
    drain(s)
    assert s.abort("a") is None and s.abort(r) is None
    r2 = make_req("a", max_tokens=2)
    s.submit(r2)
    assert s.abort("a") is r2 and r.completed_at is not None


def test_a_request_id_changed_after_submit_leaves_no_entry_behind():
    s = Scheduler(backend=ScriptedBackend())
    r = make_req("before", max_tokens=3)
    s.submit(r)
    r.request_id = "after"  # the caller's object: the scheduler keys it by the id it was submitted with
    assert s.abort("after") is None
    assert drain(s) == [r] and not s.state.by_id


def test_aborted_requests_are_left_out_of_latency_and_throughput():
    s = new()
    a, b = make_req("a", max_tokens=4), make_req("b", max_tokens=50)
    s.submit(a)
    s.submit(b)
    s.tick()
    s.abort(b)
    drain(s)
    m = s.metrics()
    assert m["requests_finished"] == 1 and m["output_tokens"] == 4
    assert m["avg_latency_s"] == pytest.approx(a.completed_at - a.submitted_at)


def test_last_finished_gives_each_reason():
    be = ScriptedBackend(eos_at={"a": 2})
    s = new(be)
    a, b = make_req("a", max_tokens=5), make_req("b", max_tokens=2)
    s.submit(a)
    s.submit(b)
    assert s.last_finished == []
    s.tick()
    assert s.tick() == [a, b]
    assert s.last_finished == [(a, "stop"), (b, "length")]


# ---------------------------------------------------------------- abort racing an in-flight tick


def start_tick(s):
    out = {}

    def run():
        try:
            out["finished"] = s.tick()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out


def start_abort(s, target):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("result", s.abort(target)))
    t.start()
    return t, out


def abort_during_tick(s, gate, target):
    """Start a tick, abort ``target`` from another thread while ``forward`` is inside the gate
    (the abort is deferred), then let the tick finish; returns (tick outcome, abort outcome)."""
    ticker, tout = start_tick(s)
    assert gate.entered.wait(10)
    aborter, aout = start_abort(s, target)
    wait_for(lambda: s._pending_aborts, "abort to be deferred")
    gate.release.set()
    ticker.join(10)
    aborter.join(10)
    return tout, aout


@pytest.mark.parametrize("when", ["decoding", "admitted_in_this_tick"])
def test_abort_of_a_request_in_the_inflight_batch_waits_for_the_tick_then_aborts(when):
    gate = Gate()
    s = new(gate)
    r = make_req("r", max_tokens=10)
    other = make_req("o", user="u2", max_tokens=10)
    s.submit(r)
    s.submit(other)
    if when == "decoding":
        gate.armed = False
        s.tick()
        gate.armed = True
    ticker, tout = start_tick(s)
    assert gate.entered.wait(10)
    held_during_forward = s.pool.num_used
    aborter, aout = start_abort(s, "r")
    wait_for(lambda: s._pending_aborts, "abort to be deferred")  # it waits: forward still reads r's blocks
    assert s.pool.num_used == held_during_forward and aborter.is_alive()
    gate.release.set()
    ticker.join(10)
    aborter.join(10)
    assert not ticker.is_alive() and not aborter.is_alive()
    assert "error" not in tout, tout.get("error")
    assert aout["result"] is r and r not in tout["finished"]
    assert len(r.generated) == (2 if when == "decoding" else 1)  # the in-flight token was applied
    assert s.abort("r") is None
    s.check_integrity()
    assert drain(s) == [other] and s.metrics()["finish_reasons"] == {"abort": 1, "length": 1}
    assert_idle_and_empty(s)


def test_abort_racing_the_tick_that_finishes_the_request_returns_none():
    gate = Gate()
    s = new(gate)
    r = make_req("r", max_tokens=1)
    s.submit(r)
    tout, aout = abort_during_tick(s, gate, r)
    assert tout["finished"] == [r] and aout["result"] is None  # returned once, by the tick
    assert s.metrics()["finish_reasons"] == {"length": 1}
    assert_idle_and_empty(s)


def test_abort_during_a_failing_tick_is_applied_after_rollback():
    gate = Gate()
    gate.fail = True
    s = new(gate, kv_cap_blocks=8)
    r = make_req("r", max_tokens=5)
    other = make_req("o", user="u2", max_tokens=5)
    s.submit(r)
    s.submit(other)
    tout, aout = abort_during_tick(s, gate, "r")
    assert isinstance(tout["error"], BackendError) and aout["result"] is r
    s.check_integrity()
    assert drain(s) == [other]
    assert_idle_and_empty(s)


def test_two_threads_aborting_the_same_inflight_request_one_gets_it():
    gate = Gate()
    s = new(gate)
    r = make_req("r", max_tokens=10)
    s.submit(r)
    ticker, _ = start_tick(s)
    assert gate.entered.wait(10)
    (a1, o1), (a2, o2) = start_abort(s, "r"), start_abort(s, r)
    wait_for(lambda: len(s._pending_aborts) == 1 and sum(t.is_alive() for t in (a1, a2)) == 2,
             "both aborts to wait")
    gate.release.set()
    for t in (ticker, a1, a2):
        t.join(10)
    assert sorted([o1["result"] is r, o2["result"] is r]) == [False, True]
    assert [o1["result"], o2["result"]].count(None) == 1
    assert_idle_and_empty(s)


def test_abort_of_a_request_outside_the_inflight_plan_does_not_wait():
    gate = Gate()
    s = new(gate, max_running=1)
    a, b = make_req("a", max_tokens=5), make_req("b", max_tokens=5)
    s.submit(a)
    s.submit(b)  # b stays queued: max_running is 1
    ticker, _ = start_tick(s)
    assert gate.entered.wait(10)
    aborter, aout = start_abort(s, "b")
    aborter.join(10)
    assert not aborter.is_alive() and aout["result"] is b  # while forward is still blocked
    late = make_req("late", max_tokens=2)
    s.submit(late)  # submit during forward: joins a later tick
    assert s.has_active() and s.metrics()["waiting"] >= 1
    gate.release.set()
    ticker.join(10)
    assert sorted(r.request_id for r in drain(s)) == ["a", "late"]
    assert_idle_and_empty(s)


def test_abort_from_inside_forward_of_its_own_batch_raises_instead_of_deadlocking():
    seen = {}
    s = None
    inner = ScriptedBackend()

    def backend(batch):
        try:
            s.abort(batch[0])
        except RuntimeError as e:
            seen["error"] = e
        seen["queued"] = s.abort("q")  # not in this batch: aborted at once
        return inner(batch)

    s = new(backend, max_running=1)
    a, q = make_req("a", max_tokens=1), make_req("q", max_tokens=1)
    s.submit(a)
    s.submit(q)
    assert s.tick() == [a]
    assert "inside forward" in str(seen["error"]) and seen["queued"] is q
    assert_idle_and_empty(s)


def test_keyboard_interrupt_in_forward_rolls_back_and_propagates():
    calls = {"n": 0}
    inner = ScriptedBackend()

    def backend(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return inner(batch)

    s = new(backend, kv_cap_blocks=8)
    reqs = [make_req(f"r{i}", user=f"u{i}", n_prompt=31, max_tokens=6) for i in range(4)]
    for r in reqs:
        s.submit(r)
    s.tick()
    before = ([list(q.block_table) for q in s.running], [list(r.generated) for r in reqs], s.pool.num_free)
    with pytest.raises(KeyboardInterrupt):
        s.tick()
    assert ([list(q.block_table) for q in s.running], [list(r.generated) for r in reqs], s.pool.num_free) == before
    assert len(drain(s)) == 4
    assert_idle_and_empty(s)


def test_two_aborts_of_a_repeated_id_during_a_tick_reach_both_twins():
    """Sequentially, abort("x") twice aborts both requests numbered "x". During a tick that holds
    the oldest, the second abort used to find the same oldest (already claimed by the first),
    return None, and leave the other twin running."""
    gate = Gate()
    gate.armed = False
    s = Scheduler(backend=gate)
    t0, t1 = make_req("x", max_tokens=50), make_req("x", max_tokens=50)
    s.submit(t0)
    s.submit(t1)
    s.tick()  # both resident
    gate.armed = True
    ticker = threading.Thread(target=s.tick)
    ticker.start()
    assert gate.entered.wait(10)
    out = []
    a1 = threading.Thread(target=lambda: out.append(s.abort("x")))
    a1.start()
    wait_for(lambda: len(s._pending_aborts) == 1, "the first abort to be deferred")
    a2 = threading.Thread(target=lambda: out.append(s.abort("x")))
    a2.start()
    wait_for(lambda: len(s._tick_done._waiters) == 2, "both aborts to wait for the tick")
    gate.release.set()
    for t in (ticker, a1, a2):
        t.join(10)
    assert sorted(map(id, out)) == sorted([id(t0), id(t1)])
    assert not s.has_active() and not s.state.by_id


# ---------------------------------------------------------------- a clock or an update_from_output that fails in a tick


class FailingClock(StepClock):
    """A ``StepClock`` whose next reading raises once ``fail_next`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False

    def __call__(self) -> float:
        if self.fail_next:
            self.fail_next = False
            raise OSError("clock read failed")
        return super().__call__()


class ArmsClock(ScriptedBackend):
    """Answers like ``ScriptedBackend`` and makes the clock's next reading (the tick's, right
    after ``forward``) raise, on the calls numbered in ``fail_on`` (1-based)."""

    def __init__(self, clock: FailingClock, fail_on: set[int]) -> None:
        super().__init__()
        self.clock = clock
        self.fail_on = fail_on

    def __call__(self, batch):
        out = super().__call__(batch)
        if len(self.batches) in self.fail_on:
            self.clock.fail_next = True
        return out


def _state(s: Scheduler) -> tuple:
    """What a rolled-back tick must leave as it was: tokens, blocks, counts, the KV ledger."""
    reqs = sorted(s.state.by_obj.values(), key=lambda q: q.arrival_no)
    return (tuple((q.request_id, q.state, q.num_computed_tokens, tuple(q.block_table), len(q.req.generated))
                  for q in reqs), s.pool.num_used, len(s.running), len(s.policy), s.metrics()["ticks"])


def _four_requests(clock: FailingClock, backend: ArmsClock) -> Scheduler:
    """Four requests on 8 blocks of 4 tokens under FCFS: tick 1 admits all four, tick 2 decodes,
    tick 3 preempts r3 and r2 to grow r0 and r1 by a block each."""
    s = Scheduler(backend=backend, clock=clock, kv_cap_blocks=8, block_tokens=4, policy=FCFSPolicy())
    for i in range(4):
        s.submit(make_req(f"r{i}", n_prompt=6, max_tokens=12))
    return s


@pytest.mark.parametrize("fail_on", [1, 2, 3])  # an admitting tick, a decode tick, a preempting tick
def test_a_clock_that_raises_after_forward_rolls_the_tick_back(fail_on):
    """A clock raising when ``tick()`` read it after ``forward`` left the tick half-applied: the
    plan's blocks granted (to requests still queued), the victims' blocks freed while they stayed
    resident, and the tick marked in flight for ever, so an ``abort`` from another thread waited."""
    clock = FailingClock()
    backend = ArmsClock(clock, {fail_on})
    s = _four_requests(clock, backend)
    for _ in range(fail_on - 1):
        s.tick()
    before = _state(s)
    with pytest.raises(OSError, match="clock read failed"):
        s.tick()
    s.check_integrity()
    assert _state(s) == before, "the failed tick changed the scheduler"
    # Nothing is left in flight: an abort from another thread returns at once.
    out = []
    t = threading.Thread(target=lambda: out.append(s.abort("r3")), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive() and out and out[0].request_id == "r3", "abort waited on a tick that is over"
    done = drain(s)
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert s.pool.num_used == 0 and not s.has_active()


@pytest.mark.parametrize("clock", ["backwards", "nan"])
def test_a_clock_that_goes_back_or_reads_nan_loses_nothing(clock):
    """Admission, aging and preemption count ticks, not seconds: every request still finishes
    and no block leaks; only the latency figures are meaningless."""
    readings = iter(range(10**9))
    read = {"backwards": lambda: 1000.0 - next(readings) * 0.001, "nan": lambda: math.nan}[clock]
    s = Scheduler(backend=ScriptedBackend(), clock=read, kv_cap_blocks=16)
    for i in range(24):
        s.submit(make_req(f"r{i}", user=f"u{i % 3}", n_prompt=20 + 9 * i, max_tokens=30))
    assert len(drain(s)) == 24
    assert s.pool.num_used == 0 and not s.has_active()


class _AbortDuringForward(ScriptedBackend):
    """Answers like ``ScriptedBackend``; on its ``at``-th call another thread aborts ``victim``
    while the batch is being computed (the abort is deferred to the end of the tick), and the
    clock is armed to raise on its second reading after ``forward``: the one that retires the
    deferred aborts (the first is the tick's own reading)."""

    def __init__(self, scheduler_box: list, clock: "CountdownClock", victim: str, at: int) -> None:
        super().__init__()
        self.box, self.clock, self.victim, self.at = scheduler_box, clock, victim, at
        self.aborted: list = []
        self.thread: threading.Thread | None = None

    def __call__(self, batch):
        out = super().__call__(batch)
        if len(self.batches) == self.at:
            s = self.box[0]
            self.thread = threading.Thread(target=lambda: self.aborted.append(s.abort(self.victim)), daemon=True)
            self.thread.start()
            for _ in range(500):  # until the abort is registered as deferred
                if s._pending_aborts:
                    break
                threading.Event().wait(0.01)
            assert s._pending_aborts, "the abort was not deferred"
            self.clock.fail_at = 2
        return out


class CountdownClock(StepClock):
    """A ``StepClock`` whose ``fail_at``-th reading from now raises (once)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at = 0

    def __call__(self) -> float:
        if self.fail_at:
            self.fail_at -= 1
            if self.fail_at == 0:
                raise OSError("clock read failed")
        return super().__call__()


class _InterruptClock(CountdownClock):
    """A ``CountdownClock`` that raises ``KeyboardInterrupt`` instead of ``OSError``."""

    def __call__(self) -> float:
        try:
            return super().__call__()
        except OSError:
            raise KeyboardInterrupt from None


@pytest.mark.parametrize("clock_cls, error", [(CountdownClock, OSError), (_InterruptClock, KeyboardInterrupt)])
def test_a_clock_that_raises_while_deferred_aborts_are_applied_still_applies_them(clock_cls, error):
    """A clock raising when the aborts deferred to the end of a tick were retired left them
    unapplied and their ``abort`` calls waiting for good; the same with a ``KeyboardInterrupt``."""
    clock = clock_cls()
    box: list = []
    backend = _AbortDuringForward(box, clock, victim="r1", at=2)
    s = Scheduler(backend=backend, clock=clock, kv_cap_blocks=16, block_tokens=4, policy=FCFSPolicy())
    box.append(s)
    for i in range(3):
        s.submit(make_req(f"r{i}", n_prompt=6, max_tokens=2 + 3 * i))  # r0 finishes on tick 2
    s.tick()
    with pytest.raises(error):
        s.tick()
    backend.thread.join(5)
    assert not backend.thread.is_alive(), "the abort call still waits on a tick that is over"
    assert [r.request_id for r in backend.aborted] == ["r1"]
    assert [(r.request_id, why) for r, why in s.last_finished] == [("r0", "length")]  # the tick was applied
    r1 = backend.aborted[0]
    assert r1.completed_at is not None and r1.completed_at >= r1.submitted_at
    s.check_integrity()
    assert [r.request_id for r in drain(s)] == ["r2"]
    assert s.pool.num_used == 0 and not s.has_active()


def _abort_in_thread(s: Scheduler, rid: str) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(s.abort(rid)), daemon=True)
    t.start()
    return t, out


class _RaisesInUpdate(Scheduler):
    """Its ``update_from_output`` raises once when ``fail`` is set (before applying anything)."""

    fail = False

    def update_from_output(self, plan, tokens, *, iteration_start_s=None, now_s=None):
        if self.fail:
            self.fail = False
            raise ValueError("override failed")
        return super().update_from_output(plan, tokens, iteration_start_s=iteration_start_s, now_s=now_s)


def test_update_from_output_raising_inside_tick_leaves_no_tick_in_flight():
    """``update_from_output`` raising inside ``tick()`` (a subclass's override, or a bug) left the
    tick in flight: an ``abort`` of a request of its batch from another thread waited until some
    later tick ended, and one from the ticking thread raised "from inside forward"."""
    s = _RaisesInUpdate(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=16, block_tokens=4,
                        policy=FCFSPolicy())
    for i in range(2):
        s.submit(make_req(f"r{i}", n_prompt=6, max_tokens=4))
    s.tick()
    s.fail = True
    with pytest.raises(ValueError, match="override failed"):
        s.tick()
    assert s._inflight is None, "the failed tick is still marked in flight"
    assert s.abort("r0").request_id == "r0"  # the ticking thread: no "from inside forward" error
    t, out = _abort_in_thread(s, "r1")
    t.join(5)
    assert not t.is_alive() and out and out[0].request_id == "r1", "abort waited on a tick that is over"
    assert s.pool.num_used == 0 and not s.has_active()


class _SkipsBase(Scheduler):
    """Its ``update_from_output`` applies nothing when ``skip`` is set (a subclass that replays
    the output later by calling ``Scheduler.update_from_output`` itself)."""

    skip = False
    skipped_plan = None

    def update_from_output(self, plan, tokens, *, iteration_start_s=None, now_s=None):
        if self.skip:
            self.skipped_plan = plan
            return []
        return super().update_from_output(plan, tokens, iteration_start_s=iteration_start_s, now_s=now_s)


def test_a_tick_whose_override_skips_the_base_leaves_no_stale_clock_reading_behind():
    """A ``tick()`` whose ``update_from_output`` override did not call the base class left its
    after-forward clock reading behind: a later direct call of ``Scheduler.update_from_output``
    stamped its tokens and completions with that stale time."""
    clock = StepClock(dt_s=1.0)
    s = _SkipsBase(backend=ScriptedBackend(), clock=clock, kv_cap_blocks=16, block_tokens=4, policy=FCFSPolicy(),
                   check_invariants=False)  # the skipping tick leaves r0's blocks granted until the replay
    r = make_req("r0", n_prompt=4, max_tokens=1)
    s.submit(r)
    s.skip = True
    s.tick()  # schedules and commits r0's blocks, reads the clock after forward, applies nothing
    plan = s.skipped_plan
    t_before = clock.t
    Scheduler.update_from_output(s, plan, [5])  # the subclass replays the output itself, later
    assert r.completed_at is not None and r.completed_at > t_before, "stamped with the old tick's clock reading"


# ---------------------------------------------------------------- backend faults: the retry policy


class Poisoned:
    """Raises (or answers garbage) whenever the batch holds a poisoned request id."""

    def __init__(self, poison=("p",), garbage=False):
        self.poison = set(poison)
        self.garbage = garbage
        self.inner = ScriptedBackend()
        self.failures = 0

    def __call__(self, batch):
        if any(r.request_id in self.poison for r in batch):
            self.failures += 1
            if self.garbage:
                return [None] * len(batch)
            raise RuntimeError("NaN in logits")
        return self.inner(batch)


@pytest.mark.parametrize("garbage", [False, True])
def test_retry_policy_fails_only_the_poisoned_batch_after_n_tries(garbage):
    be = Poisoned(garbage=garbage)
    s = new(be, max_running=2, max_backend_tries=3, policy=FCFSPolicy())  # FCFS: p and a run first
    p, a = make_req("p", max_tokens=5), make_req("a", max_tokens=5)
    c, d = make_req("c", user="u2", max_tokens=4), make_req("d", user="u3", max_tokens=4)
    for r in (p, a, c, d):
        s.submit(r)
    for _ in range(2):
        with pytest.raises(BackendError, match="2: \\['p', 'a'\\]"):
            s.tick()
        s.check_integrity()
        assert p.generated == a.generated == [] and s.pool.num_used == 0
    failed = s.tick()  # the third try: fail p and a, leave c and d alone
    assert failed == [p, a] and s.last_finished == [(p, "error"), (a, "error")]
    assert all(r.completed_at is not None for r in failed)
    assert c.generated == d.generated == [] and s.metrics()["waiting"] == 2
    s.check_integrity()
    assert sorted(r.request_id for r in drain(s)) == ["c", "d"]
    assert len(c.generated) == len(d.generated) == 4
    m = s.metrics()
    assert m["finish_reasons"] == {"error": 2, "length": 2} and m["requests_finished"] == 2
    assert be.failures == 3
    assert_idle_and_empty(s)


def test_retry_policy_leaves_the_poisoned_plans_preempted_victim_untouched():
    # cap 8: four 31-token prompts fill the pool; the second tick preempts r3 (the newest) and
    # runs r0..r2, which now poison the backend. Failing that batch must give r3 back its blocks.
    be = Poisoned(poison=())
    s = new(be, kv_cap_blocks=8, max_backend_tries=2, policy=FCFSPolicy())  # FCFS packs and picks r3, r2
    reqs = [make_req(f"r{i}", user=f"u{i}", n_prompt=31, max_tokens=6) for i in range(4)]
    for r in reqs:
        s.submit(r)
    s.tick()
    tables = {r.request_id: list(seq_of(s, r).block_table) for r in reqs}
    plan = s.schedule()  # what the next tick will do: r0, r1 run; r3 and r2 are preempted for them
    assert [q.request_id for q in plan.preempted] == ["r3", "r2"]
    assert [x.seq.request_id for x in plan.batch] == ["r0", "r1"]
    be.poison = {"r0"}
    with pytest.raises(BackendError):
        s.tick()
    failed = s.tick()
    assert [r.request_id for r in failed] == ["r0", "r1"]
    for r in reqs[2:]:
        q = seq_of(s, r)
        assert q.state == lc.DECODING and q.block_table == tables[r.request_id] and len(r.generated) == 1
    s.check_integrity()
    assert drain(s) == reqs[2:] and all(len(r.generated) == 6 for r in reqs[2:])
    assert_idle_and_empty(s)


def test_retry_policy_fails_a_batch_mid_decode():
    # p joins later and poisons every batch it is in; the running request r shares its batch.
    be = Poisoned()
    s = new(be, max_backend_tries=2)
    r = make_req("r", max_tokens=10)
    s.submit(r)
    s.tick()
    s.tick()
    assert len(r.generated) == 2
    s.submit(make_req("p", max_tokens=3))
    with pytest.raises(BackendError):
        s.tick()
    assert len(r.generated) == 2
    failed = s.tick()
    assert [x.request_id for x in failed] == ["r", "p"] and len(r.generated) == 2
    assert_idle_and_empty(s)


def test_retry_count_is_consecutive_failures_only():
    calls = {"n": 0}
    inner = ScriptedBackend()

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] in (1, 3, 5):  # never two in a row
            raise RuntimeError("transient")
        return inner(batch)

    s = new(flaky, max_backend_tries=2)
    r = make_req("r", max_tokens=4)
    s.submit(r)
    done = []
    for _ in range(20):
        if not s.has_active():
            break
        try:
            done += s.tick()
        except BackendError:
            pass
    assert done == [r] and s.last_finished == [(r, "length")] and len(r.generated) == 4


def test_max_backend_tries_one_fails_at_the_first_fault_and_bad_values_raise():
    s = new(Poisoned(), max_backend_tries=1)
    p = make_req("p")
    s.submit(p)
    assert s.tick() == [p] and s.last_finished == [(p, "error")]
    assert_idle_and_empty(s)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_backend_tries"):
            Scheduler(max_backend_tries=bad)


# ---------------------------------------------------------------- concurrency with real threads


def test_submit_abort_has_active_metrics_from_threads_during_ticks():
    """Two submitters, an aborter, an observer and a ticker at once. Every third request of a
    submitter is a target: it never emits EOS and asks for a million tokens, so only the
    aborter can end it; the others end by EOS or max_tokens (and the aborter also tries every
    fifth of them, racing the ticker). Each request must come back exactly once."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many interleavings
    try:
        per_submitter = 150
        inner = ScriptedBackend(eos_at={f"s{k}-{i}": 1 + i % 7 for k in range(2) for i in range(0, per_submitter, 2)})

        def backend(batch):
            time.sleep(0)  # let the other threads in while forward runs
            return inner(batch)

        s = Scheduler(backend=backend, max_running=16)
        submitted: list[Request] = []
        returned_by_tick: list[Request] = []
        returned_by_abort: list[Request] = []
        errors: list[BaseException] = []
        submitters_done = threading.Event()

        def submitter(k):
            try:
                for i in range(per_submitter):
                    target = i % 3 == 0
                    r = make_req(f"{'t' if target else 's'}{k}-{i}", user=f"u{i % 7}", n_prompt=5 + (i * 13) % 90,
                                 max_tokens=10 ** 6 if target else 1 + i % 12)
                    s.submit(r)
                    submitted.append(r)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def aborter():
            try:
                i = 0
                while not submitters_done.is_set() or i < len(submitted):
                    if i < len(submitted):
                        r = submitted[i]
                        if r.request_id.startswith("t") or i % 5 == 0:
                            got = s.abort(r.request_id if i % 2 else r)
                            if got is not None:
                                assert got is r
                                returned_by_abort.append(got)
                        i += 1
                    else:
                        time.sleep(0)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def observer():
            try:
                while not submitters_done.is_set():
                    m = s.metrics()
                    assert 0 <= m["kv_blocks_in_use"] <= s.config.kv_cap_blocks and m["waiting"] >= 0
                    s.has_active()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def ticker():
            try:
                for _ in range(200_000):
                    if submitters_done.is_set() and not s.has_active():
                        return
                    returned_by_tick.extend(s.tick())
                raise AssertionError("ticker did not drain")
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(2)]
        others = [threading.Thread(target=f) for f in (aborter, observer, ticker)]
        for t in threads + others:
            t.start()
        for t in threads:
            t.join(60)
        submitters_done.set()
        for t in others:
            t.join(60)
        assert not any(t.is_alive() for t in threads + others)
        assert errors == []
        assert len(submitted) == 2 * per_submitter
        ids_tick = [r.request_id for r in returned_by_tick]
        ids_abort = [r.request_id for r in returned_by_abort]
        assert len(set(ids_tick)) == len(ids_tick) and len(set(ids_abort)) == len(ids_abort)
        assert sorted(ids_tick + ids_abort) == sorted(r.request_id for r in submitted)  # each exactly once
        targets = {r.request_id for r in submitted if r.request_id.startswith("t")}
        assert len(targets) == 100 and targets <= set(ids_abort)  # only abort could end them
        for r in returned_by_tick:
            assert r.generated and (r.generated[-1] == 0 or len(r.generated) == r.max_tokens)
            assert 0 not in r.generated[:-1]
        m = s.metrics()
        assert m["finish_reasons"]["abort"] == len(returned_by_abort)
        assert m["requests_finished"] == len(returned_by_tick)
        assert_idle_and_empty(s)
    finally:
        sys.setswitchinterval(old)


def test_two_ticking_threads_are_serialised():
    inner = ScriptedBackend()
    inside = {"n": 0, "max": 0}
    lock = threading.Lock()

    def backend(batch):
        with lock:
            inside["n"] += 1
            inside["max"] = max(inside["max"], inside["n"])
        time.sleep(0)
        with lock:
            inside["n"] -= 1
        return inner(batch)

    s = Scheduler(backend=backend)
    for i in range(60):
        s.submit(make_req(f"r{i}", user=f"u{i % 5}", max_tokens=1 + i % 9))
    done: list[Request] = []

    def loop():
        for _ in range(10_000):
            if not s.has_active():
                return
            done.extend(s.tick())

    ts = [threading.Thread(target=loop) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert inside["max"] == 1 and len(done) == 60 and len({id(r) for r in done}) == 60
    assert_idle_and_empty(s)


# ---------------------------------------------------------------- load and endurance


@pytest.mark.slow
def test_endurance_5000_requests_1000_users_all_complete_nothing_retained():
    import bench_load
    from batch.sim import simulate
    reqs = bench_load.make_workload(5000, users=1000, rate_per_s=20.0, seed=3)
    assert len({r.user_id for r in reqs}) > 900
    res = simulate.run_workload(reqs, virtual=True, gpu_seed=1, record_itl=False, max_ticks=400_000)
    s = res.scheduler
    assert len(res.finished) == 5000 and res.refused == []
    assert {r.request_id for r in res.finished} == {r.request_id for r in reqs}
    assert all(r.completed_at is not None and r.generated for r in res.finished)
    assert s.metrics()["requests_finished"] == 5000
    assert s.policy._counter == {}  # VTC forgot all 1000 users once none was active
    assert_idle_and_empty(s)


@pytest.mark.slow
def test_overload_burst_drains_and_admission_recovers():
    import bench_load
    from batch.sim import simulate
    burst = bench_load.make_workload(2000, users=100, rate_per_s=1e9, seed=5)  # all within microseconds
    res = simulate.run_workload(burst, virtual=True, gpu_seed=2, record_itl=False, max_ticks=200_000)
    s = res.scheduler
    assert len(res.finished) == 2000 and res.refused == []
    assert_idle_and_empty(s)
    late = make_req("late", max_tokens=3)
    s.submit(late)
    s.tick()
    assert len(late.generated) == 1  # admitted and prefilled at the first tick after the storm
    drain(s)
    assert late.completed_at is not None
    assert_idle_and_empty(s)


def test_finished_requests_are_not_referenced_by_the_scheduler():
    s = new(kv_cap_blocks=32)
    refs = []
    for i in range(300):
        r = make_req(f"r{i}", user=f"u{i % 11}", n_prompt=1 + i % 70, max_tokens=1 + i % 13)
        s.submit(r)
        refs.append(weakref.ref(r))
    del r
    s.abort("r7")
    drain(s)
    last = len(s.last_finished)  # the last tick's requests are kept for last_finished
    gc.collect()
    alive = [w() for w in refs if w() is not None]
    assert len(alive) <= last
    assert_idle_and_empty(s)


def test_finished_and_aborted_requests_are_freed_without_the_cycle_collector():
    """A request that left (finished or aborted) is freed by reference counting alone once the
    caller drops it: no reference cycle runs through its record (a cycle would keep its prompt
    and tokens alive until a full ``gc`` pass, which a long-lived server rarely runs)."""
    s = new(kv_cap_blocks=32)
    refs = []
    for i in range(6):
        r = make_req(f"r{i}", user=f"u{i % 2}", n_prompt=1 + 3 * i, max_tokens=2 + i)
        s.submit(r)
        refs.append(weakref.ref(r))
    del r
    gc.disable()
    try:
        for _ in range(4):
            s.tick()  # every request is decoding
        assert s.abort("r5") is not None
        drain(s)
        s.tick()  # an empty tick replaces the last plan, which references its batch
        assert [w() is None for w in refs] == [True] * 6
    finally:
        gc.enable()
    assert_idle_and_empty(s)


def test_schedule_touches_the_waiting_queue_in_o1_per_admission():
    """FCFS admission stops at the first request that does not fit: a tick reads at most
    (admitted + 1) waiting entries, however many wait (O(1) in the number waiting). It holds
    because ``Policy.order()`` is lazy and ``step.schedule`` breaks at the first misfit (FCFS
    has no resume-first trials); admitted requests leave the deque from its head."""
    class Counting(FCFSPolicy):
        read = 0

        def order(self):
            for x in super().order():
                self.read += 1
                yield x

    pol = Counting()
    s = new(policy=pol, kv_cap_blocks=8, check_invariants=False)  # the checker reads the whole queue
    for i in range(3000):
        s.submit(make_req(f"r{i}", user=f"u{i % 50}", n_prompt=20, max_tokens=3))
    for _ in range(200):
        pol.read = 0
        waiting_before = len(pol)
        s.tick()
        admitted = waiting_before - len(pol)
        assert pol.read <= admitted + 1
    assert len(pol) > 2000
