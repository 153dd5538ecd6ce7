"""Load and endurance benchmark (issue 6): prints figures, asserts nothing about speed.

    .venv/bin/python bench/bench_load.py                 # all three parts, 100,000 requests
    .venv/bin/python bench/bench_load.py --n 20000 --parts endurance,memory

Parts:

* ``endurance``: ``--n`` requests from ``--users`` users through ``simulate.run_workload`` on
  the virtual clock; prints completions, what the scheduler still holds afterwards, and
  throughput figures.
* ``memory``: the same workload replayed by a streaming driver that drops each request once
  it finishes (as a server does after replying), under ``tracemalloc``: prints the traced
  memory at every tenth of the run. Flat after warm-up means the scheduler keeps no finished
  request; what grows is the metrics' per-request samples (8 bytes each, see ``batch/core/metrics.py``).
* ``scaling``: per-operation cost of ``submit``, ``tick`` and ``abort`` with 1k, 10k and 100k
  requests waiting (a tiny KV cache keeps them waiting): flat figures mean O(1) in the number
  waiting; ``abort`` of a waiting request scans the FCFS deque (O(n), in C).
"""
from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from typing import Iterator

import request_gen
from batch.sim import simulate
from inference_stub import VOCAB_SIZE, Request, SimulatedGPU, VirtualClock
from scheduler import Scheduler


def make_workload(n: int, *, users: int = 1000, rate_per_s: float = 20.0, seed: int = 0) -> list[Request]:
    """``request_gen.stream(n, rate_per_s, seed)`` with users spread uniformly over ``u0..u<users-1>``.

    Args:
        n: requests.
        users: distinct users to draw from.
        rate_per_s: Poisson arrival rate, requests per second (the stub serves ~25/s at its
            default latency and EOS rate, so 20/s is a sustained load just under capacity).
        seed: seeds both the stream and the user draw.
    """
    rng = random.Random(seed ^ 0x5EED)
    reqs = request_gen.stream(n=n, lam=rate_per_s, seed=seed)
    for r in reqs:
        r.user_id = f"u{rng.randrange(users)}"
    return reqs


def iter_workload(n: int, *, users: int, rate_per_s: float, seed: int) -> Iterator[Request]:
    """The same distributions as ``make_workload``, generated lazily (nothing materialised)."""
    rng = random.Random(seed)
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        plen = rng.randint(5, 199)
        yield Request(user_id=f"u{rng.randrange(users)}", prompt=[rng.randint(1, VOCAB_SIZE - 1) for _ in range(plen)],
                      max_tokens=rng.randint(10, 99), request_id=f"r{i}", submitted_at=t)


def retained(s: Scheduler) -> dict[str, int]:
    """What the scheduler still holds: every per-request container."""
    return {"running": len(s.running), "waiting": len(s.policy), "by_obj": len(s.state.by_obj), "by_id": len(s.state.by_id),
            "pending_aborts": len(s._pending_aborts), "kv_blocks_in_use": s.pool.num_used}


def endurance(n: int, users: int, rate: float, seed: int) -> None:
    reqs = make_workload(n, users=users, rate_per_s=rate, seed=seed)
    res = simulate.run_workload(reqs, virtual=True, gpu_seed=seed, record_itl=False, progress=True)
    m = res.scheduler.metrics()
    print(f"[endurance] {n} requests, {len({r.user_id for r in reqs})} users, {rate}/s on the virtual clock")
    print(f"  finished {len(res.finished)}  refused {len(res.refused)}  ticks {m['ticks']}  "
          f"preemptions {m['preemptions']}")
    print(f"  retained after the run: {retained(res.scheduler)}")
    print(f"  simulated {res.sim_s:.0f} s in {res.wall_s:.1f} s wall ({m['ticks'] / res.wall_s:.0f} ticks/s, "
          f"{res.wall_s / max(m['ticks'], 1) * 1e6:.0f} us/tick incl. the simulated GPU)")
    print(f"  throughput {m['throughput_tokens_per_sec']:.0f} tok/s  avg latency {m['avg_latency_s']:.2f} s  "
          f"p99 {m['p99_latency_s']:.2f} s  gpu_utilization {m['gpu_utilization']:.3f}")


def memory(n: int, users: int, rate: float, seed: int) -> None:
    gc.collect()
    tracemalloc.start()
    clock = VirtualClock()
    gpu = SimulatedGPU(seed=seed, clock=clock)
    s = Scheduler(clock=clock.now, backend=gpu.forward, record_itl=False)
    src = iter_workload(n, users=users, rate_per_s=rate, seed=seed)
    nxt = next(src, None)
    finished = 0
    marks = {n * k // 10 for k in range(1, 11)}
    rows = []
    snaps = []
    base = tracemalloc.get_traced_memory()[0]
    while nxt is not None or s.has_active():
        while nxt is not None and nxt.submitted_at <= clock.now():
            s.submit(nxt)  # submit re-stamps submitted_at with the clock (= the arrival here)
            nxt = next(src, None)
        if s.has_active():
            done = s.tick()
            for _ in done:
                finished += 1
                if finished in marks:
                    gc.collect()  # count what is reachable, not cyclic garbage awaiting collection
                    cur, peak = tracemalloc.get_traced_memory()
                    rows.append((finished, cur - base, peak - base, len(s.policy), len(s.running)))
                    if len(rows) in (2, 10):
                        snaps.append((finished, tracemalloc.take_snapshot()))
            del done
        elif nxt is not None:
            clock.advance_to(nxt.submitted_at)
    tracemalloc.stop()
    by_file: dict[str, int] = {}
    if len(snaps) == 2:
        for st in snaps[1][1].compare_to(snaps[0][1], "filename"):
            name = st.traceback[0].filename.rsplit("/", 1)[-1]
            by_file[name] = by_file.get(name, 0) + st.size_diff
    print(f"[memory] streaming driver, {n} requests; tracemalloc after gc.collect(), bytes above the start")
    print(f"  {'finished':>9} {'current':>12} {'peak':>12} {'waiting':>8} {'running':>8}")
    for f, cur, peak, w, r in rows:
        print(f"  {f:>9} {cur:>12,} {peak:>12,} {w:>8} {r:>8}")
    if len(rows) >= 4:
        (f0, c0, *_), (f1, c1, *_) = rows[1], rows[-1]
        print(f"  growth from {f0} to {f1} finished: {(c1 - c0) / (f1 - f0):.1f} bytes per finished request "
              f"(metrics samples: e2e, ttft, tpot, queue + per-user e2e, ttft = 6 x 8 bytes)")
    if by_file:
        (f0, _), (f1, _) = snaps
        top = sorted(by_file.items(), key=lambda kv: -abs(kv[1]))[:4]
        print(f"  growth from {f0} to {f1} finished, by allocating file: "
              + ", ".join(f"{name} {size:+,} B" for name, size in top))
    print(f"  retained after the run: {retained(s)}")


def scaling(seed: int) -> None:
    print("[scaling] per-operation cost vs requests waiting (KV cache of 4 blocks keeps them waiting)")
    print(f"  {'waiting':>8} {'submit us':>10} {'tick us':>9} {'abort head us':>14} {'abort middle us':>16}")
    for n in (1_000, 10_000, 100_000):
        s = Scheduler(backend=lambda b: [1] * len(b), kv_cap_blocks=4, record_itl=False)
        reqs = [Request(user_id=f"u{i % 1000}", prompt=[1] * 20, max_tokens=10 ** 9, request_id=f"r{i}")
                for i in range(n)]
        t0 = time.perf_counter()
        for r in reqs:
            s.submit(r)
        submit_us = (time.perf_counter() - t0) / n * 1e6
        ticks = 2000
        t0 = time.perf_counter()
        for _ in range(ticks):
            s.tick()
        tick_us = (time.perf_counter() - t0) / ticks * 1e6
        k = 200
        t0 = time.perf_counter()
        for r in reqs[1:1 + k]:  # reqs[0] is running; these are at the head of the queue
            s.abort(r)
        head_us = (time.perf_counter() - t0) / k * 1e6
        mid = reqs[n // 2: n // 2 + k]
        t0 = time.perf_counter()
        for r in mid:
            s.abort(r)
        mid_us = (time.perf_counter() - t0) / k * 1e6
        print(f"  {len(s.policy):>8} {submit_us:>10.1f} {tick_us:>9.1f} {head_us:>14.1f} {mid_us:>16.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default="endurance,memory,scaling")
    a = p.parse_args()
    parts = a.parts.split(",")
    if "endurance" in parts:
        endurance(a.n, a.users, a.rate, a.seed)
    if "memory" in parts:
        memory(a.n, a.users, a.rate, a.seed)
    if "scaling" in parts:
        scaling(a.seed)


if __name__ == "__main__":
    main()
