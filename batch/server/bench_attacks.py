"""``batch-llm bench-serve --attack``: what connection and request floods cost honest clients.

    batch-llm bench-serve --attack idle-sockets,slow-headers --honest-key sk-alice
    batch-llm bench-serve --attack scrape,401-flood --honest-key sk-alice --attacker-key sk-mallory

Each attack is a phase of two windows of ``--attack-duration-s`` seconds: the honest party alone,
then the honest party with the attacker. The honest party (``--honest-key``; this process, over
``httpx``) keeps ``--attack-honest-concurrency`` short streaming completions going, one after the
other (a prompt of 8 words, ``max_tokens`` 16), and a probe sends ``GET /health`` and a keyed
non-streaming completion (``max_tokens`` 1) every 0.25 s. The attacker runs in its own process (its
own event loop and CPU, as a client elsewhere would), on raw sockets with pre-built requests (a
cheap client, so the server's cost is what limits it):

* ``idle-sockets``: ``--attack-sockets`` (1,100) connections that never send a byte, each opened
  again as soon as the server closes it;
* ``slow-headers``: as many connections, each sending a request head one header line a second and
  never its end (slowloris), each opened again when closed;
* ``scrape``: ``--attack-clients`` (4) keep-alive connections requesting ``GET /metrics`` in a loop
  (with ``--attacker-key`` when given, else none: a keyed server answers 401);
* ``401-flood``: as many keep-alive connections posting completions with a made-up key each time.

It prints, per attack: the honest completions per second and tokens per second in each window and
their change, the probes' latencies (p50 and the worst, ms) and how many got no answer within 5 s,
and the attacker's count (sockets held and reopened, or requests answered and by which status).
Real time on a shared machine: the figures move with its load.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

__all__ = ["ATTACKS", "attack_phase", "format_phase", "context"]

#: The attacks ``attack_phase`` runs.
ATTACKS = ("idle-sockets", "slow-headers", "scrape", "401-flood")
PROBE_PERIOD_S = 0.25
PROBE_TIMEOUT_S = 5.0


def _raise_own_fd_limit() -> None:
    try:
        import resource  # POSIX only
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---------------------------------------------------------------- the attacker (its own process)


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 response with a ``content-length``; its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    if length:
        await reader.readexactly(length)
    return status


async def _attacker(kind: str, host: str, port: int, n: int, key: str | None, stop: asyncio.Event,
                    counts: dict[str, Any]) -> None:
    """One attacker connection's loop (``kind`` as the module doc says), until ``stop``."""
    rng = random.Random(os.getpid() * 7919 + n)
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_errors"] += 1
            await asyncio.sleep(0.05)
            continue
        counts["opened"] += 1
        try:
            if kind == "idle-sockets":
                closed = asyncio.ensure_future(reader.read(1))
                await asyncio.wait((closed, asyncio.ensure_future(stop.wait())), return_when=asyncio.FIRST_COMPLETED)
                closed.cancel()
            elif kind == "slow-headers":
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                i = 0
                while not stop.is_set():
                    closed = asyncio.ensure_future(reader.read(1))
                    done, _ = await asyncio.wait((closed,), timeout=1.0)
                    if done:
                        break
                    closed.cancel()
                    writer.write(b"X-Slow-%d: 1\r\n" % i)
                    i += 1
            else:
                auth = b""
                if kind == "scrape":
                    if key:
                        auth = b"Authorization: Bearer " + key.encode() + b"\r\n"
                    while not stop.is_set():
                        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
                        status = await _read_response(reader)
                        counts["statuses"][status] = counts["statuses"].get(status, 0) + 1
                else:  # 401-flood
                    body = b'{"prompt": "a b c", "max_tokens": 16}'
                    while not stop.is_set():
                        made_up = b"sk-%016x" % rng.getrandbits(64)
                        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + made_up
                                     + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                     % len(body) + body)
                        status = await _read_response(reader)
                        counts["statuses"][status] = counts["statuses"].get(status, 0) + 1
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            pass
        finally:
            writer.close()
        if not stop.is_set():
            counts["closed_by_server"] += 1


def _attack_main(kind: str, base_url: str, n: int, key: str | None, go: Any, halt: Any, ready: Any,
                 out: Any) -> None:
    """The attacker process: ``n`` connections of ``kind`` from ``go`` until ``halt``; its counts
    go to ``out``."""
    _raise_own_fd_limit()
    u = urlsplit(base_url)
    host, port = u.hostname or "127.0.0.1", u.port or 80

    async def main() -> dict[str, Any]:
        counts: dict[str, Any] = {"opened": 0, "closed_by_server": 0, "connect_errors": 0, "statuses": {}}
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(_attacker(kind, host, port, i, key, stop, counts)))
            if i % 100 == 99:
                await asyncio.sleep(0.01)  # open them at a few thousand a second
        await asyncio.sleep(0.5)
        held_at_start = counts["opened"] - counts["closed_by_server"]
        ready.set()
        t0 = time.perf_counter()
        await loop.run_in_executor(None, halt.wait)
        counts["seconds"] = time.perf_counter() - t0
        counts["held_at_start"] = held_at_start
        counts["held_at_end"] = counts["opened"] - counts["closed_by_server"]
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return counts

    go.wait()
    out.put(asyncio.run(main()))


# ---------------------------------------------------------------- the honest party (this process)


@dataclass
class _Window:
    """What the honest party got in one window."""

    done: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    health_ms: list[float] = field(default_factory=list)
    keyed_ms: list[float] = field(default_factory=list)
    probe_failures: int = 0


async def _honest_window(base_url: str, key: str | None, concurrency: int, duration_s: float) -> _Window:
    w = _Window()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    end = time.perf_counter() + duration_s
    words = " ".join(f"w{i}" for i in range(7))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def worker(c: httpx.AsyncClient, i: int) -> None:
        n = 0
        while time.perf_counter() < end:
            n += 1
            body = {"prompt": f"h{i}-{n} {words}", "max_tokens": 16, "stream": True}
            tokens, ok = 0, False
            try:
                async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        await r.aread()
                        w.errors[str(r.status_code)] = w.errors.get(str(r.status_code), 0) + 1
                        await asyncio.sleep(0.05)
                        continue
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            ok = True
                        elif line.startswith("data: {") and '"text"' in line:
                            tokens += 1
            except (httpx.HTTPError, OSError) as e:
                w.errors[type(e).__name__] = w.errors.get(type(e).__name__, 0) + 1
                await asyncio.sleep(0.05)
                continue
            if ok and time.perf_counter() <= end:
                w.done += 1
                w.tokens += tokens

    async def probe(c: httpx.AsyncClient) -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            for path, lat in (("/health", w.health_ms), ("/v1/completions", w.keyed_ms)):
                t0 = time.perf_counter()
                try:
                    if path == "/health":
                        r = await c.get(path, timeout=PROBE_TIMEOUT_S)
                    else:
                        r = await c.post(path, json={"prompt": "probe", "max_tokens": 1}, headers=headers,
                                         timeout=PROBE_TIMEOUT_S)
                    if r.status_code != 200:
                        raise httpx.HTTPError(f"status {r.status_code}")
                    lat.append(1e3 * (time.perf_counter() - t0))
                except (httpx.HTTPError, OSError):
                    w.probe_failures += 1
            await asyncio.sleep(max(0.0, PROBE_PERIOD_S - (time.perf_counter() - t)))

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(30.0)) as c, \
            httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(PROBE_TIMEOUT_S)) as pc:
        await asyncio.gather(*(worker(c, i) for i in range(concurrency)), probe(pc))
    return w


def _spread(xs: list[float]) -> str:
    if not xs:
        return "none answered"
    return f"p50 {statistics.median(xs):.1f} ms, max {max(xs):.1f} ms"


def attack_phase(base_url: str, attack: str, *, honest_key: str | None = None, attacker_key: str | None = None,
                 duration_s: float = 10.0, honest_concurrency: int = 16, sockets: int = 1100,
                 clients: int = 4) -> dict[str, Any]:
    """One attack (``ATTACKS``): the honest party alone for ``duration_s``, then with the attacker
    (its own process) for as long.

    Returns:
        ``{"attack", "baseline", "attacked", "change", "attacker"}``: each window's ``per_s``
        (honest completions a second), ``tokens_per_s``, ``errors``, the probes' latencies
        (ms lists) and failures; ``change`` the relative change of ``per_s`` (-0.05: 5% fewer);
        ``attacker`` its counts.

    Raises:
        ValueError: an unknown ``attack``.
    """
    if attack not in ATTACKS:
        raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
    _raise_own_fd_limit()
    n = sockets if attack in ("idle-sockets", "slow-headers") else clients
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    go, halt, ready, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_attack_main, args=(attack, base_url, n, attacker_key, go, halt, ready, out),
                       daemon=True)
    proc.start()
    try:
        base = asyncio.run(_honest_window(base_url, honest_key, honest_concurrency, duration_s))
        go.set()
        if not ready.wait(60):
            raise RuntimeError("the attacker process did not start")
        hit = asyncio.run(_honest_window(base_url, honest_key, honest_concurrency, duration_s))
        halt.set()
        counts = out.get(timeout=60)
    finally:
        halt.set()
        go.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    def row(w: _Window) -> dict[str, Any]:
        return {"per_s": w.done / duration_s, "tokens_per_s": w.tokens / duration_s, "errors": w.errors,
                "health_ms": w.health_ms, "keyed_ms": w.keyed_ms, "probe_failures": w.probe_failures}
    b, a = row(base), row(hit)
    change = (a["per_s"] - b["per_s"]) / b["per_s"] if b["per_s"] else float("nan")
    return {"attack": attack, "baseline": b, "attacked": a, "change": change, "attacker": counts,
            "duration_s": duration_s, "honest_concurrency": honest_concurrency, "connections": n}


def context(base_url: str, key: str | None = None) -> str:
    """One line: this machine's load and CPUs, the server's open-files limit and connection cap
    (from ``/metrics``, with ``key`` when given)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    line = f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs at the start"
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=10, headers={"Authorization": f"Bearer {key}"} if key else None)
    except httpx.HTTPError:
        return line
    if r.status_code != 200:
        return line + " (server's /metrics needs a key)"
    vals = {}
    for ln in r.text.splitlines():
        k, _, v = ln.rpartition(" ")
        if k in ("process_max_fds", "batch:http_connections_limit"):
            vals[k] = float(v)
    if vals:
        line += (f"; the server's open-files limit {vals.get('process_max_fds', float('nan')):.0f}, connection cap "
                 f"{vals.get('batch:http_connections_limit', float('nan')):.0f}")
    return line


def format_phase(r: dict[str, Any]) -> str:
    """Three lines for one ``attack_phase`` result."""
    b, a, c = r["baseline"], r["attacked"], r["attacker"]
    if r["attack"] in ("idle-sockets", "slow-headers"):
        what = (f"{r['connections']:,} sockets: {c['held_at_start']:,} held at the start, {c['held_at_end']:,} at the "
                f"end, {c['closed_by_server']:,} closed by the server and opened again")
    else:
        rate = sum(c["statuses"].values()) / c["seconds"] if c.get("seconds") else 0.0
        what = (f"{r['connections']} clients: {rate:,.0f} answers/s "
                f"{dict(sorted(c['statuses'].items()))}")
    lines = [f"attack {r['attack']:<13} {what}",
             f"  honest completions {b['per_s']:.1f}/s alone, {a['per_s']:.1f}/s attacked ({100 * r['change']:+.1f}%); "
             f"tokens {b['tokens_per_s']:.0f}/s, {a['tokens_per_s']:.0f}/s"
             + (f"; errors attacked {a['errors']}" if a["errors"] else ""),
             f"  attacked: /health {_spread(a['health_ms'])}; keyed request {_spread(a['keyed_ms'])}; "
             f"{a['probe_failures']} probe(s) unanswered within {PROBE_TIMEOUT_S:g} s "
             f"(alone: /health {_spread(b['health_ms'])}; keyed {_spread(b['keyed_ms'])})"]
    return "\n".join(lines)


def results_json(rows: list[dict[str, Any]]) -> str:
    """The phases as JSON (latency lists kept)."""
    return json.dumps({"attacks": rows}, indent=2)
