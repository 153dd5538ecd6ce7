#!/usr/bin/env python3
"""Scheduler CPU per step of vLLM's V1 schedulers and of the same with Batch's fairness, on the
anchor traces and in the steady-decode sweep (``vllm_compare.steady_requests``): vLLM's
``Scheduler`` beside ``FairScheduler`` (synchronous) and vLLM's ``AsyncScheduler`` beside
``AsyncFairScheduler`` (async scheduling, two steps in flight), the least of ``--repeats`` runs
each, the runs of a pair alternating so that a busy spell of a shared machine falls on both
(docs/vllm-plugin.md; the goal is at most 1.1x).

    .venv-vllm/bin/python scripts/vllm_plugin_cpu.py [--repeats 5] [--sync-only]

The harness, settings and CPU definition are ``bench/vllm_compare.py``'s (schedule() +
update_from_output(), the fake forward excluded; microseconds of thread CPU time per step).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_vllm_compare():
    """``bench/vllm_compare.py`` (bench/ is not installed), loaded from its path as ``vllm_compare``."""
    spec = importlib.util.spec_from_file_location("vllm_compare", ROOT / "bench" / "vllm_compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_compare"] = mod  # before it runs: its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


vc = _load_vllm_compare()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--traces", default=None)
    p.add_argument("--sync-only", action="store_true", help="only vLLM's Scheduler beside FairScheduler")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    folder = vc.traces_dir(a.traces)
    workloads = [(f"`{path.name}`", vc.load_requests(path), False) for path in vc._trace_files(folder, None)]
    workloads += [(f"steady decode, n = {n}", vc.steady_requests(n), True) for n in vc.SWEEP_SIZES]
    pairs = [("sync", None, vc.make_fair_scheduler)]
    if not a.sync_only:
        pairs.append(("async", vc.make_async_vllm_scheduler, vc.make_async_fair_scheduler))
    print(f"Scheduler CPU per step (us: schedule() + update_from_output(), thread CPU time, the fake forward "
          f"excluded), the least of {a.repeats} runs each, vLLM and vLLM+Batch alternating\n")
    print("| workload | scheduling | vLLM (us / step) | vLLM+Batch (us / step) | ratio |\n|---|---|---|---|---|")
    worst = {}
    for label, reqs, at_once in workloads:
        for mode, make_v, make_f in pairs:
            best = {"vllm": float("inf"), "fair": float("inf")}
            for _ in range(a.repeats):
                for name, make in (("vllm", make_v), ("fair", make_f)):
                    run = vc.run_vllm(reqs, make=make, at_once=at_once)
                    best[name] = min(best[name], run.sched_cpu_s / run.steps * 1e6)
            ratio = best["fair"] / best["vllm"]
            worst[mode] = max(worst.get(mode, 0.0), ratio)
            print(f"| {label} | {mode} | {best['vllm']:.0f} | {best['fair']:.0f} | {ratio:.2f}x |", flush=True)
    print("\nHighest ratio: " + ", ".join(f"{w:.2f}x ({m})" for m, w in worst.items()) + " (goal: at most 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
