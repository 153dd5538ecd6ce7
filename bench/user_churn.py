#!/usr/bin/env python3
"""Memory per user: N distinct users each send one request over HTTP and go idle; the server's
resident memory (RSS) before and after a warm-up, and after the N users.

Each user is its own fairness identity (the server runs with ``--trust-user-field``), sends one
short streamed completion and is never seen again. A background user keeps ``--background``
long streams open throughout, so that someone is always waiting: a user's per-user state can only
be forgotten when the lift would give it back on return, which needs a backlog to be lifted
against (docs/fairness.md; docs/scale-out.md, "Forgetting idle users").

The server is started here (``batch-llm serve`` in its own process, ``--server-args`` appended), or
given (``--base-url``). Memory is read from ``/metrics``: ``process_resident_memory_bytes`` of the
server (single process); with ``--replicas N`` the sum over the replicas (their own series, pushed
every second) and the counters actor's ``batch:counter_store_resident_memory_bytes``, with the
counters actor's user count. Freed memory is not always handed back to the OS, so RSS reads the
high-water mark of what the process holds: growth after the warm-up is what per-user state costs.

Usage, from the project root::

    .venv/bin/python bench/user_churn.py --users 20000
    .venv/bin/python bench/user_churn.py --users 100000 --warmup 5000
    .venv/bin/python bench/user_churn.py --users 20000 --replicas 2
    .venv/bin/python bench/user_churn.py --users 20000 --base-url http://127.0.0.1:8000   # a running server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from batch.server.bench_serve import scrape

ROOT = Path(__file__).resolve().parent.parent


def memory(base_url: str) -> dict[str, float]:
    """``server_rss_mb`` (the single server's, or the replicas' summed), ``counters_rss_mb`` and
    ``counters_users`` (with replicas; else absent)."""
    m = scrape(base_url)
    out: dict[str, float] = {}
    rss = [v for k, v in m.items() if k.startswith("process_resident_memory_bytes")]
    if rss:
        out["server_rss_mb"] = sum(rss) / 2**20
    if "batch:counter_store_resident_memory_bytes" in m:
        out["counters_rss_mb"] = m["batch:counter_store_resident_memory_bytes"] / 2**20
        out["counters_users"] = m.get("batch:counter_store_users", float("nan"))
    return out


async def _one(client: httpx.AsyncClient, base_url: str, user: str) -> bool:
    body = {"prompt": f"{user} a b c", "max_tokens": 4, "stream": True, "user": user}
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return False
        return [ln async for ln in r.aiter_lines() if ln.startswith("data: ")][-1:] == ["data: [DONE]"]


async def churn(base_url: str, first: int, n: int, concurrency: int) -> int:
    """Users ``u<first>`` .. ``u<first + n - 1>``, one request each, ``concurrency`` at a time;
    returns the requests that failed."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    failed = 0
    nxt = iter(range(first, first + n))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120)) as client:
        async def worker() -> None:
            nonlocal failed
            for i in nxt:
                failed += not await _one(client, base_url, f"u{i}")
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


async def background(base_url: str, streams: int, stop: asyncio.Event) -> None:
    """``streams`` endless streams of the user ``heavy`` (reopened if one ends) until ``stop``."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        async def one(i: int) -> None:
            while not stop.is_set():
                body = {"prompt": f"heavy {i}", "max_tokens": 100_000, "stream": True, "user": "heavy"}
                async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        if stop.is_set():
                            return
        tasks = [asyncio.ensure_future(one(i)) for i in range(streams)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run(base_url: str, users: int, warmup: int, concurrency: int, streams: int,
              settle_s: float) -> dict[str, Any]:
    """The background streams, the memory at start, the warm-up users, the memory, the users, the
    memory; the figures (MB, bytes a user)."""
    stop = asyncio.Event()
    bg = asyncio.ensure_future(background(base_url, streams, stop)) if streams else None
    await asyncio.sleep(1.0 if streams else 0.0)
    out: dict[str, Any] = {"users": users, "warmup": warmup, "concurrency": concurrency, "background": streams}
    loop = asyncio.get_running_loop()
    out["before"] = await loop.run_in_executor(None, memory, base_url)
    t0 = time.perf_counter()
    out["warmup_failed"] = await churn(base_url, 0, warmup, concurrency)
    await asyncio.sleep(settle_s)
    out["after_warmup"] = await loop.run_in_executor(None, memory, base_url)
    t1 = time.perf_counter()
    out["failed"] = await churn(base_url, warmup, users, concurrency)
    out["churn_s"] = time.perf_counter() - t1
    await asyncio.sleep(settle_s)
    out["after"] = await loop.run_in_executor(None, memory, base_url)
    out["total_s"] = time.perf_counter() - t0
    stop.set()
    if bg is not None:
        await bg
    for k in ("server_rss_mb", "counters_rss_mb"):
        if k in out["after"] and k in out["after_warmup"]:
            grow = out["after"][k] - out["after_warmup"][k]
            out[k.replace("_mb", "_growth_mb")] = grow
            out[k.replace("_rss_mb", "_bytes_per_user")] = grow * 2**20 / users
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=20_000, help="distinct users after the warm-up (default 20,000)")
    p.add_argument("--warmup", type=int, default=2_000, help="distinct users before the first reading (default 2,000)")
    p.add_argument("--concurrency", type=int, default=32, help="users in flight at once (default 32)")
    p.add_argument("--background", type=int, default=4, help="streams of a heavy user kept open (default 4)")
    p.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    p.add_argument("--replicas", type=int, default=1, help="start batch-llm serve --replicas N (default 1)")
    p.add_argument("--time-scale", type=float, default=0.05, help="the started server's --time-scale (default 0.05)")
    p.add_argument("--server-args", default="", help="more arguments for the started server")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    if a.users < 1 or a.warmup < 0 or a.concurrency < 1 or a.background < 0:
        p.error("--users and --concurrency must be >= 1, --warmup and --background >= 0")
    settle_s = 2.5 if a.replicas > 1 else 0.5  # the replicas push their metrics every second
    proc = None
    base = a.base_url
    if base is None:
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "batch.commands", "serve", "--port", str(port), "--trust-user-field",
               "--time-scale", str(a.time_scale), "--eos-probability", "0", *a.server_args.split()]
        if a.replicas > 1:
            cmd += ["--replicas", str(a.replicas)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                p.error(f"the server did not start: {' '.join(cmd)}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
    try:
        out = asyncio.run(run(base, a.users, a.warmup, a.concurrency, a.background, settle_s))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{a.users:,} users after a warm-up of {a.warmup:,} ({a.concurrency} at a time, {a.background} background "
          f"streams); {out['failed'] + out['warmup_failed']} failed; churn {out['churn_s']:.1f} s")
    for k, label in (("server_rss_mb", "server RSS"), ("counters_rss_mb", "counters actor RSS")):
        if k in out["after"]:
            print(f"{label}: {out['before'][k]:.1f} MB at start, {out['after_warmup'][k]:.1f} MB after the warm-up, "
                  f"{out['after'][k]:.1f} MB after the users: {out[k.replace('_mb', '_growth_mb')]:+.1f} MB, "
                  f"{out[k.replace('_rss_mb', '_bytes_per_user')]:.0f} bytes a user")
    if "counters_users" in out["after"]:
        print(f"counters actor users: {out['after_warmup']['counters_users']:.0f} after the warm-up, "
              f"{out['after']['counters_users']:.0f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
