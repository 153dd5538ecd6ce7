#!/usr/bin/env python3
"""Batch beside vLLM's own V1 scheduler, on one simulated clock and the same requests (issues 16, 41).

Both schedulers are driven by the same loop on a simulated clock: at each step boundary the
requests whose arrival has come are handed to the scheduler, the scheduler picks a batch, and
the clock advances by the iteration's cost. Every request's output ends with EOS exactly at its
recorded length. Two clocks (``--gpu``, comma-separated; ``make bench-vllm`` runs both):

* ``stub``: the seed's latency model, 5 ms + 1 ms per scheduled request (a request in a prefill
  chunk counts as one); the KV cache is 256 blocks of 16 tokens on both sides, and both get
  Batch's defaults as limits: 256 resident requests (vLLM ``max_num_seqs``), a token budget of
  4,096 (vLLM ``max_num_batched_tokens``).
* a GPU profile (``h100-llama3-8b``, ``batch.sim.gpu_profile``): the iteration costs what its
  prefill tokens, decode sequences and KV reads cost on that deployment (Batch through
  ``SimulatedGPU(profile=...)``'s ``execute_model``; vLLM from its ``SchedulerOutput``: tokens
  scheduled and tokens already computed per request, ``vllm_items``), and both sides get vLLM's
  limits for that GPU (28,094 blocks, 8,192 batched tokens, 1,024 sequences). Each anchor trace
  is time-scaled to ``--load`` (default 0.9) of the GPU's capacity on it (``capacity``: the
  steady-state completion rate of a saturation run), and run at vLLM's default chunking (no
  ``long_prefill_token_threshold``; Batch's chunk = the token budget) and at the 64-token rule
  (threshold 64; Batch's chunk 64). ``--load-sweep`` adds the latency-throughput curve on
  ``trace2k.csv`` (0.3 to 1.1 of capacity; TTFT p50 / p99 and TPOT p99 against the request rate
  for Batch, Batch-FCFS, vLLM and vLLM + Batch's ``FairScheduler``) and its plot (``--plot``).

* Batch: ``scheduler.Scheduler()`` as it ships, its backend ``inference_stub.SimulatedGPU`` on
  a ``VirtualClock`` (no early EOS), replayed by ``simulate.run_workload``.
* vLLM: ``vllm.v1.core.sched.scheduler.Scheduler`` with ``long_prefill_token_threshold=64``
  (every prefill chunk at most 64 tokens, Batch's chunk) on the stub clock, the clock's limits,
  prefix caching off, on the CPU device, for a tiny Llama config
  written to a temporary directory (no weights, no hub, no tokenizer). The fake model runner
  returns one token per request whose prefill is complete after this step, none for a
  request in the middle of a (re)prefill, as vLLM's model runner does.
* vLLM+Batch: the same vLLM set-up with ``batch.integrations.vllm.FairScheduler`` (vLLM's
  ``Scheduler`` subclassed: Batch's ``VTCPolicy()`` orders admission, charges users, picks
  victims, isolates light users' first prefills; ``docs/vllm-plugin.md``), with ``--fair-vllm``
  (``make bench-vllm`` passes it).
* vLLM async and vLLM+Batch async, with ``--async-vllm``: vLLM's ``AsyncScheduler`` (async
  scheduling, vLLM's default) and ``batch.integrations.vllm.AsyncFairScheduler``, driven as
  vLLM's engine core drives them: the next step is scheduled while the last one runs, its
  requests' decodes on placeholders, and each output is processed when its step ends.

Metrics come from per-request timestamps this harness records, with one definition for both
(nothing is read from either scheduler's own statistics but the preemption count):

* TTFT = first token - nominal arrival; e2e = completion - nominal arrival;
  TPOT = (completion - first token) / (output tokens - 1), requests with >= 2 tokens;
  percentiles by linear interpolation (numpy's default);
* output throughput = output tokens / (last completion - first arrival);
* scheduler CPU per step = the thread's CPU time in the scheduler's own code per step
  (Batch: ``tick()`` less the backend call; vLLM: ``schedule()`` + ``update_from_output()``),
  the fake forward excluded.

Issue 38's measures, on each clock (and each chunking of a GPU clock):

* every anchor's **equal-demand variant** beside it, ``NAME (equal demand)``: the same rows with
  ``user = eq{i mod 5}`` by row index, so that the users' demand is about equal by construction
  (``--no-equal-demand`` leaves them out). vLLM's own scheduler is FCFS and never reads the user,
  so its run of the anchor is reused for the variant, users relabelled (the output says so);
* a **per-user table**: per trace, mean TTFT and TTFT p99 over all requests, then each user's TTFT
  p99 under each scheduler, ``*`` marking the users at or below the mean demand (a user's demand:
  its prompt + output tokens in the trace);
* an **acceptance summary**, Batch against vLLM, one row per anchor, each cell a computed ratio
  and whether it meets the issue's bound: output tok/s >= vLLM's, mean TTFT <= vLLM's, TTFT p99 of
  every user at or below the mean demand <= vLLM's (the largest ratio shown), preemptions <=
  vLLM's, and on the equal-demand variant TTFT p99 <= 1.03x vLLM's.

On the A/B trace (user ``B`` a light user beside a heavy ``A``) it also prints B's median
TTFT with A present over B's median TTFT with the same B requests alone, in three timings:
``at once`` (every request submitted at time 0, TTFT from then), ``from submit`` (each request
submitted at the first step boundary at or after its arrival, TTFT from that submit time) and
``from arrival`` (the same run, TTFT from the nominal arrival: it includes the wait for the
iteration already running when the request arrives).

Usage, from the repository root::

    make bench-vllm                                         # installs .venv-vllm once, then both clocks and the sweep
    .venv-vllm/bin/python bench/vllm_compare.py [--traces DIR] [--only NAME,...]
    .venv-vllm/bin/python bench/vllm_compare.py --gpu h100-llama3-8b --fcfs --fair-vllm --load-sweep
    python bench/vllm_compare.py --batch-only               # no vllm needed: Batch's side only

Traces: CSV files ``arrival_s,prompt_tokens,output_tokens,user`` in ``--traces DIR``, else the
``anchors/`` folder of the traces folder (``$BATCH_TRACES_DIR``, else ``data/traces`` in the
checkout; ``batch.sim.traces``), else ``$BATCH_TRACES_DIR`` itself when it has no ``anchors/``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from batch.sim import simulate, traces
from inference_stub import Request
from scheduler import Scheduler

ROOT = Path(__file__).resolve().parent.parent

#: The stub's simulated GPU, the same for both schedulers.
BASE_S = 0.005
PER_REQUEST_S = 0.001
KV_BLOCKS = 256
BLOCK_TOKENS = 16
CHUNK_TOKENS = 64
#: The limits both schedulers get on the stub's clock: Batch's defaults (``Scheduler()``: 256
#: resident requests, a token budget of the whole cache), vLLM's ``max_num_seqs`` and
#: ``max_num_batched_tokens`` set to the same.
VLLM_MAX_BATCHED_TOKENS = KV_BLOCKS * BLOCK_TOKENS
VLLM_MAX_SEQS = 256
VLLM_MAX_MODEL_LEN = KV_BLOCKS * BLOCK_TOKENS
VLLM_EOS = 2
VLLM_TOKEN = 7  # any non-EOS token

AB_TRACE = "ab_100A_5B_1s_seed0.csv"
AB_LIGHT_USER = "B"
TRACES_ENV = traces.TRACES_ENV
#: The anchor traces in the order the table prints them (any other CSV in the folder follows).
ORDER = ("poisson_n300_r30_seed0.csv", "trace200_poisson20_seed0.csv", "trace2k.csv", AB_TRACE)

_cpu = time.thread_time  # CPU seconds of this thread: other processes' load does not count


# ----------------------------------------------------------------------------- the clock

@dataclass(frozen=True)
class Clock:
    """The simulated GPU of a comparison and the limits both schedulers get.

    Attributes:
        name: ``"stub"`` (5 ms + 1 ms per scheduled request an iteration) or a
            ``batch.sim.gpu_profile`` profile name (its step cost prices what each iteration computes).
        kv_blocks, block_tokens: the KV cache (Batch ``kv_cap_blocks``; vLLM ``num_gpu_blocks``).
        max_num_batched_tokens: tokens an iteration (Batch ``token_budget_tokens``).
        max_num_seqs: most resident requests (Batch ``max_running``).
        max_model_len: vLLM's longest sequence; a request longer than it (or than the cache) is
            left out on both sides.
        profile: the ``GPUProfile`` (None for the stub).
    """

    name: str
    kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_tokens: int = BLOCK_TOKENS
    profile: object = None

    @property
    def gpu(self) -> str | None:
        """The profile name for ``simulate.run_workload(gpu=...)``; None for the stub."""
        return None if self.profile is None else self.name

    def step_s(self, items: Sequence[tuple[int, int]]) -> float:
        """Seconds of one iteration computing ``items`` (``(num_new_tokens, num_computed_tokens)``
        per scheduled request); 0 for none."""
        if not items:
            return 0.0
        if self.profile is None:
            return BASE_S + PER_REQUEST_S * len(items)
        return self.profile.step_time_s(items)

    def batch_kwargs(self) -> dict[str, int]:
        """The limits as ``scheduler.Scheduler`` keyword arguments."""
        return {"kv_cap_blocks": self.kv_blocks, "block_tokens": self.block_tokens,
                "token_budget_tokens": self.max_num_batched_tokens, "max_running": self.max_num_seqs}

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Both sides can serve it: prompt + output within ``max_model_len`` and within the cache."""
        n = prompt_tokens + output_tokens
        return n <= self.max_model_len and n <= self.kv_blocks * self.block_tokens

    def describe(self) -> str:
        what = ("the stub: 5 ms + 1 ms per scheduled request an iteration" if self.profile is None
                else self.profile.describe())
        return (f"{what}; both sides: KV {self.kv_blocks:,} blocks x {self.block_tokens} tokens, "
                f"max_num_batched_tokens = Batch token_budget_tokens = {self.max_num_batched_tokens}, "
                f"max_num_seqs = Batch max_running = {self.max_num_seqs}, max_model_len {self.max_model_len:,}")


#: The stub's clock and limits (the comparisons before issue 41 ran on it).
STUB = Clock("stub", KV_BLOCKS, VLLM_MAX_BATCHED_TOKENS, VLLM_MAX_SEQS, VLLM_MAX_MODEL_LEN)


def clock_for(name: str) -> Clock:
    """``STUB`` for ``"stub"``, else the clock of ``batch.sim.gpu_profile.get(name)`` with its limits.

    Raises:
        gpu_profile.UnknownProfileError: no such profile (a ``ValueError``).
    """
    if name == "stub":
        return STUB
    from batch.sim import gpu_profile

    prof = gpu_profile.get(name)
    lim = prof.limits
    return Clock(name, lim.num_gpu_blocks, lim.max_num_batched_tokens, lim.max_num_seqs, lim.max_model_len,
                 lim.block_tokens, prof)


def count_step(counts: dict[str, int], out) -> None:
    """Add one non-empty vLLM step's tokens and requests to ``counts`` (``Run``'s step counts)."""
    counts["busy_steps"] += 1
    counts["scheduled_tokens"] += out.total_num_scheduled_tokens
    counts["scheduled_seqs"] += len(out.num_scheduled_tokens)


def vllm_items(sched, out) -> list[tuple[int, int]]:
    """``(num_new_tokens, num_computed_tokens)`` per request vLLM's ``schedule()`` scheduled: the
    tokens scheduled and the tokens computed before them (vLLM advances ``num_computed_tokens`` in
    ``schedule()`` itself, so it is subtracted back; prefix-cache hits count as computed)."""
    return [(n, sched.requests[rid].num_computed_tokens - n) for rid, n in out.num_scheduled_tokens.items()]


# ----------------------------------------------------------------------------- workload

@dataclass(frozen=True)
class TraceRequest:
    """One trace row: what both schedulers are given."""

    rid: str
    user: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def traces_dir(arg: str | os.PathLike | None = None) -> Path:
    """The anchor traces' folder: ``arg`` if given, else ``anchors/`` in the traces folder
    (``batch.sim.traces.traces_dir()``: ``$BATCH_TRACES_DIR``, else ``data/traces`` in the checkout);
    a ``$BATCH_TRACES_DIR`` with no ``anchors/`` inside is taken as the anchors' folder."""
    if arg:
        return Path(arg)
    base = traces.traces_dir()
    anchors = base / traces.ANCHORS
    return anchors if anchors.is_dir() or not os.environ.get(TRACES_ENV) else base


def load_requests(path: str | os.PathLike) -> list[TraceRequest]:
    """The rows of a trace CSV, read by ``batch.sim.traces.load_trace`` (its ``user`` column kept)."""
    return [TraceRequest(r.request_id, r.user_id, float(r.submitted_at), len(r.prompt), r.max_tokens)
            for r in traces.load_trace(path)]


def ab_trace(seed: int) -> list[TraceRequest]:
    """The A/B burst of ``bench/cold_fairness.py`` for ``seed`` (same draws, same order): 100
    requests of user A and 5 of user B, prompts 5..199 tokens, outputs 10..99, arrivals uniform
    in one second, from ``random.Random(1000 + seed)``; sorted by arrival."""
    rnd = random.Random(1000 + seed)
    rows = []
    for user, n in (("A", 100), ("B", 5)):
        for i in range(n):
            prompt = rnd.randint(5, 199)
            for _ in range(prompt):
                rnd.randint(1, 63)  # the prompt's ids: drawn to keep the sequence; the simulator ignores them
            rows.append((f"{user}{i}", user, prompt, rnd.randint(10, 99)))
    arrivals = [rnd.uniform(0.0, 1.0) for _ in rows]
    return sorted((TraceRequest(rid, user, at, p, m) for (rid, user, p, m), at in zip(rows, arrivals)),
                  key=lambda r: r.arrival_s)


def without_user(reqs: Sequence[TraceRequest], user: str) -> list[TraceRequest]:
    """The same requests (same ids and arrivals) with ``user``'s removed."""
    return [r for r in reqs if r.user != user]


# ----------------------------------------------------------------------------- results

@dataclass
class Timing:
    """Per-request timestamps on the simulated clock, seconds."""

    rid: str
    user: str
    arrival_s: float  # nominal arrival (0 for every request when all are submitted at once)
    submit_s: float  # when the driver handed it to the scheduler
    first_s: float  # end of the step that produced its first output token
    done_s: float  # end of the step that produced its last (EOS) token
    output_tokens: int


@dataclass
class Run:
    """One replay: every request's timings and the scheduler's counters."""

    name: str
    timings: list[Timing]
    preemptions: int = 0
    steps: int = 0
    sched_cpu_s: float = 0.0
    wall_s: float = 0.0
    scheduled_tokens: int = 0  # tokens computed over every non-empty step (prefill chunks and decodes)
    scheduled_seqs: int = 0  # requests scheduled, summed over the non-empty steps
    busy_steps: int = 0  # steps that scheduled something

    def per_step(self) -> tuple[float, float]:
        """Mean tokens and mean requests of a non-empty step."""
        n = self.busy_steps
        return (self.scheduled_tokens / n, self.scheduled_seqs / n) if n else (math.nan, math.nan)


def batch_counts(metrics: dict) -> dict[str, int]:
    """``Run``'s step counts from ``Scheduler.metrics()``: its non-empty-tick averages times their number."""
    busy = round(metrics["gpu_utilization"] * metrics["ticks"])
    return {"busy_steps": busy, "scheduled_tokens": round(metrics["avg_batch_tokens"] * busy),
            "scheduled_seqs": round(metrics["avg_batch_requests"] * busy)}


@dataclass
class Summary:
    """The table's figures for one run (seconds unless named otherwise)."""

    requests: int
    output_tokens: int
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    preemptions: int
    cpu_us_per_step: float
    steps: int
    ttft_mean_s: float = math.nan
    request_rate: float = math.nan  # requests / (last completion - first arrival)


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks; nan if empty."""
    if not xs:
        return math.nan
    a = sorted(xs)
    pos = (len(a) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(a) - 1)
    return a[lo] + (a[hi] - a[lo]) * (pos - lo)


def summarize(run: Run) -> Summary:
    """The metrics of ``run`` from its timestamps (see the module docstring for the definitions)."""
    ts = run.timings
    ttft = [t.first_s - t.arrival_s for t in ts]
    e2e = [t.done_s - t.arrival_s for t in ts]
    tpot = [(t.done_s - t.first_s) / (t.output_tokens - 1) for t in ts if t.output_tokens >= 2]
    tokens = sum(t.output_tokens for t in ts)
    span = max(t.done_s for t in ts) - min(t.arrival_s for t in ts) if ts else 0.0
    return Summary(
        requests=len(ts), output_tokens=tokens, throughput_tok_s=tokens / span if span > 0 else math.nan,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
        preemptions=run.preemptions, steps=run.steps,
        cpu_us_per_step=run.sched_cpu_s / run.steps * 1e6 if run.steps else math.nan,
        ttft_mean_s=statistics.fmean(ttft) if ttft else math.nan,
        request_rate=len(ts) / span if span > 0 else math.nan)


def _check_complete(name: str, reqs: Sequence[TraceRequest], timings: list[Timing]) -> None:
    """Every request finished with exactly its recorded output length, or RuntimeError."""
    want = {r.rid: r.output_tokens for r in reqs}
    got = {t.rid: t.output_tokens for t in timings}
    if got != want:
        bad = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
        raise RuntimeError(f"{name}: {len(bad)} requests did not finish at their output length, e.g. {bad[:5]}")


# ----------------------------------------------------------------------------- Batch

class _PagedBackend:
    """A paged backend (``execute_model(items)``, ``batch.core.backend_api``) around a function."""

    def __init__(self, execute_model: Callable) -> None:
        self.execute_model = execute_model


class _MeteredBatch:
    """A ``make_scheduler`` for ``simulate.run_workload`` that counts Batch's own CPU time per
    tick: the whole ``tick()`` less the time inside the backend (the simulated GPU)."""

    def __init__(self, factory: Callable[..., Scheduler]) -> None:
        self.factory = factory
        self.scheduler: Scheduler | None = None
        self.steps = 0
        self.tick_cpu_s = 0.0
        self.forward_cpu_s = 0.0

    def __call__(self, *, clock: Callable[[], float], backend: Callable, **kw) -> Scheduler:
        inner = getattr(backend, "execute_model", None) or backend  # a profiled GPU is a paged backend

        def metered_backend(batch):
            t = _cpu()
            try:
                return inner(batch)
            finally:
                self.forward_cpu_s += _cpu() - t

        if getattr(backend, "execute_model", None) is not None:
            metered_backend = _PagedBackend(metered_backend)
        sched = self.factory(clock=clock, backend=metered_backend, **kw)
        tick = sched.tick

        def metered_tick():
            t = _cpu()
            try:
                return tick()
            finally:
                self.tick_cpu_s += _cpu() - t
                self.steps += 1

        sched.tick = metered_tick  # run_workload calls the instance's tick
        self.scheduler = sched
        return sched


def run_batch(reqs: Sequence[TraceRequest], *, at_once: bool = False,
              factory: Callable[..., Scheduler] = Scheduler, name: str = "Batch", clock: Clock = STUB,
              chunk_tokens: int = CHUNK_TOKENS) -> Run:
    """Replay ``reqs`` through Batch on the simulated clock.

    Args:
        reqs: the workload.
        at_once: submit every request at time 0 (its nominal arrival is then taken as 0 too).
        factory: builds the scheduler from keyword arguments (``Scheduler``: as it ships).
        name: the run's label.
        clock: the simulated GPU and the limits (``STUB``, or ``clock_for(profile)``).
        chunk_tokens: Batch's ``prefill_chunk_tokens`` (64, the problem's rule; the token budget
            for vLLM's default chunking).

    Raises:
        RuntimeError: a request did not finish with exactly its output length (or was refused).
    """
    objs = [Request(user_id=r.user, prompt=[1] * r.prompt_tokens, max_tokens=r.output_tokens, request_id=r.rid,
                    submitted_at=0.0 if at_once else r.arrival_s) for r in reqs]
    nominal = {r.rid: 0.0 if at_once else r.arrival_s for r in reqs}
    meter = _MeteredBatch(factory)
    wall = time.perf_counter()
    res = simulate.run_workload(objs, make_scheduler=meter, virtual=True, gpu_seed=None, base_s=BASE_S,
                                per_request_s=PER_REQUEST_S, eos_probability=0.0, gpu=clock.gpu,
                                prefill_chunk_tokens=chunk_tokens, **clock.batch_kwargs())
    wall = time.perf_counter() - wall
    timings = [Timing(r.request_id, r.user_id, nominal[r.request_id], r.submitted_at, r.started_at, r.completed_at,
                      len(r.generated)) for r in res.finished]
    _check_complete(name, reqs, timings)
    m = res.scheduler.metrics()
    return Run(name, timings, preemptions=m["preemptions"], steps=meter.steps,
               sched_cpu_s=meter.tick_cpu_s - meter.forward_cpu_s, wall_s=wall, **batch_counts(m))


# ----------------------------------------------------------------------------- vLLM

class VLLMUnavailable(RuntimeError):
    """vllm cannot be imported here (``make bench-vllm`` installs it into .venv-vllm)."""


_VLLM_CACHE: dict[str, object] = {}


def _vllm():
    """vLLM's modules, imported on first use (never at module import: the Batch side needs none)."""
    if "mods" not in _VLLM_CACHE:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:  # F401: each name is read through locals() below
            import torch  # noqa: F401
            from transformers import LlamaConfig  # noqa: F401
            from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: F401
            from vllm.sampling_params import SamplingParams  # noqa: F401
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VAsyncScheduler  # noqa: F401
            from vllm.v1.core.sched.scheduler import Scheduler as VScheduler  # noqa: F401
            from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: F401
            from vllm.v1.outputs import ModelRunnerOutput  # noqa: F401
            from vllm.v1.request import Request as VRequest  # noqa: F401
            from vllm.v1.structured_output import StructuredOutputManager  # noqa: F401
        except ImportError as e:
            raise VLLMUnavailable(f"vllm is not importable here ({e}); `make bench-vllm` installs it "
                                  f"into .venv-vllm, or pass --batch-only") from e
        _VLLM_CACHE["mods"] = argparse.Namespace(**{k: v for k, v in locals().items() if k != "e"})
    return _VLLM_CACHE["mods"]


def _vllm_config(threshold: int, clock: Clock = STUB, prefix_caching: bool = False, async_scheduling: bool = False):
    """A ``VllmConfig`` for a tiny Llama (config.json only, in a temp dir kept for the process) with
    ``clock``'s limits (``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, block size) and
    vLLM's async scheduling on or off (``--no-async-scheduling``)."""
    key = (f"config/{threshold}/{clock.name}/{clock.max_num_batched_tokens}/{clock.max_num_seqs}/{prefix_caching}/"
           f"{async_scheduling}")
    if key in _VLLM_CACHE:
        return _VLLM_CACHE[key]
    v = _vllm()
    dkey = f"model_dir/{clock.max_model_len}"
    if dkey not in _VLLM_CACHE:
        d = tempfile.mkdtemp(prefix="vllm-compare-llama-")
        v.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=clock.max_model_len,
                      bos_token_id=1, eos_token_id=VLLM_EOS).save_pretrained(d)
        _VLLM_CACHE[dkey] = d
    model = v.ModelConfig(model=_VLLM_CACHE[dkey], skip_tokenizer_init=True, dtype="float32", seed=0,
                          max_model_len=clock.max_model_len)
    sched = v.SchedulerConfig(max_model_len=clock.max_model_len, is_encoder_decoder=False,
                              max_num_batched_tokens=clock.max_num_batched_tokens, max_num_seqs=clock.max_num_seqs,
                              long_prefill_token_threshold=threshold, enable_chunked_prefill=True,
                              async_scheduling=async_scheduling)
    cache = v.CacheConfig(block_size=clock.block_tokens, enable_prefix_caching=prefix_caching)
    cfg = v.VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                       device_config=v.DeviceConfig(device="cpu"))
    _VLLM_CACHE[key] = cfg
    return cfg


def make_vllm_scheduler(threshold: int = CHUNK_TOKENS, cls=None, clock: Clock = STUB, prefix_caching: bool = False,
                        log_stats: bool = False, **kwargs):
    """vLLM's V1 ``Scheduler`` (or its subclass ``cls``, given ``kwargs`` besides vLLM's) with
    ``clock``'s cache (one full-attention group of ``kv_blocks`` blocks) and limits; async scheduling
    on when ``cls`` is an ``AsyncScheduler``, off otherwise."""
    v = _vllm()
    cls = cls or v.VScheduler
    cfg = _vllm_config(threshold, clock, prefix_caching, issubclass(cls, v.VAsyncScheduler))
    cfg.cache_config.num_gpu_blocks = clock.kv_blocks
    kv = v.KVCacheConfig(num_blocks=clock.kv_blocks, kv_cache_tensors=[], kv_cache_groups=[
        v.KVCacheGroupSpec(["layer.0"], v.FullAttentionSpec(block_size=clock.block_tokens, num_kv_heads=2,
                                                            head_size=32, dtype=v.torch.float32))])
    return cls(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=v.StructuredOutputManager(cfg),
               block_size=clock.block_tokens, log_stats=log_stats, **kwargs)


def make_fair_scheduler(threshold: int = CHUNK_TOKENS, policy=None, clock: Clock = STUB, **kwargs):
    """vLLM's V1 ``Scheduler`` with Batch's fairness: ``batch.integrations.vllm.FairScheduler``
    (``policy``: its ``fair_policy``, default ``VTCPolicy()``), set up as ``make_vllm_scheduler``."""
    from batch.integrations.vllm import FairScheduler
    from batch.policies.vtc import VTCPolicy
    return make_vllm_scheduler(threshold, FairScheduler, clock=clock,
                               fair_policy=policy if policy is not None else VTCPolicy(), **kwargs)


def make_async_vllm_scheduler(threshold: int = CHUNK_TOKENS, clock: Clock = STUB):
    """vLLM's ``AsyncScheduler`` (async scheduling, vLLM's default), set up as ``make_vllm_scheduler``."""
    return make_vllm_scheduler(threshold, _vllm().VAsyncScheduler, clock=clock)


def make_async_fair_scheduler(threshold: int = CHUNK_TOKENS, policy=None, clock: Clock = STUB):
    """vLLM's ``AsyncScheduler`` with Batch's fairness: ``batch.integrations.vllm.AsyncFairScheduler``
    (``policy``: its ``fair_policy``, default ``VTCPolicy()``), set up as ``make_vllm_scheduler``."""
    from batch.integrations.vllm import AsyncFairScheduler
    from batch.policies.vtc import VTCPolicy
    return make_vllm_scheduler(threshold, AsyncFairScheduler, clock=clock,
                               fair_policy=policy if policy is not None else VTCPolicy())


def fake_forward(sched, out, token_at: Callable[[object], int]) -> list[list[int]]:
    """The fake model runner's sampled tokens for ``out``, decided when ``out`` is scheduled (the
    step it runs): one token for each request whose (re)prefill this step completes, none in the
    middle of one, as vLLM's model runner does (``Request.is_prefill_chunk`` after ``schedule()``;
    under async scheduling a decode scheduled on a placeholder samples too). ``token_at(request)``
    is the token to sample."""
    reqs = sched.requests
    return [[] if reqs[rid].is_prefill_chunk else [token_at(reqs[rid])] for rid in out.num_scheduled_tokens]


def run_vllm(reqs: Sequence[TraceRequest], *, at_once: bool = False, threshold: int = CHUNK_TOKENS,
             name: str = "vLLM", make: Callable[..., object] | None = None, clock: Clock = STUB,
             on_schedule: Callable[[object], None] | None = None) -> Run:
    """Replay ``reqs`` through vLLM's V1 scheduler on the simulated clock (same loop as Batch's);
    ``make(threshold)`` builds the scheduler (``make(threshold, clock=clock)`` on a clock other than
    ``STUB``; default ``make_vllm_scheduler``). Each
    request's user travels in ``sampling_params.extra_args["user"]`` (vLLM's own scheduler ignores it).
    An iteration costs ``clock.step_s`` of what vLLM scheduled (``vllm_items``).

    The loop is vLLM's engine core's: up to ``vllm_config.max_concurrent_batches`` steps in flight
    (1 for the synchronous ``Scheduler``: ``EngineCore.step``; 2 with async scheduling:
    ``step_with_batch_queue``, which schedules the next step before the last one's output is
    processed). A step runs on the simulated GPU from the later of its scheduling and the end of
    the step before it; its output is processed (``update_from_output``) at its end. Arrivals are
    handed to the scheduler when ``schedule()`` is called. The fake forward samples the EOS token
    at the request's recorded output length (by the sampled token's position), and timings come
    from the outputs vLLM delivers. ``on_schedule(scheduler_output)`` sees every step.

    Raises:
        VLLMUnavailable: vllm cannot be imported.
        RuntimeError: a request did not finish with exactly its output length.
    """
    v = _vllm()
    if make is None:
        sched = make_vllm_scheduler(threshold, clock=clock)
    else:  # a caller's factory takes the clock only off the stub (the plugin tests' take the threshold alone)
        sched = make(threshold) if clock is STUB else make(threshold, clock=clock)
    depth = sched.vllm_config.max_concurrent_batches
    pending = sorted(reqs, key=lambda r: 0.0 if at_once else r.arrival_s)
    nominal = {r.rid: 0.0 if at_once else r.arrival_s for r in reqs}
    out_len = {r.rid: r.output_tokens for r in reqs}
    meta = {r.rid: r for r in reqs}
    submit: dict[str, float] = {}
    first: dict[str, float] = {}
    produced: dict[str, int] = {}
    vreqs = []
    timings: list[Timing] = []
    inflight: deque = deque()  # (scheduler output, model runner output, end of its step on the GPU)
    now, gpu_free, i, steps, cpu = 0.0, 0.0, 0, 0, 0.0
    counts = {"busy_steps": 0, "scheduled_tokens": 0, "scheduled_seqs": 0}

    def token_at(vr) -> int:  # the sampled token's 1-based output index from its position
        return VLLM_EOS if vr.num_computed_tokens - vr.num_prompt_tokens + 1 >= out_len[vr.request_id] else VLLM_TOKEN

    wall = time.perf_counter()
    while i < len(pending) or sched.has_unfinished_requests() or inflight:
        while i < len(pending) and nominal[pending[i].rid] <= now:
            r = pending[i]
            sp = v.SamplingParams(max_tokens=r.output_tokens, ignore_eos=False, extra_args={"user": r.user})
            sp.update_from_generation_config({}, eos_token_id=VLLM_EOS)
            vr = v.VRequest(request_id=r.rid, prompt_token_ids=[1] * r.prompt_tokens, sampling_params=sp,
                            pooling_params=None, arrival_time=nominal[r.rid])
            vreqs.append(vr)
            sched.add_request(vr)  # not counted: Batch's submit is not either
            submit[r.rid] = now
            i += 1
        if sched.has_unfinished_requests():
            t = _cpu()
            out = sched.schedule()
            cpu += _cpu() - t
            steps += 1
            if on_schedule is not None:
                on_schedule(out)
            ids = list(out.num_scheduled_tokens)
            mro = v.ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                                      sampled_token_ids=fake_forward(sched, out, token_at))
            if ids:
                gpu_free = max(now, gpu_free) + clock.step_s(vllm_items(sched, out))
                count_step(counts, out)
            inflight.append((out, mro, gpu_free if ids else now))
            if ids and len(inflight) < depth:
                continue  # the engine schedules the next step before waiting on this one
        elif not inflight:
            now = max(now, nominal[pending[i].rid])  # idle: skip to the next arrival
            continue
        out, mro, end = inflight.popleft()
        now = max(now, end)
        t = _cpu()
        delivered = sched.update_from_output(out, mro)
        cpu += _cpu() - t
        for eco in delivered.values():
            for o in eco.outputs:
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finish_reason is not None:
                    m = meta[o.request_id]
                    timings.append(Timing(o.request_id, m.user, nominal[o.request_id], submit[o.request_id],
                                          first[o.request_id], now, produced[o.request_id]))
        if not out.num_scheduled_tokens and not inflight and sched.has_unfinished_requests():
            if i >= len(pending):  # nothing runnable, nothing in flight, nothing left to arrive
                raise RuntimeError(f"{name}: vLLM scheduled nothing with {sched.get_num_unfinished_requests()} "
                                   f"requests unfinished and none left to arrive")
            now = max(now, nominal[pending[i].rid])  # nothing runnable yet: wait for the next arrival
    wall = time.perf_counter() - wall
    _check_complete(name, reqs, timings)
    left = [vr.request_id for vr in vreqs if not vr.is_finished()]
    if left:
        raise RuntimeError(f"{name}: vLLM still holds {len(left)} requests, e.g. {left[:5]}")
    return Run(name, timings, preemptions=sum(vr.num_preemptions for vr in vreqs), steps=steps, sched_cpu_s=cpu,
               wall_s=wall, **counts)


# ----------------------------------------------------------------------------- A/B

@dataclass
class ABResult:
    """B's median TTFT with A and alone, per timing: ``{timing: (with_a_s, alone_s)}``."""

    name: str
    medians: dict[str, tuple[float, float]] = field(default_factory=dict)

    def ratio(self, timing: str) -> float:
        with_a, alone = self.medians[timing]
        return with_a / alone


AB_TIMINGS = ("at once", "from submit", "from arrival")


def _b_median(run: Run, user: str, since: str) -> float:
    ts = [t for t in run.timings if t.user == user]
    if not ts:
        raise ValueError(f"{run.name}: no request of user {user!r}")
    return statistics.median(t.first_s - (t.submit_s if since == "submit" else t.arrival_s) for t in ts)


def ab_ratios(runner: Callable[..., Run], reqs: Sequence[TraceRequest], *, light: str = AB_LIGHT_USER,
              timed_with: Run | None = None, name: str = "") -> ABResult:
    """B's median TTFT with the other users present over the same B requests alone, three timings.

    Args:
        runner: ``run_batch`` or ``run_vllm`` (or a partial of either).
        reqs: the A/B workload.
        light: the light user's id.
        timed_with: the arrival-timed run of ``reqs`` if already made (the main table's), reused.
    """
    alone = [r for r in reqs if r.user == light]
    with_t = timed_with or runner(reqs)
    alone_t = runner(alone)
    with_0, alone_0 = runner(reqs, at_once=True), runner(alone, at_once=True)
    res = ABResult(name or with_t.name)
    res.medians["at once"] = (_b_median(with_0, light, "submit"), _b_median(alone_0, light, "submit"))
    res.medians["from submit"] = (_b_median(with_t, light, "submit"), _b_median(alone_t, light, "submit"))
    res.medians["from arrival"] = (_b_median(with_t, light, "arrival"), _b_median(alone_t, light, "arrival"))
    return res


# ----------------------------------------------------------------------------- steady-state CPU

SWEEP_SIZES = (16, 32, 64, 128)


def steady_requests(n: int, *, prompt_tokens: int = 4, output_tokens: int = 28) -> list[TraceRequest]:
    """``n`` short requests of five users, all at time 0: after one prefill step every step decodes
    all ``n`` (4 + 28 tokens = 2 blocks each, so 128 of them fill the 256 blocks exactly)."""
    return [TraceRequest(f"s{i}", f"u{i % 5 + 1}", 0.0, prompt_tokens, output_tokens) for i in range(n)]


def cpu_sweep(runner: Callable[..., Run], sizes: Sequence[int] = SWEEP_SIZES, repeats: int = 3) -> dict[int, float]:
    """Scheduler CPU per step (us) with ``n`` requests decoding together, for each ``n`` in ``sizes``:
    the least of ``repeats`` runs (the usual guard against a busy machine in a microbenchmark)."""
    return {n: min(summarize(runner(steady_requests(n), at_once=True)).cpu_us_per_step for _ in range(repeats))
            for n in sizes}


# ----------------------------------------------------------------------------- per user, equal demand, acceptance

#: The equal-demand variant of a trace: its rows with ``user = eq{i mod 5}`` by row index (issue 38),
#: so that every user's demand is about the same by construction; shown as ``NAME (equal demand)``.
EQUAL_DEMAND = " (equal demand)"
EQUAL_USERS = 5
#: Issue 38's bound on the equal-demand variants: Batch's TTFT p99 at most this times vLLM's.
EQUAL_P99_BOUND = 1.03


def equal_demand(reqs: Sequence[TraceRequest], users: int = EQUAL_USERS) -> list[TraceRequest]:
    """The same rows (ids, arrivals, lengths) with user ``eq{i mod users}`` for the ``i``-th row."""
    return [dataclasses.replace(r, user=f"eq{i % users}") for i, r in enumerate(reqs)]


def demand(reqs: Sequence[TraceRequest]) -> dict[str, int]:
    """Each user's demand: the prompt + output tokens of its rows in the trace."""
    out: dict[str, int] = {}
    for r in reqs:
        out[r.user] = out.get(r.user, 0) + r.prompt_tokens + r.output_tokens
    return out


def light_users(reqs: Sequence[TraceRequest]) -> set[str]:
    """The users whose demand is at or below the mean demand over the trace's users."""
    d = demand(reqs)
    mean = statistics.fmean(d.values()) if d else 0.0
    return {u for u, x in d.items() if x <= mean}


def user_ttft_p99(run: Run) -> dict[str, float]:
    """Each user's TTFT p99 (s, from the nominal arrival) in ``run``."""
    by: dict[str, list[float]] = {}
    for t in run.timings:
        by.setdefault(t.user, []).append(t.first_s - t.arrival_s)
    return {u: percentile(xs, 99) for u, xs in by.items()}


def relabeled(run: Run, reqs: Sequence[TraceRequest]) -> Run:
    """``run`` with each timing's user taken from ``reqs`` (matched by request id): a run of a
    scheduler blind to users (vLLM's FCFS) reused for a variant that differs only in its users.

    Raises:
        ValueError: ``reqs`` and ``run`` do not hold the same request ids.
    """
    user = {r.rid: r.user for r in reqs}
    if set(user) != {t.rid for t in run.timings}:
        raise ValueError(f"{run.name}: the variant's requests are not the run's")
    return dataclasses.replace(run, timings=[dataclasses.replace(t, user=user[t.rid]) for t in run.timings])


@dataclass
class Trial:
    """One trace (an anchor or its equal-demand variant) on one clock: its requests (users and
    demand) and each scheduler's run, by the scheduler's name."""

    trace: str
    reqs: list[TraceRequest]
    runs: dict[str, Run] = field(default_factory=dict)


def with_equal_demand(trace: str, reqs: Sequence[TraceRequest], runners: Sequence[tuple[str, Callable[..., Run]]],
                      user_blind: Sequence[str], *, equal: bool = True,
                      on_trial: Callable[[Trial, str], None] | None = None) -> list[Trial]:
    """The anchor's trial and (``equal``) its equal-demand variant's; the runners named in
    ``user_blind`` run once, on the anchor, and their runs are reused for the variant.
    ``on_trial(trial, name)`` is called after each scheduler's run (to print its row at once)."""
    out = []
    for tname, treqs in ((trace, list(reqs)), (trace + EQUAL_DEMAND, equal_demand(reqs))) if equal else (
            (trace, list(reqs)),):
        reuse = {n: out[0].runs[n] for n in user_blind if out and n in out[0].runs}
        trial = Trial(tname, treqs)
        for name, runner in runners:
            trial.runs[name] = relabeled(reuse[name], treqs) if name in reuse else runner(treqs)
            if on_trial is not None:
                on_trial(trial, name)
        out.append(trial)
    return out


def per_user_lines(trials: Sequence[Trial], names: Sequence[str]) -> list[str]:
    """The per-user table: per trace, mean TTFT and TTFT p99 over all requests, then each user's
    TTFT p99 (seconds) under each scheduler; ``*`` marks the users at or below the mean demand."""
    out = ["| trace | user | requests | demand (tokens) | " + " | ".join(names) + " |",
           "|---|---|---|---|" + "---|" * len(names)]
    for tr in trials:
        sums = {n: summarize(tr.runs[n]) for n in names}
        out.append(f"| `{tr.trace}` | all: mean TTFT | {len(tr.reqs)} | {sum(demand(tr.reqs).values()):,} | "
                   + " | ".join(f"{sums[n].ttft_mean_s:.3f}" for n in names) + " |")
        out.append(f"| `{tr.trace}` | all: TTFT p99 | | | " + " | ".join(f"{sums[n].ttft_p99_s:.3f}" for n in names)
                   + " |")
        d, light = demand(tr.reqs), light_users(tr.reqs)
        counts: dict[str, int] = {}
        for r in tr.reqs:
            counts[r.user] = counts.get(r.user, 0) + 1
        p99 = {n: user_ttft_p99(tr.runs[n]) for n in names}
        for u in sorted(d, key=lambda u: (d[u], u)):
            out.append(f"| `{tr.trace}` | {u}{' *' if u in light else ''} | {counts[u]} | {d[u]:,} | "
                       + " | ".join(f"{p99[n][u]:.3f}" for n in names) + " |")
    return out


@dataclass(frozen=True)
class Check:
    """One cell of the acceptance summary: the figure as printed and whether it meets the bound."""

    text: str
    met: bool

    def cell(self) -> str:
        return f"{self.text} {'met' if self.met else '**not met**'}"


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else math.inf)


def acceptance(anchor: Trial, variant: Trial | None, batch: str, vllm: str) -> dict[str, Check]:
    """Issue 38's figures for one anchor, Batch (``batch``) against vLLM (``vllm``), each computed:

    * ``throughput``: Batch's output tok/s over vLLM's, >= 1;
    * ``mean TTFT``: Batch's over vLLM's, <= 1;
    * ``light p99``: per user at or below the mean demand, Batch's TTFT p99 over vLLM's, the
      largest (its user named), <= 1;
    * ``preemptions``: Batch's and vLLM's, Batch's <= vLLM's;
    * ``equal p99``: on the equal-demand variant (if run), Batch's TTFT p99 over vLLM's, <= 1.03.
    """
    b, v = summarize(anchor.runs[batch]), summarize(anchor.runs[vllm])
    out: dict[str, Check] = {}
    r = _ratio(b.throughput_tok_s, v.throughput_tok_s)
    out["throughput"] = Check(f"{r:.3f}", r >= 1.0)
    r = _ratio(b.ttft_mean_s, v.ttft_mean_s)
    out["mean TTFT"] = Check(f"{r:.3f}", r <= 1.0)
    bp, vp = user_ttft_p99(anchor.runs[batch]), user_ttft_p99(anchor.runs[vllm])
    ratios = {u: _ratio(bp[u], vp[u]) for u in light_users(anchor.reqs)}
    worst = max(ratios, key=lambda u: (ratios[u], u))
    out["light p99"] = Check(f"{ratios[worst]:.3f} ({worst}; {len(ratios)} user{'' if len(ratios) == 1 else 's'})",
                             all(x <= 1.0 for x in ratios.values()))
    out["preemptions"] = Check(f"{b.preemptions} / {v.preemptions}", b.preemptions <= v.preemptions)
    if variant is not None:
        r = _ratio(summarize(variant.runs[batch]).ttft_p99_s, summarize(variant.runs[vllm]).ttft_p99_s)
        out["equal p99"] = Check(f"{r:.3f}", r <= EQUAL_P99_BOUND)
    return out


ACCEPTANCE_COLUMNS = (("throughput", "tok/s Batch / vLLM >= 1"), ("mean TTFT", "mean TTFT Batch / vLLM <= 1"),
                      ("light p99", "light users' TTFT p99 Batch / vLLM <= 1 (largest)"),
                      ("preemptions", "preemptions Batch / vLLM, Batch's <= vLLM's"),
                      ("equal p99", f"equal demand: TTFT p99 Batch / vLLM <= {EQUAL_P99_BOUND:g}"))


def acceptance_lines(trials: Sequence[Trial], batch: str, vllm: str) -> list[str]:
    """The acceptance summary (``acceptance``), one row per anchor of ``trials`` (each followed by
    its equal-demand variant when it was run), and a last line counting the cells met."""
    out = ["| anchor | " + " | ".join(h for _, h in ACCEPTANCE_COLUMNS) + " | all met |",
           "|---|" + "---|" * (len(ACCEPTANCE_COLUMNS) + 1)]
    met = total = 0
    by_name = {t.trace: t for t in trials}
    for tr in trials:
        if tr.trace.endswith(EQUAL_DEMAND):
            continue
        checks = acceptance(tr, by_name.get(tr.trace + EQUAL_DEMAND), batch, vllm)
        met += sum(c.met for c in checks.values())
        total += len(checks)
        cells = [checks[k].cell() if k in checks else "not run" for k, _ in ACCEPTANCE_COLUMNS]
        every = "yes" if all(c.met for c in checks.values()) else "no"
        out.append(f"| `{tr.trace}` | " + " | ".join(cells) + f" | {every} |")
    out.append(f"\n{met} of {total} cells met ({batch} against {vllm}).")
    return out


def equal_demand_note(user_blind: Sequence[str]) -> str:
    """The line above a table with equal-demand rows: what they are and which runs are reused."""
    note = (f"`NAME{EQUAL_DEMAND}`: the same rows with user = eq{{i mod {EQUAL_USERS}}} by row index (every user's "
            f"demand about equal by construction).")
    if user_blind:
        note += (f" {', '.join(user_blind)}: run once per trace and reused for its variant, users relabelled "
                 f"(vLLM's scheduler is FCFS and never reads the user, so its run is the same).")
    return note


def print_per_user(trials: Sequence[Trial], names: Sequence[str], vllm: str | None, batch: str = "Batch") -> None:
    """Print the per-user TTFT table (``per_user_lines``) and, with a vLLM run (``vllm``: its
    scheduler's name), the acceptance summary (``acceptance_lines``)."""
    print("\nMean TTFT and TTFT p99 per user (s, from each request's arrival); demand = the user's prompt + output "
          "tokens in the trace; `*`: at or below the mean demand over the trace's users\n")
    print("\n".join(per_user_lines(trials, names)))
    if vllm is None:
        print("\nAcceptance summary (issue 38): not computed (Batch only).")
        return
    print(f"\nAcceptance summary (issue 38), {batch} against {vllm}: each cell the computed ratio (or counts) and "
          "whether it meets the issue's bound; light users = at or below the mean demand\n")
    print("\n".join(acceptance_lines(trials, batch, vllm)))


# ----------------------------------------------------------------------------- report

HEADER = ("| trace | scheduler | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | e2e p50 / p99 (s) | "
          "preemptions | sched CPU / step (us) |")


def table_row(trace: str, s: Summary, name: str) -> str:
    return (f"| `{trace}` | {name} | {s.throughput_tok_s:.1f} | {s.ttft_p50_s:.2f} / {s.ttft_p99_s:.2f} | "
            f"{s.tpot_p50_s * 1e3:.1f} / {s.tpot_p99_s * 1e3:.1f} | {s.e2e_p50_s:.2f} / {s.e2e_p99_s:.2f} | "
            f"{s.preemptions} | {s.cpu_us_per_step:.0f} |")


def ab_lines(results: Sequence[ABResult]) -> list[str]:
    out = ["| scheduler | " + " | ".join(f"{t}: with A / alone (ms) = ratio" for t in AB_TIMINGS) + " |",
           "|---|" + "---|" * len(AB_TIMINGS)]
    for r in results:
        cells = [f"{r.medians[t][0] * 1e3:.1f} / {r.medians[t][1] * 1e3:.1f} = **{r.ratio(t):.2f}x**"
                 for t in AB_TIMINGS]
        out.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return out


def _trace_files(folder: Path, only: Sequence[str] | None) -> list[Path]:
    files = sorted(folder.glob("*.csv"), key=lambda p: (ORDER.index(p.name) if p.name in ORDER else len(ORDER), p.name))
    if only:
        files = [p for p in files if p.name in only or p.stem in only]
    return files


# ----------------------------------------------------------------------------- the GPU clock

#: The loads of the sweep (fractions of the capacity) and its trace.
SWEEP_LOADS = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1)
SWEEP_TRACE = "trace2k.csv"
#: Where ``--load-sweep`` writes its plot and data by default.
SWEEP_PLOT = ROOT / "docs" / "img" / "vllm-load-sweep.png"
#: The two chunkings of the GPU-clock tables: (label, vLLM long_prefill_token_threshold, Batch
#: prefill_chunk_tokens; None: the token budget).
CHUNKINGS = (("vLLM's default chunking (vLLM long_prefill_token_threshold 0; Batch prefill_chunk_tokens = "
              "the token budget)", 0, None),
             ("the 64-token rule (vLLM long_prefill_token_threshold 64; Batch prefill_chunk_tokens 64)", 64, 64))

GPU_HEADER = ("| trace | load (rate, req/s) | scheduler | req/s | tok/s | TTFT mean / p50 / p99 (s) | "
              "TPOT p50 / p99 (ms) | preemptions | steps | tokens / requests a step |")


def native_rate(reqs: Sequence[TraceRequest]) -> float:
    """A trace's own request rate: requests / (last arrival - first arrival); inf if all arrive at once."""
    arr = [r.arrival_s for r in reqs]
    span = max(arr) - min(arr)
    return len(reqs) / span if span > 0 else math.inf


def time_scaled(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests with every arrival offset multiplied by ``factor``."""
    return [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in reqs]


def at_load(reqs: Sequence[TraceRequest], load: float, capacity_req_s: float) -> tuple[list[TraceRequest], float]:
    """``reqs`` time-scaled to ``load`` x ``capacity_req_s`` requests/s; returns them and that rate."""
    rate = load * capacity_req_s
    return time_scaled(reqs, native_rate(reqs) / rate), rate


#: The saturation run repeats a trace to at least this many requests, and measures the completion
#: rate between these shares of its completions (the ramp-up and the drain left out).
CAPACITY_MIN_REQUESTS = 2000
CAPACITY_WINDOW = (0.1, 0.9)


def capacity(reqs: Sequence[TraceRequest], runner: Callable[..., Run], min_requests: int = CAPACITY_MIN_REQUESTS,
             window: tuple[float, float] = CAPACITY_WINDOW) -> float:
    """The most requests/s the GPU sustains on this mix: a saturation run (the trace's requests,
    repeated to at least ``min_requests``, all submitted at time 0) through ``runner``, and its
    completion rate in steady state: the completions between the ``window`` shares of them (10% and
    90%) over the time between those two completions."""
    copies = max(1, math.ceil(min_requests / len(reqs)))
    many = [dataclasses.replace(r, rid=f"{r.rid}#{k}") for k in range(copies) for r in reqs]
    done = sorted(t.done_s for t in runner(many, at_once=True).timings)
    lo, hi = (int(round(w * (len(done) - 1))) for w in window)
    return (hi - lo) / (done[hi] - done[lo])


def gpu_row(trace: str, load: float, rate: float, run: Run, name: str) -> str:
    s = summarize(run)
    tok, seqs = run.per_step()
    return (f"| `{trace}` | {load:.2f} ({rate:.1f}) | {name} | {s.request_rate:.2f} | {s.throughput_tok_s:.0f} | "
            f"{s.ttft_mean_s:.3f} / {s.ttft_p50_s:.3f} / {s.ttft_p99_s:.3f} | {s.tpot_p50_s * 1e3:.1f} / "
            f"{s.tpot_p99_s * 1e3:.1f} | {s.preemptions} | {s.steps} | {tok:.0f} / {seqs:.1f} |")


def gpu_runners(clock: Clock, vllm_threshold: int, batch_chunk: int | None, *, fcfs: bool, tolerances: Sequence[int],
                vllm: bool, fair_vllm: bool) -> list[tuple[str, Callable[..., Run]]]:
    """The schedulers of a GPU-clock table, each a ``runner(reqs, at_once=False) -> Run`` on ``clock``."""
    from functools import partial

    chunk = clock.max_num_batched_tokens if batch_chunk is None else batch_chunk
    out: list[tuple[str, Callable[..., Run]]] = [("Batch", partial(run_batch, clock=clock, chunk_tokens=chunk))]
    if fcfs:
        from batch.policies.policy import FCFSPolicy
        out.append(("Batch-FCFS", partial(run_batch, clock=clock, chunk_tokens=chunk, name="Batch-FCFS",
                                          factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k))))
    for tol in tolerances:
        from batch.policies.vtc import VTCPolicy
        out.append((f"Batch-T{tol}", partial(run_batch, clock=clock, chunk_tokens=chunk, name=f"Batch-T{tol}",
                                             factory=lambda tol=tol, **k: Scheduler(
                                                 policy=VTCPolicy(tolerance_tokens=tol), **k))))
    if vllm:
        out.append((f"vLLM (thr {vllm_threshold})", partial(run_vllm, clock=clock, threshold=vllm_threshold,
                                                            name=f"vLLM (thr {vllm_threshold})")))
        if fair_vllm:
            out.append((f"vLLM+Batch (thr {vllm_threshold})",
                        partial(run_vllm, clock=clock, threshold=vllm_threshold, make=make_fair_scheduler,
                                name=f"vLLM+Batch (thr {vllm_threshold})")))
    return out


def reference_runner(clock: Clock, vllm: bool) -> tuple[str, Callable[..., Run]]:
    """The scheduler whose saturation run defines a trace's capacity on ``clock``: vLLM at its default
    chunking when vllm imports, else Batch-FCFS with chunks up to the token budget."""
    from functools import partial

    if vllm:
        return "vLLM at its default chunking", partial(run_vllm, clock=clock, threshold=0)
    from batch.policies.policy import FCFSPolicy
    return ("Batch-FCFS with chunks up to the token budget (vllm not importable)",
            partial(run_batch, clock=clock, chunk_tokens=clock.max_num_batched_tokens,
                    factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k)))


def gpu_section(clock: Clock, files: Sequence[Path], *, load: float, fcfs: bool, tolerances: Sequence[int],
                vllm: bool, fair_vllm: bool, ab: bool = True, equal: bool = True) -> None:
    """Print the GPU-clock tables: capacity per trace, then each trace (and, with ``equal``, its
    equal-demand variant: the same arrivals) at ``load`` x capacity under each chunking
    (``CHUNKINGS``), the per-user TTFT table and the acceptance summary, then the A/B ratios on it."""
    print(f"\n## GPU clock `{clock.name}`\n\n{clock.describe()}\n")
    ref_name, ref = reference_runner(clock, vllm)
    print(f"Capacity: the steady-state completion rate of a saturation run through {ref_name}: the trace's "
          f"requests repeated to at least {CAPACITY_MIN_REQUESTS:,}, all at time 0, the completions between the "
          f"{CAPACITY_WINDOW[0]:.0%} and {CAPACITY_WINDOW[1]:.0%} marks over the time between them. Each trace is "
          f"then time-scaled to arrive at load x capacity requests/s (its gaps kept, scaled).\n")
    print("| trace | requests | own rate (req/s) | capacity (req/s) | time scale at load " f"{load:g} |")
    print("|---|---|---|---|---|")
    loaded: list[tuple[str, list[TraceRequest], float]] = []
    for path in files:
        reqs = [r for r in load_requests(path) if clock.fits(r.prompt_tokens, r.output_tokens)]
        cap = capacity(reqs, ref)
        scaled, rate = at_load(reqs, load, cap)
        print(f"| `{path.name}` | {len(reqs)} | {native_rate(reqs):.1f} | {cap:.1f} | "
              f"{native_rate(reqs) / rate:.4f} |", flush=True)
        loaded.append((path.name, scaled, rate))
    for label, thr, chunk in CHUNKINGS:
        runners = gpu_runners(clock, thr, chunk, fcfs=fcfs, tolerances=tolerances, vllm=vllm, fair_vllm=fair_vllm)
        print(f"\n### {label}, load {load:g}\n")
        print("TTFT from each request's arrival; req/s and tok/s: requests and output tokens / (last completion - "
              "first arrival)")
        if equal:
            print(equal_demand_note([f"vLLM (thr {thr})"] if vllm else []))
        print()
        print(GPU_HEADER)
        print("|---|---|---|---|---|---|---|---|---|---|")
        ab_results: list[ABResult] = []
        trials: list[Trial] = []
        vname = f"vLLM (thr {thr})" if vllm else None
        for name, scaled, rate in loaded:
            trials += with_equal_demand(name, scaled, runners, [vname] if vname else [], equal=equal,
                                        on_trial=lambda tr, rname, rate=rate: print(
                                            gpu_row(tr.trace, load, rate, tr.runs[rname], rname), flush=True))
            if ab and name == AB_TRACE and thr == CHUNK_TOKENS:
                anchor = next(t for t in trials if t.trace == AB_TRACE)
                for rname, runner in runners:
                    ab_results.append(ab_ratios(runner, scaled, timed_with=anchor.runs[rname], name=rname))
        print_per_user(trials, [rname for rname, _ in runners], vname)
        if ab_results:
            print(f"\nA/B trace `{AB_TRACE}` at load {load:g}, this chunking: B's median TTFT with A present over "
                  "the same B requests alone\n")
            print("\n".join(ab_lines(ab_results)))


def load_sweep(clock: Clock, path: Path, loads: Sequence[float], *, vllm: bool, fair_vllm: bool,
               threshold: int = CHUNK_TOKENS) -> dict:
    """TTFT p50 / p99 and TPOT p99 of Batch, Batch-FCFS, vLLM and vLLM + Batch's ``FairScheduler``
    on ``path`` time-scaled to each load (fraction of the capacity), at the 64-token rule. Returns
    the data (what ``plot_sweep`` draws) after printing its table."""
    reqs = [r for r in load_requests(path) if clock.fits(r.prompt_tokens, r.output_tokens)]
    ref_name, ref = reference_runner(clock, vllm)
    cap = capacity(reqs, ref)
    runners = gpu_runners(clock, threshold, threshold, fcfs=True, tolerances=(), vllm=vllm, fair_vllm=fair_vllm)
    data = {"clock": clock.name, "trace": path.name, "capacity_req_s": cap, "capacity_by": ref_name,
            "chunking": f"64-token rule (vLLM thr {threshold}, Batch chunk {threshold})", "loads": list(loads),
            "series": {name: [] for name, _ in runners}}
    print(f"\n### Load sweep on `{path.name}`, GPU clock `{clock.name}`, the 64-token rule\n")
    print(f"Capacity {cap:.1f} req/s ({ref_name}, saturation run). Rate = load x capacity.\n")
    print("| load | rate (req/s) | scheduler | req/s | tok/s | TTFT mean / p50 / p99 (s) | TPOT p50 / p99 (ms) | "
          "preemptions |")
    print("|---|---|---|---|---|---|---|---|")
    for load in loads:
        scaled, rate = at_load(reqs, load, cap)
        for name, runner in runners:
            s = summarize(runner(scaled))
            data["series"][name].append({"load": load, "rate_req_s": rate, "served_req_s": s.request_rate,
                                         "tok_s": s.throughput_tok_s, "ttft_mean_s": s.ttft_mean_s,
                                         "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
                                         "tpot_p50_s": s.tpot_p50_s, "tpot_p99_s": s.tpot_p99_s,
                                         "preemptions": s.preemptions})
            print(f"| {load:.2f} | {rate:.1f} | {name} | {s.request_rate:.2f} | {s.throughput_tok_s:.0f} | "
                  f"{s.ttft_mean_s:.3f} / {s.ttft_p50_s:.3f} / {s.ttft_p99_s:.3f} | {s.tpot_p50_s * 1e3:.1f} / "
                  f"{s.tpot_p99_s * 1e3:.1f} | {s.preemptions} |", flush=True)
    return data


def plot_sweep(data: dict, out: Path) -> str:
    """Draw the latency-throughput plot of ``load_sweep``'s data to ``out`` (PNG): TTFT p50, TTFT p99
    and TPOT p99 against the offered request rate, one line per scheduler. Without matplotlib here,
    the data go to ``out`` with ``.json`` and the project's ``.venv`` draws them
    (``python bench/vllm_compare.py --plot-json FILE``). Returns what was written."""
    import json

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        js = out.with_suffix(".json")
        js.write_text(json.dumps(data, indent=1))
        venv = ROOT / ".venv" / "bin" / "python"
        if venv.exists():
            p = subprocess.run([str(venv), str(Path(__file__).resolve()), "--plot-json", str(js), "--plot", str(out)],
                               capture_output=True, text=True)
            if p.returncode == 0:
                js.unlink()
                return str(out)
        return f"{js} (no matplotlib here; draw it with: .venv/bin/python bench/vllm_compare.py --plot-json {js})"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"), ("tpot_p99_s", "TPOT p99 (ms)"))
    for ax, (key, label) in zip(axes, panels):
        for k, (name, pts) in enumerate(data["series"].items()):
            xs = [pt["rate_req_s"] for pt in pts]
            ys = [pt[key] * (1e3 if key.startswith("tpot") else 1.0) for pt in pts]
            ax.plot(xs, ys, marker="os^xd"[k % 5], linestyle=("-", "--", ":", "-.")[k % 4], label=name)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(label)
        if key.startswith("ttft"):
            ax.set_yscale("log")
        ax.axvline(data["capacity_req_s"], color="grey", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{data['trace']} on GPU clock {data['clock']}, {data['chunking']}; capacity "
                 f"{data['capacity_req_s']:.0f} req/s (dotted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default=None, help=f"folder of trace CSVs (default: anchors/ in ${TRACES_ENV}, "
                                                  f"else data/traces/anchors in the checkout)")
    p.add_argument("--only", default=None, help="comma-separated trace file names (or stems) to run")
    p.add_argument("--batch-only", action="store_true", help="Batch's side only (no vllm needed)")
    p.add_argument("--fcfs", action="store_true", help="also Batch with policy.FCFSPolicy() (arrival order)")
    p.add_argument("--tolerance", type=int, action="append", default=[], metavar="TOKENS",
                   help="also Batch with VTCPolicy(tolerance_tokens=TOKENS) (repeatable)")
    p.add_argument("--no-sweep", action="store_true", help="skip the steady-state CPU-per-step sweep")
    p.add_argument("--fair-vllm", action="store_true",
                   help="also vLLM+Batch: vLLM's Scheduler subclassed by batch.integrations.vllm.FairScheduler "
                        "(make bench-vllm passes it)")
    p.add_argument("--async-vllm", action="store_true",
                   help="also vLLM's AsyncScheduler (async scheduling, vLLM's default: one step ahead of the output) "
                        "and, with --fair-vllm, batch.integrations.vllm.AsyncFairScheduler (make bench-vllm passes it)")
    p.add_argument("--vllm-threshold", type=int, default=CHUNK_TOKENS,
                   help="on the stub clock: vLLM's long_prefill_token_threshold (default 64, Batch's chunk; 0: "
                        "vLLM's default, none)")
    p.add_argument("--gpu", default="stub",
                   help="comma-separated clocks: stub (5 ms + 1 ms per request, the default) and/or a GPU profile "
                        "(h100-llama3-8b: batch.sim.gpu_profile, with vLLM's limits for it on both sides); each "
                        "GPU clock prints capacity, both chunkings at --load, and the A/B ratios")
    p.add_argument("--load", type=float, default=0.9, help="on a GPU clock: the anchors' load, a fraction of the "
                                                           "capacity (default 0.9)")
    p.add_argument("--no-anchors", action="store_true", help="on a GPU clock: skip the anchor tables")
    p.add_argument("--no-equal-demand", action="store_true",
                   help="skip the anchors' equal-demand variants (the same rows, user = eq{i mod 5} by row index)")
    p.add_argument("--load-sweep", action="store_true",
                   help=f"on each GPU clock: the load sweep ({', '.join(map(str, SWEEP_LOADS))} of capacity) on "
                        f"{SWEEP_TRACE} and its plot (--plot)")
    p.add_argument("--sweep-loads", default=None, help="comma-separated loads of the sweep")
    p.add_argument("--plot", default=str(SWEEP_PLOT), help=f"the sweep's plot (default {SWEEP_PLOT.relative_to(ROOT)})")
    p.add_argument("--plot-json", default=None, help=argparse.SUPPRESS)  # draw a sweep's saved data, then exit
    a = p.parse_args(argv)
    if a.plot_json:
        import json
        print(plot_sweep(json.loads(Path(a.plot_json).read_text()), Path(a.plot)))
        return 0
    try:
        clocks = [clock_for(n.strip()) for n in a.gpu.split(",") if n.strip()]
    except ValueError as e:
        p.error(str(e))
    if not clocks:
        p.error("--gpu names no clock")
    if not 0 < a.load < math.inf:
        p.error(f"--load must be a fraction of the capacity > 0, got {a.load}")
    try:
        loads = tuple(float(x) for x in a.sweep_loads.split(",")) if a.sweep_loads else SWEEP_LOADS
    except ValueError:
        p.error(f"--sweep-loads must be comma-separated numbers, got {a.sweep_loads!r}")
    folder = traces_dir(a.traces)
    if not folder.is_dir():
        p.error(f"no trace folder at {folder} (pass --traces DIR or set {TRACES_ENV})")
    files = _trace_files(folder, a.only.split(",") if a.only else None)
    if not files:
        p.error(f"no trace CSVs in {folder}" + (f" named {a.only}" if a.only else ""))
    for tol in a.tolerance:
        if tol < 0:
            p.error(f"--tolerance must be >= 0, got {tol}")
    vllm = not a.batch_only
    if vllm:
        try:
            _vllm()
        except VLLMUnavailable as e:
            print(f"vllm_compare: {e}", file=sys.stderr)
            return 2
    for clock in clocks:
        if clock.profile is None:
            stub_section(a, files, folder)
            continue
        if not a.no_anchors:
            gpu_section(clock, files, load=a.load, fcfs=a.fcfs, tolerances=a.tolerance, vllm=vllm,
                        fair_vllm=a.fair_vllm, equal=not a.no_equal_demand)
        if a.load_sweep:
            sweep = folder / SWEEP_TRACE
            if not sweep.is_file():
                p.error(f"the load sweep's trace {SWEEP_TRACE} is not in {folder}")
            data = load_sweep(clock, sweep, loads, vllm=vllm, fair_vllm=a.fair_vllm)
            print(f"\nPlot: {plot_sweep(data, Path(a.plot))}")
    return 0


def stub_section(a: argparse.Namespace, files: Sequence[Path], folder: Path) -> None:
    """The stub clock's tables (the comparison as it ran before the GPU clock): every trace, the
    steady-state CPU sweep and the A/B ratios."""
    runners: list[tuple[str, Callable[..., Run]]] = [("Batch", run_batch)]
    if a.fcfs:
        from batch.policies.policy import FCFSPolicy

        def run_fcfs(reqs, **kw):
            return run_batch(reqs, factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k), name="Batch-FCFS", **kw)
        runners.append(("Batch-FCFS", run_fcfs))
    for tol in a.tolerance:
        from batch.policies.vtc import VTCPolicy

        def run_tol(reqs, tol=tol, **kw):
            return run_batch(reqs, factory=lambda **k: Scheduler(policy=VTCPolicy(tolerance_tokens=tol), **k),
                             name=f"Batch-T{tol}", **kw)
        runners.append((f"Batch-T{tol}", run_tol))
    if not a.batch_only:
        vname = f"vLLM (thr {a.vllm_threshold})"

        def run_v(reqs, **kw):
            return run_vllm(reqs, threshold=a.vllm_threshold, name=vname, **kw)
        runners.append((vname, run_v))
        if a.fair_vllm:
            fname = f"vLLM+Batch (thr {a.vllm_threshold})"

            def run_f(reqs, **kw):
                return run_vllm(reqs, threshold=a.vllm_threshold, name=fname, make=make_fair_scheduler, **kw)
            runners.append((fname, run_f))
        if a.async_vllm:
            aname = f"vLLM async (thr {a.vllm_threshold})"

            def run_a(reqs, **kw):
                return run_vllm(reqs, threshold=a.vllm_threshold, name=aname, make=make_async_vllm_scheduler, **kw)
            runners.append((aname, run_a))
            if a.fair_vllm:
                afname = f"vLLM+Batch async (thr {a.vllm_threshold})"

                def run_af(reqs, **kw):
                    return run_vllm(reqs, threshold=a.vllm_threshold, name=afname, make=make_async_fair_scheduler,
                                    **kw)
                runners.append((afname, run_af))

    print(f"Simulated clock: {BASE_S * 1e3:g} ms + {PER_REQUEST_S * 1e3:g} ms per scheduled request per step; "
          f"KV {KV_BLOCKS} blocks x {BLOCK_TOKENS} tokens; EOS at each request's recorded output length; "
          f"traces from {traces.shown_path(folder)}")
    print(f"Limits on both sides: max_num_seqs = Batch max_running = {VLLM_MAX_SEQS}, max_num_batched_tokens = "
          f"Batch token_budget_tokens = {VLLM_MAX_BATCHED_TOKENS}")
    if not a.batch_only:
        print(f"vLLM V1 Scheduler: long_prefill_token_threshold={a.vllm_threshold}, block_size {BLOCK_TOKENS}, "
              f"{KV_BLOCKS} blocks, prefix caching off, CPU")
        if a.async_vllm:
            print("vLLM async: AsyncScheduler with async scheduling on, driven as vLLM's engine core does (two steps "
                  "in flight: the next step is scheduled before the last one's output is processed)")
    print("TTFT and e2e from each request's nominal arrival; sched CPU = the scheduler's own code per step, "
          "fake forward excluded")
    equal = not a.no_equal_demand
    if equal:
        print(equal_demand_note([vname] if not a.batch_only else []))
    print()
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    ab: list[ABResult] = []
    trials: list[Trial] = []
    for path in files:
        reqs = load_requests(path)
        trials += with_equal_demand(path.name, reqs, runners, [] if a.batch_only else [vname], equal=equal,
                                    on_trial=lambda tr, name: print(table_row(tr.trace, summarize(tr.runs[name]), name),
                                                                    flush=True))
        if path.name == AB_TRACE:
            anchor = next(t for t in trials if t.trace == AB_TRACE)
            for name, runner in runners:
                ab.append(ab_ratios(runner, reqs, timed_with=anchor.runs[name], name=name))
    print_per_user(trials, [name for name, _ in runners], None if a.batch_only else vname)
    if not a.no_sweep:
        sweeps = [(name, cpu_sweep(runner)) for name, runner in runners]
        print("\nScheduler CPU per step (us), n requests decoding together (prompt 4, output 28, "
              "all at time 0; least of 3 runs)\n")
        print("| scheduler | " + " | ".join(f"n = {n}" for n in SWEEP_SIZES) + " |")
        print("|---|" + "---|" * len(SWEEP_SIZES))
        for name, sw in sweeps:
            print(f"| {name} | " + " | ".join(f"{sw[n]:.0f}" for n in SWEEP_SIZES) + " |")
    if ab:
        print(f"\nA/B trace `{AB_TRACE}`: B's median TTFT with A present over the same B requests alone")
        print("(at once: all submitted at time 0; from submit: submitted at the first step boundary after "
              "arrival, timed from then; from arrival: the same run, timed from the nominal arrival)\n")
        print("\n".join(ab_lines(ab)))


if __name__ == "__main__":
    sys.exit(main())
