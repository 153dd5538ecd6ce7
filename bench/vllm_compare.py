#!/usr/bin/env python3
"""Batch beside vLLM's own V1 scheduler, on one simulated clock and the same requests (issue 16).

Both schedulers are driven by the same loop on a simulated clock: at each step boundary the
requests whose arrival has come are handed to the scheduler, the scheduler picks a batch, and
the clock advances by the stub's latency model, 5 ms + 1 ms per scheduled request (a request
in a prefill chunk counts as one). Every request's output ends with EOS exactly at its
recorded length. The KV cache is 256 blocks of 16 tokens on both sides.

* Batch: ``scheduler.Scheduler()`` as it ships, its backend ``inference_stub.SimulatedGPU`` on
  a ``VirtualClock`` (no early EOS), replayed by ``simulate.run_workload``.
* vLLM: ``vllm.v1.core.sched.scheduler.Scheduler`` with ``long_prefill_token_threshold=64``
  (every prefill chunk at most 64 tokens, Batch's chunk), ``max_num_batched_tokens=2048``,
  ``max_num_seqs=128``, prefix caching off, on the CPU device, for a tiny Llama config
  written to a temporary directory (no weights, no hub, no tokenizer). The fake model runner
  returns one token per request whose prefill is complete after this step, none for a
  request in the middle of a (re)prefill, as vLLM's model runner does.
* vLLM+Batch: the same vLLM set-up with ``batch.integrations.vllm.FairScheduler`` (vLLM's
  ``Scheduler`` subclassed: Batch's ``VTCPolicy()`` orders admission, charges users, picks
  victims, isolates light users' first prefills; ``docs/vllm-plugin.md``), with ``--fair-vllm``
  (``make bench-vllm`` passes it).

Metrics come from per-request timestamps this harness records, with one definition for both
(nothing is read from either scheduler's own statistics but the preemption count):

* TTFT = first token - nominal arrival; e2e = completion - nominal arrival;
  TPOT = (completion - first token) / (output tokens - 1), requests with >= 2 tokens;
  percentiles by linear interpolation (numpy's default);
* output throughput = output tokens / (last completion - first arrival);
* scheduler CPU per step = the thread's CPU time in the scheduler's own code per step
  (Batch: ``tick()`` less the backend call; vLLM: ``schedule()`` + ``update_from_output()``),
  the fake forward excluded.

On the A/B trace (user ``B`` a light user beside a heavy ``A``) it also prints B's median
TTFT with A present over B's median TTFT with the same B requests alone, in three timings:
``at once`` (every request submitted at time 0, TTFT from then), ``from submit`` (each request
submitted at the first step boundary at or after its arrival, TTFT from that submit time) and
``from arrival`` (the same run, TTFT from the nominal arrival: it includes the wait for the
iteration already running when the request arrives).

Usage, from the repository root::

    make bench-vllm                                         # installs .venv-vllm once, then runs this with --fair-vllm
    .venv-vllm/bin/python bench/vllm_compare.py [--traces DIR] [--only NAME,...]
    python bench/vllm_compare.py --batch-only               # no vllm needed: Batch's side only

Traces: CSV files ``arrival_s,prompt_tokens,output_tokens,user`` in ``--traces DIR``, else the
``anchors/`` folder of the traces folder (``$BATCH_TRACES_DIR``, else ``data/traces`` in the
checkout; ``batch.sim.traces``), else ``$BATCH_TRACES_DIR`` itself when it has no ``anchors/``.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from batch.sim import simulate, traces  # noqa: E402
from inference_stub import Request  # noqa: E402
from scheduler import Scheduler  # noqa: E402

#: The simulated GPU, the same for both schedulers.
BASE_S = 0.005
PER_REQUEST_S = 0.001
KV_BLOCKS = 256
BLOCK_TOKENS = 16
CHUNK_TOKENS = 64
#: vLLM's scheduler settings (the guide's "thr 64" configuration).
VLLM_MAX_BATCHED_TOKENS = 2048
VLLM_MAX_SEQS = 128
VLLM_MAX_MODEL_LEN = KV_BLOCKS * BLOCK_TOKENS
VLLM_EOS = 2
VLLM_TOKEN = 7  # any non-EOS token

AB_TRACE = "ab_100A_5B_1s_seed0.csv"
AB_LIGHT_USER = "B"
TRACES_ENV = traces.TRACES_ENV
#: The anchor traces in the order the table prints them (any other CSV in the folder follows).
ORDER = ("poisson_n300_r30_seed0.csv", "trace200_poisson20_seed0.csv", "trace2k.csv", AB_TRACE)

_cpu = time.thread_time  # CPU seconds of this thread: other processes' load does not count


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
        cpu_us_per_step=run.sched_cpu_s / run.steps * 1e6 if run.steps else math.nan)


def _check_complete(name: str, reqs: Sequence[TraceRequest], timings: list[Timing]) -> None:
    """Every request finished with exactly its recorded output length, or RuntimeError."""
    want = {r.rid: r.output_tokens for r in reqs}
    got = {t.rid: t.output_tokens for t in timings}
    if got != want:
        bad = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
        raise RuntimeError(f"{name}: {len(bad)} requests did not finish at their output length, e.g. {bad[:5]}")


# ----------------------------------------------------------------------------- Batch

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
        def metered_backend(batch):
            t = _cpu()
            try:
                return backend(batch)
            finally:
                self.forward_cpu_s += _cpu() - t

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
              factory: Callable[..., Scheduler] = Scheduler, name: str = "Batch") -> Run:
    """Replay ``reqs`` through Batch on the simulated clock.

    Args:
        reqs: the workload.
        at_once: submit every request at time 0 (its nominal arrival is then taken as 0 too).
        factory: builds the scheduler from keyword arguments (``Scheduler``: as it ships).
        name: the run's label.

    Raises:
        RuntimeError: a request did not finish with exactly its output length (or was refused).
    """
    objs = [Request(user_id=r.user, prompt=[1] * r.prompt_tokens, max_tokens=r.output_tokens, request_id=r.rid,
                    submitted_at=0.0 if at_once else r.arrival_s) for r in reqs]
    nominal = {r.rid: 0.0 if at_once else r.arrival_s for r in reqs}
    meter = _MeteredBatch(factory)
    wall = time.perf_counter()
    res = simulate.run_workload(objs, make_scheduler=meter, virtual=True, gpu_seed=None, base_s=BASE_S,
                                per_request_s=PER_REQUEST_S, eos_probability=0.0, kv_cap_blocks=KV_BLOCKS,
                                block_tokens=BLOCK_TOKENS, prefill_chunk_tokens=CHUNK_TOKENS)
    wall = time.perf_counter() - wall
    timings = [Timing(r.request_id, r.user_id, nominal[r.request_id], r.submitted_at, r.started_at, r.completed_at,
                      len(r.generated)) for r in res.finished]
    _check_complete(name, reqs, timings)
    return Run(name, timings, preemptions=res.scheduler.metrics()["preemptions"], steps=meter.steps,
               sched_cpu_s=meter.tick_cpu_s - meter.forward_cpu_s, wall_s=wall)


# ----------------------------------------------------------------------------- vLLM

class VLLMUnavailable(RuntimeError):
    """vllm cannot be imported here (``make bench-vllm`` installs it into .venv-vllm)."""


_VLLM_CACHE: dict[str, object] = {}


def _vllm():
    """vLLM's modules, imported on first use (never at module import: the Batch side needs none)."""
    if "mods" not in _VLLM_CACHE:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import torch  # noqa: PLC0415
            from transformers import LlamaConfig  # noqa: PLC0415
            from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig,  # noqa: PLC0415
                                     VllmConfig)
            from vllm.sampling_params import SamplingParams  # noqa: PLC0415
            from vllm.v1.core.sched.scheduler import Scheduler as VScheduler  # noqa: PLC0415
            from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: PLC0415
                                                    KVCacheGroupSpec)
            from vllm.v1.outputs import ModelRunnerOutput  # noqa: PLC0415
            from vllm.v1.request import Request as VRequest  # noqa: PLC0415
            from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415
        except ImportError as e:
            raise VLLMUnavailable(f"vllm is not importable here ({e}); `make bench-vllm` installs it "
                                  f"into .venv-vllm, or pass --batch-only") from e
        _VLLM_CACHE["mods"] = argparse.Namespace(**{k: v for k, v in locals().items() if k != "e"})
    return _VLLM_CACHE["mods"]


def _vllm_config(threshold: int):
    """A ``VllmConfig`` for a tiny Llama (config.json only, in a temp dir kept for the process)."""
    key = f"config/{threshold}"
    if key in _VLLM_CACHE:
        return _VLLM_CACHE[key]
    v = _vllm()
    if "model_dir" not in _VLLM_CACHE:
        d = tempfile.mkdtemp(prefix="vllm-compare-llama-")
        v.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=VLLM_MAX_MODEL_LEN,
                      bos_token_id=1, eos_token_id=VLLM_EOS).save_pretrained(d)
        _VLLM_CACHE["model_dir"] = d
    model = v.ModelConfig(model=_VLLM_CACHE["model_dir"], skip_tokenizer_init=True, dtype="float32", seed=0,
                          max_model_len=VLLM_MAX_MODEL_LEN)
    sched = v.SchedulerConfig(max_model_len=VLLM_MAX_MODEL_LEN, is_encoder_decoder=False,
                              max_num_batched_tokens=VLLM_MAX_BATCHED_TOKENS, max_num_seqs=VLLM_MAX_SEQS,
                              long_prefill_token_threshold=threshold, enable_chunked_prefill=True)
    cache = v.CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=False)
    cfg = v.VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                       device_config=v.DeviceConfig(device="cpu"))
    _VLLM_CACHE[key] = cfg
    return cfg


def make_vllm_scheduler(threshold: int = CHUNK_TOKENS, cls=None, **kwargs):
    """vLLM's V1 ``Scheduler`` (or its subclass ``cls``, given ``kwargs`` besides vLLM's) with 256
    blocks of 16 tokens (one full-attention group)."""
    v = _vllm()
    cls = cls or v.VScheduler
    cfg = _vllm_config(threshold)
    cfg.cache_config.num_gpu_blocks = KV_BLOCKS
    kv = v.KVCacheConfig(num_blocks=KV_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        v.KVCacheGroupSpec(["layer.0"], v.FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=32,
                                                            dtype=v.torch.float32))])
    return cls(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=v.StructuredOutputManager(cfg),
               block_size=BLOCK_TOKENS, log_stats=False, **kwargs)


def make_fair_scheduler(threshold: int = CHUNK_TOKENS, policy=None):
    """vLLM's V1 ``Scheduler`` with Batch's fairness: ``batch.integrations.vllm.FairScheduler``
    (``policy``: its ``fair_policy``, default ``VTCPolicy()``), set up as ``make_vllm_scheduler``."""
    from batch.integrations.vllm import FairScheduler  # noqa: PLC0415
    from batch.policies.vtc import VTCPolicy  # noqa: PLC0415
    return make_vllm_scheduler(threshold, FairScheduler, fair_policy=policy if policy is not None else VTCPolicy())


def run_vllm(reqs: Sequence[TraceRequest], *, at_once: bool = False, threshold: int = CHUNK_TOKENS,
             name: str = "vLLM", make: Callable[[int], object] | None = None) -> Run:
    """Replay ``reqs`` through vLLM's V1 scheduler on the simulated clock (same loop as Batch's);
    ``make(threshold)`` builds the scheduler (default ``make_vllm_scheduler``). Each request's
    user travels in ``sampling_params.extra_args["user"]`` (vLLM's own scheduler ignores it).

    Raises:
        VLLMUnavailable: vllm cannot be imported.
        RuntimeError: a request did not finish with exactly its output length.
    """
    v = _vllm()
    sched = (make or make_vllm_scheduler)(threshold)
    pending = sorted(reqs, key=lambda r: 0.0 if at_once else r.arrival_s)
    nominal = {r.rid: 0.0 if at_once else r.arrival_s for r in reqs}
    out_len = {r.rid: r.output_tokens for r in reqs}
    meta = {r.rid: r for r in reqs}
    submit: dict[str, float] = {}
    first: dict[str, float] = {}
    produced: dict[str, int] = {}
    vreqs = []
    timings: list[Timing] = []
    now, i, steps, cpu = 0.0, 0, 0, 0.0
    wall = time.perf_counter()
    while i < len(pending) or sched.has_unfinished_requests():
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
        if not sched.has_unfinished_requests():
            now = max(now, nominal[pending[i].rid])  # idle: skip to the next arrival
            continue
        t = _cpu()
        out = sched.schedule()
        cpu += _cpu() - t
        steps += 1
        ids = list(out.num_scheduled_tokens)
        if ids:
            now += BASE_S + PER_REQUEST_S * len(ids)
        elif i < len(pending):  # nothing runnable yet: wait for the next arrival
            now = max(now, nominal[pending[i].rid])
        else:
            raise RuntimeError(f"{name}: vLLM scheduled nothing with {sched.get_num_unfinished_requests()} "
                               f"requests unfinished and none left to arrive")
        # The fake forward: a token for each request whose (re)prefill is complete after this step.
        sampled: list[list[int]] = []
        for rid in ids:
            vr = sched.requests[rid]
            if vr.num_computed_tokens >= vr.num_tokens:
                k = produced.get(rid, 0) + 1
                produced[rid] = k
                sampled.append([VLLM_EOS if k >= out_len[rid] else VLLM_TOKEN])
                first.setdefault(rid, now)
                if k >= out_len[rid]:
                    m = meta[rid]
                    timings.append(Timing(rid, m.user, nominal[rid], submit[rid], first[rid], now, k))
            else:
                sampled.append([])
        mro = v.ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                                  sampled_token_ids=sampled)
        t = _cpu()
        sched.update_from_output(out, mro)
        cpu += _cpu() - t
    wall = time.perf_counter() - wall
    _check_complete(name, reqs, timings)
    left = [vr.request_id for vr in vreqs if not vr.is_finished()]
    if left:
        raise RuntimeError(f"{name}: vLLM still holds {len(left)} requests, e.g. {left[:5]}")
    return Run(name, timings, preemptions=sum(vr.num_preemptions for vr in vreqs), steps=steps, sched_cpu_s=cpu,
               wall_s=wall)


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
    p.add_argument("--vllm-threshold", type=int, default=CHUNK_TOKENS,
                   help="vLLM's long_prefill_token_threshold (default 64, Batch's chunk; 0: vLLM's default, none)")
    a = p.parse_args(argv)
    folder = traces_dir(a.traces)
    if not folder.is_dir():
        p.error(f"no trace folder at {folder} (pass --traces DIR or set {TRACES_ENV})")
    files = _trace_files(folder, a.only.split(",") if a.only else None)
    if not files:
        p.error(f"no trace CSVs in {folder}" + (f" named {a.only}" if a.only else ""))

    runners: list[tuple[str, Callable[..., Run]]] = [("Batch", run_batch)]
    if a.fcfs:
        from batch.policies.policy import FCFSPolicy  # noqa: PLC0415

        def run_fcfs(reqs, **kw):
            return run_batch(reqs, factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k), name="Batch-FCFS", **kw)
        runners.append(("Batch-FCFS", run_fcfs))
    for tol in a.tolerance:
        if tol < 0:
            p.error(f"--tolerance must be >= 0, got {tol}")
        from batch.policies.vtc import VTCPolicy  # noqa: PLC0415

        def run_tol(reqs, tol=tol, **kw):
            return run_batch(reqs, factory=lambda **k: Scheduler(policy=VTCPolicy(tolerance_tokens=tol), **k),
                             name=f"Batch-T{tol}", **kw)
        runners.append((f"Batch-T{tol}", run_tol))
    if not a.batch_only:
        vname = f"vLLM (thr {a.vllm_threshold})"
        try:
            _vllm()
        except VLLMUnavailable as e:
            print(f"vllm_compare: {e}", file=sys.stderr)
            return 2

        def run_v(reqs, **kw):
            return run_vllm(reqs, threshold=a.vllm_threshold, name=vname, **kw)
        runners.append((vname, run_v))
        if a.fair_vllm:
            fname = f"vLLM+Batch (thr {a.vllm_threshold})"

            def run_f(reqs, **kw):
                return run_vllm(reqs, threshold=a.vllm_threshold, name=fname, make=make_fair_scheduler, **kw)
            runners.append((fname, run_f))

    print(f"Simulated clock: {BASE_S * 1e3:g} ms + {PER_REQUEST_S * 1e3:g} ms per scheduled request per step; "
          f"KV {KV_BLOCKS} blocks x {BLOCK_TOKENS} tokens; EOS at each request's recorded output length; "
          f"traces from {traces.shown_path(folder)}")
    if not a.batch_only:
        print(f"vLLM V1 Scheduler: long_prefill_token_threshold={a.vllm_threshold}, max_num_batched_tokens="
              f"{VLLM_MAX_BATCHED_TOKENS}, max_num_seqs={VLLM_MAX_SEQS}, block_size {BLOCK_TOKENS}, "
              f"{KV_BLOCKS} blocks, prefix caching off, CPU")
    print("TTFT and e2e from each request's nominal arrival; sched CPU = the scheduler's own code per step, "
          "fake forward excluded\n")
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    ab: list[ABResult] = []
    for path in files:
        reqs = load_requests(path)
        for name, runner in runners:
            run = runner(reqs)
            print(table_row(path.name, summarize(run), name), flush=True)
            if path.name == AB_TRACE:
                ab.append(ab_ratios(runner, reqs, timed_with=run, name=name))
    if not a.no_sweep:
        sweeps = [(name, cpu_sweep(runner)) for name, runner in runners]
        print(f"\nScheduler CPU per step (us), n requests decoding together (prompt 4, output 28, "
              f"all at time 0; least of 3 runs)\n")
        print("| scheduler | " + " | ".join(f"n = {n}" for n in SWEEP_SIZES) + " |")
        print("|---|" + "---|" * len(SWEEP_SIZES))
        for name, sw in sweeps:
            print(f"| {name} | " + " | ".join(f"{sw[n]:.0f}" for n in SWEEP_SIZES) + " |")
    if ab:
        print(f"\nA/B trace `{AB_TRACE}`: B's median TTFT with A present over the same B requests alone")
        print("(at once: all submitted at time 0; from submit: submitted at the first step boundary after "
              "arrival, timed from then; from arrival: the same run, timed from the nominal arrival)\n")
        print("\n".join(ab_lines(ab)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
