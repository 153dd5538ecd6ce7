"""Review 6 of preempted decodes resuming first (scheduler trials): findings and gaps as tests."""
from __future__ import annotations

from conftest import ScriptedBackend, StepClock, make_req
from test_fairness import Spy
from test_resume import _decode, _Resumes

from policy import VTCPolicy
from scheduler import BACKFILL_WINDOW


def test_turning_resume_decodes_first_off_stops_the_trials_of_decodes_already_waiting():
    # resume_first's docstring: the preempted decodes "when resume_decodes_first; otherwise
    # none". The flag is a public attribute (as drain_longest_first, read every tick); turned
    # off, the decodes preempted while it was on were still tried first.
    p = VTCPolicy()
    d = _decode("a", 1)
    p.requeue(d)
    p.resume_decodes_first = False
    assert list(p.resume_first()) == []
    assert list(p.admission_order()) == [d]  # it still waits at its place in the counter order
    p.resume_decodes_first = True
    assert list(p.resume_first()) == [d]  # and is tried first again once the rule is back on
    p.remove(d)
    assert list(p.resume_first()) == []


def _ten_block_cache(pol):
    """R (user c) resident with 6 of 10 blocks after two ticks (prompt 90 of 16-token blocks)."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=10, policy=pol)
    s.submit(make_req("R", user="c", n_prompt=90, max_tokens=50))
    s.tick()
    s.tick()
    return s


def test_a_trial_that_does_not_fit_does_not_stop_the_trials_after_it():
    # t1 (5 blocks with its slot and the headroom) does not fit the 4 free blocks; t2 (1 block)
    # does and goes before h, the first of the counter order, which would also fit.
    pol = _Resumes(isolation=False)
    s = _ten_block_cache(pol)
    t1, t2 = make_req("t1", user="x", n_prompt=60), make_req("t2", user="x", n_prompt=10)
    h = make_req("h", user="a", n_prompt=10)
    for r in (t1, t2, h):
        s.submit(r)
    pol.on_service("x", 4000, 0)  # a first in counter order
    pol.first = [s._lookup(t1), s._lookup(t2)]
    s.tick()
    assert [e.seq.request_id for e in s.plans[-1].batch if e.admitted][0] == "t2"


def test_at_most_backfill_window_trials_are_tried_in_a_tick():
    # BACKFILL_WINDOW trials that do not fit, then one that does: it is not reached as a trial,
    # so h, first in the counter order, is admitted before it.
    pol = _Resumes(isolation=False)
    s = _ten_block_cache(pol)
    big = [make_req(f"t{i}", user="x", n_prompt=60) for i in range(BACKFILL_WINDOW)]
    last, h = make_req("last", user="x", n_prompt=10), make_req("h", user="a", n_prompt=10)
    for r in (*big, last, h):
        s.submit(r)
    pol.on_service("x", 4000, 0)
    pol.first = [s._lookup(r) for r in (*big, last)]
    s.tick()
    assert [e.seq.request_id for e in s.plans[-1].batch if e.admitted][0] == "h"


def test_trials_that_easy_refuses_past_a_blocked_head_do_not_use_up_its_window():
    # big (user a) is the blocked head; BACKFILL_WINDOW trials of user x fit now but would hold
    # their blocks at big's shadow iteration (500 output tokens), so EASY refuses them; they
    # are skipped without counting as passed, so s (user b, next in the counter order, one
    # block and one token) is still tried past big and admitted.
    pol = _Resumes(isolation=False)
    s = _ten_block_cache(pol)
    big = make_req("big", user="a", n_prompt=60, max_tokens=5)
    trials = [make_req(f"t{i}", user="x", n_prompt=40, max_tokens=500) for i in range(BACKFILL_WINDOW)]
    small = make_req("s", user="b", n_prompt=5, max_tokens=1)
    for r in (big, *trials, small):
        s.submit(r)
    pol.on_service("b", 400, 0)
    pol.on_service("x", 4000, 0)  # counter order: a, b, x
    s.tick()  # no trials yet: big is blocked, s passes it under EASY
    assert s._lookup(big).blocked_ticks == 1
    assert [e.seq.request_id for e in s.plans[-1].batch if e.admitted] == ["s"]
    small2 = make_req("s2", user="b", n_prompt=5, max_tokens=1)
    s.submit(small2)
    pol.first = [s._lookup(r) for r in trials]
    s.tick()
    assert [e.seq.request_id for e in s.plans[-1].batch if e.admitted] == ["s2"]
    assert s._lookup(big).blocked_ticks == 2
