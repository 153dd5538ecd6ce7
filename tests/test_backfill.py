"""EASY backfilling (``backfill.py``): the worst-case profile against a brute force, and the
scheduler passing a request that does not fit only with what cannot delay it."""
from __future__ import annotations

import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fairness import Spy

from backfill import WorstCaseProfile, worst_case_iterations
from policy import VTCPolicy
from spec import fairness_rules as fr
from spec import rules

# ---------------------------------------------------------------- the profile, by brute force


def test_worst_case_iterations_of_a_waiting_a_prefilling_and_a_decoding_request():
    # waiting: 300-token prompt in chunks of 64 (5 chunks, the last produces token 1), then 19 decodes
    assert worst_case_iterations(300, 0, 300, 0, 20, 4096, 64) == (5, 24)
    # prefilling: 100 of 300 computed: 4 chunks left
    assert worst_case_iterations(300, 100, 300, 0, 20, 4096, 64) == (4, 23)
    # decoding: 7 of 20 generated, the last one not computed yet: a 1-token chunk, then 12 more
    assert worst_case_iterations(307, 306, 300, 7, 20, 4096, 64) == (1, 13)
    # the cache length caps the output: 4096 - 4000 = 96 tokens at most
    assert worst_case_iterations(4000, 0, 4000, 0, 500, 4096, 64) == (63, 63 + 95)


def _blocks_at(row, k, block_tokens):
    """Brute force: blocks one row holds at iteration k (0 once finished)."""
    tokens, pre, iters, held = row
    if k >= iters:
        return 0
    known = tokens + max(0, k - pre + 1)  # tokens known before iteration k
    return max(held, rules.blocks_needed(known, block_tokens))


def _usage(rows, k, block_tokens):
    return sum(_blocks_at(r, k, block_tokens) for r in rows)


B = 4  # small blocks so that growth matters within a few iterations


@st.composite
def _rows(draw, n_max=5):
    rows = []
    for _ in range(draw(st.integers(0, n_max))):
        tokens = draw(st.integers(1, 40))
        pre = draw(st.integers(1, 4))
        iters = pre + draw(st.integers(0, 12))
        held = draw(st.integers(0, rules.blocks_needed(tokens, B) + 2))
        rows.append((tokens, pre, iters, held))
    return rows


@settings(max_examples=150, deadline=None)
@given(rows=_rows(), cand=_rows(n_max=1).filter(len), cap=st.integers(8, 60), need=st.integers(1, 30))
def test_shadow_and_admits_match_a_brute_force_over_every_iteration(rows, cand, cap, need):
    p = WorstCaseProfile(cap, B)
    for r in rows:
        p.add(*r)
    horizon = max([r[2] for r in rows] + [cand[0][2]]) + 2
    fits = [k for k in range(horizon) if cap - _usage(rows, k, B) >= need]
    shadow = p.shadow(need)
    if not fits:
        assert shadow is None
        return
    assert shadow is not None and shadow.iteration == fits[0]  # the first iteration the head fits
    assert shadow.extra_blocks == cap - _usage(rows, fits[0], B) - need
    c = cand[0]
    s = shadow.iteration
    never_over = all(_usage(rows, k, B) + _blocks_at(c, k, B) <= cap for k in range(min(c[2], s)))
    head_fits_at_shadow = _usage(rows, s, B) + _blocks_at(c, s, B) + need <= cap
    assert p.admits(*c, shadow) == (s > 0 and never_over and head_fits_at_shadow)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 6), st.integers(0, 80), st.integers(0, 40)),
                     max_size=12),
       block_tokens=st.sampled_from([1, 3, 4, 16]), ks=st.lists(st.integers(0, 120), max_size=20))
def test_the_usage_sweep_matches_a_brute_force_at_any_iterations(rows, block_tokens, ks):
    """``usage_blocks`` sweeps growing rows with a histogram of their block offsets; any point,
    in any order and with repeats, equals the per-row sum (rows may hold more than they need,
    finish at 0 iterations, or switch to growing at once)."""
    p = WorstCaseProfile(10_000, block_tokens)
    for r in rows:
        p.add(*r)
    assert p.usage_blocks(ks) == [_usage(rows, k, block_tokens) for k in ks]


def test_max_iters_is_the_longest_row():
    p = WorstCaseProfile(32, 16)
    assert p.max_iters == 0
    p.add(10, 1, 7, 1)
    p.add(10, 1, 3, 1)
    assert p.max_iters == 7


# ---------------------------------------------------------------- the scheduler


def _scenario(**kw):
    """A 32-block cache. User a's 300-token prompt runs first (19 blocks, 24 iterations at worst);
    user b's 448-token prompt (29 blocks + 1 headroom) does not fit until it finishes. Users c and
    d wait behind it: c's request ends within 3 iterations; d's fits now (4 blocks) but holds at
    least 4 at b's shadow iteration, where b leaves 2 free. The scripted backend never emits EOS,
    so the worst case is what happens. Returns (scheduler, {rid: admission tick})."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, isolation=False, **kw)
    for r in (make_req("a", "a", 300, 20), make_req("b", "b", 448, 5), make_req("d", "d", 60, 100),
              make_req("c", "c", 20, 3)):
        s.submit(r)
    drain(s)
    admitted = {b.seq.request_id: t for t, p in enumerate(s.plans) for b in p.batch if b.admitted}
    return s, admitted


def test_easy_admits_past_the_head_only_what_cannot_delay_it():
    _, at = _scenario()
    assert at["a"] == 0
    assert at["c"] == 0  # finishes long before the head's shadow iteration: passes it
    assert at["b"] == 24  # when a finishes: the shadow iteration, not later
    assert at["d"] > at["b"]  # would hold a block b needs at iteration 24: waits behind it


def test_without_easy_backfill_nothing_passes_the_head():
    _, at = _scenario(easy_backfill=False)
    assert at["b"] == 24
    assert at["c"] > at["b"] and at["d"] > at["b"]


def test_the_vtc_policy_asks_for_easy_backfill_and_the_knob_is_checked():
    from scheduler import Scheduler

    assert Scheduler(policy=VTCPolicy()).easy_backfill
    assert not Scheduler(policy=VTCPolicy(easy_backfill=False)).easy_backfill
    with pytest.raises(ValueError, match="easy_backfill"):
        Scheduler(easy_backfill="yes")


def _reserved_scenario(aging_ticks):
    """As ``_scenario`` without c and d; b gets the reservation after ``aging_ticks`` ticks.
    At tick 6, c (5 iterations at worst) and d (30 iterations: longer than a's remaining 18,
    but it fits beside b at b's shadow iteration) arrive."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, isolation=False, aging_ticks=aging_ticks)
    s.submit(make_req("a", "a", 300, 20))
    s.submit(make_req("b", "b", 400, 5))
    for _ in range(6):
        s.tick()
    s.submit(make_req("c", "c", 20, 5))
    s.submit(make_req("d", "d", 20, 30))
    drain(s)
    admitted = {b.seq.request_id: t for t, p in enumerate(s.plans) for b in p.batch if b.admitted}
    return s, admitted


def test_past_the_reservation_only_work_shorter_than_every_resident_s_remaining_passes():
    s, at = _reserved_scenario(aging_ticks=2)
    assert at["c"] == 6  # shorter than a's remaining work, done before b's shadow: passes the reservation
    assert at["b"] == 24
    assert at["d"] >= at["b"]  # may_pass_reservation: 30 iterations >= a's 18 left (tried after b)


def test_before_the_reservation_easy_lets_through_what_fits_beside_the_head():
    _, at = _reserved_scenario(aging_ticks=10 ** 6)
    assert at["c"] == 6
    assert at["d"] == 6  # fits beside b at its shadow iteration: passes (no reservation yet)
    assert at["b"] == 24  # and b is not delayed by it


def test_a_planted_non_strict_reservation_guard_lets_equal_work_pass(monkeypatch):
    """Teeth for the scenario above: d's worst case equal to a's remaining work passes only
    when ``may_pass_reservation`` is not strict."""
    def run():
        s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, isolation=False, aging_ticks=2)
        s.submit(make_req("a", "a", 300, 20))
        s.submit(make_req("b", "b", 400, 5))
        for _ in range(6):
            s.tick()
        s.submit(make_req("d", "d", 20, 18))  # 18 iterations: exactly a's remaining worst case
        drain(s)
        return {b.seq.request_id: t for t, p in enumerate(s.plans) for b in p.batch if b.admitted}
    assert run()["d"] >= 24
    monkeypatch.setattr(fr, "may_pass_reservation", lambda c, m: c <= m)
    assert run()["d"] == 6
