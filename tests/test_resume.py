"""Preempted decodes resume first (``VTCPolicy(resume_decodes_first=True)``, the default)."""
from __future__ import annotations

import random

import pytest
from conftest import ScriptedBackend, StepClock, make_req
from test_fairness import Spy
from test_throughput_rules import Seq

from batch.policies.policy import VTCPolicy
from scheduler import BACKFILL_WINDOW, Scheduler
from spec import lifecycle as lc


def _decode(user: str, arrival_no: int, generated: int = 2) -> Seq:
    """A scheduler-like record that was preempted after ``generated`` output tokens."""
    q = Seq(user, arrival_no, num_preemptions=1)
    q.req.generated.extend([5] * generated)
    return q


def test_preempted_decodes_are_tried_first_oldest_first_and_the_counter_order_is_unchanged():
    p = VTCPolicy()
    fresh_b = Seq("b", 0)
    p.add(fresh_b)
    p.on_service("a", 500, 100)  # user a has been served: b comes first in counter order
    resumed = _decode("a", 1)
    p.requeue(resumed)
    assert list(p.resume_first()) == [resumed]
    assert list(p.admission_order()) == [fresh_b, resumed]


def test_off_or_preempted_in_prefill_nothing_is_tried_first():
    off = VTCPolicy(resume_decodes_first=False)
    off.requeue(_decode("a", 1))
    on = VTCPolicy()
    on.requeue(Seq("a", 1, num_preemptions=1))  # preempted while prefilling: no output to stall
    assert list(off.resume_first()) == [] and list(on.resume_first()) == []
    assert len(list(off.admission_order())) == len(list(on.admission_order())) == 1


def test_resumed_decodes_go_oldest_first_and_leave_when_admitted_or_aborted():
    p = VTCPolicy()
    fresh = [Seq("c", 0), Seq("a", 3)]
    for q in fresh:
        p.add(q)
    late, early, mid = _decode("a", 7), _decode("b", 1), _decode("a", 4)
    for q in (late, early, mid):
        p.requeue(q)
    assert list(p.resume_first()) == [early, mid, late]
    order = list(p.admission_order())
    assert sorted(map(id, order)) == sorted(map(id, fresh + [late, early, mid]))  # each once
    p.remove(early)  # admitted
    p.discard(late)  # aborted while waiting
    assert list(p.resume_first()) == [mid]
    assert len(list(p.admission_order())) == len(p) == 3
    p.remove(mid)
    assert list(p.resume_first()) == []


class _Resumes(VTCPolicy):
    """VTC whose ``resume_first`` names chosen waiting requests (as if preempted decodes)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.first: list = []

    def resume_first(self):
        return iter([q for q in self.first if q.state in lc.WAITING_STATES])


def _scheduler_with(first_rid: str, counter_first: str, **kw):
    """A 10-block cache: R (user c) resident with 6 blocks; waiting: big (user a, 4 blocks with
    its first slot) and small (user b, 1 block). ``first_rid`` is what ``resume_first`` names;
    ``counter_first`` is the user with the smaller counter."""
    pol = _Resumes(isolation=False, tolerance_tokens=0, **kw)  # strict counter order
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=10, policy=pol)
    s.submit(make_req("R", user="c", n_prompt=90, max_tokens=50))
    s.tick()
    s.tick()  # R's prompt is in: 6 blocks
    big, small = make_req("big", user="a", n_prompt=60, max_tokens=5), make_req("small", user="b", n_prompt=10)
    s.submit(big)
    s.submit(small)
    pol.on_service("b" if counter_first == "a" else "a", 400, 0)  # both backlogged: no lift evens it
    pol.first = [s._lookup(big if first_rid == "big" else small)]
    return s, s._lookup(big), s._lookup(small)


@pytest.mark.parametrize("easy", [True, False])
def test_a_trial_that_does_not_fit_is_skipped_not_blocked(easy):
    # big is tried first but does not fit (4 free blocks less the headroom); small, first in the
    # counter order, still gets in (with big as a blocking head it would not, EASY off), and big
    # ages once, as the first request of the counter order that does not fit.
    s, big, small = _scheduler_with("big", counter_first="b", easy_backfill=easy)
    s.tick()
    admitted = [e.seq.request_id for e in s.plans[-1].batch if e.admitted]
    assert admitted == ["small"] and big.blocked_ticks == 1


def test_a_trial_that_fits_goes_before_the_counter_order():
    s, big, small = _scheduler_with("small", counter_first="a")
    s.tick()
    admitted = [e.seq.request_id for e in s.plans[-1].batch if e.admitted]
    assert admitted[0] == "small"  # a's big comes first in counter order but does not fit
    s2, big2, small2 = _scheduler_with("big", counter_first="b")
    s2.policy.first = []
    s2.tick()
    assert [e.seq.request_id for e in s2.plans[-1].batch if e.admitted] == ["small"]


@pytest.mark.parametrize("flag", ["backfill", "isolation", "admission_headroom", "easy_backfill",
                                  "drain_longest_first", "resume_decodes_first"])
def test_a_flag_that_is_not_a_bool_is_refused(flag):
    with pytest.raises(ValueError, match=flag):
        VTCPolicy(**{flag: 1})


def _stalls(seed: int, on: bool) -> list[int]:
    """Ticks from each preemption of a request with output tokens to its next output token,
    on a seeded 3-user workload under KV pressure."""
    rng = random.Random(seed)
    s = Spy(backend=ScriptedBackend(block_tokens=4), clock=StepClock(), kv_cap_blocks=24, block_tokens=4,
            prefill_chunk_tokens=8, policy=VTCPolicy(resume_decodes_first=on, tolerance_tokens=0))
    reqs = [make_req(f"r{j}", user=f"u{j % 3}", n_prompt=rng.randint(4, 20), max_tokens=rng.randint(5, 30))
            for j in range(18)]
    for r in reqs:
        s.submit(r)
    since: dict[str, tuple[int, int]] = {}
    stalls = []
    t = 0
    while s.has_active():
        s.tick()
        t += 1
        for q in s.plans[-1].preempted:
            if q.req.generated:
                since[q.request_id] = (t, len(q.req.generated))
        for r in reqs:
            if r.request_id in since and len(r.generated) > since[r.request_id][1]:
                stalls.append(t - since.pop(r.request_id)[0])
    assert not since and all(r.completed_at is not None for r in reqs)
    return stalls


def test_preempted_decodes_stall_for_fewer_ticks_than_in_counter_order():
    on = [_stalls(seed, True) for seed in range(10)]
    off = [_stalls(seed, False) for seed in range(10)]
    assert all(on_s and off_s for on_s, off_s in zip(on, off))  # preemptions of decodes happened
    assert sum(map(sum, on)) < sum(map(sum, off))
    assert sum(map(max, on)) < sum(map(max, off))


def test_a_blocked_head_of_the_counter_order_keeps_its_easy_protection_from_trials():
    # big (user a, the smaller counter) does not fit and is the blocked head after one tick; a
    # trial (b's request, 3 blocks, up to 500 tokens) fits now but would still hold the blocks
    # big needs at big's shadow iteration: it is not admitted past big. Before big was blocked
    # the same trial goes first.
    def setup():
        pol = _Resumes(isolation=False)
        s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=10, policy=pol)
        s.submit(make_req("R", user="c", n_prompt=90, max_tokens=50))
        s.tick()
        s.tick()  # R's prompt is in: 6 blocks
        big, trial = make_req("big", user="a", n_prompt=60, max_tokens=5), make_req("t", "b", 40, 500)
        s.submit(big)
        s.submit(trial)
        pol.on_service("b", 400, 0)  # a first in counter order
        return s, pol, s._lookup(big), s._lookup(trial)

    s, pol, big, trial = setup()
    s.tick()  # no trials: big is the blocked head, and EASY does not pass it with t
    assert big.blocked_ticks == 1 and not any(e.admitted for e in s.plans[-1].batch)
    pol.first = [trial]
    s.tick()
    assert not any(e.admitted for e in s.plans[-1].batch) and big.blocked_ticks == 2
    s, pol, big, trial = setup()
    pol.first = [trial]
    s.tick()  # big not blocked yet: the trial goes first
    assert [e.seq for e in s.plans[-1].batch if e.admitted] == [trial]


def test_the_resume_search_of_bench_fairness_runs():
    from bench_fairness import large_prompt_wait_ticks  # noqa: PLC0415
    waits = [large_prompt_wait_ticks(seed, on, iso) for seed in range(3) for on in (True, False)
             for iso in (False, True)]
    assert all(isinstance(w, int) and w >= 0 for w in waits)


# ---------------------------------------------------------------- isolation past the preempted decodes


def _light_user_ttft_ticks(resume_decodes_first: bool) -> tuple[int, int]:
    """40 requests of user A (15-token prompts, 60 output tokens) grow into a second block in
    the same tick and preempt each other in a 48-block cache; user L's 10-token request arrives
    3 ticks in. Returns (preempted decodes waiting when L arrives, ticks to L's first token)."""
    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=48,
                  policy=VTCPolicy(resume_decodes_first=resume_decodes_first))
    for i in range(40):
        s.submit(make_req(f"a{i}", user="A", n_prompt=15, max_tokens=60))
    light = make_req("L", user="L", n_prompt=10, max_tokens=3)
    waiting_decodes = 0
    for t in range(500):
        if t == 3:
            s.submit(light)
            waiting_decodes = sum(1 for q in s.policy.admission_order() if q.req.generated)
        s.tick()
        if light.generated:
            return waiting_decodes, t - 3 + 1
    raise AssertionError("L got no token in 500 ticks")


def test_isolation_sees_a_light_user_behind_more_preempted_decodes_than_it_peeks_at():
    # Isolation looks at the first 16 waiting candidates; with resume_decodes_first those were
    # all of A's preempted decodes, so L was never protected and waited for A's backlog (69 ticks).
    waiting_decodes, ticks = _light_user_ttft_ticks(True)
    assert waiting_decodes >= 16  # more than isolation's peek window
    assert ticks <= 2
    assert _light_user_ttft_ticks(False)[1] <= 2


# ---------------------------------------------------------------- turning the rule off, the trials and their window


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
