#!/usr/bin/env python3
"""Scheduler CPU per step of vLLM's V1 Scheduler and of vLLM + ``FairScheduler`` on the anchor
traces, the least of ``--repeats`` runs each, the two runs alternating (docs/vllm-plugin.md).

    .venv-vllm/bin/python scripts/vllm_plugin_cpu.py [--repeats 3]

The harness, settings and CPU definition are ``bench/vllm_compare.py``'s (schedule() +
update_from_output(), the fake forward excluded; microseconds of thread CPU time per step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import vllm_compare as vc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--traces", default=None)
    a = p.parse_args(argv)
    folder = vc.traces_dir(a.traces)
    print("| trace | vLLM (us / step) | vLLM+Batch (us / step) | ratio |\n|---|---|---|---|")
    for path in vc._trace_files(folder, None):
        reqs = vc.load_requests(path)
        best = {"vllm": float("inf"), "fair": float("inf")}
        for _ in range(a.repeats):
            for name, make in (("vllm", None), ("fair", vc.make_fair_scheduler)):
                run = vc.run_vllm(reqs, make=make)
                best[name] = min(best[name], run.sched_cpu_s / run.steps * 1e6)
        print(f"| `{path.name}` | {best['vllm']:.0f} | {best['fair']:.0f} | {best['fair'] / best['vllm']:.2f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
