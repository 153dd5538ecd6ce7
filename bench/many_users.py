#!/usr/bin/env python3
"""Scheduler CPU per tick with many backlogged users (the admission order's cost in U).

A null backend (one token per request, no sleep) and a frozen clock; 256 resident requests
and ``per_user`` waiting per user; every finished request is replaced by a new one of the same
user, so admission runs every tick. Prints process CPU time per tick over 60 ticks after 20
warm-up ticks, the least of 3 runs (the machine's noise is +-40% on one run), for a few
(users, waiting per user, longest output) settings.

Usage, from the project root::

    python bench/many_users.py
"""
from __future__ import annotations

import random
import sys
import time

from inference_stub import Request
from scheduler import Scheduler

SETTINGS = ((200, 4, 4), (1000, 4, 8), (1000, 1, 8), (5000, 2, 32))


def cpu_us_per_tick(users: int, per_user: int, max_out: int, running: int = 256, ticks: int = 60,
                    seed: int = 0) -> tuple[float, float]:
    """(CPU microseconds per tick, requests finished per tick)."""
    rng = random.Random(seed)
    s = Scheduler(backend=lambda batch: [1] * len(batch), clock=lambda: 0.0, kv_cap_blocks=100_000,
                  record_itl=False, max_running=running)
    n = 0

    def submit(u: int) -> None:
        nonlocal n
        s.submit(Request(user_id=f"u{u}", prompt=[1] * rng.randint(4, 40), max_tokens=rng.randint(1, max_out),
                         request_id=f"r{n}"))
        n += 1

    for i in range(running):
        submit(i % users)
    for u in range(users):
        for _ in range(per_user):
            submit(u)
    for _ in range(20):
        for r in s.tick():
            submit(int(r.user_id[1:]))
    t0, finished = time.process_time(), 0
    for _ in range(ticks):
        done = s.tick()
        finished += len(done)
        for r in done:
            submit(int(r.user_id[1:]))
    return (time.process_time() - t0) / ticks * 1e6, finished / ticks


def main() -> int:
    for users, per_user, max_out in SETTINGS:
        us, fin = min(cpu_us_per_tick(users, per_user, max_out) for _ in range(3))
        print(f"users {users:5d}, waiting per user {per_user}, max_tokens <= {max_out:2d}: "
              f"{us:7.0f} us/tick ({fin:.1f} finished per tick)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
