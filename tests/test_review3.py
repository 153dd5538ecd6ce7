"""Found by a fresh-eyes review of the repeated-id, victim and knob changes."""
from __future__ import annotations

import threading

import pytest

import request_gen
from conftest import ScriptedBackend, drain, make_req
from scheduler import Scheduler
from test_reliability import Gate, wait_for


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
    assert not s.has_active() and not s._by_id


def test_numpy_integer_eos_and_vocab_size_are_accepted_as_before_the_knob_checks():
    """``Scheduler(eos_token_id=np.int64(2), vocab_size=np.int64(64))`` worked before the
    constructor checks (the values are only compared); the checks refused it. Accepted again,
    stored as plain ints; a bool or a negative id stays refused."""
    np = pytest.importorskip("numpy")
    b = ScriptedBackend(eos_at={"e": 3})
    s = Scheduler(backend=b, eos_token_id=np.int64(0), vocab_size=np.int64(64))
    assert type(s.eos_token_id) is int and type(s.vocab_size) is int
    r = make_req("e", max_tokens=10)
    s.submit(r)
    assert drain(s) == [r] and len(r.generated) == 3 and r.generated[-1] == 0
    for bad in ({"eos_token_id": np.bool_(True)}, {"eos_token_id": np.float64(0.0)}, {"vocab_size": np.int64(0)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Scheduler(**bad)


def test_stream_takes_numpy_numbers_as_before_its_argument_checks():
    """``stream(n=np.int64(3), lam=np.float32(2.5))`` worked before the argument checks and was
    refused by them; accepted again, with plain-float arrival offsets."""
    np = pytest.importorskip("numpy")
    got = request_gen.stream(n=np.int64(3), lam=np.float32(2.5), seed=1)
    assert [(r.request_id, r.submitted_at) for r in got] == [
        (r.request_id, r.submitted_at) for r in request_gen.stream(n=3, lam=2.5, seed=1)]
    assert all(type(r.submitted_at) is float for r in got)
    for bad in ({"n": np.float64(3.0)}, {"n": np.int64(-1)}, {"lam": np.float64("nan")}, {"lam": np.bool_(True)}):
        with pytest.raises(ValueError):
            request_gen.stream(**bad)


def test_a_negative_eos_token_id_never_matches():
    """``eos_token_id=-1`` (worked before the knob checks): no token ends a request early."""
    b = ScriptedBackend()
    s = Scheduler(backend=b, eos_token_id=-1)
    r = make_req("r", max_tokens=6)
    b.eos_at["r"] = 2  # the backend's EOS (0) at the 2nd token is an ordinary token here
    s.submit(r)
    assert drain(s) == [r] and len(r.generated) == 6


def test_a_request_id_changed_after_submit_leaves_no_entry_behind():
    s = Scheduler(backend=ScriptedBackend())
    r = make_req("before", max_tokens=3)
    s.submit(r)
    r.request_id = "after"  # the caller's object: the scheduler keys it by the id it was submitted with
    assert s.abort("after") is None
    assert drain(s) == [r] and not s._by_id
