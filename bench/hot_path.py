#!/usr/bin/env python3
"""Scheduler CPU per tick at 256 running: this tree against an earlier commit, in one run.

The method of ``make bench``'s overhead figure (``bench/bench.py``, ``tick_overhead_us``, called
here on each tree's ``Scheduler``): a null backend, ``running`` requests resident and decoding (nobody finishes), ``waiting`` more queued
behind them, 5 users, 20 warm-up ticks, then CPU time (``time.process_time``) per tick over
``ticks`` ticks, the backend's own time subtracted. Each measurement runs in a fresh process
that imports ``scheduler`` from the tree being measured; the two trees alternate, ``--rounds``
times, and the median of each is reported with their ratio and as a share of the stub's 5 ms
base iteration. The baseline tree is ``git archive REV`` unpacked in a temporary folder.

Usage::

    python bench/hot_path.py [--baseline f584b6c] [--rounds 7] [--running 256] [--waiting 100]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The last commit before the rules' compiled forms (spec/concrete.py) reached the tick.
DEFAULT_BASELINE = "f584b6c"
BASE_ITERATION_US = 5000.0


def _child(tree: str, running: int, waiting: int, ticks: int) -> float:
    """CPU microseconds per tick outside the backend, ``scheduler`` imported from ``tree``
    (``bench.tick_overhead_us``, ``make bench``'s method, on that tree's ``Scheduler``)."""
    import importlib.util

    import scheduler  # from `tree`, first on PYTHONPATH (``measure``): bench.py's `import scheduler` finds this one

    if not Path(scheduler.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"scheduler imported from {scheduler.__file__}, not from {tree}")

    spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parent / "bench.py")
    bench = importlib.util.module_from_spec(spec)  # this tree's bench.py, whichever tree is measured
    sys.modules["bench"] = bench
    spec.loader.exec_module(bench)
    return bench.tick_overhead_us(running, waiting, ticks=ticks, make=scheduler.Scheduler)


def measure(tree: Path, running: int, waiting: int, ticks: int) -> float:
    """One measurement in a fresh process that imports ``tree``'s modules; microseconds per tick."""
    path = os.pathsep.join(x for x in (str(tree), os.environ.get("PYTHONPATH", "")) if x)
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(tree), str(running),
                        str(waiting), str(ticks)], capture_output=True, text=True, cwd=tree,
                       env={**os.environ, "PYTHONPATH": path})
    if p.returncode != 0:
        raise RuntimeError(f"{tree}: {p.stderr[-600:]}")
    return float(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=DEFAULT_BASELINE, help=f"git revision to compare with ({DEFAULT_BASELINE})")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, default=100)
    p.add_argument("--ticks", type=int, default=300)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(repr(_child(a.child[0], int(a.child[1]), int(a.child[2]), int(a.child[3]))))
        return 0
    if min(a.rounds, a.running, a.ticks) < 1 or a.waiting < 0:
        p.error("--rounds, --running and --ticks must be >= 1, --waiting >= 0")
    with tempfile.TemporaryDirectory(prefix="batch-baseline-") as tmp:
        archive = subprocess.run(["git", "archive", a.baseline], cwd=ROOT, capture_output=True)
        if archive.returncode != 0:
            p.error(f"git archive {a.baseline}: {archive.stderr.decode()[-300:]}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        trees = {f"baseline {a.baseline}": Path(tmp), "this tree": ROOT}
        got: dict[str, list[float]] = {k: [] for k in trees}
        for _ in range(a.rounds):
            for name, tree in trees.items():
                got[name].append(measure(tree, a.running, a.waiting, a.ticks))
    print(f"scheduler CPU per tick outside forward, {a.running} running, {a.waiting} waiting, "
          f"median of {a.rounds} fresh processes each (alternating):")
    med = {k: statistics.median(v) for k, v in got.items()}
    for name, v in got.items():
        print(f"  {name:24s} {med[name]:7.1f} us  ({100 * med[name] / BASE_ITERATION_US:4.1f}% of a 5 ms iteration)"
              f"  runs {', '.join(f'{x:.0f}' for x in sorted(v))}")
    base, new = med[f"baseline {a.baseline}"], med["this tree"]
    print(f"  ratio this tree / baseline: {new / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
