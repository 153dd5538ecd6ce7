"""``bench/bench_throughput.py``'s bookkeeping, on fake runs: ``online_frontier`` (the published
seed, the best baseline, both goals, the policy table restored when a run raises), ``ttft_search``
(bounds the largest TTFT, keeps nothing over the limit) and ``AgedLPT``'s order. These pin what
the end-to-end tests in ``test_bench.py`` cannot tell apart."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import ScriptedBackend, make_req

import bench
import bench_throughput as bt
from scheduler import Scheduler


class _FakeCell:
    def __init__(self, frac: float, ttft_s: np.ndarray, p99_s: float) -> None:
        self.frac, self.ttft_s, self.metrics = frac, ttft_s, {"ttft_p99_s": p99_s}


#: Batch on each fake seed of ``online_frontier``: (fraction of the bound, TTFT p99 / best baseline's).
_SEEDS = [(0.90, 1.00), (0.96, 1.05), (0.96, 1.20), (0.94, 1.00), (0.97, 1.08), (0.99, 1.30)]


def _fake_bench(monkeypatch, run_cell) -> None:
    monkeypatch.setattr(bench, "run_cell", run_cell)
    monkeypatch.setattr(bench, "throughput_upper_bound", lambda *a, **k: None)
    monkeypatch.setattr(bench, "fraction", lambda c, b: c.frac)


def _frontier_cell(w, name, **_):
    seed = w.build()
    if name in bench.BASELINES:  # the best baseline's TTFT p99 is 2 s on every seed
        return _FakeCell(0.0, np.zeros(1), 2.0 + list(bench.BASELINES).index(name))
    frac, ratio = _SEEDS[seed]
    return _FakeCell(frac, np.zeros(1), 2.0 * ratio)


def test_online_frontier_reads_the_published_seed_the_best_baseline_and_both_goals(monkeypatch):
    monkeypatch.setattr(bt, "_seed_cases", lambda n, names: [("ab-burst", lambda s=s: s) for s in range(n)])
    _fake_bench(monkeypatch, _frontier_cell)
    monkeypatch.setattr(bt, "AGED_LPT_BETAS_S", ())
    assert bt._workload("ab-burst").seed == 4
    lines = bt.online_frontier(n_seeds=6)
    assert len(lines) == 3  # the header, its rule, Batch's row
    row = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert row[:2] == ["Batch", "shipped"]
    assert row[2:] == ["0.9533", "1.105x", "1.30x", "0.970 at 1.08x", "2 of 6"]


def test_online_frontier_restores_the_policy_table_when_a_run_raises(monkeypatch):
    monkeypatch.setattr(bt, "_seed_cases", lambda n, names: [("ab-burst", lambda: 0)])

    def raising(w, name, **kw):
        if name != "aged":
            return _frontier_cell(w, name)
        raise RuntimeError("run failed")

    _fake_bench(monkeypatch, raising)
    monkeypatch.setattr(bt, "AGED_LPT_BETAS_S", (0.002,))
    with pytest.raises(RuntimeError, match="run failed"):
        bt.online_frontier(n_seeds=1)
    assert "aged" not in bench.POLICIES


def _search_cell(outlier_s):
    """A fake ``run_cell`` for ``ttft_search`` on 12 requests: the fraction rises with the
    inversions of the order (0.9 in arrival order, 1.0 reversed), the TTFT p99 is 2 s always,
    and one request's TTFT is ``outlier_s(share of inversions)``. Best baseline's p99: 2 s."""
    def run_cell(w, name, requests=None, **_):
        if name in bench.BASELINES:
            return _FakeCell(0.0, np.zeros(1), 2.0)
        rank = bench.POLICIES[name]()
        order = [int(rid[1:]) for rid in sorted(rank, key=rank.get)]
        inv = sum(a > b for i, a in enumerate(order) for b in order[i + 1:]) / (len(order) * (len(order) - 1) / 2)
        return _FakeCell(0.9 + 0.1 * inv, np.array([1.0, outlier_s(inv)]), 2.0)
    return run_cell


def _fake_search(monkeypatch, outlier_s) -> None:
    w = bt.replace(bt._workload("ab-burst"), build=lambda: [make_req(f"r{i}") for i in range(12)])
    monkeypatch.setattr(bt, "_workload", lambda name: w)
    monkeypatch.setattr(bt, "_RankedPolicy", lambda known, rank: rank)
    monkeypatch.setattr(bt, "Scheduler", lambda policy, **kw: policy)
    _fake_bench(monkeypatch, _search_cell(outlier_s))


def _figures(lines: list[str]) -> list[float]:
    return [float(line.split("|")[3].split(",")[0]) for line in lines]


def test_ttft_search_bounds_the_largest_ttft_not_the_p99(monkeypatch):
    # The largest TTFT passes the limit (2.2 s) beyond a third of the inversions; the p99 never does.
    _fake_search(monkeypatch, lambda inv: 2.0 + 0.6 * inv)
    lines = bt.ttft_search(steps=60, seed=0)
    final = lines[-1]
    largest = float(final.split("largest TTFT ")[1].split("x")[0])
    assert largest <= 1.10
    assert _figures(lines[2:]) == sorted(_figures(lines[2:])) and _figures(lines[-1:])[0] > 0.9


def test_ttft_search_keeps_nothing_when_no_order_is_within_the_limit(monkeypatch):
    _fake_search(monkeypatch, lambda inv: 3.0)  # every order's largest TTFT is 1.5x the best p99
    lines = bt.ttft_search(steps=20, seed=0)
    assert all(f == 0.0 for f in _figures(lines[2:-1])), "an order over the limit was kept"


@pytest.mark.parametrize("beta_s, want", [(0.0, ["a", "b", "c"]),  # arrival order
                                          (0.004, ["b", "a", "c"]),  # b's 45 more iterations outweigh 0.1 s
                                          (1.0, ["b", "c", "a"])])  # longest first
def test_aged_lpt_orders_each_users_queue_by_arrival_minus_beta_per_remaining_iteration(beta_s, want):
    now = {"s": 0.0}
    s = Scheduler(backend=ScriptedBackend(), clock=lambda: now["s"], policy=bt.AgedLPT(beta_s, prefill_chunk_tokens=64))
    for rid, at_s, max_tokens in (("a", 0.0, 5), ("b", 0.1, 50), ("c", 0.2, 20)):  # 1 prompt chunk each
        now["s"] = at_s
        s.submit(make_req(rid, n_prompt=10, max_tokens=max_tokens))
    assert [q.request_id for q in s.policy.order()] == want
