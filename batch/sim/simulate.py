"""The main job's library: push a workload through a scheduler on the simulated GPU, and the
metrics table and JSON it prints (the command line is ``batch.cli``: ``python -m batch``).

Arrivals are replayed: each request is submitted when the clock passes its arrival offset,
between ticks, as a serving loop would. With ``--clock virtual`` the stub advances simulated
time by its latency model instead of sleeping, and idle gaps are skipped. With ``gpu=NAME``
(``--gpu``) the iteration time is a real deployment's instead (``batch.sim.gpu_profile``: what
each iteration's prefill tokens, decode sequences and KV reads cost there), and the scheduler's
limits default to vLLM's for that GPU.

The metrics are ``Scheduler.metrics()`` (``batch.core.metrics``); ``--json`` prints them under vLLM
``benchmark_serving``'s names (``goodput.benchmark_metrics``) with the goodput under
``--slo-ttft-ms`` / ``--slo-tpot-ms`` / ``--slo-e2el-ms``. ``gpu_utilization`` is the
contract's fraction of ticks whose batch was non-empty; ``gpu_busy_fraction`` is the time
the simulated GPU spent in ``forward`` over the duration (first submit to last completion on
the run's clock), the GPU-busy share of clock time.
"""
from __future__ import annotations

import math
import numbers
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import inference_stub
from batch.core import goodput, metrics
from batch.sim.baselines import ReservationScheduler, StaticBatchScheduler
from batch.policies.policy import FCFSPolicy
from batch.policies.roundrobin import RoundRobinPolicy
from inference_stub import Request, SimulatedGPU, VirtualClock
from scheduler import RequestError, Scheduler

#: ``--policy`` choices: name -> (scheduler class, policy factory or ``None`` for the class's
#: default, what it is). ``vtc`` is ``Scheduler()`` as shipped.
POLICIES: dict[str, tuple[type[Scheduler], Callable[[], object] | None, str]] = {
    "vtc": (Scheduler, None, "Scheduler() as shipped: VTC fair share with TTFT isolation (default)"),
    "fcfs": (Scheduler, FCFSPolicy, "FCFS, preemption by recompute, newest victim (vLLM V1)"),
    "round-robin": (Scheduler, RoundRobinPolicy, "per-user round-robin admission"),
    "fcfs-reserve": (ReservationScheduler, None, "FCFS reserving prompt + max_tokens, never preempts "
                                                 "(TGI, TensorRT-LLM); stub backend only"),
    "static": (StaticBatchScheduler, None, "static batching, 32 a batch; stub backend only"),
}
#: A run's progress bar (``run_workload(progress=True)``) appears once it has lasted this long, so
#: short runs print nothing.
PROGRESS_DELAY_S = 2.0
#: Default SLOs for goodput, ms: a first token within a second, then at least 10 tokens a second.
DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_TPOT_MS = 100.0


@dataclass
class RunResult:
    """What a run produced.

    Attributes:
        scheduler: the scheduler after the run (``metrics()`` is ready).
        finished: requests that completed, in completion order.
        refused: ``(request, error)`` for each request refused at submit.
        wall_s: real seconds the run took.
        sim_s: seconds on the run's clock from the first arrival to the end.
        busy_s: seconds the GPU spent in ``forward`` (simulated GPUs only, else 0).
        failed: requests among ``finished`` that the backend retry policy failed (finish
            reason ``"error"``, ``max_backend_tries``): returned, but not completions.
    """

    scheduler: Scheduler
    finished: list[Request]
    refused: list[tuple[Request, RequestError]] = field(default_factory=list)
    wall_s: float = 0.0
    sim_s: float = 0.0
    busy_s: float = 0.0
    failed: list[Request] = field(default_factory=list)

    def completed(self) -> list[Request]:
        """``finished`` less ``failed``: the requests that completed (EOS, ``max_tokens``, cache length)."""
        failed = {id(r) for r in self.failed}
        return [r for r in self.finished if id(r) not in failed] if failed else list(self.finished)

    def gpu_busy_fraction(self, duration_s: float) -> float | None:
        """Seconds the simulated GPU spent in ``forward`` / ``duration_s`` (the metrics'
        ``duration_s``: first submit to last completion on the run's clock); ``None`` when no
        simulated GPU did the work (``--backend model``) or no time passed."""
        return min(1.0, self.busy_s / duration_s) if self.busy_s and duration_s > 0 else None


def run_workload(
    requests: Sequence[Request],
    *,
    make_scheduler: Callable[..., Scheduler] = Scheduler,
    virtual: bool = True,
    gpu_seed: int | None = 0,
    base_s: float = inference_stub.ITERATION_BASE_S,
    per_request_s: float = inference_stub.ITERATION_PER_REQUEST_S,
    eos_probability: float = inference_stub.EOS_PROBABILITY,
    progress: bool = False,
    max_ticks: int | None = None,
    gpu: str | None = None,
    **scheduler_kwargs,
) -> RunResult:
    """Replay ``requests`` (``submitted_at`` = arrival offset, seconds) through a scheduler.

    Args:
        requests: the workload; each is submitted when the clock passes its offset.
        make_scheduler: a scheduler class or factory taking keyword arguments.
        virtual: simulated time (a ``VirtualClock``) instead of real sleeps.
        gpu_seed: seeded token streams (``SimulatedGPU(seed=...)``); ``None`` for shared random.
        base_s, per_request_s, eos_probability: the simulated GPU's parameters.
        progress: show a tqdm progress bar of finished (and refused) requests on stderr once the
            run has lasted ``PROGRESS_DELAY_S`` (a shorter run prints nothing).
        max_ticks: stop with ``RuntimeError`` after this many ticks (a guard for tests).
        gpu: a ``batch.sim.gpu_profile`` profile name: the iteration time is that deployment's
            (``SimulatedGPU(profile=gpu)``, a paged backend the scheduler drives through
            ``execute_model``; ``base_s`` and ``per_request_s`` are unused) and the scheduler's
            ``kv_cap_blocks``, ``block_tokens``, ``token_budget_tokens`` and ``max_running`` default to
            the profile's limits (vLLM's defaults for that GPU). ``None``: the stub's clock.
        **scheduler_kwargs: passed to ``make_scheduler`` (``clock`` and ``backend`` are set here).

    Returns:
        A ``RunResult``; refused requests are counted there and in ``metrics()["refusals"]``.

    Raises:
        ValueError: a request's ``submitted_at`` is not a finite number of seconds >= 0 (nan,
            inf, negative, or not a number), naming the request; checked before anything runs
            (a nan offset made the replay wait for ever).
        RuntimeError: ``max_ticks`` ticks passed and the run has not finished.
    """
    for r in requests:
        t = r.submitted_at
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
            raise ValueError(f"request {r.request_id!r}: submitted_at (arrival offset) must be a finite "
                             f"number of seconds >= 0, got {t!r}")
    clock = VirtualClock() if virtual else None
    now: Callable[[], float] = clock.now if clock else time.time
    if gpu is None:
        sim = SimulatedGPU(base_s=base_s, per_request_s=per_request_s, eos_probability=eos_probability,
                           seed=gpu_seed, clock=clock)
        backend = sim.forward
    else:
        sim = SimulatedGPU(profile=gpu, eos_probability=eos_probability, seed=gpu_seed, clock=clock)
        backend = sim  # the scheduler calls its execute_model
        scheduler_kwargs = {**sim.profile.limits.scheduler_kwargs(), **scheduler_kwargs}
    sched = make_scheduler(clock=now, backend=backend, **scheduler_kwargs)
    pending = sorted(requests, key=lambda r: r.submitted_at)
    offsets = [r.submitted_at for r in pending]
    result = RunResult(scheduler=sched, finished=[])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(pending), unit="req", file=sys.stderr, mininterval=0.5, delay=PROGRESS_DELAY_S)
    wall0 = time.perf_counter()
    t0 = now()
    i, ticks = 0, 0
    # only a retry policy fails requests; reading last_finished at every tick costs a dict of the batch
    may_fail = getattr(sched, "max_backend_tries", None) is not None
    while i < len(pending) or sched.has_active():
        t = now()
        while i < len(pending) and t0 + offsets[i] <= t:
            try:
                sched.submit(pending[i])
            except RequestError as e:
                result.refused.append((pending[i], e))
                if bar:
                    bar.update(1)
            i += 1
        if sched.has_active():
            done = sched.tick()
            ticks += 1
            if done:
                result.finished.extend(done)
                if may_fail:
                    result.failed.extend(r for r, why in sched.last_finished if why == "error")
                if bar:
                    bar.update(len(done))
            if max_ticks is not None and ticks > max_ticks:
                raise RuntimeError(f"run did not finish within {max_ticks} ticks")
        elif i < len(pending):
            if clock:
                clock.advance_to(t0 + offsets[i])
            else:
                time.sleep(max(0.0, t0 + offsets[i] - now()))
    if bar:
        bar.close()
    result.wall_s = time.perf_counter() - wall0
    result.sim_s = now() - t0
    result.busy_s = sim.busy_s
    return result


def _spread(m: dict, key: str, scale: float) -> str:
    """``mean / p50 / p90 / p95 / p99`` of ``key`` (``metrics.PERCENTILES``), times ``scale``."""
    vals = [m[f"{key}_mean_s"]] + [m[f"{key}_p{q}_s"] for q in metrics.PERCENTILES]
    return " / ".join(f"{v * scale:.{1 if scale > 1 else 3}f}" for v in vals)


def _slo_text(slo: goodput.SLO) -> str:
    return ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slo.as_ms().items()) or "no SLO"


#: The label column's width: ``tests/test_model_backend.py`` reads the table's rows as they are.
_LABEL_WIDTH = 33


def format_metrics(m: dict, result: RunResult | None = None, *, slo: goodput.SLO | None = None,
                   good: int | None = None) -> str:
    """A plain two-column table of the headline metrics (seconds shown in ms where small).

    With ``slo`` and ``good`` (completed requests meeting it: ``goodput.good_requests``), a
    goodput row. ``gpu_utilization`` is the contract's fraction of ticks whose batch was
    non-empty; ``gpu_busy_fraction`` (with a ``result`` whose simulated GPU did the work) is
    the time spent in ``forward`` over the duration (first submit to last completion).
    """
    rows = [
        ("requests finished", f"{m['requests_finished']}"),
        ("requests refused", f"{m['refusals']}" + (f"  {m['refusals_by_reason']}" if m["refusals"] else "")),
        ("output tokens", f"{m['output_tokens']}"),
        ("throughput (output tok/s)", f"{m['throughput_tokens_per_sec']:.1f}"),
        ("request throughput (req/s)", f"{m['request_throughput']:.2f}"),
    ]
    if slo is not None and good is not None:
        d = m["duration_s"]
        rows.append(("goodput (req/s meeting the SLOs)",
                     f"{good / d if d > 0 else 0.0:.2f}  ({good} of {m['requests_finished']} requests: "
                     f"{_slo_text(slo)})"))
    rows += [
        ("e2e mean / p50 / p90 / p95 / p99", _spread(m, "e2e", 1.0) + " s"),
        ("TTFT mean / p50 / p90 / p95 / p99", _spread(m, "ttft", 1e3) + " ms"),
        ("TPOT mean / p50 / p90 / p95 / p99", _spread(m, "tpot", 1e3) + " ms"),
        ("ITL mean / p50 / p90 / p95 / p99", _spread(m, "itl", 1e3) + " ms"),
        ("queue time p50 / p99", f"{m['queue_p50_s']*1e3:.1f} / {m['queue_p99_s']*1e3:.1f} ms"),
        ("gpu_utilization (non-empty ticks)",
         f"{m['gpu_utilization']:.3f}  (the contract's: fraction of ticks whose batch was non-empty)"),
    ]
    busy = result.gpu_busy_fraction(m["duration_s"]) if result is not None else None
    if busy is not None:
        rows.append(("gpu_busy_fraction", f"{busy:.3f}  (time in forward / duration, first submit to last "
                                          "completion)"))
    rows += [
        ("avg batch (requests / tokens)", f"{m['avg_batch_requests']:.1f} / {m['avg_batch_tokens']:.1f}"),
        ("KV utilization (avg of cap)", f"{m['kv_utilization']:.3f}"),
        ("preemptions", f"{m['preemptions']}"),
        *([("prefix cache hit rate", f"{m['prefix_cache_hit_rate'] * 100:.1f}%  ({m['prefix_cache_hits']} of "
                                     f"{m['prefix_cache_queries']} tokens looked up at admission)")]
          if "prefix_cache_queries" in m else []),
        ("finish reasons", f"{m['finish_reasons']}"),
        *([("Jain index (output tokens/user)", f"{goodput.jain_index_of(result.finished):.3f}")]
          if result is not None else []),
        ("ticks", f"{m['ticks']}"),
    ]
    if result is not None:
        rows.append(("clock seconds / wall seconds", f"{result.sim_s:.2f} / {result.wall_s:.2f}"))
    assert max(len(k) for k, _ in rows) <= _LABEL_WIDTH
    return "\n".join(f"{k:<{_LABEL_WIDTH}}  {v}" for k, v in rows)


def json_metrics(m: dict, result: RunResult, *, slo: goodput.SLO, good: int, **context: object) -> dict:
    """What ``--json`` prints: ``context`` (policy, backend, clock, workload), then vLLM
    ``benchmark_serving``'s keys (``goodput.benchmark_metrics``), the goodput's SLOs and
    count, Batch's own figures (the prefix cache's ``prefix_cache_queries`` / ``_hits`` /
    ``_hit_rate``, tokens, 0 with prefix caching off), and the whole ``Scheduler.metrics()`` under
    ``scheduler_metrics``."""
    return {
        **context,
        **goodput.benchmark_metrics(m, good_completed=good),
        "goodput_slo_ms": slo.as_ms(),
        "good_completed": good,
        "refused": m["refusals"],
        "preemptions": m["preemptions"],
        # prefix caching (Scheduler(prefix_caching=True)): vLLM's counters, tokens; 0 with it off
        "prefix_caching": bool(getattr(getattr(result.scheduler, "config", None), "prefix_caching", False)),
        "prefix_cache_queries": m.get("prefix_cache_queries", 0),
        "prefix_cache_hits": m.get("prefix_cache_hits", 0),
        "prefix_cache_hit_rate": m.get("prefix_cache_hit_rate", 0.0),
        "gpu_utilization": m["gpu_utilization"],  # the contract's: fraction of ticks whose batch was non-empty
        "gpu_busy_fraction": result.gpu_busy_fraction(m["duration_s"]),  # time in forward / duration
        "jain_index_output_tokens": goodput.jain_index_of(result.finished),
        "clock_s": result.sim_s,
        "wall_s": result.wall_s,
        "scheduler_metrics": m,
    }
