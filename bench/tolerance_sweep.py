#!/usr/bin/env python3
"""What ``VTCPolicy(tolerance_tokens=T)`` buys and costs, per tolerance ``T`` (docs/fairness.md,
section 6, "Tolerance").

For each ``T`` (weighted tokens), with ``Scheduler(policy=VTCPolicy(tolerance_tokens=T))``:

* the balanced anchor traces (``trace200_poisson20_seed0.csv``, ``poisson_n300_r30_seed0.csv``):
  output tok/s and TTFT p99 from nominal arrival, replayed on the simulated clock exactly as
  ``bench/vllm_compare.py`` replays them (its Batch driver, so the figures match its table);
* the overload (``bench_fairness.overload(0)``, four users with 400 requests each): Jain's
  index of service while all are backlogged and the largest service gap, weighted tokens;
* weighted shares: the same overload with user ``short`` at weight 2, its service over the mean
  of the others' while all four are backlogged (2.0 is exact);
* a light user early in a burst (a scenario of ``tests/test_resume.py``): user A's 40 requests
  preempt each other in a 48-block cache; user L's 10-token request arrives 3 ticks in; ticks
  from L's arrival to its first token.

FCFS (``FCFSPolicy()``) is printed beside for the first two. Usage, from the project root::

    python bench/tolerance_sweep.py [--tolerances 0,512,1024,2048,4096] [--traces DIR]

About 10 s. Needs only the scheduler's own closure (bench_fairness imports numpy-free modules).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bench_fairness as bf
import vllm_compare as vc
from batch.policies.policy import FCFSPolicy
from batch.policies.vtc import VTCPolicy
from batch.sim import simulate
from inference_stub import Request
from scheduler import Scheduler

HERE = Path(__file__).resolve().parent

BALANCED = ("trace200_poisson20_seed0.csv", "poisson_n300_r30_seed0.csv")


def light_user_ticks(policy: VTCPolicy) -> int:
    """Ticks from user L's arrival to its first token, early in user A's burst (see above)."""
    from inference_stub import SimulatedGPU, VirtualClock

    clock = VirtualClock()
    gpu = SimulatedGPU(eos_probability=0.0, seed=0, clock=clock)
    s = Scheduler(backend=gpu, clock=clock, kv_cap_blocks=48, policy=policy)
    for i in range(40):
        s.submit(Request(user_id="A", prompt=[1 + j % 63 for j in range(15)], max_tokens=60, request_id=f"a{i}"))
    light = Request(user_id="L", prompt=[1 + j % 63 for j in range(10)], max_tokens=3, request_id="L")
    for t in range(2000):
        if t == 3:
            s.submit(light)
        s.tick()
        if light.generated:
            return t - 3 + 1
    raise RuntimeError("L got no token in 2000 ticks")


def overload(policy) -> tuple[float, float]:
    """(Jain's index while all four are backlogged, largest service gap in weighted tokens)."""
    res = simulate.run_workload(bf.overload(0, n_per_user=400), record_itl=False,
                                make_scheduler=bf.RecordingScheduler, policy=policy)
    return (bf.jain_while_all_backlogged(res.scheduler.trace, list(bf.OVERLOAD_USERS)),
            bf.max_service_gap(res.scheduler.trace))


def weighted_share(tol: int) -> float:
    """User ``short``'s service (weight 2) over the mean of the other three's, all backlogged."""
    w = {"short": 2}
    res = simulate.run_workload(bf.overload(0, n_per_user=400), record_itl=False,
                                make_scheduler=lambda **k: bf.RecordingScheduler(weights=w, **k),
                                policy=VTCPolicy(weights=w, tolerance_tokens=tol))
    acc = bf.raw_service_while_backlogged(res.scheduler.trace, bf.OVERLOAD_USERS, w)
    others = [acc[u] for u in bf.OVERLOAD_USERS if u != "short"]
    return acc["short"] / (sum(others) / len(others))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tolerances", default="0,512,1024,2048,4096", help="comma-separated, weighted tokens")
    p.add_argument("--traces", default=None, help="folder of the anchor traces (as bench/vllm_compare.py)")
    a = p.parse_args(argv)
    try:
        tols = [int(x) for x in a.tolerances.split(",")]
    except ValueError:
        p.error(f"--tolerances must be comma-separated ints, got {a.tolerances!r}")
    if any(t < 0 for t in tols):
        p.error("--tolerances must be >= 0")
    folder = vc.traces_dir(a.traces)
    missing = [name for name in BALANCED if not (folder / name).is_file()]
    if missing:
        p.error(f"no {missing[0]} in {folder} (pass --traces DIR or set {vc.TRACES_ENV})")
    traces = {name: vc.load_requests(folder / name) for name in BALANCED}
    rows = [(f"T = {t}", lambda t=t: VTCPolicy(tolerance_tokens=t)) for t in tols] + [("FCFS", FCFSPolicy)]
    print("| policy | " + " | ".join(f"`{n.split('_')[0]}` tok/s, TTFT p99 (s)" for n in BALANCED)
          + " | overload: Jain / largest gap | weight 2 : 1 share | light user in a burst: ticks |")
    print("|---|" + "---|" * (len(BALANCED) + 3))
    for name, make in rows:
        cells = []
        for reqs in traces.values():
            summ = vc.summarize(vc.run_batch(reqs, factory=lambda make=make, **k: Scheduler(policy=make(), **k),
                                             name=name))
            cells.append(f"{summ.throughput_tok_s:.1f}, {summ.ttft_p99_s:.2f}")
        jain, gap = overload(make())
        vtc = name != "FCFS"
        share = f"{weighted_share(int(name[4:])):.2f}" if vtc else "-"
        light = light_user_ticks(make()) if vtc else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {jain:.3f} / {gap:.0f} | {share} | {light} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
