"""bench/vllm_compare.py: the Batch driver's timings on hand-made traces, the metrics helper against
hand-computed values, the three A/B timings, without vLLM; and the tests marked ``vllm`` (the vLLM
driver, the side-by-side command line), which need vllm: ``make test`` runs them in ``.venv-vllm``
(``pytest -m vllm``) and the rest in ``.venv``."""
from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import vllm_compare as vc  # noqa: E402
from batch.policies.policy import FCFSPolicy  # noqa: E402
from scheduler import Scheduler  # noqa: E402

T = vc.TraceRequest
IT = 0.006  # one iteration with one request: 5 ms + 1 ms


def fcfs(reqs, **kw):
    return vc.run_batch(reqs, factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k), name="Batch-FCFS", **kw)


def by_id(run: vc.Run) -> dict[str, vc.Timing]:
    return {t.rid: t for t in run.timings}


@pytest.mark.parametrize("prompt", [1, 63, 64, 65, 128, 200])
def test_one_request_alone_prefills_in_64_token_chunks(prompt):
    run = vc.run_batch([T("r", "u1", 0.5, prompt, 5)])
    t = by_id(run)["r"]
    chunks = math.ceil(prompt / 64)
    assert t.submit_s == pytest.approx(0.5)  # idle until it arrives: submitted at its arrival
    assert t.first_s - t.arrival_s == pytest.approx(chunks * IT)
    assert t.done_s - t.arrival_s == pytest.approx((chunks + 4) * IT)
    assert t.output_tokens == 5 and run.steps == chunks + 4 and run.preemptions == 0
    s = vc.summarize(run)
    assert s.ttft_p50_s == pytest.approx(chunks * IT) and s.tpot_p99_s == pytest.approx(IT)
    assert s.throughput_tok_s == pytest.approx(5 / ((chunks + 4) * IT))
    assert s.cpu_us_per_step > 0


def test_batched_requests_share_iterations_and_eos_ends_each_at_its_length():
    run = vc.run_batch([T("a", "u1", 0.0, 10, 3), T("b", "u2", 0.0, 10, 5)])
    a, b = by_id(run)["a"], by_id(run)["b"]
    assert a.first_s == b.first_s == pytest.approx(0.007)  # both in one 7 ms iteration
    assert a.done_s == pytest.approx(3 * 0.007)
    assert b.done_s == pytest.approx(3 * 0.007 + 2 * IT)  # alone after a finished
    assert (a.output_tokens, b.output_tokens) == (3, 5)


def test_a_request_is_submitted_at_the_first_step_boundary_after_its_arrival():
    run = fcfs([T("a", "A", 0.0, 10, 10), T("b", "B", 0.004, 10, 2)])
    b = by_id(run)["b"]
    assert b.submit_s == pytest.approx(IT)  # arrived mid-iteration; handed over when it ended
    assert b.first_s == pytest.approx(IT + 0.007)


def test_percentile_linear_interpolation():
    assert vc.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert vc.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert vc.percentile([1, 2, 3, 4], 0) == 1 and vc.percentile([1, 2, 3, 4], 100) == 4
    assert vc.percentile([5.0], 99) == 5.0
    assert math.isnan(vc.percentile([], 50))


def test_summarize_against_hand_computed_values():
    run = vc.Run("x", [vc.Timing("r1", "u", 0.0, 0.0, 0.1, 0.5, 5),
                       vc.Timing("r2", "u", 1.0, 1.01, 1.3, 2.0, 1),
                       vc.Timing("r3", "u", 0.5, 0.5, 0.9, 1.9, 11)],
                 preemptions=3, steps=4, sched_cpu_s=0.002)
    s = vc.summarize(run)
    assert s.output_tokens == 17 and s.requests == 3
    assert s.throughput_tok_s == pytest.approx(17 / 2.0)  # last completion 2.0 - first arrival 0.0
    # TTFT from nominal arrival: 0.1, 0.3, 0.4
    assert s.ttft_p50_s == pytest.approx(0.3) and s.ttft_p99_s == pytest.approx(0.3 + 0.1 * 0.98)
    # TPOT of requests with >= 2 tokens: 0.4 / 4 = 0.1 and 1.0 / 10 = 0.1
    assert s.tpot_p50_s == pytest.approx(0.1) and s.tpot_p99_s == pytest.approx(0.1)
    # e2e: 0.5, 1.0, 1.4
    assert s.e2e_p50_s == pytest.approx(1.0) and s.e2e_p99_s == pytest.approx(1.0 + 0.4 * 0.98)
    assert s.preemptions == 3 and s.steps == 4 and s.cpu_us_per_step == pytest.approx(500.0)


def test_three_ab_timings_on_a_tiny_trace():
    # A: two requests at 0 (prompt 10, 10 tokens); B: one arriving at 4 ms (prompt 10, 2 tokens).
    reqs = [T("a1", "A", 0.0, 10, 10), T("a2", "A", 0.0, 10, 10), T("b1", "B", 0.004, 10, 2)]
    r = vc.ab_ratios(fcfs, reqs)
    # at once: all three prefill together in an 8 ms iteration; B alone: 6 ms
    assert r.medians["at once"] == pytest.approx((0.008, 0.006))
    # timed: B waits for A's first 7 ms iteration (submitted at 7 ms), then joins an 8 ms one.
    # Alone: submitted at its arrival, first token 6 ms later.
    assert r.medians["from submit"] == pytest.approx((0.008, 0.006))
    assert r.medians["from arrival"] == pytest.approx((0.015 - 0.004, 0.006))
    assert r.ratio("from arrival") == pytest.approx(11 / 6)
    lines = vc.ab_lines([r])
    assert "1.83x" in lines[-1] and len(lines) == 3


def test_ab_ratios_reuses_the_timed_run_it_is_given():
    reqs = [T("a1", "A", 0.0, 10, 10), T("b1", "B", 0.004, 10, 2)]
    timed = fcfs(reqs)
    calls = []

    def counting(rs, **kw):
        calls.append((len(rs), kw.get("at_once", False)))
        return fcfs(rs, **kw)

    vc.ab_ratios(counting, reqs, timed_with=timed)
    assert sorted(calls) == [(1, False), (1, True), (2, True)]


def test_traces_dir_flag_then_env_then_default(monkeypatch, tmp_path):
    monkeypatch.delenv(vc.TRACES_ENV, raising=False)
    assert vc.traces_dir() == ROOT / "data" / "traces" / "anchors"
    monkeypatch.setenv(vc.TRACES_ENV, str(tmp_path))
    assert vc.traces_dir() == tmp_path  # a folder of anchor traces itself
    (tmp_path / "anchors").mkdir()
    assert vc.traces_dir() == tmp_path / "anchors"  # the traces folder, as the main job reads it
    assert vc.traces_dir("elsewhere") == Path("elsewhere")


def test_ab_trace_draws_the_cold_harness_workload():
    """``ab_trace(seed)`` is the A/B burst ``bench/cold_fairness.py`` draws for the same seed
    (lengths, users, arrival order), so the ablation's ratios and the cold harness's compare."""
    rnd = random.Random(1000 + 4)
    want = []
    for user, n in (("A", 100), ("B", 5)):
        for i in range(n):
            prompt = [rnd.randint(1, 63) for _ in range(rnd.randint(5, 199))]
            want.append((f"{user}{i}", user, len(prompt), rnd.randint(10, 99)))
    arrivals = [rnd.uniform(0.0, 1.0) for _ in want]
    want = [w for _, w in sorted(zip(arrivals, want), key=lambda x: x[0])]
    assert [(r.rid, r.user, r.prompt_tokens, r.output_tokens) for r in vc.ab_trace(4)] == want


def test_load_requests_keeps_the_user_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens,user\n0.1,10,5,A\n0.2,70,3,B\n")
    assert vc.load_requests(p) == [T("t0", "A", 0.1, 10, 5), T("t1", "B", 0.2, 70, 3)]


def test_batch_only_command_line_without_vllm(tmp_path):
    (tmp_path / vc.AB_TRACE).write_text("arrival_s,prompt_tokens,output_tokens,user\n"
                                        "0.0,10,10,A\n0.0,10,10,A\n0.004,10,2,B\n")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_compare.py"), "--batch-only", "--no-sweep",
                        "--traces", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert f"| `{vc.AB_TRACE}` | Batch |" in p.stdout and "from arrival" in p.stdout
    assert "vLLM" not in p.stdout.split("\n\n", 1)[1]  # no vLLM row; the module never imported it


def test_module_import_does_not_import_vllm():
    code = ("import sys; sys.path.insert(0, 'bench'); import vllm_compare; "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr


@pytest.mark.vllm
def test_vllm_driver_on_a_tiny_trace():
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    # Alone, vLLM lifts the 64-token threshold (nobody to starve): a 100-token prompt in one step.
    alone = by_id(vc.run_vllm([T("r", "u1", 0.0, 100, 5)]))["r"]
    assert alone.first_s == pytest.approx(IT) and alone.done_s == pytest.approx(5 * IT)
    # Two together: chunks of at most 64 tokens, so 100 tokens take two 7 ms steps.
    run = vc.run_vllm([T("a", "u1", 0.0, 100, 3), T("b", "u2", 0.0, 100, 4)])
    a, b = by_id(run)["a"], by_id(run)["b"]
    assert a.first_s == b.first_s == pytest.approx(2 * 0.007)
    assert a.done_s == pytest.approx(4 * 0.007) and b.done_s == pytest.approx(4 * 0.007 + IT)
    assert (a.output_tokens, b.output_tokens) == (3, 4) and run.preemptions == 0


@pytest.mark.vllm
def test_side_by_side_command_line_prints_batch_and_vllm_rows_and_ab_ratios(tmp_path):
    """``bench/vllm_compare.py`` as ``make bench-vllm`` runs it, on a three-request A/B trace: a
    Batch row and a vLLM row with equal figures (one request at a time fits both the same way),
    and the A/B ratios of both in the three timings."""
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    (tmp_path / vc.AB_TRACE).write_text("arrival_s,prompt_tokens,output_tokens,user\n"
                                        "0.0,10,10,A\n0.0,10,10,A\n0.004,10,2,B\n")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_compare.py"), "--no-sweep", "--traces",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    main_table = p.stdout.split("\nMean TTFT and TTFT p99 per user")[0]
    rows = {line.split("|")[2].strip(): line.split("|")[3:-2] for line in main_table.splitlines()
            if line.startswith(f"| `{vc.AB_TRACE}` |")}
    assert set(rows) == {"Batch", "vLLM (thr 64)"}, p.stdout
    assert rows["Batch"][:5] == rows["vLLM (thr 64)"][:5]  # tok/s, TTFT, TPOT, e2e, preemptions
    ab = [line for line in p.stdout.splitlines() if line.startswith(("| Batch |", "| vLLM (thr 64) |"))]
    assert len(ab) == 2 and all("11.0 / 6.0 = **1.83x**" in line for line in ab), p.stdout


def test_tolerance_rows_beside_the_shipped_batch(tmp_path):
    """``--tolerance T`` adds a ``Batch-T{T}`` row: the same requests through
    ``VTCPolicy(tolerance_tokens=T)``; a negative tolerance is a one-line usage error."""
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens,user\n0.0,10,3,A\n0.001,10,3,B\n")
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_compare.py"), "--batch-only", "--no-sweep",
           "--traces", str(tmp_path)]
    p = subprocess.run(cmd + ["--tolerance", "64"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "| `t.csv` | Batch |" in p.stdout and "| `t.csv` | Batch-T64 |" in p.stdout
    p = subprocess.run(cmd + ["--tolerance", "-1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--tolerance must be >= 0" in p.stderr


@pytest.mark.slow
def test_the_tolerance_sweep_prints_a_row_per_tolerance_and_fcfs():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "tolerance_sweep.py"), "--tolerances", "0,4096"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if line.startswith("| ")}
    assert {"T = 0", "T = 4096", "FCFS"} <= set(rows)
    cells = {name: rows[name].split("|") for name in ("T = 0", "T = 4096")}
    assert int(cells["T = 0"][-2]) <= 2  # lifted below the band, a light user early in a burst is served at once
    # the band applies only among users of equal weight (fairness_rules.band_tolerance), so the 2:1
    # share does not drift with it (it did before; 3.03 and 1.93 at both tolerances since)
    assert float(cells["T = 4096"][-3]) == float(cells["T = 0"][-3])


# ----------------------------------------------------------------------------- the GPU clock (issue 41)

H100 = vc.clock_for("h100-llama3-8b")


def step(items) -> float:
    return H100.profile.step_time_s(items)


def test_the_stub_clock_keeps_the_seeds_latency_and_gives_both_sides_batchs_defaults():
    assert vc.clock_for("stub") is vc.STUB and vc.STUB.step_s([(64, 0), (1, 9)]) == pytest.approx(0.007)
    assert vc.STUB.step_s([]) == 0.0
    assert vc.STUB.batch_kwargs() == {"kv_cap_blocks": 256, "block_tokens": 16, "token_budget_tokens": 4096,
                                      "max_running": 256}
    s = Scheduler()
    assert (s.config.max_running, s.config.token_budget_tokens) == (vc.VLLM_MAX_SEQS, vc.VLLM_MAX_BATCHED_TOKENS)


def test_a_gpu_clock_takes_the_profiles_limits_and_an_unknown_one_is_a_value_error():
    assert (H100.kv_blocks, H100.max_num_batched_tokens, H100.max_num_seqs, H100.max_model_len) == (28094, 8192, 1024,
                                                                                                   131072)
    assert H100.fits(131000, 72) and not H100.fits(131000, 73)
    with pytest.raises(ValueError, match="unknown GPU profile"):
        vc.clock_for("b200-nope")


@pytest.mark.parametrize("chunk, prefills", [(64, [(64, 0), (36, 64)]), (8192, [(100, 0)])])
def test_batch_on_a_gpu_clock_pays_each_step_what_the_profile_prices(chunk, prefills):
    run = vc.run_batch([T("r", "u1", 0.25, 100, 3)], clock=H100, chunk_tokens=chunk)
    r = by_id(run)["r"]
    first = sum(step([it]) for it in prefills)
    assert r.first_s - r.arrival_s == pytest.approx(first)
    assert r.done_s - r.arrival_s == pytest.approx(first + step([(1, 100)]) + step([(1, 101)]))
    assert run.busy_steps == run.steps == len(prefills) + 2 and run.scheduled_tokens == 102


def test_vllm_items_are_the_tokens_scheduled_and_those_computed_before_them():
    from types import SimpleNamespace as NS
    out = NS(num_scheduled_tokens={"a": 64, "b": 1})
    sched = NS(requests={"a": NS(num_computed_tokens=128), "b": NS(num_computed_tokens=501)})
    assert vc.vllm_items(sched, out) == [(64, 64), (1, 500)]  # schedule() already advanced the counts


def test_capacity_is_the_completion_rate_between_the_10_and_90_percent_marks():
    reqs = [T(f"r{i}", "u", 0.0, 4, 1) for i in range(10)]
    seen = []

    def runner(rs, at_once=False):
        seen.append((len(rs), at_once))
        return vc.Run("x", [vc.Timing(r.rid, "u", 0.0, 0.0, 0.0, (k + 1) ** 1.0 * 0.5, 1) for k, r in enumerate(rs)])
    assert vc.capacity(reqs, runner, min_requests=25) == pytest.approx(2.0)  # one completion each 0.5 s
    assert seen == [(30, True)]  # repeated to >= 25 requests, all at time 0


def test_at_load_scales_the_arrivals_to_the_asked_rate():
    reqs = [T(f"r{i}", "u", float(i), 4, 1) for i in range(4)]  # 4 requests over 3 s
    scaled, rate = vc.at_load(reqs, 0.5, 8.0)
    assert rate == 4.0 and [r.arrival_s for r in scaled] == pytest.approx([0, 1 / 3, 2 / 3, 1])
    assert vc.native_rate(scaled) == pytest.approx(4.0)


def test_batch_only_command_line_on_the_gpu_clock(tmp_path):
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens,user\n0.0,100,3,A\n0.01,50,4,B\n")
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_compare.py"), "--batch-only", "--traces", str(tmp_path)]
    p = subprocess.run(cmd + ["--gpu", "h100-llama3-8b", "--fcfs"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "## GPU clock `h100-llama3-8b`" in p.stdout and "28,094 blocks" in p.stdout
    assert p.stdout.count("| `t.csv` | 0.90 (") == 4  # Batch and Batch-FCFS, at both chunkings
    assert "vLLM's default chunking" in p.stdout and "the 64-token rule" in p.stdout
    p = subprocess.run(cmd + ["--gpu", "h100-nope"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "unknown GPU profile" in p.stderr and "Traceback" not in p.stderr


def test_the_sweep_plot_draws_every_scheduler(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (the bench extra)")
    pts = [{"load": x, "rate_req_s": 10 * x, "ttft_p50_s": x, "ttft_p99_s": 2 * x, "tpot_p99_s": 0.01 * x}
           for x in (0.5, 1.0)]
    data = {"clock": "h100-llama3-8b", "trace": "t.csv", "capacity_req_s": 10.0, "chunking": "64",
            "series": {"Batch": pts, "vLLM (thr 64)": pts}}
    out = Path(vc.plot_sweep(data, tmp_path / "sweep.png"))
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
def test_vllm_on_a_gpu_clock_pays_the_same_step_costs_as_batch():
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    reqs = [T("a", "u1", 0.0, 100, 3), T("b", "u2", 0.0, 100, 4)]
    v = by_id(vc.run_vllm(reqs, clock=H100, threshold=64))
    b = by_id(vc.run_batch(reqs, clock=H100, chunk_tokens=64))
    two = step([(64, 0), (64, 0)]) + step([(36, 64), (36, 64)])  # both chunk 64 + 36 together
    assert v["a"].first_s == pytest.approx(two) == b["a"].first_s
    assert v["b"].done_s == pytest.approx(b["b"].done_s)


# ----------------------------------------------------------------------------- per user, equal demand, acceptance (issue 38)

def timing(rid, user, ttft, done=1.0, tokens=2, at=0.0):
    return vc.Timing(rid, user, at, at, at + ttft, at + done, tokens)


def test_equal_demand_variant_keeps_each_row_and_sets_user_to_the_row_index_mod_5():
    reqs = [T(f"t{i}", "A" if i < 5 else "B", 0.1 * i, 10 + i, 3) for i in range(7)]
    eq = vc.equal_demand(reqs)
    assert [r.user for r in eq] == ["eq0", "eq1", "eq2", "eq3", "eq4", "eq0", "eq1"]
    assert [(r.rid, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in eq] == \
        [(r.rid, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs]


def test_demand_is_prompt_plus_output_tokens_and_light_users_are_at_or_below_the_mean():
    reqs = [T("a", "A", 0, 90, 10), T("b", "B", 0, 40, 10), T("c", "C", 0, 20, 0), T("d", "C", 0, 20, 10)]
    assert vc.demand(reqs) == {"A": 100, "B": 50, "C": 50}
    assert vc.light_users(reqs) == {"B", "C"}  # mean 66.7
    assert vc.light_users([T("a", "A", 0, 5, 5), T("b", "B", 0, 5, 5)]) == {"A", "B"}  # equal: both at the mean


def test_user_ttft_p99_per_user_and_relabeled_moves_timings_to_the_variants_users():
    run = vc.Run("v", [timing("r1", "A", 0.1), timing("r2", "A", 0.3), timing("r3", "B", 0.2)])
    assert vc.user_ttft_p99(run) == pytest.approx({"A": 0.1 + 0.2 * 0.99, "B": 0.2})
    re = vc.relabeled(run, [T("r1", "x", 0, 1, 2), T("r2", "y", 0, 1, 2), T("r3", "x", 0, 1, 2)])
    assert [(t.rid, t.user, t.first_s) for t in re.timings] == [("r1", "x", 0.1), ("r2", "y", 0.3), ("r3", "x", 0.2)]
    assert [t.user for t in run.timings] == ["A", "A", "B"]  # the original is left as it was
    with pytest.raises(ValueError, match="not the run's"):
        vc.relabeled(run, [T("r1", "x", 0, 1, 2)])


def _trial(trace, reqs, batch_ttft, vllm_ttft, *, bp=0, vp=0, batch_done=1.0, vllm_done=1.0):
    return vc.Trial(trace, reqs, {
        "Batch": vc.Run("Batch", [timing(r.rid, r.user, x, batch_done) for r, x in zip(reqs, batch_ttft)],
                        preemptions=bp),
        "vLLM": vc.Run("vLLM", [timing(r.rid, r.user, x, vllm_done) for r, x in zip(reqs, vllm_ttft)],
                       preemptions=vp)})


def test_acceptance_computes_each_ratio_and_whether_it_meets_the_issues_bound():
    # A heavy (demand 100), B and C light (20 each): mean demand 46.7.
    reqs = [T("a", "A", 0, 90, 10), T("b", "B", 0, 10, 10), T("c", "C", 0, 10, 10)]
    anchor = _trial("t.csv", reqs, [0.5, 0.1, 0.3], [0.2, 0.2, 0.2], bp=3, vp=3, batch_done=1.0, vllm_done=1.25)
    variant = _trial("t.csv (equal demand)", vc.equal_demand(reqs), [0.5, 0.1, 0.3], [0.2, 0.2, 0.2])
    c = vc.acceptance(anchor, variant, "Batch", "vLLM")
    assert (c["throughput"].text, c["throughput"].met) == ("1.250", True)  # 6 tokens over 1.0 s against 1.25 s
    assert (c["mean TTFT"].text, c["mean TTFT"].met) == ("1.500", False)  # 0.3 against 0.2
    assert (c["light p99"].text, c["light p99"].met) == ("1.500 (C; 2 users)", False)  # B 0.5, C 1.5
    assert (c["preemptions"].text, c["preemptions"].met) == ("3 / 3", True)
    p99 = vc.percentile([0.5, 0.1, 0.3], 99) / 0.2
    assert (c["equal p99"].text, c["equal p99"].met) == (f"{p99:.3f}", False)
    lines = vc.acceptance_lines([anchor, variant], "Batch", "vLLM")
    assert len(lines) == 4 and lines[2].startswith("| `t.csv` |") and lines[2].endswith("| no |")
    assert "1.250 met" in lines[2] and "1.500 **not met**" in lines[2]
    assert lines[3] == "\n2 of 5 cells met (Batch against vLLM)."


def test_acceptance_light_users_met_and_the_equal_demand_bound_is_1_03():
    reqs = [T("a", "A", 0, 90, 10), T("b", "B", 0, 10, 10)]
    anchor = _trial("t.csv", reqs, [0.3, 0.1], [0.2, 0.2], bp=1, vp=2)
    for b, met in ((0.206, True), (0.207, False)):  # vLLM's p99 0.2: at most 1.03x
        variant = _trial("t.csv (equal demand)", vc.equal_demand(reqs), [b, b], [0.2, 0.2])
        c = vc.acceptance(anchor, variant, "Batch", "vLLM")
        assert c["equal p99"].met is met, c["equal p99"]
    assert c["light p99"] == vc.Check("0.500 (B; 1 user)", True) and c["preemptions"].met
    assert "equal p99" not in vc.acceptance(anchor, None, "Batch", "vLLM")
    assert "not run" in vc.acceptance_lines([anchor], "Batch", "vLLM")[2]


def test_per_user_table_marks_the_light_users_and_gives_mean_ttft():
    reqs = [T("a", "A", 0, 90, 10), T("b", "B", 0, 10, 10)]
    lines = vc.per_user_lines([_trial("t.csv", reqs, [0.3, 0.1], [0.2, 0.2])], ["Batch", "vLLM"])
    assert lines[2] == "| `t.csv` | all: mean TTFT | 2 | 120 | 0.200 | 0.200 |"
    assert lines[4] == "| `t.csv` | B * | 1 | 20 | 0.100 | 0.200 |"
    assert lines[5] == "| `t.csv` | A | 1 | 100 | 0.300 | 0.200 |"


def test_with_equal_demand_runs_the_variant_and_reuses_the_user_blind_runs():
    reqs = [T(f"t{i}", "A" if i else "B", 0.001 * i, 10, 3) for i in range(6)]
    calls = []

    def counting(rs, **kw):
        calls.append([r.user for r in rs])
        return fcfs(rs, **kw)

    anchor, variant = vc.with_equal_demand("t.csv", reqs, [("Batch", vc.run_batch), ("FCFS", counting)], ["FCFS"])
    assert variant.trace == "t.csv (equal demand)" and calls == [["B", "A", "A", "A", "A", "A"]]  # FCFS ran once
    assert {t.user for t in variant.runs["FCFS"].timings} == {f"eq{i}" for i in range(5)}
    assert {t.user for t in variant.runs["Batch"].timings} == {f"eq{i}" for i in range(5)}
    assert [(t.rid, t.first_s) for t in variant.runs["FCFS"].timings] == \
        [(t.rid, t.first_s) for t in anchor.runs["FCFS"].timings]
    assert [t.trace for t in vc.with_equal_demand("t.csv", reqs, [("Batch", vc.run_batch)], [], equal=False)] == \
        ["t.csv"]


def test_batch_only_command_line_prints_the_equal_demand_rows_and_the_per_user_table(tmp_path):
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens,user\n0.0,100,3,A\n0.01,50,4,B\n"
                                    "0.02,20,2,B\n")
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_compare.py"), "--batch-only", "--no-sweep", "--traces",
           str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "| `t.csv (equal demand)` | Batch |" in p.stdout and "| `t.csv` | B * | 2 | 76 |" in p.stdout
    assert "| `t.csv (equal demand)` | eq1 * | 1 | 54 |" in p.stdout
    assert "Acceptance summary (issue 38): not computed" in p.stdout
    p = subprocess.run(cmd + ["--no-equal-demand"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and "equal demand" not in p.stdout, p.stderr


@pytest.mark.vllm
def test_vllm_runs_a_trace_and_its_equal_demand_variant_the_same_way():
    """The ground for reusing vLLM's run of an anchor for its equal-demand variant: its scheduler
    (FCFS) gives every request the same timings whatever the users, on both clocks."""
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    reqs = [T(f"t{i}", "A" if i % 3 else "B", 0.002 * i, 30 + 7 * i, 5 + i % 4) for i in range(12)]
    for clock in (vc.STUB, H100):
        a, b = vc.run_vllm(reqs, clock=clock), vc.run_vllm(vc.equal_demand(reqs), clock=clock)
        strip = lambda run: [(t.rid, t.first_s, t.done_s, t.output_tokens) for t in run.timings]  # noqa: E731
        assert strip(a) == strip(b) and a.preemptions == b.preemptions


@pytest.mark.vllm
def test_side_by_side_command_line_prints_the_acceptance_summary(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens,user\n0.0,10,10,A\n0.0,10,10,A\n"
                                    "0.004,10,2,B\n")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_compare.py"), "--no-sweep", "--traces",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "vLLM (thr 64): run once per trace and reused for its variant" in p.stdout
    assert "| `t.csv (equal demand)` | vLLM (thr 64) |" in p.stdout
    (row,) = [line for line in p.stdout.splitlines() if line.startswith("| `t.csv` |") and "met" in line]
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert len(cells) == 6 and all(c.endswith(("met", "**not met**")) for c in cells[:5]), row
    assert cells[5] == ("yes" if all(c.endswith(" met") and "not" not in c for c in cells[:5]) else "no"), row
    assert "of 5 cells met (Batch against vLLM (thr 64))." in p.stdout
