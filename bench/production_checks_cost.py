"""CPU cost of ``Scheduler(production_checks=True)`` per tick (issue 40, item 4).

Runs the same workload twice on a zero-latency backend (tokens only, no sleep), with the
production subset off and on, ``scheduler.CHECK_INVARIANTS`` off, and prints the scheduler's CPU
seconds per tick (``time.process_time`` over the whole drain, divided by the ticks) and the
difference as a share of the unchecked tick. Each configuration is run ``--repeat`` times and the
fastest run is kept (the machine is shared: noise only ever adds time). Prints figures; asserts
nothing.

    PYTHONPATH=. python bench/production_checks_cost.py [--requests 2000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import time
import zlib

import scheduler
from inference_stub import Request


def _backend(batch: list[Request]) -> list[int]:
    """A token per request, EOS (0) with a fixed 1-in-40 chance keyed by (request, position)."""
    out = []
    for r in batch:
        h = zlib.crc32(f"{r.request_id}:{len(r.generated)}".encode())
        out.append(0 if h % 40 == 0 else 1 + h % 63)
    return out


def run(requests: int, production: bool, prefix: bool) -> tuple[float, int]:
    """CPU seconds and ticks to drain ``requests`` requests (8 users, prompts 20-300 tokens)."""
    scheduler.CHECK_INVARIANTS = False
    s = scheduler.Scheduler(backend=_backend, production_checks=production, prefix_caching=prefix,
                            check_invariants=False, clock=time.perf_counter)
    for i in range(requests):
        n = 20 + zlib.crc32(f"p{i}".encode()) % 280
        prompt = [1 + (j % 50) for j in range(n)] if prefix else [1 + (i + j) % 63 for j in range(n)]
        s.submit(Request(user_id=f"u{i % 8}", prompt=prompt, max_tokens=64, request_id=f"r{i}"))
    ticks = 0
    t0 = time.process_time()
    while s.has_active():
        s.tick()
        ticks += 1
    return time.process_time() - t0, ticks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    print("| prefix caching | ticks | CPU us/tick, checks off | CPU us/tick, production checks | cost |")
    print("|---|---|---|---|---|")
    for prefix in (False, True):
        best = {}
        for production in (False, True):
            runs = [run(a.requests, production, prefix) for _ in range(a.repeat)]
            cpu, ticks = min(runs)
            best[production] = (cpu / ticks * 1e6, ticks)
        off, on = best[False][0], best[True][0]
        print(f"| {'on' if prefix else 'off'} | {best[False][1]} | {off:.1f} | {on:.1f} | {100 * (on - off) / off:+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
