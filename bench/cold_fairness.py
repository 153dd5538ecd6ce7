#!/usr/bin/env python3
"""The seed's fairness test as an outside harness runs it: each measurement cold, in a fresh process.

Workload: 100 requests of user A and 5 of user B, arrivals uniform in one second, lengths as
``request_gen.stream`` (prompt 5..199 ids in 1..63, ``max_tokens`` 10..99), drawn from
``random.Random(1000 + seed)``. The real-time stub (``inference_stub.forward`` as it is: real
sleeps, its own random EOS). Each measurement is the first thing its process does after
importing ``inference_stub`` and ``scheduler``: no warm-up, so any first-call cost on the tick
path lands where a harness would see it.

Ratio = B's median TTFT with A present / B's median TTFT with the same B requests alone.

Harness styles:

* ``at_once``: all requests submitted before the first tick; ticks until every B request has its
  first token; TTFT = ``started_at - submitted_at``.
* ``when_due``: a driver loop submits each request once its arrival offset has passed (wall
  clock), ticking in between; TTFT = ``started_at - submitted_at``.
* ``arrival``: the same loop, TTFT = the harness's own wall time after the tick that gave the
  first token minus the nominal arrival time (issue 16's timing; it includes the wait for the
  iteration running when a request arrives, which the scheduler cannot shorten).

Usage (from the project root; needs only the scheduler's own closure, stdlib + transitions)::

    python bench/cold_fairness.py [--seeds 20] [--styles at_once,when_due] [--policies batch,fcfs,no-isolation]
                                  [--json]

Prints, per style, one line per seed (B with A, B alone, ratio) and a summary line: median and
worst ratio over the seeds and how many exceed 2.0 (the seed problem's limit). Takes about
1.2 s per seed and style (two processes each).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STYLES = ("at_once", "when_due", "arrival")
POLICIES = ("batch", "fcfs", "no-isolation")
N_A, N_B, WINDOW_S = 100, 5, 1.0


def _child(seed: int, style: str, with_a: bool, policy: str) -> float:
    """One measurement in this (fresh) process: B's median TTFT, seconds."""
    import random
    import time

    import scheduler
    from batch.policies.policy import FCFSPolicy
    from inference_stub import Request

    rnd = random.Random(1000 + seed)

    def make(user: str, i: int) -> Request:
        prompt = [rnd.randint(1, 63) for _ in range(rnd.randint(5, 199))]
        return Request(user_id=user, prompt=prompt, max_tokens=rnd.randint(10, 99), request_id=f"{user}{i}")

    a = [make("A", i) for i in range(N_A)]
    b = [make("B", i) for i in range(N_B)]
    arrivals = sorted(((rnd.uniform(0.0, WINDOW_S), r) for r in a + b), key=lambda x: x[0])
    if not with_a:
        arrivals = [(t, r) for t, r in arrivals if r.user_id == "B"]
    if policy == "batch":
        s = scheduler.Scheduler()
    elif policy == "fcfs":
        s = scheduler.Scheduler(policy=FCFSPolicy())
    else:  # "no-isolation": the VTC order alone
        s = scheduler.Scheduler(isolation=False)
    if style == "at_once":
        for _, r in arrivals:
            s.submit(r)
        t0 = time.time()
        while any(r.started_at is None for r in b):
            s.tick()
            if time.time() - t0 > 60:
                raise SystemExit("B never started within 60 s")
        return statistics.median(r.started_at - r.submitted_at for r in b)
    first: dict[str, float] = {}  # B request id -> harness-clock TTFT from nominal arrival
    t0 = time.time()
    i = 0
    while len(first) < N_B:
        now = time.time() - t0
        while i < len(arrivals) and arrivals[i][0] <= now:
            s.submit(arrivals[i][1])
            i += 1
        if s.has_active():
            s.tick()
            t = time.time() - t0
            for at, r in arrivals[:i]:
                if r.user_id == "B" and r.request_id not in first and r.generated:
                    first[r.request_id] = t - at
        else:
            time.sleep(0.0002)
        if time.time() - t0 > 60:
            raise SystemExit("B never started within 60 s")
    if style == "when_due":
        return statistics.median(r.started_at - r.submitted_at for r in b)
    return statistics.median(first.values())


def _child_env() -> dict[str, str]:
    """The child's environment: this checkout first on ``PYTHONPATH``, so that the child imports its
    modules, as a harness with the checkout on ``sys.path`` does, whatever ``python`` has installed."""
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}


def measure(seed: int, style: str, with_a: bool, *, policy: str = "batch", python: str = sys.executable,
            timeout_s: float = 120.0) -> float:
    """B's median TTFT (seconds) for one seed, style and with/without A, measured in a fresh process.

    Raises:
        RuntimeError: the child process failed (its stderr's tail in the message).
    """
    p = subprocess.run([python, str(Path(__file__).resolve()), "--child", str(seed), style, str(int(with_a)), policy],
                       capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=_child_env())
    if p.returncode != 0:
        raise RuntimeError(f"seed {seed} {style} with_a={with_a}: exit {p.returncode}: {p.stderr[-800:]}")
    return float(p.stdout.strip().splitlines()[-1])


def ratios(seeds: range, style: str, *, policy: str = "batch", echo: bool = False) -> list[float]:
    """B's median TTFT with A over alone, per seed, each side measured cold."""
    out = []
    for seed in seeds:
        alone = measure(seed, style, False, policy=policy)
        mixed = measure(seed, style, True, policy=policy)
        out.append(mixed / alone)
        if echo:
            print(f"  {policy:12s} {style:8s} seed {seed:2d}  B with A {mixed * 1e3:7.1f} ms  "
                  f"alone {alone * 1e3:6.1f} ms  ratio {mixed / alone:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (default 20)")
    p.add_argument("--styles", default="at_once,when_due", help=f"comma-separated, of {', '.join(STYLES)}")
    p.add_argument("--policies", default="batch", help="comma-separated, of batch (Scheduler() as it ships), "
                   "fcfs (Scheduler(policy=FCFSPolicy()), the baseline) and no-isolation "
                   "(Scheduler(isolation=False): the VTC order without TTFT isolation); default batch")
    p.add_argument("--json", action="store_true", help="also print the ratios as one JSON line")
    p.add_argument("--child", nargs=4, metavar=("SEED", "STYLE", "WITH_A", "POLICY"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(repr(_child(int(a.child[0]), a.child[1], a.child[2] == "1", a.child[3])))
        return 0
    styles, policies = a.styles.split(","), a.policies.split(",")
    bad = [s for s in styles if s not in STYLES] + [q for q in policies if q not in POLICIES]
    if bad or a.seeds < 1:
        p.error(f"unknown style or policy {bad[0]!r}" if bad else "--seeds must be >= 1")
    table: dict[str, list[float]] = {}
    summary = []
    for policy in policies:
        for style in styles:
            rs = ratios(range(a.seeds), style, policy=policy, echo=True)
            table[f"{policy}/{style}"] = rs
            summary.append(f"{policy:12s} {style:8s} median {statistics.median(rs):6.2f}  worst {max(rs):6.2f}  "
                           f"over 1.5: {sum(r > 1.5 for r in rs):2d}/{len(rs)}  "
                           f"over 2.0: {sum(r > 2.0 for r in rs):2d}/{len(rs)}")
    print(f"\nB's median TTFT with A / alone, seeds 0..{a.seeds - 1}, each measurement in a fresh process:")
    print("\n".join(summary))
    if a.json:
        print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
