#!/usr/bin/env python3
"""Batch's prefix caching beside vLLM's (``enable_prefix_caching=True``) on the Mooncake traces
(issues 30 and 41).

Two clocks (``--gpu``, comma-separated; ``make bench-vllm`` runs both). ``stub``: what follows.
A GPU profile (``h100-llama3-8b``): the iteration costs what it computes on that deployment
(``batch.sim.gpu_profile``; a prefix hit saves its tokens' compute), both sides get the profile's
cache (28,094 blocks, vLLM's sizing for an H100) and vLLM's limits for it, ``max_model_len``
131,072; the first ``GPU_LIMIT`` rows of each trace are time-scaled to ``--load`` (default 0.7)
of the capacity at each chunking (vLLM's default chunking and the 64-token rule; the capacity is
the steady-state completion rate of the rows all at once through vLLM with prefix caching), and the
table adds the steps and the mean tokens and requests a step (the instrumented counts that say
why two schedulers differ).

On the stub clock: the harness of ``bench/vllm_compare.py`` (the same simulated clock, 5 ms + 1 ms
per scheduled request a step; the same fake forward; the same timing definitions, ``summarize``),
with three changes:

* the prompts are real token ids: each Mooncake row's ``hash_ids`` (one per 512-token block)
  become token ids by ``batch.sim.traces.mooncake_prompt``, so equal ids give equal tokens, and
  both schedulers are given the same ids;
* the KV cache is ``KV_BLOCKS`` = 2,048 blocks of 16 tokens on both sides (32,768 tokens, what
  the ``mooncake-conv`` workload of ``make bench`` uses; the default cap, 256 blocks, is smaller
  than a median Mooncake prompt), vLLM's ``max_model_len`` is that many tokens, and both sides get
  256 resident requests and a token budget of the whole cache (Batch's defaults);
* prefix caching is on on both sides: ``Scheduler(prefix_caching=True)`` and vLLM's
  ``CacheConfig(enable_prefix_caching=True)``.

Rows whose prompt and output together exceed the cache (``prompt + output > 32,768`` tokens)
are left out on both sides (Batch refuses them at ``submit``; vLLM's engine refuses them
before its scheduler sees them); the table says how many.

Hit rate = prefix-cache hits / queries, in tokens, over every admission (a fresh request and a
preempted one coming back): Batch's ``prefix_cache_hits`` / ``prefix_cache_queries``
(``Scheduler.metrics()``); vLLM's ``PrefixCacheStats`` from its KV cache manager, the new
requests' and the preempted requests' counts added (vLLM keeps the two apart). And over the
fresh admissions alone: vLLM's exported ``prefix_cache_hits`` / ``prefix_cache_queries``; for
Batch, read from each tick's plan (its admissions never preempted, the cached blocks each got).

Usage, from the repository root::

    make bench-vllm                                    # this runs after bench/vllm_compare.py
    .venv-vllm/bin/python bench/vllm_prefix_compare.py [--limit 400] [--only conversation]
    .venv-vllm/bin/python bench/vllm_prefix_compare.py --gpu h100-llama3-8b [--load 0.7]
    python bench/vllm_prefix_compare.py --batch-only   # no vllm needed: Batch's side only
    python bench/vllm_prefix_compare.py --ab-seeds 10  # the A/B burst with a shared system prompt

Figures and what they mean: ``docs/prefix-caching.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import vllm_compare as vc
from batch.sim import simulate, traces
from inference_stub import Request
from scheduler import Scheduler

#: The cache on both sides on the stub's clock: 2,048 blocks of 16 tokens (``workloads``
#: ``mooncake-conv``'s cap), and Batch's defaults as the limits of both (256 resident requests, a
#: token budget of the whole cache).
KV_BLOCKS = 2048
BLOCK_TOKENS = vc.BLOCK_TOKENS
CAP_TOKENS = KV_BLOCKS * BLOCK_TOKENS
STUB = vc.Clock("stub", KV_BLOCKS, CAP_TOKENS, vc.VLLM_MAX_SEQS, CAP_TOKENS)
#: On a GPU clock: the load (fraction of the capacity at each chunking) and the rows of each trace.
GPU_LOAD = 0.7
GPU_LIMIT = 400
#: The Mooncake traces, in the order the table prints them.
TRACES = ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl")
LIMIT = 400
USERS = 5
SEED = 0


@dataclass(frozen=True)
class PromptRequest:
    """One trace row with its prompt's token ids: what both schedulers are given."""

    rid: str
    user: str
    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass
class CachedRun:
    """A replay and its prefix-cache counters (tokens, over every admission)."""

    run: vc.Run
    queries: int
    hits: int
    new_queries: int | None = None  # the fresh requests' alone (vLLM's exported counters); None: not kept apart
    new_hits: int | None = None
    isolated_steps: int | None = None  # Batch's isolated iterations (light users' prefill, the rest sit out)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def new_hit_rate(self) -> float | None:
        if self.new_queries is None:
            return None
        return self.new_hits / self.new_queries if self.new_queries else 0.0


def load_requests(path: str | Path, limit: int | None = LIMIT, users: int = USERS,
                  seed: int = SEED, clock: vc.Clock = STUB) -> tuple[list[PromptRequest], int]:
    """The first ``limit`` rows of a Mooncake trace that both sides can serve, and how many not.

    Returns:
        ``(requests, left_out)``: the rows with ``prompt + output`` within the cache and vLLM's
        ``max_model_len`` (``clock.fits``; users ``u1..u<users>`` drawn with ``seed``), and the
        count of the others.
    """
    rows = traces.load_mooncake(path, limit=limit, users=users, seed=seed)
    fit = [PromptRequest(r.request_id, r.user_id, float(r.submitted_at), tuple(r.prompt), r.max_tokens)
           for r in rows if clock.fits(len(r.prompt), r.max_tokens)]
    return fit, len(rows) - len(fit)


def run_batch(reqs: Sequence[PromptRequest], *, prefix_caching: bool = True, name: str = "Batch",
              clock: vc.Clock = STUB, chunk_tokens: int = vc.CHUNK_TOKENS, at_once: bool = False,
              factory=Scheduler) -> CachedRun:
    """Replay ``reqs`` through ``Scheduler(prefix_caching=...)`` on ``clock`` with its limits (the
    rest as ``vllm_compare.run_batch``: ``chunk_tokens``-token prefill chunks, no early EOS).

    Raises:
        RuntimeError: a request did not finish with exactly its output length (or was refused).
    """
    objs = [Request(user_id=r.user, prompt=list(r.prompt), max_tokens=r.output_tokens, request_id=r.rid,
                    submitted_at=0.0 if at_once else r.arrival_s) for r in reqs]
    meter = vc._MeteredBatch(functools.partial(factory, prefix_caching=prefix_caching))
    fresh = [0, 0, 0]  # fresh admissions' looked-up and hit tokens; isolated iterations

    def counting(**kw):
        sched = meter(**kw)
        tick = sched.tick

        def counted_tick():
            done = tick()
            plan = sched._last[0]  # the tick's plan (batch.core.state.Plan): its admissions and their hits
            if plan is not None:
                fresh[2] += bool(plan.isolated)
            if prefix_caching and plan is not None and plan.num_admitted:
                for seq in plan.seqs[len(plan.seqs) - plan.num_admitted:]:
                    if seq.num_preemptions == 0:
                        fresh[0] += seq.num_prompt_tokens
                        fresh[1] += len(plan.hits.get(seq, ())) * BLOCK_TOKENS
            return done
        sched.tick = counted_tick
        return sched
    wall = time.perf_counter()
    res = simulate.run_workload(objs, make_scheduler=counting, virtual=True,
                                gpu_seed=None, base_s=vc.BASE_S, per_request_s=vc.PER_REQUEST_S, eos_probability=0.0,
                                gpu=clock.gpu, prefill_chunk_tokens=chunk_tokens, **clock.batch_kwargs())
    wall = time.perf_counter() - wall
    nominal = {r.rid: 0.0 if at_once else r.arrival_s for r in reqs}
    timings = [vc.Timing(r.request_id, r.user_id, nominal[r.request_id], r.submitted_at, r.started_at,
                         r.completed_at, len(r.generated)) for r in res.finished]
    vc._check_complete(name, reqs, timings)
    m = res.scheduler.metrics()
    run = vc.Run(name, timings, preemptions=m["preemptions"], steps=meter.steps,
                 sched_cpu_s=meter.tick_cpu_s - meter.forward_cpu_s, wall_s=wall, **vc.batch_counts(m))
    return CachedRun(run, m.get("prefix_cache_queries", 0), m.get("prefix_cache_hits", 0), fresh[0], fresh[1],
                     isolated_steps=fresh[2])


def make_vllm_scheduler(threshold: int = vc.CHUNK_TOKENS, prefix_caching: bool = True, clock: vc.Clock = STUB,
                        cls=None, **kwargs):
    """vLLM's V1 ``Scheduler`` (or its subclass ``cls``) with ``clock``'s cache and limits
    (``max_model_len`` = the clock's), prefix caching as asked, statistics on (its prefix-cache counters)."""
    return vc.make_vllm_scheduler(threshold, cls, clock=clock, prefix_caching=prefix_caching, log_stats=True, **kwargs)


def vllm_block_hasher():
    """The per-request block hasher vLLM's engine core gives each ``Request`` when prefix caching
    is on (its hash function, chained over 16-token blocks): without one a request has no block
    hashes and never hits."""
    if "block_hasher" not in vc._VLLM_CACHE:
        from vllm.config import CacheConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(CacheConfig(block_size=BLOCK_TOKENS).prefix_caching_hash_algo)
        init_none_hash(fn)
        vc._VLLM_CACHE["block_hasher"] = get_request_block_hasher(BLOCK_TOKENS, fn)
    return vc._VLLM_CACHE["block_hasher"]


def run_vllm(reqs: Sequence[PromptRequest], *, threshold: int = vc.CHUNK_TOKENS, prefix_caching: bool = True,
             name: str = "vLLM", clock: vc.Clock = STUB, at_once: bool = False, cls=None, **kwargs) -> CachedRun:
    """Replay ``reqs`` through vLLM's V1 scheduler (or its subclass ``cls``) with prefix caching,
    the loop of ``vllm_compare.run_vllm`` (arrivals at step boundaries, ``clock.step_s`` of what
    was scheduled, a token for each request whose prefill is complete, EOS at the recorded length).

    Raises:
        VLLMUnavailable: vllm cannot be imported.
        RuntimeError: a request did not finish with exactly its output length.
    """
    v = vc._vllm()
    sched = make_vllm_scheduler(threshold, prefix_caching, clock, cls, **kwargs)
    hasher = vllm_block_hasher() if prefix_caching else None
    if at_once:
        reqs = [dataclasses.replace(r, arrival_s=0.0) for r in reqs]
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    out_len = {r.rid: r.output_tokens for r in reqs}
    meta = {r.rid: r for r in reqs}
    submit: dict[str, float] = {}
    first: dict[str, float] = {}
    produced: dict[str, int] = {}
    vreqs = []
    timings: list[vc.Timing] = []
    queries = hits = new_queries = new_hits = 0
    now, i, steps, cpu = 0.0, 0, 0, 0.0
    counts = {"busy_steps": 0, "scheduled_tokens": 0, "scheduled_seqs": 0}
    wall = time.perf_counter()
    while i < len(pending) or sched.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_s <= now:
            r = pending[i]
            sp = v.SamplingParams(max_tokens=r.output_tokens, ignore_eos=False)
            sp.update_from_generation_config({}, eos_token_id=vc.VLLM_EOS)
            vr = v.VRequest(request_id=r.rid, prompt_token_ids=list(r.prompt), sampling_params=sp,
                            pooling_params=None, arrival_time=r.arrival_s, block_hasher=hasher)
            vreqs.append(vr)
            sched.add_request(vr)
            submit[r.rid] = now
            i += 1
        if not sched.has_unfinished_requests():
            now = max(now, pending[i].arrival_s)
            continue
        t = vc._cpu()
        out = sched.schedule()
        cpu += vc._cpu() - t
        steps += 1
        stats = sched.kv_cache_manager.make_prefix_cache_stats()
        if stats is not None:
            queries += stats.queries + stats.preempted_queries
            hits += stats.hits + stats.preempted_hits
            new_queries += stats.queries
            new_hits += stats.hits
        ids = list(out.num_scheduled_tokens)
        if ids:
            now += clock.step_s(vc.vllm_items(sched, out))
            vc.count_step(counts, out)
        elif i < len(pending):
            now = max(now, pending[i].arrival_s)
        else:
            raise RuntimeError(f"{name}: vLLM scheduled nothing with {sched.get_num_unfinished_requests()} "
                               f"requests unfinished and none left to arrive")
        sampled: list[list[int]] = []
        for rid in ids:
            vr = sched.requests[rid]
            if vr.num_computed_tokens >= vr.num_tokens:
                k = produced.get(rid, 0) + 1
                produced[rid] = k
                sampled.append([vc.VLLM_EOS if k >= out_len[rid] else vc.VLLM_TOKEN])
                first.setdefault(rid, now)
                if k >= out_len[rid]:
                    timings.append(vc.Timing(rid, meta[rid].user, meta[rid].arrival_s, submit[rid], first[rid], now, k))
            else:
                sampled.append([])
        mro = v.ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                                  sampled_token_ids=sampled)
        t = vc._cpu()
        sched.update_from_output(out, mro)
        cpu += vc._cpu() - t
    wall = time.perf_counter() - wall
    vc._check_complete(name, reqs, timings)
    run = vc.Run(name, timings, preemptions=sum(vr.num_preemptions for vr in vreqs), steps=steps,
                 sched_cpu_s=cpu, wall_s=wall, **counts)
    return CachedRun(run, queries, hits, new_queries, new_hits)


HEADER = ("| trace | scheduler | hit rate (all / fresh) | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
          "e2e p50 / p99 (s) | preemptions | sched CPU / step (us) |")


def table_row(trace: str, c: CachedRun) -> str:
    s = vc.summarize(c.run)
    fresh = "n/a" if c.new_hit_rate is None else f"{c.new_hit_rate * 100:.2f}%"
    return (f"| `{trace}` | {c.run.name} | {c.hit_rate * 100:.2f}% / {fresh} | {s.throughput_tok_s:.1f} | "
            f"{s.ttft_p50_s:.2f} / {s.ttft_p99_s:.2f} | {s.tpot_p50_s * 1e3:.1f} / {s.tpot_p99_s * 1e3:.1f} | "
            f"{s.e2e_p50_s:.2f} / {s.e2e_p99_s:.2f} | {s.preemptions} | {s.cpu_us_per_step:.0f} |")


def ab_shared_prompt_ratios(seeds: Sequence[int], prefix_caching: bool) -> tuple[list[float], float]:
    """The seed's A/B burst (``bench_fairness.ab_burst``, arrivals over 1 s) with every prompt after
    one 512-token system prompt, on the virtual clock with 1,024 blocks: B's median TTFT with A over
    the same B requests alone, per seed, and the last run's hit rate (``docs/prefix-caching.md``)."""
    import bench_fairness as bf

    system = traces.block_token_ids(0)

    def burst(seed: int, with_a: bool) -> list[Request]:
        reqs = bf.ab_burst(seed, spread=True, with_a=with_a)
        for r in reqs:
            r.prompt = system + r.prompt
        return reqs

    def run(reqs: list[Request]) -> simulate.RunResult:
        return simulate.run_workload(reqs, make_scheduler=Scheduler, prefix_caching=prefix_caching,
                                     kv_cap_blocks=1024)
    ratios, hit = [], 0.0
    for seed in seeds:
        with_a, alone = run(burst(seed, True)), run(burst(seed, False))
        ratios.append(bf.median_ttft(with_a.finished, "B") / bf.median_ttft(alone.finished, "B"))
        hit = with_a.scheduler.metrics().get("prefix_cache_hit_rate", 0.0)
    return ratios, hit


def unbounded_hit_rate(reqs: Sequence[PromptRequest], block_tokens: int = BLOCK_TOKENS) -> float:
    """The hit rate ``reqs`` would reach in arrival order with a cache that never evicts: each
    prompt's leading full blocks (``batch.core.prefix_cache.block_keys``) seen in an earlier prompt,
    in tokens, over all prompt tokens. What the trace window allows; a real cache evicts."""
    from batch.core.prefix_cache import block_keys

    seen: set = set()
    hit = total = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        keys = block_keys(r.prompt, block_tokens)
        k = 0
        while k < len(keys) and keys[k] in seen:
            k += 1
        hit += k * block_tokens
        total += len(r.prompt)
        seen.update(keys)
    return hit / total if total else 0.0


GPU_HEADER = ("| trace | chunking | load (rate, req/s) | scheduler | hit rate (all / fresh) | req/s | tok/s | "
              "TTFT mean / p50 / p99 (s) | TPOT p50 / p99 (ms) | preemptions | steps (isolated) | "
              "tokens / requests a step |")


def gpu_row(trace: str, chunking: str, load: float, rate: float, c: CachedRun) -> str:
    s = vc.summarize(c.run)
    tok, seqs = c.run.per_step()
    fresh = "n/a" if c.new_hit_rate is None else f"{c.new_hit_rate * 100:.2f}%"
    return (f"| `{trace}` | {chunking} | {load:.2f} ({rate:.2f}) | {c.run.name} | {c.hit_rate * 100:.2f}% / {fresh} | "
            f"{s.request_rate:.3f} | {s.throughput_tok_s:.0f} | {s.ttft_mean_s:.2f} / {s.ttft_p50_s:.2f} / "
            f"{s.ttft_p99_s:.2f} | {s.tpot_p50_s * 1e3:.1f} / {s.tpot_p99_s * 1e3:.1f} | {s.preemptions} | "
            f"{s.steps}{'' if c.isolated_steps is None else f' ({c.isolated_steps})'} | {tok:.0f} / {seqs:.1f} |")


def gpu_section(clock: vc.Clock, folder: Path, names: Sequence[str], *, limit: int, users: int, load: float,
                cold: bool, vllm: bool, diagnose: bool = False) -> None:
    """Both Mooncake traces with prefix caching on both sides on a GPU clock, at its cache and
    limits, at ``load`` x the capacity of each chunking (``vllm_compare.CHUNKINGS``): the capacity
    is the steady-state completion rate of the rows all submitted at once, through vLLM with prefix
    caching at that chunking (Batch-FCFS where vllm does not import); the rows are not repeated,
    which would make copies hit each other."""
    from batch.policies.policy import FCFSPolicy

    print(f"\n## GPU clock `{clock.name}`: prefix caching on both sides\n\n{clock.describe()}\n")
    print(f"First {limit} rows of each trace, {users} users; each trace time-scaled to {load:g} x its capacity at each "
          f"chunking (the steady-state completion rate of its rows all at time 0 through "
          f"{'vLLM with prefix caching' if vllm else 'Batch-FCFS with prefix caching (vllm not importable)'} at that "
          f"chunking: completions between the 10% and 90% marks over the time between them).\n")
    print("Steps (isolated): Batch's iterations and, in brackets, those it ran isolated (a light user's prefill "
          "while others sit out); tokens / requests a step: means over the non-empty steps.\n")
    print(GPU_HEADER)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for name in names:
        reqs, left_out = load_requests(folder / name, limit, users, clock=clock)
        mean_prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
        notes.append(f"`{name}`: {len(reqs)} rows run, {left_out} left out (prompt + output beyond the cache or "
                     f"max_model_len {clock.max_model_len:,}); mean prompt {mean_prompt:,.0f} tokens, so the cache "
                     f"holds {clock.kv_blocks * clock.block_tokens / mean_prompt:.0f} of them; hit rate these rows "
                     f"would reach with a cache that never evicts: {unbounded_hit_rate(reqs) * 100:.1f}%")
        for _label, thr, chunk in vc.CHUNKINGS:
            chunk = clock.max_num_batched_tokens if chunk is None else chunk
            short = f"thr {thr} / chunk {chunk}"
            if vllm:
                ref = functools.partial(run_vllm, clock=clock, threshold=thr)
            else:
                ref = functools.partial(run_batch, clock=clock, chunk_tokens=chunk,
                                        factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k))
            cap = vc.capacity(reqs, lambda r, at_once=False: ref(r, at_once=at_once).run,  # noqa: B023 - called here
                              min_requests=0)
            scaled, rate = vc.at_load(reqs, load, cap)
            runners = [functools.partial(run_batch, clock=clock, chunk_tokens=chunk)]
            if diagnose:  # what the difference from vLLM is made of: the order, then isolation
                runners.append(functools.partial(run_batch, clock=clock, chunk_tokens=chunk, name="Batch-FCFS",
                                                 factory=lambda **k: Scheduler(policy=FCFSPolicy(), **k)))
                runners.append(functools.partial(run_batch, clock=clock, chunk_tokens=chunk,
                                                 name="Batch (isolation=False)",
                                                 factory=lambda **k: Scheduler(isolation=False, **k)))
            if cold:
                runners.append(functools.partial(run_batch, clock=clock, chunk_tokens=chunk, prefix_caching=False,
                                                 name="Batch (no prefix caching)"))
            if vllm:
                runners.append(functools.partial(run_vllm, clock=clock, threshold=thr,
                                                 name=f"vLLM (thr {thr}, prefix caching)"))
                if cold:
                    runners.append(functools.partial(run_vllm, clock=clock, threshold=thr, prefix_caching=False,
                                                     name=f"vLLM (thr {thr}, no prefix caching)"))
            for runner in runners:
                print(gpu_row(name, short, load, rate, runner(scaled)), flush=True)
            notes.append(f"`{name}`, {short}: capacity {cap:.2f} req/s")
    print("\n" + "\n".join(notes))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm_prefix_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default=None, help=f"the traces folder (default ${traces.TRACES_ENV}, else "
                                                  "data/traces in the checkout)")
    p.add_argument("--only", default=None, help="comma-separated trace names (or parts of them: conversation)")
    p.add_argument("--limit", type=int, default=None,
                   help=f"first N rows of each trace (default {LIMIT} on the stub clock, {GPU_LIMIT} on a GPU clock)")
    p.add_argument("--users", type=int, default=USERS, help=f"users the rows are spread over (default {USERS})")
    p.add_argument("--batch-only", action="store_true", help="Batch's side only (no vllm needed)")
    p.add_argument("--cold", action="store_true", help="also both schedulers with prefix caching off")
    p.add_argument("--diagnose", action="store_true",
                   help="on a GPU clock: also Batch-FCFS and Batch with isolation=False (both with prefix caching): "
                        "what Batch's difference from vLLM is made of")
    p.add_argument("--gpu", default="stub",
                   help="comma-separated clocks: stub (5 ms + 1 ms per request; 2,048 blocks; the default) and/or a GPU "
                        "profile (h100-llama3-8b: its step cost, cache and limits on both sides, each trace at --load "
                        "of its capacity, both chunkings)")
    p.add_argument("--load", type=float, default=GPU_LOAD,
                   help=f"on a GPU clock: the load, a fraction of the capacity (default {GPU_LOAD})")
    p.add_argument("--ab-seeds", type=int, default=None, metavar="N",
                   help="instead: the A/B burst with a shared system prompt, seeds 0..N-1, Batch with and without "
                        "prefix caching (B's median TTFT with A / alone)")
    a = p.parse_args(argv)
    if a.ab_seeds is not None:
        print("| | B's median TTFT with A / alone, per seed | worst |\n|---|---|---|")
        for on in (True, False):
            ratios, hit = ab_shared_prompt_ratios(range(a.ab_seeds), on)
            what = f"prefix caching on (hit rate {hit * 100:.1f}% on the last seed)" if on else "prefix caching off"
            print(f"| {what} | {', '.join(f'{x:.2f}' for x in ratios)} | {max(ratios):.2f} |")
        return 0
    try:
        clocks = [STUB if n.strip() == "stub" else vc.clock_for(n.strip()) for n in a.gpu.split(",") if n.strip()]
    except ValueError as e:
        p.error(str(e))
    if not clocks:
        p.error("--gpu names no clock")
    if not 0 < a.load < math.inf:
        p.error(f"--load must be a fraction of the capacity > 0, got {a.load}")
    folder = traces.traces_dir(a.traces)
    names = [t for t in TRACES if not a.only or any(o in t for o in a.only.split(","))]
    missing = [t for t in names if not (folder / t).is_file()]
    if not names or missing:
        p.error(f"no Mooncake trace {missing or a.only} in {folder} (pass --traces DIR or set {traces.TRACES_ENV})")
    vllm = not a.batch_only
    if vllm:
        try:
            vc._vllm()
        except vc.VLLMUnavailable as e:
            print(f"vllm_prefix_compare: {e}", file=sys.stderr)
            return 2
    for clock in clocks:
        if clock.profile is None:
            stub_section(a, folder, names, LIMIT if a.limit is None else a.limit, vllm)
        else:
            gpu_section(clock, folder, names, limit=GPU_LIMIT if a.limit is None else a.limit, users=a.users,
                        load=a.load, cold=a.cold, vllm=vllm, diagnose=a.diagnose)
    return 0


def stub_section(a: argparse.Namespace, folder: Path, names: Sequence[str], limit: int, vllm: bool) -> None:
    """The stub clock's table (the comparison as it ran before the GPU clock), 2,048 blocks."""
    runners: list[Callable[[Sequence[PromptRequest]], CachedRun]] = [run_batch]
    if a.cold:
        runners.append(functools.partial(run_batch, prefix_caching=False, name="Batch (no prefix caching)"))
    if vllm:
        runners.append(functools.partial(run_vllm, name="vLLM (thr 64, prefix caching)"))
        if a.cold:
            runners.append(functools.partial(run_vllm, prefix_caching=False, name="vLLM (thr 64, no prefix caching)"))
    print(f"Prefix caching on Mooncake (first {limit} rows, {a.users} users): simulated clock {vc.BASE_S * 1e3:g} ms "
          f"+ {vc.PER_REQUEST_S * 1e3:g} ms per scheduled request per step; KV {KV_BLOCKS} blocks x {BLOCK_TOKENS} "
          f"tokens on both sides; limits on both sides: max_num_seqs = Batch max_running = {STUB.max_num_seqs}, "
          f"max_num_batched_tokens = Batch token_budget_tokens = {STUB.max_num_batched_tokens}; prompts from hash_ids "
          f"(batch.sim.traces.mooncake_prompt); EOS at each request's recorded output length")
    if vllm:
        print(f"vLLM V1 Scheduler: enable_prefix_caching=True, long_prefill_token_threshold={vc.CHUNK_TOKENS}, "
              f"max_model_len={CAP_TOKENS}, CPU")
    print("hit rate = prefix-cache hit tokens / looked-up tokens, over every admission (all: a preempted request "
          "coming back hits its own blocks) and over fresh requests alone (vLLM's exported prefix_cache_hits / "
          "prefix_cache_queries)\n")
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for name in names:
        reqs, left_out = load_requests(folder / name, limit, a.users)
        notes.append(f"`{name}`: {len(reqs)} rows run, {left_out} left out (prompt + output > {CAP_TOKENS} tokens)")
        for runner in runners:
            print(table_row(name, runner(reqs)), flush=True)
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    sys.exit(main())
