#!/usr/bin/env python3
"""The iteration target's trade-off: the light user's TTFT ratio against throughput, per setting.

Each setting is a ``Scheduler`` (``Isolation(iteration_target_s=...)``, optionally a VTC
tolerance); each runs, on the simulated clock of ``bench/vllm_compare.py`` (5 ms + 1 ms per
request, 256 x 16 KV, 64-token chunks):

* the A/B burst over ``--seeds`` seeds (100 requests of A and 5 of B, arrivals uniform in one
  second, lengths as ``request_gen.stream``, drawn as ``bench/cold_fairness.py`` draws them):
  B's median TTFT with A over alone, timed from nominal arrival and from submit, and the run's
  output throughput (A's tokens and B's, over the run's span);
* the three balanced anchor traces: throughput and TTFT p50/p99.

Prints one row per setting and, with ``--plot FILE`` (needs matplotlib: ``make bench`` installs
it), draws throughput against the arrival-timed ratio. ``make bench-target`` runs it with
``--plot docs/img/target_tradeoff.png``. About 2 s per setting and seed on one core.

Usage::

    python bench/target_sweep.py [--seeds 20] [--targets-ms 10,12,15,20,25] [--tolerance 0]
                                 [--window-s 0.25] [--plot FILE] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_compare as vc  # noqa: E402  (puts the project root on sys.path)

from batch.core.isolation import ACTIVE_WINDOW_S, Isolation  # noqa: E402
from batch.policies.policy import VTCPolicy  # noqa: E402
from scheduler import Scheduler  # noqa: E402

BALANCED = vc.ORDER[:3]


def ab_trace(seed: int) -> list[vc.TraceRequest]:
    """The A/B burst of ``bench/cold_fairness.py`` for ``seed`` (same draws, same order)."""
    rnd = random.Random(1000 + seed)
    rows = []
    for user, n in (("A", 100), ("B", 5)):
        for i in range(n):
            prompt = rnd.randint(5, 199)
            for _ in range(prompt):
                rnd.randint(1, 63)  # the prompt's ids: drawn to keep the sequence; the simulator ignores them
            rows.append((f"{user}{i}", user, prompt, rnd.randint(10, 99)))
    arrivals = [rnd.uniform(0.0, 1.0) for _ in rows]
    return sorted((vc.TraceRequest(rid, user, at, p, m) for (rid, user, p, m), at in zip(rows, arrivals)),
                  key=lambda r: r.arrival_s)


def factory(target_ms: float | None, tolerance: int = 0, window_s: float = ACTIVE_WINDOW_S):
    """A ``run_batch`` factory: the default scheduler with the given target (ms), tolerance and
    active window (s)."""
    def make(**kw):
        return Scheduler(policy=VTCPolicy(tolerance_tokens=tolerance),
                         isolation=Isolation(iteration_target_s=None if target_ms is None else target_ms / 1e3,
                                             active_window_s=window_s), **kw)
    return make


def measure(target_ms: float | None, tolerance: int, seeds: range, traces: Path,
            window_s: float = ACTIVE_WINDOW_S) -> dict:
    """One setting's figures (ratios, tokens/s, seconds)."""
    fac = factory(target_ms, tolerance, window_s)

    def run(reqs, **kw):
        return vc.run_batch(reqs, factory=fac, **kw)

    arrival, submit, thr = [], [], []
    for seed in seeds:
        reqs = ab_trace(seed)
        with_a = run(reqs)
        res = vc.ab_ratios(run, reqs, timed_with=with_a)
        arrival.append(res.ratio("from arrival"))
        submit.append(res.ratio("from submit"))
        thr.append(vc.summarize(with_a).throughput_tok_s)
    out = {"target_ms": target_ms, "tolerance": tolerance, "window_s": window_s,
           "ab_arrival_median": statistics.median(arrival), "ab_arrival_worst": max(arrival),
           "ab_submit_median": statistics.median(submit), "ab_submit_worst": max(submit),
           "ab_throughput_tok_s": statistics.mean(thr), "balanced": {}}
    for name in BALANCED:
        path = traces / name
        if path.exists():
            s = vc.summarize(run(vc.load_requests(path)))
            out["balanced"][name] = {"throughput_tok_s": s.throughput_tok_s, "ttft_p50_s": s.ttft_p50_s,
                                     "ttft_p99_s": s.ttft_p99_s}
    return out


def row(r: dict, base: dict) -> str:
    name = "off" if r["target_ms"] is None else f"{r['target_ms']:g} ms"
    cells = [f"{name:>8} {r['tolerance']:>5}",
             f"{r['ab_arrival_median']:5.2f} {r['ab_arrival_worst']:5.2f}",
             f"{r['ab_submit_median']:5.2f} {r['ab_submit_worst']:5.2f}",
             f"{r['ab_throughput_tok_s']:6.1f} ({100 * (r['ab_throughput_tok_s'] / base['ab_throughput_tok_s'] - 1):+5.1f}%)"]
    for name, b in r["balanced"].items():
        b0 = base["balanced"][name]
        cells.append(f"{b['throughput_tok_s']:6.1f} ({100 * (b['throughput_tok_s'] / b0['throughput_tok_s'] - 1):+4.1f}%)"
                     f" {b['ttft_p99_s']:5.2f}")
    return " | ".join(cells)


def plot(results: list[dict], path: str) -> None:
    """Throughput on the A/B burst against B's arrival-timed ratio (median and worst), per setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = sorted(results, key=lambda r: float("inf") if r["target_ms"] is None else r["target_ms"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, marker, label in (("ab_arrival_median", "o", "median over seeds"),
                               ("ab_arrival_worst", "^", "worst seed")):
        xs = [r[key] for r in results]
        ys = [r["ab_throughput_tok_s"] for r in results]
        ax.plot(xs, ys, marker=marker, linestyle="-", label=label)
        for r, x, y in zip(results, xs, ys):
            ax.annotate("off" if r["target_ms"] is None else f"{r['target_ms']:g}", (x, y), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
    ax.axvline(2.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("B's median TTFT with A / alone, timed from nominal arrival")
    ax.set_ylabel("output throughput on the A/B burst, tokens/s")
    ax.set_title(f"Iteration target (ms, labels; active window {results[0]['window_s']:g} s), simulated clock",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="A/B seeds 0..N-1 (default 20)")
    p.add_argument("--targets-ms", default="10,12,15,20,25", help="comma-separated targets, ms (off is always run)")
    p.add_argument("--tolerance", type=int, default=0, help="VTCPolicy(tolerance_tokens=...) for every setting")
    p.add_argument("--window-s", type=float, default=ACTIVE_WINDOW_S,
                   help=f"Isolation(active_window_s=...) for every setting (default {ACTIVE_WINDOW_S})")
    p.add_argument("--traces", default=None, help="folder of the balanced anchor traces (default as vllm_compare)")
    p.add_argument("--plot", default=None, metavar="FILE", help="save the trade-off plot (PNG) here")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    a = p.parse_args(argv)
    try:
        targets = [float(x) for x in a.targets_ms.split(",") if x.strip()]
    except ValueError:
        p.error(f"--targets-ms must be comma-separated numbers, got {a.targets_ms!r}")
    if a.seeds < 1 or a.tolerance < 0 or not 0 <= a.window_s < float("inf") \
            or any(not 0 < t < float("inf") for t in targets):
        p.error("--seeds >= 1, --tolerance >= 0, --window-s >= 0 and targets > 0 are required")
    traces = vc.traces_dir(a.traces)
    print(f"simulated clock, A/B over seeds 0..{a.seeds - 1}; active window {a.window_s:g} s; "
          f"balanced anchor traces from {traces}")
    print(f"{'target':>8} {'tol':>5} | arrival med worst | submit med worst | A/B tok/s (vs off) | "
          + " | ".join(f"{n[:12]} tok/s (vs off) p99" for n in BALANCED))
    results = []
    for t in [None, *targets]:
        results.append(measure(t, a.tolerance, range(a.seeds), traces, a.window_s))
        print(row(results[-1], results[0]), flush=True)
    if a.plot:
        plot(results, a.plot)
        print(f"plot: {a.plot}")
    if a.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
