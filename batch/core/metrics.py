"""Serving metrics, defined as vLLM's ``benchmark_serving`` and LLMPerf define them.

Per finished request: e2e latency = ``completed_at - submitted_at``; TTFT = ``started_at -
submitted_at``; TPOT = ``(e2e - TTFT) / (output tokens - 1)`` (requests with >= 2 tokens);
ITL = gaps between consecutive output tokens; queue time = first admission - submit.
Output throughput = output tokens of finished requests / (last completion - first submit);
request throughput = finished requests / the same duration. Percentiles by linear
interpolation (numpy's default). ``gpu_utilization`` = ticks whose batch was non-empty /
ticks (the contract's definition: it says nothing about how long each tick's batch kept the
GPU busy). Finished requests are not retained: only these numbers are.

``benchmark_metrics`` renames a summary to vLLM ``benchmark_serving``'s result keys
(``mean_ttft_ms``, ``p99_itl_ms``, ``request_throughput``, ...), and ``good_requests`` counts
the completed requests that meet every objective of an ``SLO`` (vLLM's ``--goodput``).
"""
from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

#: The four keys of the import contract.
CONTRACT_KEYS = ("throughput_tokens_per_sec", "avg_latency_s", "p99_latency_s", "gpu_utilization")
#: The percentiles ``summary()`` reports for TTFT, TPOT, ITL and e2e latency (``<metric>_p<q>_s``).
PERCENTILES = (50, 90, 95, 99)


def _pct(a: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of the *sorted* ``a`` by linear interpolation between
    closest ranks (numpy's default, ``method="linear"``); 0.0 for no data."""
    if not a:
        return 0.0
    pos = (len(a) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(a) - 1)
    return float(a[lo] + (a[hi] - a[lo]) * (pos - lo))


def _mean(xs: Any) -> float:
    return sum(xs) / len(xs) if len(xs) else 0.0


def _spread(name: str, xs: Any, ordered: list[float]) -> dict[str, float]:
    """``{name}_mean_s`` and ``{name}_p{q}_s`` for each q of ``PERCENTILES`` (``ordered``: ``xs`` sorted)."""
    return {f"{name}_mean_s": _mean(xs), **{f"{name}_p{q}_s": _pct(ordered, q) for q in PERCENTILES}}


def jain_index(xs: Any) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` in ``(0, 1]``; 1.0 for an empty or all-zero input."""
    a = [float(x) for x in xs]
    s2 = sum(x * x for x in a)
    return sum(a) ** 2 / (len(a) * s2) if a and s2 > 0 else 1.0


class _UserStats:
    __slots__ = ("finished", "output_tokens", "prompt_tokens", "ttft_s", "e2e_s")

    def __init__(self) -> None:
        self.finished = 0
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.ttft_s = array("d")
        self.e2e_s = array("d")


class MetricsRecorder:
    """Accumulates per-tick and per-request figures; ``summary()`` turns them into a dict.

    Args:
        record_itl: keep every inter-token gap for ITL percentiles (8 bytes a token). Turn
            off for million-request runs; ITL keys are then 0.0.
    """

    def __init__(self, *, record_itl: bool = True) -> None:
        self.record_itl = record_itl
        self.ticks = 0
        self.nonempty_ticks = 0
        self.batch_requests = 0
        self.batch_tokens = 0
        self.kv_used_block_ticks = 0
        self.first_submit_s: float | None = None
        self.last_completion_s: float | None = None
        self.output_tokens = 0
        self.preemptions = 0
        self.refusals: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.e2e_s = array("d")
        self.ttft_s = array("d")
        self.tpot_s = array("d")
        self.queue_s = array("d")
        self.itl_s = array("d")
        self.users: defaultdict[str, _UserStats] = defaultdict(_UserStats)

    def on_submit(self, now_s: float) -> None:
        """A request was accepted at ``now_s``."""
        if self.first_submit_s is None:
            self.first_submit_s = now_s

    def on_refuse(self, reason: str) -> None:
        """A request was refused at submit; ``reason`` is the error class name."""
        self.refusals[reason] += 1

    def on_tick(self, batch_requests: int, batch_tokens: int, kv_used_blocks: int) -> None:
        """One tick ran with this batch (0 requests for an empty tick) and this many blocks in use."""
        self.ticks += 1
        if batch_requests:
            self.nonempty_ticks += 1
            self.batch_requests += batch_requests
            self.batch_tokens += batch_tokens
        self.kv_used_block_ticks += kv_used_blocks

    def on_itl(self, gap_s: float) -> None:
        """One inter-token gap of a request, seconds."""
        if self.record_itl:
            self.itl_s.append(gap_s)

    def on_cancel(self, reason: str) -> None:
        """A request left without completing: aborted by the caller (``"abort"``) or failed by the
        backend retry policy (``"error"``). Counted in ``finish_reasons`` only: its latency is not a
        completion latency and its tokens are not served output, so the latency and throughput
        figures leave it out (as vLLM's ``benchmark_serving`` leaves out failed requests)."""
        self.finish_reasons[reason] += 1

    def on_finish(self, *, user_id: str, reason: str, submitted_s: float, first_token_s: float | None,
                  admitted_s: float | None, completed_s: float, prompt_tokens: int, output_tokens: int) -> None:
        """A request completed (EOS, ``max_tokens`` or the cache length) at ``completed_s``."""
        self.finish_reasons[reason] += 1
        self.last_completion_s = completed_s if self.last_completion_s is None else max(self.last_completion_s,
                                                                                        completed_s)
        self.output_tokens += output_tokens
        u = self.users[user_id]
        u.finished += 1
        u.output_tokens += output_tokens
        u.prompt_tokens += prompt_tokens
        e2e = completed_s - submitted_s
        self.e2e_s.append(e2e)
        u.e2e_s.append(e2e)
        if admitted_s is not None:
            self.queue_s.append(admitted_s - submitted_s)
        if first_token_s is not None:
            ttft = first_token_s - submitted_s
            self.ttft_s.append(ttft)
            u.ttft_s.append(ttft)
            if output_tokens >= 2:
                self.tpot_s.append((completed_s - first_token_s) / (output_tokens - 1))

    def summary(self, *, kv_blocks_in_use: int, kv_cap_blocks: int, waiting: int, running: int) -> dict[str, Any]:
        """All metrics as a dict; every value a finite number (zeros before anything finished)
        while the clock reads finite, non-decreasing seconds. A clock that reads NaN or goes back
        makes the latency and throughput figures NaN or negative (``docs/reliability.md``).

        Keys: the contract's four, then ``requests_finished``, ``output_tokens``,
        ``prompt_tokens`` (of the finished requests), ``duration_s``, ``request_throughput``
        (finished requests / ``duration_s``), ``ttft_{mean,p50,p90,p95,p99}_s``,
        ``tpot_{mean,p50,p90,p95,p99}_s``, ``itl_{mean,p50,p90,p95,p99}_s``,
        ``e2e_{mean,p50,p90,p95,p99}_s`` (``e2e_mean_s`` = ``avg_latency_s``, ``e2e_p99_s`` =
        ``p99_latency_s``), ``queue_{p50,p99}_s``, ``preemptions``,
        ``refusals``, ``refusals_by_reason``, ``finish_reasons``, ``ticks``,
        ``avg_batch_requests``, ``avg_batch_tokens``, ``kv_blocks_in_use``,
        ``kv_utilization``, ``waiting``, ``running``, ``jain_index_output_tokens`` and
        ``per_user`` (user -> finished, output_tokens, prompt_tokens, ttft_p50_s, e2e_p50_s).
        """
        duration = 0.0
        if self.first_submit_s is not None and self.last_completion_s is not None:
            duration = max(0.0, self.last_completion_s - self.first_submit_s)
        ticks = max(self.ticks, 1)
        e2e, ttft, tpot, itl, queue = (sorted(xs) for xs in (self.e2e_s, self.ttft_s, self.tpot_s, self.itl_s,
                                                              self.queue_s))
        return {
            "throughput_tokens_per_sec": float(self.output_tokens / duration) if duration > 0 else 0.0,
            "avg_latency_s": _mean(self.e2e_s),
            "p99_latency_s": _pct(e2e, 99),
            "gpu_utilization": float(self.nonempty_ticks / self.ticks) if self.ticks else 0.0,
            "requests_finished": len(self.e2e_s),
            "output_tokens": self.output_tokens,
            "prompt_tokens": sum(u.prompt_tokens for u in self.users.values()),
            "duration_s": duration,
            "request_throughput": len(self.e2e_s) / duration if duration > 0 else 0.0,
            **_spread("ttft", self.ttft_s, ttft), **_spread("tpot", self.tpot_s, tpot),
            **_spread("itl", self.itl_s, itl), **_spread("e2e", self.e2e_s, e2e),
            "queue_p50_s": _pct(queue, 50), "queue_p99_s": _pct(queue, 99),
            "preemptions": self.preemptions,
            "refusals": sum(self.refusals.values()),
            "refusals_by_reason": dict(self.refusals),
            "finish_reasons": dict(self.finish_reasons),
            "ticks": self.ticks,
            "avg_batch_requests": self.batch_requests / self.nonempty_ticks if self.nonempty_ticks else 0.0,
            "avg_batch_tokens": self.batch_tokens / self.nonempty_ticks if self.nonempty_ticks else 0.0,
            "kv_blocks_in_use": kv_blocks_in_use,
            "kv_utilization": self.kv_used_block_ticks / (ticks * kv_cap_blocks),
            "waiting": waiting,
            "running": running,
            "jain_index_output_tokens": jain_index(u.output_tokens for u in self.users.values()),
            "per_user": {
                user: {"finished": u.finished, "output_tokens": u.output_tokens, "prompt_tokens": u.prompt_tokens,
                       "ttft_p50_s": _pct(sorted(u.ttft_s), 50), "e2e_p50_s": _pct(sorted(u.e2e_s), 50)}
                for user, u in sorted(self.users.items())
            },
        }


# ---------------------------------------------------------------- vLLM's benchmark names and goodput


#: vLLM ``benchmark_serving``'s latency metric names and the ``summary()`` key prefix of each.
BENCHMARK_LATENCIES = (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e"))


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, seconds; ``None`` leaves a metric unconstrained.

    A completed request meets them when its TTFT, TPOT and e2e latency are each at most the
    objective (vLLM ``benchmark_serving --goodput ttft:MS tpot:MS e2el:MS``). A request with a
    single output token has TPOT 0, as there.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
        """Whether a request with these latencies (seconds) meets every objective."""
        return all(limit is None or value <= limit
                   for value, limit in ((ttft_s, self.ttft_s), (tpot_s, self.tpot_s), (e2el_s, self.e2el_s)))

    def as_ms(self) -> dict[str, float]:
        """The objectives that are set, in ms by vLLM's names (``{"ttft": 1000.0, "tpot": 100.0}``)."""
        return {name: limit * 1e3 for name, limit in (("ttft", self.ttft_s), ("tpot", self.tpot_s),
                                                       ("e2el", self.e2el_s)) if limit is not None}


def request_latencies(req: Any) -> tuple[float, float, float] | None:
    """``(ttft, tpot, e2el)`` seconds of a completed ``Request`` (``submitted_at``, ``started_at``
    = first token, ``completed_at``, ``generated``), as ``summary()`` measures them; TPOT is
    0.0 for a single output token. ``None`` for a request that has not completed with a token."""
    if req.completed_at is None or req.started_at is None or req.submitted_at is None:
        return None
    ttft = req.started_at - req.submitted_at
    n = len(req.generated)
    tpot = (req.completed_at - req.started_at) / (n - 1) if n >= 2 else 0.0
    return ttft, tpot, req.completed_at - req.submitted_at


def good_requests(requests: Iterable[Any], slo: SLO) -> int:
    """How many of the completed ``requests`` meet ``slo`` (pass only completions: not aborted or failed ones)."""
    return sum(1 for r in requests if (lat := request_latencies(r)) is not None and slo.met(*lat))


def benchmark_metrics(m: dict[str, Any], *, good_completed: int | None = None) -> dict[str, Any]:
    """A ``summary()`` under vLLM ``benchmark_serving``'s result keys.

    ``completed``, ``duration`` (s: first submit to last completion on the scheduler's clock;
    vLLM times its whole benchmark), ``total_input_tokens``, ``total_output_tokens``,
    ``request_throughput`` (completed / duration), ``request_goodput`` (``good_completed`` /
    duration, ``None`` without it), ``output_throughput``, ``total_token_throughput`` (input +
    output tokens / duration), and ``{mean,median,p90,p95,p99}_{ttft,tpot,itl,e2el}_ms``.
    """
    duration = m["duration_s"]
    out: dict[str, Any] = {
        "completed": m["requests_finished"],
        "duration": duration,
        "total_input_tokens": m["prompt_tokens"],
        "total_output_tokens": m["output_tokens"],
        "request_throughput": m["request_throughput"],
        "request_goodput": (good_completed / duration if duration > 0 else 0.0) if good_completed is not None
        else None,
        "output_throughput": m["throughput_tokens_per_sec"],
        "total_token_throughput": (m["prompt_tokens"] + m["output_tokens"]) / duration if duration > 0 else 0.0,
    }
    for name, key in BENCHMARK_LATENCIES:
        out[f"mean_{name}_ms"] = m[f"{key}_mean_s"] * 1e3
        out[f"median_{name}_ms"] = m[f"{key}_p50_s"] * 1e3
        for q in PERCENTILES[1:]:
            out[f"p{q}_{name}_ms"] = m[f"{key}_p{q}_s"] * 1e3
    return out
