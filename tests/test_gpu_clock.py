"""The GPU clock as a backend and an option (issue 41): ``SimulatedGPU(profile=...)`` (a paged
backend the scheduler drives through ``execute_model``; the plain stub keeps ``forward`` and
nothing else), ``simulate.run_workload(gpu=...)`` and the main job's ``--gpu``."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_cli_errors import assert_one_line_error, run_cli

import inference_stub
from batch.sim import gpu_profile as gp
from batch.sim import simulate
from inference_stub import ProfiledGPU, Request, SimulatedGPU, VirtualClock
from scheduler import Scheduler

H100 = gp.get("h100-llama3-8b")


def t(items) -> float:
    return H100.step_time_s(items)



def test_simulated_gpu_with_a_profile_is_a_paged_backend_and_without_one_is_the_stub():
    plain = SimulatedGPU()
    assert type(plain) is SimulatedGPU and not hasattr(plain, "execute_model")
    gpu = SimulatedGPU(profile="h100-llama3-8b", clock=VirtualClock(), seed=0)
    assert isinstance(gpu, ProfiledGPU) and gpu.profile is H100
    with pytest.raises(TypeError, match="execute_model"):
        gpu.forward([Request(user_id="u", prompt=[1, 2], max_tokens=3)])
    with pytest.raises(ValueError, match="unknown GPU profile"):
        SimulatedGPU(profile="nope")


def test_the_scheduler_drives_a_profiled_gpu_through_execute_model_and_the_clock_prices_each_step():
    clock = VirtualClock()
    gpu = SimulatedGPU(profile="h100-llama3-8b", clock=clock, seed=0, eos_probability=0.0)
    s = Scheduler(clock=clock.now, backend=gpu, **H100.limits.scheduler_kwargs())
    r = Request(user_id="u", prompt=[1] * 100, max_tokens=3, request_id="r")
    s.submit(r)
    steps = []
    while s.has_active():
        before = clock.now()
        s.tick()
        steps.append(clock.now() - before)
    # 100 prompt tokens in 64-token chunks (the shipped rule), then two decodes
    want = [t([(64, 0)]), t([(36, 64)]), t([(1, 100)]), t([(1, 101)])]
    assert steps == pytest.approx(want) and len(r.generated) == 3
    assert r.started_at == pytest.approx(sum(want[:2]))


def test_run_workload_on_a_gpu_takes_the_profiles_limits_unless_given():
    reqs = [Request(user_id="u", prompt=[1] * 20, max_tokens=4, request_id=f"r{i}") for i in range(3)]
    res = simulate.run_workload(reqs, gpu="h100-llama3-8b", eos_probability=0.0)
    cfg = res.scheduler.config
    assert (cfg.kv_cap_blocks, cfg.token_budget_tokens, cfg.max_running) == (28094, 8192, 1024)
    res = simulate.run_workload([dataclasses.replace(r, generated=[]) for r in reqs], gpu="h100-llama3-8b",
                                eos_probability=0.0, kv_cap_blocks=64)
    assert res.scheduler.config.kv_cap_blocks == 64
    assert res.busy_s > 0 and len(res.finished) == 3


def test_the_stub_default_is_untouched():
    assert Scheduler().config.kv_cap_blocks == inference_stub.MAX_KV_BLOCKS
    assert SimulatedGPU().latency_s(3) == pytest.approx(0.008)


# ----------------------------------------------------------------------------- the main job

def test_main_job_on_the_gpu_clock_prints_the_profile_and_its_limits():
    p = run_cli("--gpu", "h100-llama3-8b", "--n", "20", "--rate", "50")
    assert p.returncode == 0, p.stderr
    assert "GPU h100-llama3-8b" in p.stdout and "KV cap 28094 blocks" in p.stdout and "clock: virtual" in p.stdout
    assert "requests finished                  20" in p.stdout


def test_main_job_json_names_the_gpu():
    p = run_cli("--gpu", "h100-llama3-8b", "--n", "10", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["gpu"] == "h100-llama3-8b" and out["clock"] == "virtual" and out["completed"] == 10


@pytest.mark.parametrize("args, message", [
    (("--gpu", "h200-nope"), "--gpu"),
    (("--gpu", "h100-llama3-8b", "--backend", "model"), "--backend model"),
    (("--gpu", "h100-llama3-8b", "--policy", "static"), "--policy static"),
])
def test_main_job_gpu_errors_are_one_line(args, message):
    assert_one_line_error(run_cli(*args), message)
