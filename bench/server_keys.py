#!/usr/bin/env python3
"""Many API keys: the key check's time, the server's memory per configured key, a ``/metrics``
scrape, with ``--keys`` keys in the config (one user per key, as a gateway handing each customer
its own key would have it).

* **key check**: ``Identities.check_key`` (the bearer header parsed, the key hashed, its digest
  looked up) in this process, on a ring of ``--keys`` keys: the mean over many calls, for a
  configured key and for made-up ones.
* **memory**: ``batch-llm serve`` started twice, with a config without keys and with the ``--keys``
  keys (each in its own process, a short warm-up of requests each); the resident memory (RSS,
  ``/proc``) of each, the difference and the bytes per key; then ``--active`` distinct keyed users
  send one request each and the RSS is read again (per-user state is made when a user is active:
  its metric series are capped by ``--max-user-labels``).
* **/metrics**: its series and size after that, and ``--scrapes`` scrapes' client-side latency
  (with a key: ``/metrics`` needs one when keys are configured) on one keep-alive connection, 0.25 s
  apart (so that no scrape waits for ``--metrics-min-interval``).

Usage, from the project root::

    .venv/bin/python bench/server_keys.py --keys 100000 --active 5000
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from batch.server.auth import Identities, KeyRing

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def key_check_us(keys: dict[str, str], n: int = 20_000) -> tuple[float, float]:
    """Mean ``Identities.check_key`` time, us: for configured keys, for made-up keys (a 401)."""
    ids = Identities(KeyRing(keys))
    good = [{"authorization": f"Bearer {k}"} for k in list(keys)[:n]]
    bad = [{"authorization": f"Bearer sk-{secrets.token_hex(16)}"} for _ in range(n)]
    t = time.perf_counter()
    for h in good:
        ids.check_key(h)
    t_good = (time.perf_counter() - t) / len(good)
    t = time.perf_counter()
    for h in bad:
        try:
            ids.check_key(h)
        except ValueError:
            pass
    t_bad = (time.perf_counter() - t) / len(bad)
    return 1e6 * t_good, 1e6 * t_bad


class Server:
    """``batch-llm serve --config CONFIG`` in its own process on a free port."""

    def __init__(self, config: Path, args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "batch.commands", "serve", "--port", str(self.port),
                                      "--config", str(config), "--time-scale", "0.05", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                break
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"batch-llm serve did not start: {self.proc.stderr.read()}") from None
                time.sleep(0.2)

    def rss_mb(self) -> float:
        return _rss_mb(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def requests(url: str, keys: list[str | None], concurrency: int = 32) -> int:
    """One short completion per key (``None``: no key), ``concurrency`` at a time; the failures."""
    failed = 0
    it = iter(keys)
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker() -> None:
            nonlocal failed
            for k in it:
                h = {"Authorization": f"Bearer {k}"} if k else {}
                r = await c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2}, headers=h)
                failed += r.status_code != 200
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--active", type=int, default=5000, help="keyed users that send one request each")
    p.add_argument("--warmup", type=int, default=500, help="requests sent to each server before its first reading")
    p.add_argument("--scrapes", type=int, default=30)
    p.add_argument("--server-args", default="", help="more batch-llm serve arguments (one string)")
    a = p.parse_args(argv)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs at the start", flush=True)
    keys = {f"sk-{secrets.token_hex(16)}": f"user{i}" for i in range(a.keys)}
    good_us, bad_us = key_check_us(keys)
    print(f"{a.keys:,} configured keys (a user each): key check {good_us:.2f} us for a configured key, "
          f"{bad_us:.2f} us for a made-up one (Identities.check_key, mean over 20,000 calls each)", flush=True)
    extra = a.server_args.split()
    with tempfile.TemporaryDirectory() as d:
        empty, full = Path(d) / "empty.toml", Path(d) / "keys.toml"
        empty.write_text("[weights]\n")
        full.write_text("[api_keys]\n" + "".join(f'"{k}" = "{u}"\n' for k, u in keys.items()))
        key_list = list(keys)
        del keys
        s0 = Server(empty, extra)
        try:
            asyncio.run(requests(s0.url, [None] * a.warmup))
            rss0 = s0.rss_mb()
        finally:
            s0.close()
        s1 = Server(full, extra)
        try:
            asyncio.run(requests(s1.url, key_list[-a.warmup:]))
            rss1 = s1.rss_mb()
            failed = asyncio.run(requests(s1.url, key_list[:a.active]))
            rss2 = s1.rss_mb()
            auth = {"Authorization": f"Bearer {key_list[0]}"}
            lat, text = [], ""
            with httpx.Client(headers=auth, timeout=30) as c:  # one client: a new one costs ~70 ms of TLS setup
                c.get(f"{s1.url}/health")
                for _ in range(a.scrapes):
                    time.sleep(0.25)
                    t = time.perf_counter()
                    r = c.get(f"{s1.url}/metrics")
                    lat.append(1e3 * (time.perf_counter() - t))
                    r.raise_for_status()
                    text = r.text
        finally:
            s1.close()
    grow = rss1 - rss0
    print(f"server RSS: {rss0:.1f} MB with no keys, {rss1:.1f} MB with {a.keys:,} keys: {grow:+.1f} MB, "
          f"{grow * 2**20 / a.keys:.0f} bytes a key (each after {a.warmup} requests); {rss2:.1f} MB after "
          f"{a.active:,} keyed users sent a request each ({rss2 - rss0:+.1f} MB over no keys; {failed} failed)")
    series = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
    users = {ln.split('"')[1] for ln in text.splitlines() if ln.startswith("batch:prompt_tokens_total{")}
    print(f"/metrics after that: {series} series, {len(text.encode()) / 1024:.1f} KiB, {len(users)} user labels; "
          f"a scrape {statistics.median(lat):.1f} ms median, {max(lat):.1f} ms max over {a.scrapes} "
          f"(client side, one keep-alive connection, 0.25 s apart)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
