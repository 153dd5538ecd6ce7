"""Preempted decodes resume first (``VTCPolicy(resume_decodes_first=True)``, the default)."""
from __future__ import annotations

import random

import pytest
from conftest import ScriptedBackend, StepClock, make_req
from test_fairness import Spy
from test_throughput_rules import Seq

from policy import VTCPolicy
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
