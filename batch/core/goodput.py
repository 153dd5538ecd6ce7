"""Figures over a run: goodput, vLLM ``benchmark_serving``'s result names over
``MetricsRecorder.summary()``, and Jain's index over per-user service.

``benchmark_metrics`` renames a summary to vLLM ``benchmark_serving``'s result keys
(``mean_ttft_ms``, ``p99_itl_ms``, ``request_throughput``, ...), and ``good_requests`` counts
the completed requests that meet every objective of an ``SLO`` (vLLM's ``--goodput``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from batch.core.metrics import PERCENTILES

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


def jain_index(xs: Any) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` in ``(0, 1]``; 1.0 for an empty or all-zero input."""
    a = [float(x) for x in xs]
    s2 = sum(x * x for x in a)
    return sum(a) ** 2 / (len(a) * s2) if a and s2 > 0 else 1.0


def jain_index_of(requests: Iterable[Any]) -> float:
    """Jain's index over the output tokens of each user's completed ``requests``."""
    per: dict[str, int] = {}
    for r in requests:
        per[r.user_id] = per.get(r.user_id, 0) + len(r.generated)
    return jain_index(per.values())
