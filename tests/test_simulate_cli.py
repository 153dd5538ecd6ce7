"""The main job's outputs (issue 17): ``--json`` under vLLM ``benchmark_serving``'s metric names,
p90 / p95 beside p50 / p99, request throughput and goodput under stated SLOs, ``--policy``,
and ``gpu_utilization`` told apart from the GPU-busy share of clock time.

``python -m batch`` runs in a subprocess on a small virtual-clock workload; the metric functions
are also checked directly.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from test_cli_errors import ROOT, assert_one_line_error, run_cli

import request_gen
from batch.core import goodput, metrics
from batch.sim import simulate
from inference_stub import Request

SMALL = ("--clock", "virtual", "--n", "40", "--rate", "30")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
VLLM_KEYS = {"completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput",
             *(f"{stat}_{name}_ms" for name in LATENCIES for stat in ("mean", "median", "p90", "p95", "p99"))}


def run_json(*args: str) -> dict:
    """``python -m batch --json`` on the small workload; stdout must be exactly one JSON object."""
    proc = run_cli(*SMALL, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)  # raises on anything but one JSON document


@pytest.fixture(scope="module")
def default_json() -> dict:
    return run_json()


def test_json_has_vllm_benchmark_keys_and_the_contract_figures(default_json):
    out = default_json
    assert VLLM_KEYS <= set(out), VLLM_KEYS - set(out)
    assert out["policy"] == "vtc" and out["policy_class"] == "VTCPolicy" and out["backend"] == "stub"
    assert out["completed"] == 40 and out["duration"] > 0 and out["refused"] == 0
    assert out["goodput_slo_ms"] == {"ttft": simulate.DEFAULT_SLO_TTFT_MS, "tpot": simulate.DEFAULT_SLO_TPOT_MS}
    m = out["scheduler_metrics"]
    assert set(metrics.CONTRACT_KEYS) <= set(m)
    assert out["request_throughput"] == pytest.approx(out["completed"] / out["duration"])
    assert out["output_throughput"] == pytest.approx(m["throughput_tokens_per_sec"])
    assert out["total_token_throughput"] == pytest.approx(
        (out["total_input_tokens"] + out["total_output_tokens"]) / out["duration"])
    assert out["mean_e2el_ms"] == pytest.approx(m["avg_latency_s"] * 1e3)
    assert out["p99_e2el_ms"] == pytest.approx(m["p99_latency_s"] * 1e3)
    assert out["gpu_utilization"] == m["gpu_utilization"]
    assert 0 < out["gpu_busy_fraction"] <= 1


def test_json_percentiles_are_ordered_and_goodput_is_at_most_request_throughput(default_json):
    out = default_json
    for name in LATENCIES:
        p50, p90, p95, p99 = (out[f"{q}_{name}_ms"] for q in ("median", "p90", "p95", "p99"))
        assert 0 <= p50 <= p90 <= p95 <= p99, name
    assert 0 <= out["request_goodput"] <= out["request_throughput"]
    assert out["request_goodput"] == pytest.approx(out["good_completed"] / out["duration"])


def test_goodput_follows_the_slos():
    strict = run_json("--slo-ttft-ms", "0.001")  # no first token comes within a microsecond
    assert strict["request_goodput"] == 0 and strict["good_completed"] == 0
    lax = run_json("--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9", "--slo-e2el-ms", "1e9")
    assert lax["good_completed"] == lax["completed"] and lax["request_goodput"] == pytest.approx(
        lax["request_throughput"])
    assert lax["goodput_slo_ms"] == {"ttft": 1e9, "tpot": 1e9, "e2el": 1e9}


@pytest.mark.parametrize("policy,policy_class,scheduler_class", [  # FCFS is the base class Policy (FCFSPolicy = Policy)
    ("fcfs", "Policy", "Scheduler"), ("round-robin", "RoundRobinPolicy", "Scheduler"),
    ("fcfs-reserve", "Policy", "ReservationScheduler"), ("static", "Policy", "StaticBatchScheduler")])
def test_policy_flag_chooses_the_admission_policy(policy, policy_class, scheduler_class):
    out = run_json("--policy", policy)
    assert (out["policy"], out["policy_class"], out["scheduler_class"]) == (policy, policy_class, scheduler_class)
    assert out["completed"] == 40


def test_human_output_has_the_new_rows_and_explains_gpu_utilization():
    proc = run_cli(*SMALL, "--policy", "fcfs")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("Batch on") and "policy fcfs (--policy fcfs)" in out
    for row in ("request throughput (req/s)", "goodput (req/s meeting the SLOs)", "TTFT mean / p50 / p90 / p95 / p99",
                "TPOT mean / p50 / p90 / p95 / p99", "ITL mean / p50 / p90 / p95 / p99",
                "e2e mean / p50 / p90 / p95 / p99", "gpu_busy_fraction"):
        assert f"\n{row}  " in out or f"\n{row} " in out, row
    util = next(line for line in out.splitlines() if line.startswith("gpu_utilization"))
    assert "fraction of ticks whose batch was non-empty" in util
    assert "TTFT <= 1000 ms, TPOT <= 100 ms" in out
    assert "requests finished                  40" in out  # the label column keeps its width


@pytest.mark.parametrize("args,words", [
    (("--policy", "bogus"), ("--policy", "'bogus'")),
    (("--slo-ttft-ms", "0"), ("--slo-ttft-ms", "'0'")),
    (("--slo-ttft-ms", "-5"), ("--slo-ttft-ms",)),
    (("--slo-tpot-ms", "nan"), ("--slo-tpot-ms", "'nan'")),
    (("--slo-tpot-ms", "fast"), ("--slo-tpot-ms", "'fast'")),
    (("--slo-e2el-ms", "inf"), ("--slo-e2el-ms", "'inf'")),
    (("--policy", "static", "--backend", "model"), ("--policy static", "stub backend only")),
    (("--json", "--policy", "FCFS"), ("--policy",)),
])
def test_bad_values_are_one_line_errors(args, words):
    proc = run_cli("--n", "5", *args)  # refused before anything runs
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_line_error(proc, *words)


# ---- the metric functions --------------------------------------------------------------------


def test_summary_keeps_the_contract_keys_and_adds_ordered_percentiles():
    res = simulate.run_workload(request_gen.stream(n=60, lam=40.0, seed=3), virtual=True, gpu_seed=0)
    m = res.scheduler.metrics()
    assert set(metrics.CONTRACT_KEYS) <= set(m)
    assert m["e2e_mean_s"] == m["avg_latency_s"] and m["e2e_p99_s"] == m["p99_latency_s"]
    for key in ("ttft", "tpot", "itl", "e2e", "queue"):
        got = [m[f"{key}_p{q}_s"] for q in metrics.PERCENTILES if f"{key}_p{q}_s" in m]
        assert got == sorted(got), key
    assert m["request_throughput"] == pytest.approx(m["requests_finished"] / m["duration_s"])
    assert m["prompt_tokens"] == sum(len(r.prompt) for r in res.finished)
    # the per-request latencies goodput uses are the ones the recorder measured
    lat = [goodput.request_latencies(r) for r in res.completed()]
    assert metrics._pct(sorted(x[0] for x in lat), 90) == pytest.approx(m["ttft_p90_s"])
    assert metrics._pct(sorted(x[2] for x in lat), 95) == pytest.approx(m["e2e_p95_s"])


def test_slo_and_request_latencies_follow_vllm():
    one = Request(user_id="u", prompt=[1], max_tokens=1, request_id="one", submitted_at=1.0)
    one.started_at, one.completed_at, one.generated = 1.5, 1.5, [7]
    three = Request(user_id="u", prompt=[1], max_tokens=3, request_id="three", submitted_at=0.0)
    three.started_at, three.completed_at, three.generated = 0.2, 0.6, [1, 2, 3]
    pending = Request(user_id="u", prompt=[1], max_tokens=3, request_id="pending", submitted_at=0.0)
    assert goodput.request_latencies(one) == (0.5, 0.0, 0.5)  # one token: TPOT 0, as vLLM
    assert goodput.request_latencies(three) == pytest.approx((0.2, 0.2, 0.6))
    assert goodput.request_latencies(pending) is None
    assert goodput.SLO(ttft_s=0.5, tpot_s=0.2).met(0.5, 0.2, 99.0)  # at the objective is within it
    assert not goodput.SLO(ttft_s=0.5, e2el_s=0.55).met(0.2, 0.2, 0.6)
    assert goodput.good_requests([one, three, pending], goodput.SLO(ttft_s=0.3)) == 1
    assert goodput.good_requests([one, three, pending], goodput.SLO()) == 2
    assert goodput.SLO(tpot_s=0.05).as_ms() == {"tpot": 50.0}


def test_benchmark_metrics_names_and_units():
    m = simulate.run_workload(request_gen.stream(n=20, lam=20.0, seed=1), virtual=True).scheduler.metrics()
    out = goodput.benchmark_metrics(m, good_completed=5)
    assert set(out) == VLLM_KEYS
    assert out["median_itl_ms"] == m["itl_p50_s"] * 1e3 and out["p95_tpot_ms"] == m["tpot_p95_s"] * 1e3
    assert out["request_goodput"] == pytest.approx(5 / m["duration_s"])
    assert goodput.benchmark_metrics(m)["request_goodput"] is None
    assert all(v is None or math.isfinite(v) for v in out.values())


def test_a_request_failed_by_the_retry_policy_is_no_completion_and_not_good():
    reqs = [Request(user_id="u", prompt=[1, 2], max_tokens=3, request_id=rid, submitted_at=t)
            for rid, t in (("a", 0.0), ("bad", 10.0), ("c", 20.0))]  # one at a time on the virtual clock

    def make(**kw):
        inner = kw.pop("backend")

        def flaky(batch):
            if any(r.request_id == "bad" for r in batch):
                raise RuntimeError("device lost")
            return inner(batch)
        return simulate.Scheduler(backend=flaky, max_backend_tries=1, **kw)

    res = simulate.run_workload(reqs, make_scheduler=make, virtual=True, eos_probability=0.0)
    assert [r.request_id for r in res.failed] == ["bad"]
    assert [r.request_id for r in res.completed()] == ["a", "c"]
    assert goodput.good_requests(res.completed(), goodput.SLO()) == 2
    assert res.scheduler.metrics()["requests_finished"] == 2


def test_metrics_imports_nothing_outside_the_standard_library():
    code = "import sys, batch.core.metrics; bad = {'numpy', 'torch'} & set(sys.modules); print(sorted(bad))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
