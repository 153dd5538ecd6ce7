"""Serving metrics as vLLM's ``benchmark_serving`` defines them: e2e = completed - submitted; TTFT =
started - submitted; TPOT = (e2e - TTFT) / (tokens - 1); ITL = gaps between tokens; throughput =
output tokens / (last completion - first submit); linear-interpolation percentiles;
``gpu_utilization`` = non-empty ticks / ticks (the contract's). Goodput: ``batch.core.goodput``.
"""
from __future__ import annotations

import math
from array import array
from collections import Counter
from typing import Any

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


class MetricsRecorder:
    """Per-tick and per-request figures; ``summary()`` turns them into a dict. ``record_itl``: keep
    every inter-token gap (8 bytes a token; off: ITL keys read 0.0). ``max_samples``: keep only
    the latest ``max_samples`` (up to twice that between trims) of each per-request latency
    (e2e, TTFT, TPOT, queue time: 8 bytes a request each), so a long-running server's memory
    does not grow with the requests it served; its percentiles and means are then over that
    window, the counts (``requests_finished``, throughput) over everything. ``None``: keep all.
    Nothing is kept per user."""

    def __init__(self, *, record_itl: bool = True, max_samples: int | None = None) -> None:
        if max_samples is not None and (not isinstance(max_samples, int) or max_samples < 1):
            raise ValueError(f"max_samples must be an int >= 1 or None, got {max_samples!r}")
        self.record_itl = record_itl
        self.max_samples = max_samples
        self.finished = 0  # requests completed (on_finish), all of them
        self.queue_dropped = 0  # queue-time samples trimmed from the front of ``queue_s`` so far
        self.ticks = 0
        self.nonempty_ticks = 0
        self.batch_requests = 0
        self.batch_tokens = 0
        self.kv_used_block_ticks = 0
        self.first_submit_s: float | None = None
        self.last_completion_s: float | None = None
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.preemptions = 0
        self.refusals: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.e2e_s = array("d")
        self.ttft_s = array("d")
        self.tpot_s = array("d")
        self.queue_s = array("d")
        self.itl_s = array("d")

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

    def on_cancel(self, reason: str) -> None:
        """A request left without completing (``"abort"``, or ``"error"`` by the retry policy): counted
        in ``finish_reasons`` only, not in latency or throughput (as vLLM's ``benchmark_serving``)."""
        self.finish_reasons[reason] += 1

    def on_finish(self, *, reason: str, submitted_s: float, first_token_s: float | None,
                  admitted_s: float | None, completed_s: float, prompt_tokens: int, output_tokens: int) -> None:
        """A request completed (EOS, ``max_tokens`` or the cache length) at ``completed_s``."""
        self.finish_reasons[reason] += 1
        self.last_completion_s = completed_s if self.last_completion_s is None else max(self.last_completion_s,
                                                                                        completed_s)
        self.output_tokens += output_tokens
        self.prompt_tokens += prompt_tokens
        self.finished += 1
        if self.max_samples is not None and len(self.e2e_s) >= 2 * self.max_samples:
            self._trim()
        self.e2e_s.append(completed_s - submitted_s)
        if admitted_s is not None:
            self.queue_s.append(admitted_s - submitted_s)
        if first_token_s is not None:
            self.ttft_s.append(first_token_s - submitted_s)
            if output_tokens >= 2:
                self.tpot_s.append((completed_s - first_token_s) / (output_tokens - 1))

    def _trim(self) -> None:
        """Drop all but the latest ``max_samples`` of each per-request latency (amortised O(1) a request)."""
        keep = self.max_samples
        assert keep is not None
        self.queue_dropped += max(0, len(self.queue_s) - keep)
        for xs in (self.e2e_s, self.ttft_s, self.tpot_s, self.queue_s):
            del xs[:max(0, len(xs) - keep)]

    def summary(self, *, kv_blocks_in_use: int, kv_cap_blocks: int, waiting: int, running: int) -> dict[str, Any]:
        """All metrics as a dict (keys: the contract's four, then the rest below; ``docs/design.md``
        lists them), finite numbers (zeros before anything finished) while the clock reads finite,
        non-decreasing seconds (``docs/reliability.md``)."""
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
            "requests_finished": self.finished,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "duration_s": duration,
            "request_throughput": self.finished / duration if duration > 0 else 0.0,
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
        }
