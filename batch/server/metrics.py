"""The server's Prometheus metrics (``/metrics``), named after vLLM's with a ``batch:`` prefix.

Each server has its own ``CollectorRegistry`` (so tests may run several in one process).
Latencies are taken on the engine's clock (``time.perf_counter``): a token's time is the end
of the tick that produced it, a request's start the moment the HTTP handler queued it.

| metric | type | what |
|---|---|---|
| ``batch:time_to_first_token_seconds`` | histogram | submit to first token |
| ``batch:inter_token_latency_seconds`` | histogram | between two tokens of a request |
| ``batch:request_time_per_output_token_seconds`` | histogram | per request: (e2e - TTFT) / (tokens - 1) |
| ``batch:e2e_request_latency_seconds`` | histogram | submit to last token (finished requests) |
| ``batch:request_queue_time_seconds`` | histogram | submit to admission (the scheduler's record) |
| ``batch:iteration_seconds`` | histogram | wall time of one engine tick with a batch (forward included) |
| ``batch:user_time_to_first_token_seconds{user}`` | summary | per user: TTFT count and sum (the mean); users past the label bound (``max_user_labels``, configured users included) under ``user="other"`` (``ServerMetrics``) |
| ``batch:prompt_tokens_total{user}`` | counter | prompt tokens of accepted requests, per user |
| ``batch:generation_tokens_total{user}`` | counter | output tokens served, per user |
| ``batch:request_success_total{finished_reason}`` | counter | requests ended: stop, length, error, abort |
| ``batch:request_rejected_total{code}`` | counter | requests answered with an error status, by status (400, 404, 413, 429, 500, 503); counted in the app's error handlers only |
| ``batch:num_requests_running`` | gauge | resident requests |
| ``batch:num_requests_waiting`` | gauge | queued or preempted requests |
| ``batch:kv_cache_usage_perc`` | gauge | KV blocks used / cap (0..1, as vLLM's) |
| ``batch:kv_cache_blocks_used`` | gauge | KV blocks used |
| ``batch:requests_in_flight`` | gauge | accepted by the scheduler, not yet finished or aborted |
| ``batch:num_preemptions_total`` | counter | preemptions by recompute |
| ``batch:prefix_cache_queries_total`` | counter | prompt tokens looked up in the prefix cache at admission (0 with prefix caching off) |
| ``batch:prefix_cache_hits_total`` | counter | of those, tokens found cached (hit rate = hits / queries, as vLLM's) |
| ``batch:iteration_seconds_per_token_total`` | counter | sum over tokens of their tick's wall time |
| ``batch:engine_output_tokens_total`` | counter | output tokens the engine produced |
| ``batch:engine_cpu_seconds_total`` | counter | CPU seconds of the engine thread |
| ``batch:invariant_checked_ticks_total`` | counter | ticks the production checks ran on (``Scheduler(production_checks=True)``, ``batch-llm serve``'s default; absent when off) |
| ``batch:invariant_violations_total{property}`` | counter | production-check violations, by the violated property (each also logged by ``batch.checks``) |
| ``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ... | | the server process (``prometheus_client``'s) |
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, Counter, Histogram, Summary, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from batch.server.engine import Engine, TokenEvent, TokenSink

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Buckets in seconds (vLLM's TTFT and ITL buckets, trimmed).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0)


class _SchedulerCollector:
    """Gauges read from the engine's last published ``Snapshot`` at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        """The gauges and counters of the engine's snapshot, read now."""
        snap = self.engine.snapshot
        yield GaugeMetricFamily("batch:num_requests_running", "Requests resident in the scheduler.", snap.running)
        yield GaugeMetricFamily("batch:num_requests_waiting", "Requests queued or preempted.", snap.waiting)
        yield GaugeMetricFamily("batch:kv_cache_usage_perc", "KV cache usage, blocks used / cap (1 = full).",
                                snap.kv_blocks_used / snap.kv_cap_blocks if snap.kv_cap_blocks else 0.0)
        yield GaugeMetricFamily("batch:kv_cache_blocks_used", "KV blocks held by requests.", snap.kv_blocks_used)
        yield GaugeMetricFamily("batch:requests_in_flight",
                                "Requests accepted by the scheduler and not yet finished or aborted.", snap.in_flight)
        yield CounterMetricFamily("batch:num_preemptions", "Preemptions by recompute.",
                                  self.engine.scheduler.stats.preemptions)
        pool = self.engine.scheduler.pool  # a PrefixCachingPool keeps the counts; a plain pool has none
        yield CounterMetricFamily("batch:prefix_cache_queries", "Prefix cache queries: prompt tokens looked up at "
                                  "admission (every admission, a preempted request's again).",
                                  getattr(pool, "query_tokens", 0))
        yield CounterMetricFamily("batch:prefix_cache_hits", "Prefix cache hits: looked-up tokens found cached.",
                                  getattr(pool, "hit_tokens", 0))
        yield CounterMetricFamily("batch:iteration_seconds_per_token", "Sum over output tokens of the wall time "
                                  "of the tick that produced each (divided by the tokens: the token-weighted "
                                  "iteration time).", self.engine.token_iteration_s)
        yield CounterMetricFamily("batch:engine_output_tokens", "Output tokens the engine produced.",
                                  self.engine.tokens_out)
        yield CounterMetricFamily("batch:engine_cpu_seconds", "CPU seconds of the engine thread (scheduler, "
                                  "backend's Python, hand-over).", self.engine.cpu_s)
        guard = getattr(self.engine.scheduler, "_guard", None)
        if guard is not None:  # spec.invariants.ProductionChecker
            yield CounterMetricFamily("batch:invariant_checked_ticks", "Ticks the production checks ran on.",
                                      guard.ticks)
            v = CounterMetricFamily("batch:invariant_violations", "Production-check violations, by property "
                                    "(logged by batch.checks).", labels=["property"])
            for prop, n in list(guard.violations.items()):
                v.add_metric([prop], n)
            yield v


class ServerMetrics:
    """The metrics of one server; ``observe_tick`` runs on the event loop after each tick.

    Per-user series are bounded whatever the config holds: the first ``max_user_labels`` users
    seen (configured or not: a config of 100,000 keys gives no more series than one of ten) get
    their own ``user`` label, every later user is counted under ``user="other"``; a user gets its
    label when it is first active, so nothing is held for a configured user that never sends.

    Args:
        engine: whose snapshot the gauges read.
        max_user_labels: how many users get their own label (>= 0).
    """

    def __init__(self, engine: Engine, max_user_labels: int = 100) -> None:
        if max_user_labels < 0:
            raise ValueError(f"max_user_labels must be >= 0, got {max_user_labels}")
        self._labels: dict[str, str] = {}  # user -> its label (never more than max_user_labels entries)
        self._unnamed_left = max_user_labels
        disable_created_metrics()  # no *_created series (process-wide in prometheus_client)
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("batch:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("batch:inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("batch:request_time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (output tokens - 1).", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("batch:e2e_request_latency_seconds", "Submit to last token.", buckets=E2E_BUCKETS,
                             registry=r)
        self.queue = Histogram("batch:request_queue_time_seconds", "Submit to admission.", buckets=TTFT_BUCKETS,
                               registry=r)
        self.iteration = Histogram("batch:iteration_seconds", "Wall time of one engine tick with a batch.",
                                   buckets=ITL_BUCKETS, registry=r)
        self.user_ttft = Summary("batch:user_time_to_first_token_seconds", "Time to first token per user.", ["user"],
                                 registry=r)
        self.prompt_tokens = Counter("batch:prompt_tokens", "Prompt tokens of accepted requests.", ["user"],
                                     registry=r)
        self.generation_tokens = Counter("batch:generation_tokens", "Output tokens served.", ["user"], registry=r)
        self.success = Counter("batch:request_success", "Requests ended, by finish reason.", ["finished_reason"],
                               registry=r)
        self.rejected = Counter("batch:request_rejected", "Requests refused, by HTTP status.", ["code"], registry=r)
        r.register(_SchedulerCollector(engine))
        ProcessCollector(registry=r)  # process_cpu_seconds_total, memory (Linux)
        self.engine = engine
        self._queue_seen = 0

    def user_label(self, user: str) -> str:
        """The ``user`` label of ``user``: its name, or ``"other"`` once the labels are spent."""
        label = self._labels.get(user)
        if label is None:
            if self._unnamed_left <= 0:
                return "other"
            self._unnamed_left -= 1
            label = self._labels[user] = user
        return label

    def observe_tick(self, events: list[tuple[TokenSink, TokenEvent]], iteration_s: float) -> None:
        """Record one tick's events: token latencies, per-user tokens, finished requests."""
        if iteration_s > 0:
            self.iteration.observe(iteration_s)
        per_user: dict[str, int] = {}
        ttft, itl = self.ttft.observe, self.itl.observe
        for sink, ev in events:
            t = ev.t_s
            if ev.token is not None:
                u = sink.request.user_id
                per_user[u] = per_user.get(u, 0) + 1
                if sink.first_token_s is None:
                    sink.first_token_s = t
                    ttft(t - sink.submitted_s)
                    self.user_ttft.labels(self.user_label(u)).observe(t - sink.submitted_s)
                else:
                    itl(t - sink.last_token_s)  # type: ignore[operator]
                sink.last_token_s = t
            if ev.finish_reason is not None and ev.error is None or ev.finish_reason == "abort":
                self.success.labels(ev.finish_reason).inc()
                if ev.finish_reason != "abort" and sink.first_token_s is not None:
                    self.e2e.observe(t - sink.submitted_s)
                    n = len(sink.request.generated)
                    if n > 1:
                        self.tpot.observe((t - sink.first_token_s) / (n - 1))
        for u, n in per_user.items():
            self.generation_tokens.labels(self.user_label(u)).inc(n)
        stats = self.engine.scheduler.stats  # its per-request queue times, appended at finish (a trimmed window)
        q, dropped = stats.queue_s, stats.queue_dropped
        if dropped + len(q) > self._queue_seen:
            for x in q[max(0, self._queue_seen - dropped):]:
                self.queue.observe(x)
            self._queue_seen = dropped + len(q)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
