"""bench/ablation.py: the default scheduler with one mechanism off at a time (docs/design.md,
"What each mechanism buys"). A tiny configuration: one seed, the small workloads, one short trace."""
from __future__ import annotations

import math

import ablation  # bench/ablation.py (tests/conftest.py puts bench/ on sys.path)
import pytest
import vllm_compare as vc

import scheduler


@pytest.fixture(autouse=True)
def _no_invariant_checks(monkeypatch):
    """The ablation measures the scheduler as shipped: without the suite's per-tick invariant
    checks (conftest turns them on), which would multiply its run time."""
    monkeypatch.setattr(scheduler, "CHECK_INVARIANTS", False)


def test_ablation_has_a_row_per_mechanism_with_finite_figures(tmp_path):
    traces = vc.traces_dir()
    cfg = ablation.Config.quick()
    rows, mat = ablation.ablate(cfg, traces=traces if (traces / cfg.anchors[0]).is_file() else tmp_path)
    assert [r.key for r in rows] == [v.key for v in ablation.MECHANISMS]
    assert len(rows) == 9
    for r in rows:
        assert r.figures, r.key
        for f in r.figures:
            assert f.finite(), (r.key, f)
    lines = ablation.table(rows)
    assert len(lines) == 2 + sum(len(r.figures) for r in rows)
    assert all(line.count("|") == 8 for line in lines)
    for r in rows:
        assert sum(f"**{r.mechanism}**" in line for line in lines) == 1
    # the matrix: the default, every mechanism off, FCFS; every figure finite
    assert list(mat) == ["default", *(v.key for v in ablation.MECHANISMS), "fcfs"]
    for cells in mat.values():
        for c in cells.values():
            assert all(math.isfinite(c[k]) for k in ("throughput_tok_s", "preemptions", "ttft_p99_s", "tpot_p99_s"))


def test_each_variant_switches_off_only_its_mechanism():
    """The variant's scheduler differs from the default's in the one knob named."""
    def knobs(s):
        p = s.policy
        return {"policy": type(p).__name__, "tolerance": getattr(p, "tolerance_tokens", None),
                "isolation": s.isolation is not None,
                "model": None if s.isolation is None else s.isolation.model.min_observations,
                "headroom": s.admission_headroom, "easy": s.easy_backfill,
                "drain": getattr(p, "drain_longest_first", None), "resume": getattr(p, "resume_decodes_first", None),
                "aging": s.aging_ticks, "cap": s.max_preemptions}

    base = knobs(ablation.DEFAULT.factory()())
    assert base == knobs(scheduler.Scheduler())
    changed = {v.key: {k for k, x in knobs(v.factory()()).items() if x != base[k]} for v in ablation.MECHANISMS}
    assert changed == {"vtc": {"tolerance"}, "isolation": {"isolation", "model"}, "latency-model": {"model"},
                       "headroom": {"headroom"}, "easy": {"easy"}, "drain": {"drain"}, "resume-first": {"resume"},
                       "aging": {"aging"}, "preemption-cap": {"cap"}}
