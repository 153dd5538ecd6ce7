"""Preempted decodes resume first (``Config.resume_first``; ``VTCPolicy(resume_first=True)``, the
default): ``Policy.resumable`` lists them, the scheduler tries each before the order."""
from __future__ import annotations

import random

import pytest
from conftest import ScriptedBackend, StepClock, make_req
from test_fairness import Spy
from test_throughput_rules import make_seq

from batch.policies.vtc import VTCPolicy
from scheduler import Scheduler
from spec import lifecycle as lc


def _record(s: Scheduler, request):
    """The scheduler's record (``batch.core.state.Seq``) of a live request."""
    return s.state.by_obj[id(request)]


def _admitted(s: Spy) -> list[str]:
    return [e.seq.request_id for e in s.plans[-1].batch if e.admitted]


def _decode(user: str, arrival_no: int, generated: int = 2):
    """A scheduler record that was preempted after ``generated`` output tokens."""
    q = make_seq(user, arrival_no, num_preemptions=1)
    q.req.generated.extend([5] * generated)
    return q


def test_preempted_decodes_are_tried_first_oldest_first_and_the_counter_order_is_unchanged():
    p = VTCPolicy()
    fresh_b = make_seq("b", 0)
    p.add(fresh_b)
    p.charge("a", 500, 100)  # user a has been served: b comes first in counter order
    resumed = _decode("a", 1)
    p.requeue(resumed)
    assert list(p.resumable()) == [resumed]
    assert list(p.order()) == [fresh_b, resumed]


def test_preempted_in_prefill_nothing_is_tried_first():
    on = VTCPolicy()
    on.requeue(make_seq("a", 1, num_preemptions=1))  # preempted while prefilling: no output to stall
    assert list(on.resumable()) == []
    assert len(list(on.order())) == 1


def test_resumed_decodes_go_oldest_first_and_leave_when_admitted_or_aborted():
    p = VTCPolicy()
    fresh = [make_seq("c", 0), make_seq("a", 3)]
    for q in fresh:
        p.add(q)
    late, early, mid = _decode("a", 7), _decode("b", 1), _decode("a", 4)
    for q in (late, early, mid):
        p.requeue(q)
    assert list(p.resumable()) == [early, mid, late]
    order = list(p.order())
    assert sorted(map(id, order)) == sorted(map(id, fresh + [late, early, mid]))  # each once
    p.remove(early)  # admitted
    p.remove(late)  # aborted while waiting
    assert list(p.resumable()) == [mid]
    assert len(list(p.order())) == len(p) == 3
    p.remove(mid)
    assert list(p.resumable()) == []


class _Resumes(VTCPolicy):
    """VTC whose ``resumable`` names chosen waiting requests (as if preempted decodes)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.first: list = []

    def resumable(self):
        return [q for q in self.first if q.state in lc.WAITING_STATES]


def _scheduler_with(first_rid: str, counter_first: str, **kw):
    """A 10-block cache: R (user c) resident with 6 blocks; waiting: big (user a, 5 blocks with
    its first slot: it does not fit the 4 free) and small (user b, 1 block). ``first_rid`` is
    what ``resumable`` names; ``counter_first`` is the user with the smaller counter."""
    pol = _Resumes(isolation=False, tolerance_tokens=0)  # strict counter order
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=10, policy=pol, **kw)
    s.submit(make_req("R", user="c", n_prompt=90, max_tokens=50))
    s.tick()
    s.tick()  # R's prompt is in: 6 blocks
    big, small = make_req("big", user="a", n_prompt=64, max_tokens=5), make_req("small", user="b", n_prompt=10)
    s.submit(big)
    s.submit(small)
    pol.charge("b" if counter_first == "a" else "a", 400, 0)  # both backlogged: no lift evens it
    pol.first = [_record(s, big if first_rid == "big" else small)]
    return s, _record(s, big), _record(s, small)


def test_a_trial_that_does_not_fit_is_skipped_not_blocked():
    # big is tried first but does not fit (4 free blocks); small, first in the
    # counter order, still gets in (with big as a blocking head it would not), and big ages
    # once, as the first request of the counter order that does not fit.
    s, big, small = _scheduler_with("big", counter_first="b")
    s.tick()
    assert _admitted(s) == ["small"] and big.blocked_ticks == 1


def test_a_trial_that_fits_goes_before_the_counter_order():
    s, big, small = _scheduler_with("small", counter_first="a")
    s.tick()
    assert _admitted(s)[0] == "small"  # a's big comes first in counter order but does not fit
    s2, big2, small2 = _scheduler_with("big", counter_first="b")
    s2.policy.first = []
    s2.tick()
    assert _admitted(s2) == ["small"]


def test_with_resume_first_off_the_scheduler_tries_nothing_first():
    # the policy still names small, but the scheduler (resume_first=False) does not try it: the
    # counter order's big is the blocked head and nothing passes it within the hold
    s, big, small = _scheduler_with("small", counter_first="a", resume_first=False)
    assert not s.config.resume_first
    s.tick()
    assert _admitted(s) == [] and big.blocked_ticks == 1
    assert not Scheduler(policy=VTCPolicy(resume_first=False)).config.resume_first
    assert Scheduler(policy=VTCPolicy()).config.resume_first


@pytest.mark.parametrize("flag", ["isolation", "headroom", "resume_first"])
def test_a_policy_flag_that_is_not_a_bool_is_refused(flag):
    with pytest.raises(ValueError, match=flag):
        VTCPolicy(**{flag: 1})


@pytest.mark.parametrize("flag", ["isolation", "admission_headroom", "resume_first"])
def test_a_scheduler_flag_that_is_not_a_bool_is_refused(flag):
    with pytest.raises(ValueError, match=flag):
        Scheduler(**{flag: 1})


def _stalls(seed: int, on: bool) -> list[int]:
    """Ticks from each preemption of a request with output tokens to its next output token,
    on a seeded 3-user workload under KV pressure."""
    rng = random.Random(seed)
    s = Spy(backend=ScriptedBackend(block_tokens=4), clock=StepClock(), kv_cap_blocks=24, block_tokens=4,
            prefill_chunk_tokens=8, policy=VTCPolicy(resume_first=on, tolerance_tokens=0))
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


def _blocked_head_and_trial(aging_ticks: int):
    """R (user c) holds 6 of 10 blocks; big (user a, the smaller counter: 65 tokens, 5 blocks)
    does not fit, even without the headroom; t (user b, 3 blocks, up to 500 tokens) fits with it."""
    pol = _Resumes(isolation=False)
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=10, policy=pol, aging_ticks=aging_ticks)
    s.submit(make_req("R", user="c", n_prompt=90, max_tokens=50))
    s.tick()
    s.tick()  # R's prompt is in: 6 blocks
    big, trial = make_req("big", user="a", n_prompt=64, max_tokens=5), make_req("t", "b", 40, 500)
    s.submit(big)
    s.submit(trial)
    pol.charge("b", 400, 0)  # a first in counter order
    return s, pol, _record(s, big), _record(s, trial)


def test_a_blocked_head_of_the_counter_order_blocks_the_order_but_not_a_trial_before_its_reservation():
    s, pol, big, trial = _blocked_head_and_trial(aging_ticks=32)
    s.tick()  # no trials: big is the blocked head and t, behind it in the order, does not pass it
    assert big.blocked_ticks == 1 and _admitted(s) == [] and s.plans[-1].blocked is big
    pol.first = [trial]
    s.tick()  # a trial goes before the order, blocked head or not
    assert _admitted(s) == ["t"] and big.blocked_ticks == 2


def test_the_reservation_holder_goes_before_the_trials_and_takes_room():
    s, pol, big, trial = _blocked_head_and_trial(aging_ticks=1)
    s.tick()
    assert s.state.reserved is big
    pol.first = [trial]
    s.tick()  # big does not fit: it takes R's room (any resident may give it) before t is tried
    assert _admitted(s) == ["big", "t"] and [q.request_id for q in s.plans[-1].preempted] == ["R"]
    assert s.state.reserved is None and s.state.protected is big and big.holder


def test_the_resume_search_of_bench_fairness_runs():
    from bench_fairness import large_prompt_wait_ticks
    waits = [large_prompt_wait_ticks(seed, on, iso) for seed in range(3) for on in (True, False)
             for iso in (False, True)]
    assert all(isinstance(w, int) and w >= 0 for w in waits)


# ---------------------------------------------------------------- isolation past the preempted decodes


def _light_user_ttft_ticks(resume_first: bool) -> tuple[int, int]:
    """40 requests of user A (15-token prompts, 60 output tokens) grow into a second block in
    the same tick and preempt each other in a 48-block cache; user L's 10-token request arrives
    3 ticks in. Returns (preempted decodes waiting when L arrives, ticks to L's first token)."""
    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=48,
                  policy=VTCPolicy(resume_first=resume_first))
    for i in range(40):
        s.submit(make_req(f"a{i}", user="A", n_prompt=15, max_tokens=60))
    light = make_req("L", user="L", n_prompt=10, max_tokens=3)
    waiting_decodes = 0
    for t in range(500):
        if t == 3:
            s.submit(light)
            waiting_decodes = sum(1 for q in s.policy.order() if q.req.generated)
        s.tick()
        if light.generated:
            return waiting_decodes, t - 3 + 1
    raise AssertionError("L got no token in 500 ticks")


def test_isolation_sees_a_light_user_behind_many_preempted_decodes():
    # With resume_first, 16 or more of A's preempted decodes wait (and are tried first) when L
    # arrives; L is still protected and gets its first token at once.
    waiting_decodes, ticks = _light_user_ttft_ticks(True)
    assert waiting_decodes >= 16
    assert ticks <= 2
    assert _light_user_ttft_ticks(False)[1] <= 2


# ---------------------------------------------------------------- the trials


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
    pol.charge("x", 4000, 0)  # a first in counter order
    pol.first = [_record(s, t1), _record(s, t2)]
    s.tick()
    assert _admitted(s)[0] == "t2"
