"""bench/ablation.py: the default scheduler with one mechanism off at a time (docs/design.md,
"Mechanisms on the default path"). A tiny configuration: one seed, the small workloads, one short trace."""
from __future__ import annotations

import math

import ablation  # bench/ablation.py (tests/conftest.py puts bench/ on sys.path)
import pytest
import vllm_compare as vc

import scheduler
from batch.policies.policy import Policy
from conftest import ROOT
from batch.policies.vtc import VTCPolicy


@pytest.fixture(autouse=True)
def _no_invariant_checks(monkeypatch):
    """The ablation measures the scheduler as shipped: without the suite's per-tick invariant
    checks (conftest turns them on), which would multiply its run time."""
    monkeypatch.setattr(scheduler, "CHECK_INVARIANTS", False)


def test_ablation_has_a_row_per_mechanism_and_the_tolerance_curve_with_finite_figures():
    cfg = ablation.Config.quick()
    rows, mat, curve = ablation.ablate(cfg, traces=ROOT / "data" / "traces" / "anchors")  # the repository's
    assert [r.key for r in rows] == [v.key for v in ablation.MECHANISMS] + [ablation.TOLERANCE]
    assert len(rows) == 14
    for r in rows:
        assert r.figures, r.key
        for f in r.figures:
            assert f.finite(), (r.key, f)
    lines = ablation.table(rows)
    assert len(lines) == 2 + sum(len(r.figures) + 1 for r in rows)  # each row's figures and its verdict
    assert all(line.count("|") == 8 for line in lines)
    for r in rows:
        assert sum(f"**{r.mechanism}**" in line for line in lines) == 1
    assert sum("**verdict**" in line for line in lines) == len(rows)
    # the curve: a line per tolerance, then FCFS and vLLM; the row compares each T > 0 with T = 0
    assert [c["tolerance"] for c in curve] == [*cfg.tolerances, None, None]
    assert curve[-1]["name"].startswith("vLLM") and curve[-1]["weighted_share"] is None
    assert sum("weight-2" in f.label for f in rows[-1].figures) == len(cfg.tolerances) - 1
    assert len(ablation.curve_table(curve)) == 2 + len(curve)
    # the matrix: the default, every mechanism off, FCFS; every figure finite
    assert list(mat) == ["default", *(v.key for v in ablation.MECHANISMS), "fcfs"]
    for cells in mat.values():
        for c in cells.values():
            assert all(math.isfinite(c[k]) for k in ("throughput_tok_s", "preemptions", "ttft_p99_s", "tpot_p99_s"))


def _victim_probe():
    """Candidates on which the three victim rules differ: user a's two requests (6 blocks each,
    400 and 500 tokens computed, admitted 1st and 2nd), user b's one (2 blocks, 30 tokens,
    admitted 0th). VTC: a's cheaper (a has the higher pressure); victim_before alone: b's (least
    recompute, b not light); the newest admission: a's costlier."""
    def seq(rid, user, admit_no, blocks, computed):
        s = type("S", (), {})()
        s.request_id, s.user_id, s.admit_no, s.block_table, s.num_preemptions, s.num_computed_tokens = (
            rid, user, admit_no, [0] * blocks, 0, computed)
        return s

    return [seq("a-cheap", "a", 1, 6, 400), seq("a-costly", "a", 2, 6, 500), seq("b", "b", 0, 2, 30)]


def test_each_variant_switches_off_only_its_mechanism():
    """The variant's scheduler differs from the default's in the one knob named; the victim rule
    and the order are told apart by what they answer."""
    def knobs(s):
        p, c = s.policy, s.config
        # the first of the order when user b (arrived second) is light: b, unless light is ignored
        a, b = (type("Q", (), {"user_id": u, "arrival_no": i, "order_no": i, "num_prompt_tokens": 10,
                               "prompt_charged_tokens": 0}) for i, u in enumerate("ab"))
        for q in (a, b):
            p.add(q)
        first = next(iter(p.order(lambda u: u == "b"))).user_id
        for q in (a, b):
            p.remove(q)
        return {"vtc": isinstance(p, VTCPolicy), "tolerance": getattr(p, "tolerance_tokens", None),
                "isolation": c.isolation, "headroom": c.headroom, "resume": c.resume_first,
                "victim": p.victim(_victim_probe()).request_id, "room": p.pressure("a", 0) is not None,
                "requeue_behind": p.requeue_behind, "light_first": first, "aging": c.aging_ticks,
                "cap": c.max_preemptions, "quantum": c.quantum_ticks, "hold": c.hold_ticks}

    base = knobs(ablation.DEFAULT.factory()())
    assert base == knobs(scheduler.Scheduler())
    assert base["victim"] == "a-cheap" and base["room"] and base["light_first"] == "b"
    changed = {v.key: {k for k, x in knobs(v.factory()()).items() if x != base[k]} for v in ablation.MECHANISMS}
    assert changed == {"vtc": {"tolerance"}, "isolation": {"isolation"}, "headroom": {"headroom"},
                       "resume-first": {"resume"}, "victim": {"victim"}, "aging": {"aging"}, "preemption-cap": {"cap"},
                       "pressure-victim": {"victim"}, "room": {"room"}, "quantum": {"quantum"}, "hold": {"hold"},
                       "requeue-behind": {"requeue_behind"}, "light-first": {"light_first"}}
    assert knobs(ablation.tolerance_variant(512).factory()()) == {**base, "tolerance": 512}
    assert knobs(ablation.VARIANTS["victim"].factory()())["victim"] == "a-costly"  # the newest admission
    assert knobs(ablation.VARIANTS["pressure-victim"].factory()())["victim"] == "b"  # victim_before alone
    assert ablation.VARIANTS["preemption-cap"].factory()().config.max_preemptions == 4


def test_the_pressure_free_victim_is_vtcs_victim_whenever_no_user_goes_first():
    """``NoPressureVictimVTC`` copies ``VTCPolicy.victim`` less ``victim_user_first``: where the
    pressures are within a request's worth, or one user holds every candidate, both agree."""
    cands = _victim_probe()
    evened = ablation.NoPressureVictimVTC()
    full = VTCPolicy()
    for p in (evened, full):
        p.charge("b", 0, 512)  # b's counter makes up its one resident request less
    assert full.victim(cands).request_id == evened.victim(cands).request_id == "b"
    assert VTCPolicy().victim(cands[:2]) is ablation.NoPressureVictimVTC().victim(cands[:2]) is cands[0]
    room_off = ablation.NoRoomVTC()
    assert room_off.pressure("a", 3) is None and room_off.victim(cands) is VTCPolicy().victim(cands)


def test_the_victim_variant_preempts_the_newest_admission_where_vtc_shields_a_light_user():
    """Two requests of the heavy user ``h`` admitted first, the light user's ``l`` last: VTC's rule
    spares ``l`` (its user holds at most a quarter of the blocks); vLLM's rule takes the newest."""
    def seq(user, admit_no, blocks):
        s = type("S", (), {})()
        s.user_id, s.admit_no, s.block_table, s.num_preemptions, s.num_computed_tokens = (
            user, admit_no, [0] * blocks, 0, 16 * blocks)
        return s

    cands = [seq("h", 0, 8), seq("h", 1, 8), seq("l", 2, 1)]
    assert VTCPolicy().victim(cands).user_id == "h"
    assert ablation.NewestVictimVTC().victim(cands) is cands[2]
    assert ablation.NewestVictimVTC.victim is Policy.victim


def test_the_verdict_names_the_outcomes_that_move_by_one_percent_or_says_none_does():
    F = ablation.Figure
    row = ablation.Row("x", "x", "x=False", "", [F("a", 100.0, 100.5, None), F("b", 10.0, 12.0, None),
                                                 F("  paired", math.nan, 5.0, None), F("c", 0.0, 0.0, None),
                                                 F("d", 0.0, 3.0, None), F("own", 9.0, 0.0, None, outcome=False)])
    assert [f.label for f in row.moved()] == ["d", "b"]  # from 0 first; the mechanism's own count left out
    assert row.figures[3].cells()[3] == "0" and row.figures[4].cells()[3] == "from 0"
    v = row.verdict()
    assert v.startswith("2 of 5 outcome figures change by 1% or more") and "d from 0; b +20.0%" in v
    flat = ablation.Row("y", "y", "y=False", "", [F("a", 100.0, 100.5, None), F("  paired", math.nan, 5.0, None),
                                                  F("own", 9.0, 0.0, None, outcome=False)])
    assert flat.moved() == [] and flat.verdict() == "none of its 2 outcome figures changes by 1% or more without it"


def test_vllm_figures_are_quoted_when_vllm_is_not_importable(monkeypatch, tmp_path):
    def unavailable():
        raise vc.VLLMUnavailable("not here")

    monkeypatch.setattr(vc, "_vllm", unavailable)
    for name, x in ablation.VLLM_TTFT_P99_QUOTED.items():
        assert ablation.vllm_ttft_p99(tmp_path / name) == (x, "quoted")
    got, source = ablation.vllm_ttft_p99(tmp_path / "other.csv")
    assert math.isnan(got) and source == "quoted"
    assert set(ablation.VLLM_TTFT_P99_QUOTED) == set(vc.ORDER)


def test_on_a_gpu_clock_only_the_iteration_time_changes(monkeypatch, tmp_path):
    """``--gpu h100-llama3-8b``: every replay prices its iterations with the GPU profile while the
    workload's cache and ``Scheduler()``'s limits stay; the token-clock rows (redundant there) go."""
    monkeypatch.setattr(ablation, "GPU", "h100-llama3-8b")
    reqs = [scheduler.Request(user_id="u", prompt=[1] * 100, max_tokens=2, request_id="r")]
    res = ablation.run_workload(reqs, eos_probability=0.0, gpu_seed=0)
    cfg = res.scheduler.config
    assert (cfg.kv_cap_blocks, cfg.max_running, cfg.token_budget_tokens) == (256, 256, 4096)
    h100 = vc.clock_for("h100-llama3-8b").profile
    want = h100.step_time_s([(64, 0)]) + h100.step_time_s([(36, 64)]) + h100.step_time_s([(1, 100)])
    assert res.sim_s == pytest.approx(want)
    clock = ablation.clock()
    assert clock.profile is h100 and clock.kv_blocks == vc.STUB.kv_blocks
    rows, _, _ = ablation.ablate(ablation.Config.quick(), only=["isolation"], matrix=False,
                                 traces=vc.traces_dir() if (vc.traces_dir() / vc.AB_TRACE).is_file() else tmp_path)
    assert not any(f.label.startswith("token clock") for f in rows[0].figures)
