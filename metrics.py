"""Serving metrics, defined as vLLM's ``benchmark_serving`` and LLMPerf define them.

Per finished request: e2e latency = ``completed_at - submitted_at``; TTFT = ``started_at -
submitted_at``; TPOT = ``(e2e - TTFT) / (output tokens - 1)`` (requests with >= 2 tokens);
ITL = gaps between consecutive output tokens; queue time = first admission - submit.
Output throughput = output tokens of finished requests / (last completion - first submit).
Percentiles by linear interpolation (numpy's default). ``gpu_utilization`` = ticks whose
batch was non-empty / ticks. Finished requests are not retained: only these numbers are.
"""
from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict
from typing import Any

#: The four keys of the import contract.
CONTRACT_KEYS = ("throughput_tokens_per_sec", "avg_latency_s", "p99_latency_s", "gpu_utilization")


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
        ``duration_s``, ``ttft_{mean,p50,p99}_s``, ``tpot_{mean,p50,p99}_s``,
        ``itl_{mean,p50,p99}_s``, ``e2e_p50_s``, ``queue_{p50,p99}_s``, ``preemptions``,
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
            "duration_s": duration,
            "ttft_mean_s": _mean(self.ttft_s), "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_mean_s": _mean(self.tpot_s), "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
            "itl_mean_s": _mean(self.itl_s), "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
            "e2e_p50_s": _pct(e2e, 50),
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
