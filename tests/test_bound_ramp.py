"""The ramp-up term of ``bench.throughput_upper_bound``: the cache time that the requests
arrived so far cannot fill. Checked two ways: against a direct evaluation of the formula in
``bench._ramp_bound``'s docstring (position by position, no event bookkeeping), and against
every policy and the clairvoyant oracle on random workloads where the term sets the bound
(a bound that any schedule beats is wrong)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

import bench
from batch.policies.policy import FCFSPolicy
from batch.sim.baselines import StaticBatchScheduler
from batch.sim.workloads import Workload
from inference_stub import Request

BASE, PER, CHUNK, BT = bench.BASE_S, bench.PER_REQUEST_S, 64, 16


def _spec(rng: random.Random, n: int, span_s: float, prompt: int = 100,
          out: tuple[int, int] = (5, 60)) -> list[tuple[float, int, int, str]]:
    return [(rng.uniform(0, span_s), rng.randint(1, prompt), rng.randint(*out), f"u{rng.randint(1, 3)}")
            for _ in range(n)]


def _build(spec: list[tuple[float, int, int, str]]) -> list[Request]:
    return [Request(user_id=u, prompt=[1 + j % 63 for j in range(p)], max_tokens=m, request_id=f"q{k}",
                    submitted_at=t) for k, (t, p, m, u) in enumerate(spec)]


def _direct_ramp_duration(reqs: list[Request], cap: int, eos: float, max_running: int = 256) -> float:
    """The docstring's formula, evaluated naively: max over splits k of
    ``a_k - a_0 + PER*W_k + BASE*S_k/cap + integral_{a_k}^{a_0+d} rho_k``, d the bound without it,
    with ``U_i(t) = b_i(min(n_i, floor((t - a_i)/delta) + 1))`` read at the middle of each step."""
    lengths = bench.output_lengths(reqs, kv_cap_blocks=cap, eos_probability=eos)
    rows = sorted((r.submitted_at, len(r.prompt), n) for r, n in zip(reqs, lengths) if n is not None)
    a = [x[0] for x in rows]
    blocks = []  # b_i(j), j = 1..n_i
    for _, p, out in rows:
        c = math.ceil(p / CHUNK)
        blocks.append([math.ceil(p / BT)] * c + [math.ceil((p + g) / BT) for g in range(1, out)])
    delta = BASE + PER
    W = [sum(len(b) for b in blocks[k:]) for k in range(len(rows))]
    S = [sum(sum(b) for b in blocks[k:]) for k in range(len(rows))]

    def waste(k: int, horizon: float) -> float:
        cuts = sorted({a[i] + (j - 1) * delta for i in range(k, len(rows)) for j in range(1, len(blocks[i]) + 1)}
                      | {horizon})
        total = 0.0
        for lo, hi in zip(cuts, cuts[1:]):
            if lo >= horizon:
                break
            mid = (lo + hi) / 2
            u = sum(blocks[i][min(len(blocks[i]), int((mid - a[i]) // delta) + 1) - 1]
                    for i in range(k, len(rows)) if a[i] <= mid)
            m = min(max_running, sum(1 for x in a if x <= mid))
            total += (hi - lo) * BASE * max(0.0, 1 - u / cap) / (BASE + PER * m)
        return total

    plain = bench.throughput_upper_bound(reqs, kv_cap_blocks=cap, eos_probability=eos, ramp=False,
                                          max_running=max_running).min_duration_s
    return max([plain] + [a[k] - a[0] + PER * W[k] + BASE * S[k] / cap + waste(k, a[0] + plain)
                          for k in range(len(rows))])


@pytest.mark.parametrize("seed", [0, 4, 11])  # seeds where the ramp term sets the bound
def test_ramp_term_matches_the_formula_evaluated_directly(seed):
    # short prompts arriving slowly: the cache fills as much by decode growth as by arrivals
    rng = random.Random(seed)
    spec = _spec(rng, rng.randint(20, 30), rng.uniform(0.15, 0.3), prompt=40, out=(20, 60))
    cap = rng.choice((24, 32))
    b = bench.throughput_upper_bound(_build(spec), kv_cap_blocks=cap, eos_probability=0.05)
    assert b.ramp_s > 0, "the case must exercise the ramp term"
    assert b.min_duration_s == pytest.approx(_direct_ramp_duration(_build(spec), cap, 0.05), rel=1e-9, abs=1e-12)


def test_ramp_term_sets_the_bound_when_the_cache_cannot_fill_yet():
    # 60 requests trickling in over 0.2 s: at first too few have arrived to fill the cache
    spec = _spec(random.Random(7), 60, 0.2)
    b = bench.throughput_upper_bound(_build(spec), kv_cap_blocks=48, eos_probability=0.05)
    assert b.ramp_s > 0 and b.binding_arrival_s == 0.0
    # all at once, the same work fills the cache from the start: no ramp
    at_once = [(0.0, p, m, u) for _, p, m, u in spec]
    b0 = bench.throughput_upper_bound(_build(at_once), kv_cap_blocks=48, eos_probability=0.05)
    assert b0.ramp_s == 0.0 and b0.output_tokens == b.output_tokens
    assert b.min_duration_s > b0.min_duration_s


class _StaticFCFS(FCFSPolicy):
    """FCFS under a class the spec's reference tick does not model: ``StaticBatchScheduler``
    admits only into an empty batch, on purpose not the rules' plan (the other invariants run)."""


@pytest.mark.slow
def test_no_policy_beats_the_bound_where_the_ramp_term_sets_it(monkeypatch):
    monkeypatch.setitem(bench.POLICIES, "Static", lambda **kw: StaticBatchScheduler(policy=_StaticFCFS(), **kw))
    rng = random.Random(1)
    binding = 0
    for i in range(6):
        spec, cap = _spec(rng, rng.randint(30, 60), rng.uniform(0.05, 0.4)), rng.choice((32, 48, 64))
        w = Workload(f"ramp{i}", "ramp", "tests", lambda spec=spec: _build(spec), kv_cap_blocks=cap,
                     eos_probability=0.05)
        b = bench.throughput_upper_bound(w.build(), kv_cap_blocks=cap, eos_probability=0.05)
        binding += b.ramp_s > 0
        for p in (*bench.POLICIES, bench.ORACLE):
            c = bench.run_cell(w, p)
            assert c.metrics["output_tokens"] == b.output_tokens, (i, p)
            assert c.metrics["duration_s"] >= b.min_duration_s * (1 - 1e-9), (i, p, b.ramp_s)
    assert binding >= 4, "the workloads must exercise the ramp term"


def test_ramp_events_step_where_kv_blocks_for_does():
    # prompt 20 tokens (2 blocks, 1 chunk): the 3rd block is needed at 33 tokens, decode g = 13
    reqs = [Request(user_id="u", prompt=[1] * 20, max_tokens=40, request_id="x")]
    ramp_k, w = bench._ramp_bound(np.array([0.0]), np.array([20]), np.array([40]), np.array([1]), np.array([2]),
                                  np.array([0.0]), np.array([1.0]), 10.0, cap=4, block_tokens=16, max_running=256,
                                  base_s=BASE, per_request_s=PER)
    delta = BASE + PER
    # U = 2 blocks on [0, 13*delta), 3 on [13*delta, 29*delta), 4 from 29*delta (positions 30..40 hold 49..59 tokens)
    rate = BASE / (BASE + PER)
    expect = rate * (13 * delta * 0.5 + 16 * delta * 0.25)
    assert ramp_k == 0 and w == pytest.approx(expect)
    assert bench.output_lengths(reqs, kv_cap_blocks=4, eos_probability=0.0) == [40]


@pytest.mark.parametrize("seed", [6, 102, 109])  # the horizon truncates the integral; 102: max_running 2; 109: split k > 0
def test_ramp_term_matches_the_formula_at_later_splits_small_batches_and_the_horizon(seed):
    rng = random.Random(seed)
    n, cap = rng.randint(3, 12), rng.choice((8, 16, 24, 64, 256))
    spec = _spec(rng, n, rng.uniform(0.01, 0.5), prompt=rng.choice((20, 40, 100)), out=(5, 60))
    max_running = rng.choice((2, 4, 256))
    b = bench.throughput_upper_bound(_build(spec), kv_cap_blocks=cap, eos_probability=0.05, max_running=max_running)
    assert b.ramp_s > 0
    direct = _direct_ramp_duration(_build(spec), cap, 0.05, max_running=max_running)
    assert b.min_duration_s == pytest.approx(direct, rel=1e-9, abs=1e-12)


def test_large_workloads_evaluate_a_subset_of_splits_and_stay_valid(monkeypatch):
    # over RAMP_ALL_SPLITS requests only the split k = 0 and the RAMP_SPLITS largest splits are tried:
    # any subset is valid, so the bound lies between the plain bound and the all-splits one
    spec = _spec(random.Random(7), 60, 0.2)
    full = bench.throughput_upper_bound(_build(spec), kv_cap_blocks=48, eos_probability=0.05)
    plain = bench.throughput_upper_bound(_build(spec), kv_cap_blocks=48, eos_probability=0.05, ramp=False)
    monkeypatch.setattr(bench, "RAMP_ALL_SPLITS", 10)
    monkeypatch.setattr(bench, "RAMP_SPLITS", 3)
    sub = bench.throughput_upper_bound(_build(spec), kv_cap_blocks=48, eos_probability=0.05)
    assert plain.min_duration_s < sub.min_duration_s <= full.min_duration_s
    assert sub.ramp_s > 0
