"""``batch-llm bench-serve``: a load generator for ``batch-llm serve``, after vLLM's ``benchmark_serving``.

    batch-llm bench-serve --num-prompts 500 --request-rate 20 --users 5       # Poisson arrivals
    batch-llm bench-serve --trace norm_azure2023_conv.csv --limit 300         # a trace's arrivals and lengths
    batch-llm bench-serve --max-concurrency 64 --num-prompts 2000 --request-rate inf   # 64 streams at a time
    batch-llm bench-serve --ab-burst --ab-seeds 4,5,6                         # the A/B fairness burst over HTTP
    batch-llm bench-serve --num-prompts 10000 --disconnect-prob 0.3 --check-drained
    batch-llm bench-serve --sybil one-key,made-up-keys --honest-key sk-alice --attacker-key sk-mallory
    batch-llm bench-serve --sybil one-key --attacker-first --honest-key sk-alice --attacker-key sk-mallory
    batch-llm bench-serve --stall 100 --honest-key sk-alice --attacker-key sk-mallory
    batch-llm bench-serve --attack idle-sockets,slow-headers,scrape,401-flood --honest-key sk-alice

Every request streams (``/v1/completions``, ``stream: true``) over ``httpx`` (async). Client
times, per request: TTFT (send to the first chunk), ITL (between chunks), TPOT ((e2el - TTFT)
/ (chunks - 1)) and e2el (send to ``[DONE]``); reported per user and overall as mean / p50 /
p90 / p99 in ms, with goodput (completed requests per second meeting every SLO). Prompts are
``--prompt-len`` words (one token each under the simulated GPU's tokenizer); a trace gives
each request's prompt and output lengths.

Beside the client's figures it reads the server's ``/metrics`` before and after the run: the
engine's mean iteration wall time and its own inter-token latency (tick end to tick end), so
the server's overhead per streamed token is the client's mean ITL minus the engine's.

``--disconnect-prob p``: each request, with probability p, is closed by the client after a
uniform random number of chunks (0 .. its max_tokens): a disconnect. ``--check-drained`` then
waits for the server to drain and checks its ``/health``: no request in flight, no KV block
held, nothing running or waiting, and every request it accepted finished or aborted.

``--ab-burst`` reproduces the fairness burst of ``batch.sim.workloads.ab_burst`` (100
requests of user A, 5 of user B, the same lengths), all sent at once (``--ab-window-s`` spreads
them over their arrival offsets instead), and B's 5 alone, fresh user names for each phase;
it prints B's median TTFT with A over B's median TTFT alone, per seed.

``--sybil one-key,key-random-user,made-up-keys,random-user`` is the Sybil test: an honest party
(``--honest-key``) keeps ``--sybil-concurrency`` (64) long streams open; a second later an
attacker keeps as many open, claiming identities as each attack says (its one key
``--attacker-key``; its key with a random ``user`` per request; a made-up key per request; no key
and a random ``user`` per request). It prints the attacker's share of the tokens streamed in
``--sybil-duration-s`` and the statuses it got (401s for made-up keys on a server with keys).
Start the server with ``--eos-probability 0`` so that streams do not end early. Per-user state
carries over from one attack to the next (a fresh server per attack measures each alone); the
honest party starts first, so an attacker's own history can only lower its share.
``--attacker-first`` turns the order round (issue 38: the first party must not keep what it holds): the attacker's
streams open first and the honest party's ``--attacker-lead-s`` (2) later. Either way it also
prints the honest party's share in every ``--share-window-s`` (15) window from
``--share-window-skip-s`` (5) after the second party's start (min / mean / max and the list),
beside the fair share at ``--sybil-weights H:A`` (the weights the server's ``--config`` gives the
two users; the client only prints against them)::

    batch-llm serve --config keys.toml --eos-probability 0     # keys sk-honest -> honest, sk-attacker -> attacker
    batch-llm bench-serve --sybil one-key --attacker-first --attacker-lead-s 2 --sybil-duration-s 60 \
        --honest-key sk-honest --attacker-key sk-attacker

``--stall N`` is the stall probe: a 2-token request's TTFT (``--honest-key``) on the idle server,
then again after one key (``--attacker-key``) has run N streams of ``--stall-max-tokens`` (3000)
for ``--stall-warmup-s`` (30) seconds, and the ratio (issue 38 wants at most 3x); start the
server with ``--eos-probability 0``.

``--attack idle-sockets,slow-headers,scrape,401-flood`` measures what connection and request
floods cost honest clients: per attack, the honest completions per second alone and attacked, and
``/health`` and a keyed request's latency meanwhile (``batch.server.bench_attacks``).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

__all__ = ["Job", "Result", "run_jobs", "summarize", "ab_burst_ratio", "sybil_phase", "window_shares", "share_spread",
           "stall_probe", "SYBIL_ATTACKS", "main"]


@dataclass
class Job:
    """One request to send.

    Attributes:
        user: the body's ``user``; prompt_words: prompt length in words; max_tokens: its
        ``max_tokens``; at_s: send time, seconds from the start; disconnect_after: close the
        stream after this many chunks (``None``: read to the end); tag: a word mixed into the
        prompt so that prompts differ.
    """

    user: str
    prompt_words: int
    max_tokens: int
    at_s: float = 0.0
    disconnect_after: int | None = None
    tag: str = ""


@dataclass
class Result:
    """What the client saw of one request (times in seconds, ``time.perf_counter``).

    Attributes:
        outcome: ``ok`` (read to ``[DONE]``), ``disconnected`` (closed by us on purpose),
            ``rejected`` (429), ``error`` (another status, an exception, or a stream that
            carried an error chunk or ended with ``finish_reason: "error"``; ``detail`` says).
        chunk_s: arrival time of every token chunk.
    """

    job: Job
    outcome: str = "error"
    status: int = 0
    sent_s: float = 0.0
    headers_s: float = 0.0
    done_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    detail: str = ""

    @property
    def ttft_s(self) -> float | None:
        """Send to the first token chunk, seconds (``None`` without a chunk)."""
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def e2el_s(self) -> float:
        """Send to the end (``[DONE]``, the disconnect or the error), seconds."""
        return self.done_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token chunks, seconds (``len(chunk_s) - 1`` of them)."""
        c = self.chunk_s
        return [b - a for a, b in zip(c, c[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(e2el - TTFT) / (chunks - 1), seconds (``None`` with fewer than 2 chunks)."""
        n = len(self.chunk_s)
        return (self.done_s - self.chunk_s[0]) / (n - 1) if n > 1 else None


def _prompt(job: Job, index: int) -> str:
    words = [f"w{(index * 7919 + i) % 997}" for i in range(max(job.prompt_words - 1, 0))]
    return " ".join([job.tag or f"r{index}", *words])


async def _one(client: httpx.AsyncClient, base_url: str, job: Job, index: int, model: str | None,
               res: Result | None = None) -> Result:
    """Send one job and read its stream into ``res`` (a new ``Result`` if not given: a caller
    that passes its own sees the chunks arrive)."""
    res = res if res is not None else Result(job)
    body: dict[str, Any] = {"prompt": _prompt(job, index), "max_tokens": job.max_tokens, "stream": True,
                            "user": job.user}
    if model:
        body["model"] = model
    res.sent_s = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            res.status = r.status_code
            res.headers_s = time.perf_counter()
            if r.status_code != 200:
                await r.aread()
                res.outcome = "rejected" if r.status_code == 429 else "error"
                res.detail = r.text[:200]
                res.done_s = time.perf_counter()
                return res
            if job.disconnect_after == 0:
                res.outcome, res.done_s = "disconnected", time.perf_counter()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    failed = res.detail or res.finish_reason == "error"
                    res.outcome, res.done_s = ("error" if failed else "ok"), now
                    if res.finish_reason == "error" and not res.detail:
                        res.detail = 'finish_reason "error"'
                    return res
                if '"error"' in line[:16]:  # an error chunk: the request failed after its 200
                    res.detail = line[6:200]
                    continue
                res.chunk_s.append(now)
                m = _FINISH.search(line)
                if m:
                    res.finish_reason = m.group(1)
                if job.disconnect_after is not None and len(res.chunk_s) >= job.disconnect_after:
                    res.outcome, res.done_s = "disconnected", time.perf_counter()
                    return res  # leaving the block closes the connection mid-stream
            res.detail = "stream ended without [DONE]"
    except (httpx.HTTPError, OSError) as e:
        res.detail = f"{type(e).__name__}: {e}"
    res.done_s = time.perf_counter()
    return res


_FINISH = re.compile(r'"finish_reason":"([a-z]+)"')


async def run_jobs(base_url: str, jobs: Sequence[Job], *, max_concurrency: int | None = None,
                   model: str | None = None) -> tuple[list[Result], float]:
    """Send ``jobs`` at their ``at_s`` offsets (at most ``max_concurrency`` open at once).

    Returns:
        ``(results in job order, wall seconds from the first send to the last answer)``.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        t0 = time.perf_counter()

        async def go(i: int, job: Job) -> Result:
            delay = t0 + job.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await _one(client, base_url, job, i, model)
            async with sem:
                return await _one(client, base_url, job, i, model)

        results = await asyncio.gather(*(go(i, j) for i, j in enumerate(jobs)))
    return list(results), time.perf_counter() - t0


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _spread_ms(xs: Sequence[float]) -> dict[str, float]:
    return {"mean": 1e3 * statistics.fmean(xs) if xs else float("nan"), "p50": 1e3 * _pct(xs, 50),
            "p90": 1e3 * _pct(xs, 90), "p99": 1e3 * _pct(xs, 99)}


def summarize(results: Sequence[Result], duration_s: float, *, slo_ttft_ms: float = 1000.0,
              slo_tpot_ms: float = 100.0, slo_e2el_ms: float | None = None) -> dict[str, Any]:
    """Figures of a run: counts per outcome, throughput, goodput, and per user and overall the
    TTFT / TPOT / ITL / e2el spreads in ms (completed requests only)."""
    ok = [r for r in results if r.outcome == "ok"]

    def lat(rs: Sequence[Result]) -> dict[str, Any]:
        return {"completed": len(rs),
                "ttft_ms": _spread_ms([r.ttft_s for r in rs if r.ttft_s is not None]),
                "tpot_ms": _spread_ms([r.tpot_s for r in rs if r.tpot_s is not None]),
                "itl_ms": _spread_ms([x for r in rs for x in r.itl_s]),
                "e2el_ms": _spread_ms([r.e2el_s for r in rs])}

    def good(r: Result) -> bool:
        return ((r.ttft_s or 0) * 1e3 <= slo_ttft_ms and (r.tpot_s or 0) * 1e3 <= slo_tpot_ms
                and (slo_e2el_ms is None or r.e2el_s * 1e3 <= slo_e2el_ms))

    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    users = sorted({r.job.user for r in results})
    n_good = sum(1 for r in ok if good(r))
    return {"requests": len(results), "outcomes": outcomes, "duration_s": duration_s,
            "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
            "output_throughput": sum(len(r.chunk_s) for r in ok) / duration_s if duration_s > 0 else 0.0,
            "goodput": n_good / duration_s if duration_s > 0 else 0.0, "good_requests": n_good,
            "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "e2el_ms": slo_e2el_ms},
            "overall": lat(ok), "per_user": {u: lat([r for r in ok if r.job.user == u]) for u in users},
            "errors": [r.detail for r in results if r.outcome == "error"][:5]}


# ---------------------------------------------------------------- the server's side


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The server's ``/metrics`` as ``{series: value}`` (labels kept in the key); ``headers``
    carry a key where ``/metrics`` needs one.

    Raises:
        httpx.HTTPStatusError: ``/metrics`` did not answer 200 (a 401 without a key).
    """
    r = httpx.get(f"{base_url}/metrics", timeout=30, headers=headers)
    r.raise_for_status()
    text = r.text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def engine_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's side of a run, between two scrapes of ``/metrics``.

    Returns:
        ``iteration_ms`` (mean wall time of an engine tick with a batch), ``token_iteration_ms``
        (the same weighted by the tokens each tick produced: per token, its tick's time), ``itl_ms`` (the
        engine's mean inter-token latency, tick end to tick end), ``tokens`` (output tokens
        served), ``cpu_per_token_ms`` (server process CPU per token), ``http_cpu_per_token_ms``
        (the same outside the engine thread: the event loop's HTTP, SSE and hand-over work).
    """
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(name: str) -> float:
        n = delta(f"{name}_count")
        return 1e3 * delta(f"{name}_sum") / n if n else float("nan")

    tokens = sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith("batch:generation_tokens_total"))
    cpu, engine_cpu = delta("process_cpu_seconds_total"), delta("batch:engine_cpu_seconds_total")
    n_out = delta("batch:engine_output_tokens_total")
    return {"iteration_ms": mean("batch:iteration_seconds"), "itl_ms": mean("batch:inter_token_latency_seconds"),
            "token_iteration_ms": 1e3 * delta("batch:iteration_seconds_per_token_total") / n_out if n_out else math.nan,
            "tokens": tokens, "cpu_per_token_ms": 1e3 * cpu / tokens if tokens else float("nan"),
            "http_cpu_per_token_ms": 1e3 * (cpu - engine_cpu) / tokens if tokens else float("nan")}


def wait_drained(base_url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll ``/health`` until nothing is in flight (or ``timeout_s``); returns the last answer."""
    end = time.monotonic() + timeout_s
    while True:
        h = httpx.get(f"{base_url}/health", timeout=30).json()
        if (h["in_flight"] == 0 and not h["active"] and h["http_waiting"] == 0) or time.monotonic() > end:
            return h
        time.sleep(0.05)


# ---------------------------------------------------------------- workloads


def poisson_jobs(n: int, rate: float, users: int, seed: int, prompt_len: tuple[int, int],
                 max_tokens: tuple[int, int], disconnect_prob: float = 0.0) -> list[Job]:
    """``n`` jobs with Poisson arrivals at ``rate``/s (``inf``: all at t = 0), users
    ``u1..u<users>`` drawn uniformly, lengths uniform in the given ranges."""
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        mt = rng.randint(*max_tokens)
        d = rng.randint(0, mt) if rng.random() < disconnect_prob else None
        jobs.append(Job(f"u{rng.randint(1, users)}", rng.randint(*prompt_len), mt, t, d, f"s{seed}r{i}"))
    return jobs


def trace_jobs(trace: str, limit: int | None, users: int, seed: int, time_scale: float,
               trace_dir: str | None) -> list[Job]:
    """Jobs from a normalised trace (``batch.sim.traces.load_trace``): its arrivals and lengths."""
    from batch.sim import traces

    reqs = traces.load_trace(trace, limit=limit, time_scale=time_scale, users=users, seed=seed, trace_dir=trace_dir)
    return [Job(r.user_id, len(r.prompt), r.max_tokens, r.submitted_at, None, f"{r.request_id}") for r in reqs]


def ab_jobs(seed: int, with_a: bool, window_s: float | None) -> list[Job]:
    """The A/B burst of ``workloads.ab_burst(seed=seed)`` (100 of A, 5 of B, same lengths):
    all at t = 0, or at their offsets within ``window_s``; only B's without A. User names carry
    the seed and the phase, so no phase inherits another's fair-share counters."""
    from batch.sim.workloads import ab_burst

    phase = "with-A" if with_a else "alone"
    out = []
    for r in ab_burst(n_a=100, n_b=5, window_s=window_s or 1.0, seed=seed):
        if r.user_id == "A" and not with_a:
            continue
        user = f"{r.user_id}-{phase}-s{seed}"
        out.append(Job(user, len(r.prompt), r.max_tokens, r.submitted_at if window_s else 0.0, None,
                       f"{r.request_id}-s{seed}"))
    return out


async def ab_phase(base_url: str, seed: int, with_a: bool, window_s: float | None = None,
                   drop_after_b: bool = False) -> list[Result]:
    """Run one phase of the A/B burst (``ab_jobs``); returns every request's ``Result``.

    Args:
        drop_after_b: once every B request has its first token, drop every stream still open
            (a disconnect: the server aborts them); their outcome stays ``error`` with no
            ``done_s``. Otherwise every request is read to its end.
    """
    jobs = ab_jobs(seed, with_a, window_s)
    results = [Result(j) for j in jobs]
    b = [r for r in results if r.job.user.startswith("B-")]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        t0 = time.perf_counter()

        async def go(i: int, job: Job, res: Result) -> Result:
            delay = t0 + job.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await _one(client, base_url, job, i, None, res)

        tasks = [asyncio.ensure_future(go(i, j, r)) for i, (j, r) in enumerate(zip(jobs, results))]
        if drop_after_b:
            while not all(r.chunk_s for r in b):
                if any(t.done() and r.outcome != "ok" for t, r in zip(tasks, results)):
                    break
                await asyncio.sleep(0.002)
            for t in tasks:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def ab_burst_ratio(base_url: str, seed: int, window_s: float | None = None,
                   drop_after_b: bool = False) -> dict[str, Any]:
    """B alone, then A and B together (``ab_phase``); B's median TTFT (client side, ms) in each
    and their ratio, and beside them the server's mean TTFT of B (submit to first token on the
    engine's clock, from ``batch:user_time_to_first_token_seconds``) and its ratio.

    Raises:
        RuntimeError: a B request got no first token (refused or failed).
    """
    out: dict[str, Any] = {"seed": seed}
    for with_a in (False, True):
        wait_drained(base_url)
        before = scrape(base_url)
        results = asyncio.run(ab_phase(base_url, seed, with_a, window_s, drop_after_b))
        b = [r for r in results if r.job.user.startswith("B-")]
        if not all(r.chunk_s for r in b):
            bad = next(r for r in b if not r.chunk_s)
            raise RuntimeError(f"A/B burst: a B request got no token: {bad.outcome} {bad.detail}")
        key = "b_ttft_ms_with_a" if with_a else "b_ttft_ms_alone"
        out[key] = 1e3 * statistics.median(r.ttft_s for r in b)
        out["server_" + key.replace("_ms", "_mean_ms")] = _user_mean_ms(
            before, scrape(base_url), "batch:user_time_to_first_token_seconds", b[0].job.user)
    out["ratio"] = out["b_ttft_ms_with_a"] / out["b_ttft_ms_alone"]
    out["server_ratio"] = out["server_b_ttft_mean_ms_with_a"] / out["server_b_ttft_mean_ms_alone"]
    wait_drained(base_url)
    return out


def _user_mean_ms(before: dict[str, float], after: dict[str, float], name: str, user: str) -> float:
    """Mean of a per-user summary between two scrapes, ms (``nan`` without observations)."""
    k = f'{{user="{user}"}}'
    n = after.get(f"{name}_count{k}", 0) - before.get(f"{name}_count{k}", 0)
    s = after.get(f"{name}_sum{k}", 0) - before.get(f"{name}_sum{k}", 0)
    return 1e3 * s / n if n else float("nan")


# ---------------------------------------------------------------- the Sybil attack


#: The attacker's ways to claim identities (``sybil_phase``): its one key; its key with a random
#: ``user`` per request; a made-up key per request; no key and a random ``user`` per request.
SYBIL_ATTACKS = ("one-key", "key-random-user", "made-up-keys", "random-user")


@dataclass
class SybilSide:
    """What one party of a Sybil phase got.

    Attributes:
        tokens: token chunks received within the window.
        statuses: HTTP status -> requests answered with it (sent within the window or before).
        requests: requests sent.
        times: the arrival time (``time.perf_counter``) of every token chunk received, in the
            window or not (the share per window is computed from them).
    """

    tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    requests: int = 0
    times: list[float] = field(default_factory=list)


async def _flood(client: httpx.AsyncClient, base_url: str, side: SybilSide, headers_of: Any, body_of: Any,
                 window: list[float], stop: asyncio.Event, first_token: asyncio.Event | None = None) -> None:
    """One of a party's concurrent workers: send a stream, read it to its end, send the next, until
    ``stop``; count the token chunks that arrive within ``window`` = [start, end] (perf_counter s)
    and keep every chunk's arrival time."""
    while not stop.is_set():
        side.requests += 1
        try:
            async with client.stream("POST", f"{base_url}/v1/completions", json=body_of(),
                                     headers=headers_of()) as r:
                side.statuses[r.status_code] = side.statuses.get(r.status_code, 0) + 1
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0)  # an attacker that is refused tries again at once
                    continue
                async for line in r.aiter_lines():
                    if stop.is_set():
                        return  # leaving the block closes the stream: the server aborts it
                    if not line.startswith("data: {") or '"choices":[]' in line or '"error"' in line[:16]:
                        continue
                    if first_token is not None:
                        first_token.set()
                    now = time.perf_counter()
                    side.times.append(now)
                    if window[0] <= now <= window[1]:
                        side.tokens += 1
        except (httpx.HTTPError, OSError):
            side.statuses[0] = side.statuses.get(0, 0) + 1


def window_shares(honest: Sequence[float], attacker: Sequence[float], start: float, end: float, *,
                  window_s: float, step_s: float | None = None) -> list[dict[str, Any]]:
    """The honest party's share of the token chunks in each window ``[t, t + window_s)`` for
    ``t = start, start + step_s, ...`` while ``t + window_s <= end`` (``step_s`` defaults to
    ``window_s``: back-to-back windows).

    Args:
        honest, attacker: each party's chunk arrival times (any clock, the same for all four).

    Returns:
        one ``{"from_s", "to_s", "honest_tokens", "attacker_tokens", "honest_share"}`` per window,
        ``from_s``/``to_s`` relative to ``start``; ``honest_share`` is ``None`` for a window without
        a token.

    Raises:
        ValueError: ``window_s`` or ``step_s`` not > 0.
    """
    step_s = window_s if step_s is None else step_s
    if not window_s > 0 or not step_s > 0:
        raise ValueError(f"window_s and step_s must be > 0, got {window_s}, {step_s}")
    hs, at = sorted(honest), sorted(attacker)
    out = []
    k = 0
    while start + k * step_s + window_s <= end + 1e-9:
        lo = start + k * step_s
        hi = lo + window_s
        h = bisect.bisect_left(hs, hi) - bisect.bisect_left(hs, lo)
        a = bisect.bisect_left(at, hi) - bisect.bisect_left(at, lo)
        out.append({"from_s": lo - start, "to_s": hi - start, "honest_tokens": h, "attacker_tokens": a,
                    "honest_share": h / (h + a) if h + a else None})
        k += 1
    return out


async def sybil_phase(base_url: str, attack: str, *, honest_key: str | None, attacker_key: str | None,
                      concurrency: int = 64, duration_s: float = 15.0, max_tokens: int = 100_000,
                      prompt_words: int = 8, lead_s: float = 1.0, seed: int = 0, attacker_first: bool = False,
                      window_s: float = 15.0, window_skip_s: float = 5.0,
                      window_step_s: float | None = None) -> dict[str, Any]:
    """One Sybil phase: the first party keeps ``concurrency`` long streams open; after ``lead_s``
    (its requests admitted and streaming, so the second party arrives against a backlogged user,
    as a flood does), the second party keeps ``concurrency`` streams open too. The honest party
    (its key, or its ``user`` ``honest`` without a key) comes first, or second with
    ``attacker_first``; the attacker claims identities as ``attack`` says (``SYBIL_ATTACKS``).
    Tokens are counted for ``duration_s`` from the second party's start, each party's streams
    reopened as they end; then every stream is closed (the server aborts them).

    Beside the whole-run shares, the honest party's share in each ``window_s`` window from
    ``window_skip_s`` after the second party's start (``window_shares``, every ``window_step_s``;
    back to back by default) up to the end of the ``duration_s``.

    Returns:
        ``{"attack", "order", "lead_s", "honest_tokens", "attacker_tokens", "attacker_share",
        "honest_share", "windows", "window_s", "window_skip_s", "window_step_s", "honest_statuses",
        "attacker_statuses", "attacker_requests", "duration_s", "concurrency"}``; ``order`` is
        ``"honest-first"`` or ``"attacker-first"``; the shares are ``None`` when neither party got a
        token.

    Raises:
        ValueError: an unknown ``attack``, or one that needs ``attacker_key`` without it.
    """
    if attack not in SYBIL_ATTACKS:
        raise ValueError(f"attack must be one of {', '.join(SYBIL_ATTACKS)}, got {attack!r}")
    if attack in ("one-key", "key-random-user") and not attacker_key:
        raise ValueError(f"the {attack} attack needs the attacker's key (--attacker-key)")
    rng = random.Random(seed)
    words = " ".join(f"w{i}" for i in range(prompt_words - 1))
    n = itertools.count()

    def body(user: str | None) -> dict[str, Any]:
        b: dict[str, Any] = {"prompt": f"p{next(n)} {words}", "max_tokens": max_tokens, "stream": True}
        if user is not None:
            b["user"] = user
        return b

    def bearer(key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    fresh = lambda: f"{rng.getrandbits(64):016x}"  # noqa: E731 - a made-up name or key
    honest_headers, honest_body = (lambda: bearer(honest_key)), (lambda: body("honest"))
    attacker_headers = {"one-key": lambda: bearer(attacker_key), "key-random-user": lambda: bearer(attacker_key),
                        "made-up-keys": lambda: bearer(f"sk-{fresh()}"), "random-user": lambda: {}}[attack]
    attacker_body = {"one-key": lambda: body("attacker"), "key-random-user": lambda: body(f"u-{fresh()}"),
                     "made-up-keys": lambda: body(f"u-{fresh()}"), "random-user": lambda: body(f"u-{fresh()}")}[attack]
    honest, attacker = SybilSide(), SybilSide()
    first, second = ((attacker, attacker_headers, attacker_body), (honest, honest_headers, honest_body))
    if not attacker_first:
        first, second = second, first
    window = [math.inf, math.inf]
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=4 * concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        started = asyncio.Event()
        tasks = [asyncio.ensure_future(_flood(client, base_url, *first, window, stop, started))
                 for _ in range(concurrency)]
        await asyncio.wait_for(started.wait(), 60 + lead_s)
        await asyncio.sleep(lead_s)
        window[0] = time.perf_counter()
        window[1] = window[0] + duration_s
        tasks += [asyncio.ensure_future(_flood(client, base_url, *second, window, stop))
                  for _ in range(concurrency)]
        await asyncio.sleep(duration_s)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    total = honest.tokens + attacker.tokens
    windows = window_shares(honest.times, attacker.times, window[0] + window_skip_s, window[1], window_s=window_s,
                            step_s=window_step_s)
    return {"attack": attack, "order": "attacker-first" if attacker_first else "honest-first", "lead_s": lead_s,
            "honest_tokens": honest.tokens, "attacker_tokens": attacker.tokens,
            "attacker_share": attacker.tokens / total if total else None,
            "honest_share": honest.tokens / total if total else None,
            "windows": windows, "window_s": window_s, "window_skip_s": window_skip_s,
            "window_step_s": window_s if window_step_s is None else window_step_s,
            "honest_statuses": honest.statuses, "attacker_statuses": attacker.statuses,
            "attacker_requests": attacker.requests, "duration_s": duration_s, "concurrency": concurrency}


def share_spread(row: dict[str, Any]) -> dict[str, Any]:
    """The honest party's share over a phase's windows (``sybil_phase``'s ``windows``):
    ``{"min", "mean", "max", "shares"}``, windows without a token left out (``None`` figures when
    no window had one)."""
    xs = [w["honest_share"] for w in row["windows"] if w["honest_share"] is not None]
    return {"min": min(xs) if xs else None, "mean": statistics.fmean(xs) if xs else None,
            "max": max(xs) if xs else None, "shares": xs}


# ---------------------------------------------------------------- the stall probe


async def _probe(client: httpx.AsyncClient, base_url: str, key: str | None, prompt: str, max_tokens: int,
                 user: str = "prober") -> float:
    """One streamed request; seconds from its send to its first token chunk.

    Raises:
        RuntimeError: not a 200, or no token chunk.
    """
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "user": user}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sent = time.perf_counter()
    first = None
    async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"the probe got {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"choices":[]' not in line \
                    and '"error"' not in line[:16]:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the probe got no token")
    return first - sent


_USER_LABEL = re.compile(r'[{,]user="([^"]*)"')


def user_sums(metrics: dict[str, float], name: str) -> dict[str, float]:
    """Per ``user`` label, the sum of the series ``name`` in a scrape (``scrape``'s dict) over its
    other labels (a ``replica`` label on the replicas' ``Ingress``)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k.startswith(name + "{"):
            m = _USER_LABEL.search(k)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def _server_ttft(before: dict[str, float], after: dict[str, float], user: str | None = None
                 ) -> tuple[str | None, float | None]:
    """The server's mean TTFT (s) between two scrapes for ``user``, or (``None``) for the user whose
    TTFT count grew most; ``(user, mean)``, ``(None, None)`` when no user's count grew."""
    name = "batch:user_time_to_first_token_seconds"
    n0, n1 = user_sums(before, name + "_count"), user_sums(after, name + "_count")
    s0, s1 = user_sums(before, name + "_sum"), user_sums(after, name + "_sum")
    grown = {u: n1[u] - n0.get(u, 0.0) for u in n1 if n1[u] > n0.get(u, 0.0)}
    if user is None:
        if not grown:
            return None, None
        user = max(grown, key=grown.get)
    if not grown.get(user):
        return user, None
    return user, (s1[user] - s0.get(user, 0.0)) / grown[user]


def _scrape_or_empty(base_url: str, key: str | None) -> dict[str, float]:
    try:
        return scrape(base_url, headers={"Authorization": f"Bearer {key}"} if key else None)
    except (httpx.HTTPError, ValueError):
        return {}


def _health(base_url: str) -> dict[str, Any]:
    try:
        return httpx.get(f"{base_url}/health", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


async def stall_probe(base_url: str, *, streams: int = 100, stream_key: str | None, probe_key: str | None,
                      stream_max_tokens: int = 3000, warmup_s: float = 30.0, probes: int = 5,
                      probe_gap_s: float = 1.0, probe_max_tokens: int = 2, prompt_words: int = 8) -> dict[str, Any]:
    """The stall probe: a 2-token request's TTFT while one key runs ``streams`` long streams,
    against the same request's TTFT on the idle server.

    First ``probes`` probes (after one discarded warm-up probe) on the server as it is (idle: the
    caller drains it); then the stream key (``stream_key``; its ``user`` ``streamer`` without a key)
    keeps ``streams`` streams of ``stream_max_tokens`` open, each reopened when it ends (start the
    server with ``--eos-probability 0`` so that none stops early); after ``warmup_s`` the probe key
    (``probe_key``; ``user`` ``prober``) sends ``probes`` probes one after the other,
    ``probe_gap_s`` apart, each the same request as the idle ones (prompt, ``probe_max_tokens``).
    ``/health`` is read before each loaded probe (``running``, ``waiting``, ``kv_blocks_used``: the
    single server's; ``None`` where ``/health`` has no such field, as the replicas' ``Ingress``).

    Returns:
        ``{"idle_ttft_s": [...], "loaded_ttft_s": [...], "idle_median_s", "loaded_median_s",
        "loaded_max_s", "ratio_median", "ratio_max", "health": [...], "stream_tokens",
        "stream_tok_s", "streams", "stream_max_tokens", "warmup_s", "probe_max_tokens", "stream_statuses",
        "server_idle_mean_s", "server_loaded_mean_s", "server_ratio"}``;
        ``ratio_median`` = loaded median / idle median, ``ratio_max`` = loaded max / idle median;
        the ``server_`` figures: the probes' mean TTFT on the server's clock (handler submit to
        first token, ``batch:user_time_to_first_token_seconds`` of the probe key's user, read from
        ``/metrics`` with the probe key around each phase), ``None`` where ``/metrics`` did not
        answer;
        ``stream_tok_s``: the streams' token chunks per second over the warm-up's last half.

    Raises:
        RuntimeError: a probe was refused or got no token.
    """
    words = " ".join(f"w{i}" for i in range(prompt_words - 1))
    prompt = f"probe {words}"
    n = itertools.count()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=2 * streams + 8)
    # The replicas' Ingress renders metrics each replica pushed (every second): wait for the last push.
    settle_s = 0.0 if "in_flight" in _health(base_url) else 2.5
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        await _probe(client, base_url, probe_key, prompt, probe_max_tokens)  # warm-up: connections, code paths
        await asyncio.sleep(settle_s)
        m0 = await asyncio.to_thread(_scrape_or_empty, base_url, probe_key)
        idle = []
        for _ in range(probes):
            idle.append(await _probe(client, base_url, probe_key, prompt, probe_max_tokens))
            await asyncio.sleep(probe_gap_s)
        await asyncio.sleep(settle_s)
        m1 = await asyncio.to_thread(_scrape_or_empty, base_url, probe_key)
        probe_user, server_idle = _server_ttft(m0, m1)
        side, stop = SybilSide(), asyncio.Event()
        window = [-math.inf, math.inf]
        headers = (lambda: {"Authorization": f"Bearer {stream_key}"}) if stream_key else (lambda: {})
        body = lambda: {"prompt": f"s{next(n)} {words}", "max_tokens": stream_max_tokens,  # noqa: E731
                        "stream": True, "user": "streamer"}
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(_flood(client, base_url, side, headers, body, window, stop))
                 for _ in range(streams)]
        await asyncio.sleep(warmup_s)
        t1 = time.perf_counter()
        loaded, health = [], []
        try:
            m2 = await asyncio.to_thread(_scrape_or_empty, base_url, probe_key)
            for _ in range(probes):
                h = await asyncio.to_thread(_health, base_url)
                health.append({k: h.get(k) for k in ("running", "waiting", "kv_blocks_used", "ticks")})
                loaded.append(await _probe(client, base_url, probe_key, prompt, probe_max_tokens))
                await asyncio.sleep(probe_gap_s)
            await asyncio.sleep(settle_s)
            m3 = await asyncio.to_thread(_scrape_or_empty, base_url, probe_key)
            _, server_loaded = _server_ttft(m2, m3, probe_user) if probe_user else (None, None)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    half = t0 + warmup_s / 2
    recent = sum(1 for x in side.times if half <= x < t1)
    idle_med, loaded_med = statistics.median(idle), statistics.median(loaded)
    return {"idle_ttft_s": idle, "loaded_ttft_s": loaded, "idle_median_s": idle_med, "loaded_median_s": loaded_med,
            "loaded_max_s": max(loaded), "ratio_median": loaded_med / idle_med, "ratio_max": max(loaded) / idle_med,
            "health": health, "stream_tokens": len(side.times), "stream_tok_s": recent / (t1 - half),
            "streams": streams, "stream_max_tokens": stream_max_tokens, "warmup_s": warmup_s,
            "probe_max_tokens": probe_max_tokens, "stream_statuses": side.statuses,
            "server_idle_mean_s": server_idle, "server_loaded_mean_s": server_loaded,
            "server_ratio": server_loaded / server_idle if server_idle and server_loaded is not None else None}


def _wait_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Wait for the server to hold nothing (``/health``'s ``in_flight``; a server whose ``/health``
    has no such field, the replicas' ``Ingress``, gets a fixed 2 s)."""
    h = httpx.get(f"{base_url}/health", timeout=30).json()
    if "in_flight" not in h:
        time.sleep(2.0)
        return
    wait_drained(base_url, timeout_s)


# ---------------------------------------------------------------- the command line


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(text)
    return a, b


_range.__name__ = "LO,HI (1 <= LO <= HI)"


def _fmt(name: str, s: dict[str, float]) -> str:
    return f"{name:<6} mean / p50 / p90 / p99 ms  {s['mean']:8.2f} {s['p50']:8.2f} {s['p90']:8.2f} {s['p99']:8.2f}"


def _weights(text: str) -> tuple[int, int]:
    h, sep, a = text.partition(":")
    hw, aw = int(h), int(a)
    if not sep or hw < 1 or aw < 1:
        raise ValueError(text)
    return hw, aw


_weights.__name__ = "H:A (ints >= 1)"


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _sybil_main(p: argparse.ArgumentParser, a: argparse.Namespace, base: str) -> int:
    """``--sybil``: each attack in turn, the server drained between them; prints each attack's
    lines (or JSON); 1 if an attacker's share is over ``--sybil-max-share`` or an honest window's
    share under ``--sybil-min-honest-share``."""
    attacks = a.sybil.split(",")
    bad = [x for x in attacks if x not in SYBIL_ATTACKS]
    if bad:
        p.error(f"--sybil: unknown attack(s) {', '.join(bad)}; choose among {', '.join(SYBIL_ATTACKS)}")
    if a.sybil_concurrency < 1 or not a.sybil_duration_s > 0 or a.sybil_lead_s < 0 or a.sybil_max_tokens < 1:
        p.error("--sybil-concurrency and --sybil-max-tokens must be >= 1, --sybil-duration-s > 0, --sybil-lead-s >= 0")
    if a.attacker_lead_s is not None and not a.attacker_first:
        p.error("--attacker-lead-s needs --attacker-first")
    lead = (2.0 if a.attacker_lead_s is None else a.attacker_lead_s) if a.attacker_first else a.sybil_lead_s
    if lead < 0 or not a.share_window_s > 0 or a.share_window_skip_s < 0 or (
            a.share_window_step_s is not None and not a.share_window_step_s > 0):
        p.error("--attacker-lead-s and --share-window-skip-s must be >= 0, --share-window-s and "
                "--share-window-step-s > 0")
    hw, aw = a.sybil_weights
    fair = hw / (hw + aw)
    rows = []
    for i, attack in enumerate(attacks):
        _wait_idle(base)
        try:
            rows.append(asyncio.run(sybil_phase(base, attack, honest_key=a.honest_key, attacker_key=a.attacker_key,
                                                concurrency=a.sybil_concurrency, duration_s=a.sybil_duration_s,
                                                max_tokens=a.sybil_max_tokens, lead_s=lead, seed=a.seed + i,
                                                attacker_first=a.attacker_first, window_s=a.share_window_s,
                                                window_skip_s=a.share_window_skip_s,
                                                window_step_s=a.share_window_step_s)))
        except ValueError as e:
            p.error(str(e))
        rows[-1]["honest_windows"] = share_spread(rows[-1])
        rows[-1]["fair_honest_share"] = fair
    _wait_idle(base)
    over = [r for r in rows if a.sybil_max_share is not None and (r["attacker_share"] or 0.0) > a.sybil_max_share]
    under = [r for r in rows if a.sybil_min_honest_share is not None and r["attacker_tokens"] > 0
             and any(x < a.sybil_min_honest_share for x in r["honest_windows"]["shares"] or [r["honest_share"] or 0.0])]
    if a.json:
        print(json.dumps({"sybil": rows, "max_share": a.sybil_max_share, "min_honest_share": a.sybil_min_honest_share,
                          "weights": {"honest": hw, "attacker": aw}, "over": [r["attack"] for r in over],
                          "under": [r["attack"] for r in under]}, indent=2))
    else:
        for r in rows:
            print(f"sybil {r['attack']:<16} {r['order']} (lead {r['lead_s']:g} s): attacker "
                  f"{_share(r['attacker_share'])}, honest {_share(r['honest_share'])} of "
                  f"{r['honest_tokens'] + r['attacker_tokens']:,} tokens in {r['duration_s']:g} s from the second "
                  f"party's start (honest {r['honest_tokens']:,}, attacker {r['attacker_tokens']:,}); attacker's "
                  f"answers {dict(sorted(r['attacker_statuses'].items()))} over {r['attacker_requests']:,} requests; "
                  f"honest's {dict(sorted(r['honest_statuses'].items()))}")
            w = r["honest_windows"]
            if w["shares"]:
                dev = max(abs(x - fair) for x in w["shares"])
                print(f"  honest share per {r['window_s']:g}-s window (every {r['window_step_s']:g} s from "
                      f"{r['window_skip_s']:g} s after the second party's start; fair share at weights {hw}:{aw} "
                      f"{100 * fair:.1f}%): min {_share(w['min'])}, mean {_share(w['mean'])}, max "
                      f"{_share(w['max'])}, farthest from fair {100 * dev:.1f} points; "
                      f"[{', '.join(_share(x) for x in w['shares'])}]")
            else:
                print(f"  no {r['window_s']:g}-s window with a token fits {r['duration_s']:g} s after a "
                      f"{r['window_skip_s']:g}-s skip")
    return 1 if over or under else 0


def _stall_main(p: argparse.ArgumentParser, a: argparse.Namespace, base: str) -> int:
    """``--stall N``: the stall probe (``stall_probe``); its lines or JSON; 1 when the ratio of the
    loaded median TTFT over the idle one is over ``--stall-max-ratio``."""
    if a.stall < 1 or a.stall_max_tokens < 1 or a.stall_probes < 1 or a.stall_warmup_s < 0 or a.stall_probe_gap_s < 0:
        p.error("--stall, --stall-max-tokens, --stall-probes must be >= 1; --stall-warmup-s, --stall-probe-gap-s >= 0")
    _wait_idle(base)
    try:
        r = asyncio.run(stall_probe(base, streams=a.stall, stream_key=a.attacker_key, probe_key=a.honest_key,
                                    stream_max_tokens=a.stall_max_tokens, warmup_s=a.stall_warmup_s,
                                    probes=a.stall_probes, probe_gap_s=a.stall_probe_gap_s))
    except RuntimeError as e:
        print(f"batch-llm bench-serve: stall probe: {e}", file=sys.stderr)
        return 1
    _wait_idle(base)
    bad = a.stall_max_ratio is not None and r["ratio_median"] > a.stall_max_ratio
    if a.json:
        print(json.dumps({"stall": r, "max_ratio": a.stall_max_ratio}, indent=2))
        return 1 if bad else 0
    ms = lambda xs: ", ".join(f"{1e3 * x:.1f}" for x in xs)  # noqa: E731
    print(f"stall probe: {r['streams']} streams of max_tokens {r['stream_max_tokens']} on one key, probes after "
          f"{r['warmup_s']:g} s: a {r['probe_max_tokens']}-token request's TTFT "
          f"{1e3 * r['loaded_median_s']:.1f} ms median (max {1e3 * r['loaded_max_s']:.1f}) against "
          f"{1e3 * r['idle_median_s']:.1f} ms idle: ratio {r['ratio_median']:.2f} (max {r['ratio_max']:.2f})")
    if r["server_ratio"] is not None:
        print(f"  on the server's clock (submit to first token, /metrics): mean "
              f"{1e3 * r['server_loaded_mean_s']:.1f} ms loaded against {1e3 * r['server_idle_mean_s']:.1f} ms idle: ratio {r['server_ratio']:.2f}")
    print(f"  idle TTFT ms [{ms(r['idle_ttft_s'])}]; loaded [{ms(r['loaded_ttft_s'])}]; the streams' rate over the "
          f"warm-up's second half {r['stream_tok_s']:.0f} tok/s; server at each probe (running / waiting / KV blocks): "
          + ", ".join("/".join("n/a" if h[k] is None else str(h[k]) for k in ("running", "waiting", "kv_blocks_used"))
                      for h in r["health"]))
    return 1 if bad else 0


def _attack_main(p: argparse.ArgumentParser, a: argparse.Namespace, base: str) -> int:
    """``--attack``: each attack in turn (``batch.server.bench_attacks``); three lines each, or JSON."""
    from batch.server import bench_attacks

    attacks = a.attack.split(",")
    bad = [x for x in attacks if x not in bench_attacks.ATTACKS]
    if bad:
        p.error(f"--attack: unknown attack(s) {', '.join(bad)}; choose among {', '.join(bench_attacks.ATTACKS)}")
    if not a.attack_duration_s > 0 or min(a.attack_honest_concurrency, a.attack_sockets, a.attack_clients) < 1:
        p.error("--attack-duration-s must be > 0; --attack-honest-concurrency, --attack-sockets, --attack-clients >= 1")
    rows = []
    if not a.json:
        print(bench_attacks.context(base, a.honest_key), flush=True)
    for attack in attacks:
        rows.append(bench_attacks.attack_phase(base, attack, honest_key=a.honest_key, attacker_key=a.attacker_key,
                                               duration_s=a.attack_duration_s,
                                               honest_concurrency=a.attack_honest_concurrency,
                                               sockets=a.attack_sockets, clients=a.attack_clients))
        if not a.json:
            print(bench_attacks.format_phase(rows[-1]), flush=True)
        time.sleep(1.0)
    if a.json:
        print(bench_attacks.results_json(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``batch-llm bench-serve``; returns the exit status (1 when ``--check-drained`` fails or a
    request was lost, 2 for a bad argument)."""
    p = argparse.ArgumentParser(prog="batch-llm bench-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the body's model (default: none sent)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests open at once")
    p.add_argument("--users", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=_range, default=(5, 199), help="prompt words LO,HI (default 5,199)")
    p.add_argument("--max-tokens", type=_range, default=(10, 99), help="max_tokens LO,HI (default 10,99)")
    p.add_argument("--trace", default=None, help="a normalised trace CSV (batch.sim.traces): arrivals and lengths")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--limit", type=int, default=None, help="first N trace rows")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival offsets by this")
    p.add_argument("--disconnect-prob", type=float, default=0.0)
    p.add_argument("--check-drained", action="store_true", help="after the run, check the server holds nothing")
    p.add_argument("--ab-burst", action="store_true", help="the A/B fairness burst: B's median TTFT ratio")
    p.add_argument("--ab-seeds", default="4", help="seeds of the A/B burst, comma-separated (default 4)")
    p.add_argument("--ab-window-s", type=float, default=None, help="spread the burst over its arrival offsets")
    p.add_argument("--ab-drop-after-b", action="store_true",
                   help="drop every stream once B's first tokens are in (a faster run; aborts A's requests)")
    p.add_argument("--sybil", default=None, metavar="ATTACKS",
                   help=f"the Sybil test: an honest party and an attacker, each with --sybil-concurrency streams; the "
                        f"attacker's token share per attack, comma-separated, of: {', '.join(SYBIL_ATTACKS)}")
    p.add_argument("--honest-key", default=None, help="--sybil: the honest party's API key (none: no key)")
    p.add_argument("--attacker-key", default=None, help="--sybil: the attacker's one valid API key")
    p.add_argument("--sybil-concurrency", type=int, default=64, help="--sybil: streams per party (default 64)")
    p.add_argument("--sybil-duration-s", type=float, default=15.0, help="--sybil: seconds counted (default 15)")
    p.add_argument("--sybil-lead-s", type=float, default=1.0,
                   help="--sybil: the honest party streams this long before the attacker starts (default 1)")
    p.add_argument("--sybil-max-tokens", type=int, default=100_000, help="--sybil: max_tokens of each request")
    p.add_argument("--sybil-max-share", type=float, default=None,
                   help="--sybil: exit 1 if an attacker's share of the tokens is above this")
    p.add_argument("--attacker-first", action="store_true",
                   help="--sybil: the attacker's streams open first, the honest party's --attacker-lead-s later")
    p.add_argument("--attacker-lead-s", type=float, default=None,
                   help="--sybil --attacker-first: the attacker streams this long before the honest party starts "
                        "(default 2)")
    p.add_argument("--share-window-s", type=float, default=15.0,
                   help="--sybil: the honest party's share is also given per window of this many seconds (default 15)")
    p.add_argument("--share-window-skip-s", type=float, default=5.0,
                   help="--sybil: the first window starts this long after the second party's start (default 5)")
    p.add_argument("--share-window-step-s", type=float, default=None,
                   help="--sybil: a window starts every this many seconds (default: --share-window-s, back to back)")
    p.add_argument("--sybil-weights", type=_weights, default=(1, 1), metavar="H:A",
                   help="--sybil: the weights the server's config gives the honest and the attacker's users (default "
                        "1:1); only sets the fair share the windows are printed against (the server's config sets "
                        "the weights)")
    p.add_argument("--sybil-min-honest-share", type=float, default=None,
                   help="--sybil: exit 1 if the honest party's share in a window (the whole run without a window) is "
                        "below this")
    p.add_argument("--stall", type=int, default=None, metavar="N",
                   help="the stall probe: one key (--attacker-key) runs N long streams, another key's (--honest-key) "
                        "2-token request's TTFT against the same request's on the idle server")
    p.add_argument("--stall-max-tokens", type=int, default=3000, help="--stall: max_tokens of each long stream")
    p.add_argument("--stall-warmup-s", type=float, default=30.0,
                   help="--stall: seconds of long streams before the probes (default 30)")
    p.add_argument("--stall-probes", type=int, default=5, help="--stall: probes idle and loaded (default 5)")
    p.add_argument("--stall-probe-gap-s", type=float, default=1.0, help="--stall: seconds between probes (default 1)")
    p.add_argument("--stall-max-ratio", type=float, default=None,
                   help="--stall: exit 1 if the loaded median TTFT is over this times the idle one")
    p.add_argument("--attack", default=None, metavar="ATTACKS",
                   help="honest throughput alone and under each attack, comma-separated, of: idle-sockets, "
                        "slow-headers, scrape, 401-flood (batch.server.bench_attacks); --honest-key, --attacker-key")
    p.add_argument("--attack-duration-s", type=float, default=10.0, help="--attack: seconds of each window (default 10)")
    p.add_argument("--attack-honest-concurrency", type=int, default=16,
                   help="--attack: honest streams kept going (default 16)")
    p.add_argument("--attack-sockets", type=int, default=1100,
                   help="--attack idle-sockets, slow-headers: connections held (default 1100)")
    p.add_argument("--attack-clients", type=int, default=4,
                   help="--attack scrape, 401-flood: keep-alive connections flooding (default 4)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo-e2el-ms", type=float, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    base = a.base_url.rstrip("/")
    try:
        httpx.get(f"{base}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as e:
        p.error(f"no server at {base}: {e}")

    if a.sybil:
        return _sybil_main(p, a, base)

    if a.stall is not None:
        return _stall_main(p, a, base)

    if a.attack:
        return _attack_main(p, a, base)

    if a.ab_burst:
        rows = [ab_burst_ratio(base, int(s), a.ab_window_s, a.ab_drop_after_b) for s in a.ab_seeds.split(",")]
        ratios = [r["ratio"] for r in rows]
        out = {"ab_burst": rows, "ratio_median": statistics.median(ratios), "ratio_worst": max(ratios),
               "server_ratio_median": statistics.median(r["server_ratio"] for r in rows),
               "server_ratio_worst": max(r["server_ratio"] for r in rows)}
        if a.json:
            print(json.dumps(out, indent=2))
        else:
            for r in rows:
                print(f"A/B burst seed {r['seed']}: B median TTFT {r['b_ttft_ms_with_a']:.1f} ms with A, "
                      f"{r['b_ttft_ms_alone']:.1f} ms alone: ratio {r['ratio']:.2f} (client); server-side B mean "
                      f"TTFT {r['server_b_ttft_mean_ms_with_a']:.1f} / {r['server_b_ttft_mean_ms_alone']:.1f} ms: "
                      f"ratio {r['server_ratio']:.2f}")
            print(f"ratio median {out['ratio_median']:.2f}, worst {out['ratio_worst']:.2f} over {len(rows)} seed(s) "
                  f"(client); server-side median {out['server_ratio_median']:.2f}, worst {out['server_ratio_worst']:.2f}")
        return 0

    if a.trace:
        jobs = trace_jobs(a.trace, a.limit, a.users, a.seed, a.time_scale, a.trace_dir)
    else:
        jobs = poisson_jobs(a.num_prompts, a.request_rate, a.users, a.seed, a.prompt_len, a.max_tokens,
                            a.disconnect_prob)
    before = scrape(base)
    results, duration = asyncio.run(run_jobs(base, jobs, max_concurrency=a.max_concurrency, model=a.model))
    after = scrape(base)
    s = summarize(results, duration, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, slo_e2el_ms=a.slo_e2el_ms)
    s["engine"] = engine_figures(before, after)
    s["overhead_per_token_ms"] = s["overall"]["itl_ms"]["mean"] - s["engine"]["itl_ms"]
    s["itl_minus_iteration_ms"] = s["overall"]["itl_ms"]["mean"] - s["engine"]["token_iteration_ms"]
    status = 0
    lost = s["outcomes"].get("error", 0)
    if a.check_drained:
        h = wait_drained(base)
        accepted = s["outcomes"].get("ok", 0) + s["outcomes"].get("disconnected", 0)
        checks = {"no request in flight": h["in_flight"] == 0, "no KV block held": h["kv_blocks_used"] == 0,
                  "nothing running or waiting": h["running"] == 0 and h["waiting"] == 0,
                  "accepted = finished + aborted": h["submitted"] == h["finished"] + h["aborted"],
                  "no client request lost": lost == 0}
        s["drained"] = {"health": h, "checks": checks, "client_accepted": accepted}
        status = 0 if all(checks.values()) else 1
    if a.json:
        print(json.dumps(s, indent=2))
        return status
    print(f"requests {s['requests']}  outcomes {s['outcomes']}  duration {duration:.2f} s")
    print(f"request throughput {s['request_throughput']:.2f} req/s  output {s['output_throughput']:.1f} tok/s  "
          f"goodput {s['goodput']:.2f} req/s ({s['good_requests']} within TTFT <= {a.slo_ttft_ms:g} ms, "
          f"TPOT <= {a.slo_tpot_ms:g} ms{'' if a.slo_e2el_ms is None else f', e2el <= {a.slo_e2el_ms:g} ms'})")
    for name, lat in [("all", s["overall"]), *s["per_user"].items()]:
        print(f"-- {name}: {lat['completed']} completed")
        for k in ("ttft", "tpot", "itl", "e2el"):
            print("   " + _fmt(k.upper(), lat[f"{k}_ms"]))
    e = s["engine"]
    print(f"server: mean iteration {e['iteration_ms']:.3f} ms a tick, {e['token_iteration_ms']:.3f} ms a token "
          f"(token-weighted); engine ITL {e['itl_ms']:.3f} ms; client ITL {s['overall']['itl_ms']['mean']:.3f} ms")
    print(f"overhead per streamed token: client ITL - engine ITL {s['overhead_per_token_ms']:.3f} ms; client ITL - "
          f"iteration (token-weighted) {s['itl_minus_iteration_ms']:.3f} ms")
    print(f"server CPU per streamed token {e['cpu_per_token_ms']:.3f} ms, of which outside the engine thread "
          f"(HTTP, SSE, hand-over) {e['http_cpu_per_token_ms']:.3f} ms ({e['tokens']:.0f} tokens)")
    if a.check_drained:
        d = s["drained"]
        print("drained: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in d["checks"].items()))
        print(f"server: submitted {d['health']['submitted']}, finished {d['health']['finished']}, aborted "
              f"{d['health']['aborted']}, refused {d['health']['refused']}; client: accepted {d['client_accepted']}")
    if s["errors"]:
        print("first errors:", s["errors"])
    return status
