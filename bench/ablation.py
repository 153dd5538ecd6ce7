#!/usr/bin/env python3
"""What each mechanism of the default scheduler buys: the default with one mechanism off at a time.

``Scheduler()`` is ``VTCPolicy()`` with the tick's mechanisms on (``batch/core/step.py``). For each,
this runs the default with only that mechanism switched off, beside the full default and FCFS
(``FCFSPolicy()``, vLLM V1's rule) as a reference, on the simulated clock (deterministic: seeded
workloads and token streams), and measures what the mechanism is *for*:

==============  ===========================================  ========================================
mechanism       switched off by                              measured
==============  ===========================================  ========================================
vtc             ``VTCPolicy(tolerance_tokens=2**40)``: every  four-user overload: largest service gap
                backlogged user within the band, so           and Jain's index; weighted share (weight
                admission is arrival order (nothing else      2 : 1, exact 2.00); B's TTFT ratio on the
                changes)                                      A/B burst
isolation       ``isolation=False``                           B's median TTFT with A / alone over the
                                                              A/B seeds (from submit, from arrival) and
                                                              on the A/B anchor (at once, from submit);
                                                              light users' TTFT p99 in a flood; the
                                                              same on a token-driven clock; the
                                                              isolated iterations and their throughput
headroom        ``admission_headroom=False``                  preemptions and throughput under KV
                                                              pressure
resume-first    ``resume_first=False``                        TPOT p99 under KV pressure (and over 8
                                                              seeds of the long requests)
victim          ``NewestVictimVTC()``: VTC with vLLM's        light users' requests preempted and
                victim, the newest admission (no pressure,    their TTFT p99 in a flood; B's requests
                no light-user shield, no fewest-preemptions   preempted on the A/B burst; preemptions,
                / fewest-computed-tokens order)               throughput, TTFT p99 under KV pressure
aging           ``aging_ticks=10**9`` (never comes due)       longest admission wait (ticks) of the
                                                              largest prompts, and of any request in
                                                              random small-cache cases
preemption-cap  ``max_preemptions=4``: the cap switched ON    most preemptions of one request, on the
(no cap)        (the default pins nothing; the protected      workloads and in random tiny-cache cases;
                reservation holder bounds waits instead)      the longest waits
pressure-       ``NoPressureVictimVTC()``: VTC's victim       the second user's token share when the
victim          without ``victim_user_first`` (the user of    attacker comes first; the weighted
                highest pressure first)                       overload's shares; preemptions
room            ``NoRoomVTC()``: ``Policy.pressure`` is       the attacker-first share; a 2-token
                ``None`` to admission (no room for another    request's iterations to its first token
                user's request by pressure)                   beside long streams; preemptions
quantum         ``quantum_ticks=1``                           preemptions and recomputed work in the
                                                              attacker-first loop; its share
hold            ``hold_ticks=0``: requests that fit pass a    longest waits of the largest prompts;
                blocked head at once                          throughput, TTFT p99
requeue-behind  ``FrontRequeueVTC()``: a preempted decode     TTFT p99 and TPOT p99 under KV pressure;
                keeps its arrival place                       preemptions
light-first     ``NoLightFirstVTC()``: the order ignores      light users' TTFT in a flood and beside
                light users                                   long streams; B's ratio on the A/B burst
tolerance       ``VTCPolicy(tolerance_tokens=T)``, T in 0,    a trade-off curve, not a switch: TTFT
                512, 2048, 32768 (the default is T = 8192)    p99 on the three balanced anchors beside
                                                              vLLM's; the weight-2 user's share on the
                                                              weighted overload (exact 2.00)
==============  ===========================================  ========================================

Each row ends with its verdict: the figures that change by 1% or more without the mechanism
(``Row.moved``), or that none does. A change is given paired by seed (mean, sd, seeds worse /
better) where a single seed would not tell it from noise.

Workloads: ``batch.sim.workloads`` (``make bench``'s saturating ones), the four anchor traces of
``bench/vllm_compare.py`` (replayed by its ``run_batch``: throughput, TTFT p50 / p99, TPOT p99,
preemptions, and on the A/B anchor B's ratios at once / from submit / from arrival), the A/B
burst ``vllm_compare.ab_trace`` over seeds (B's ratio by ``vllm_compare.ab_ratios``), and the
overload, flood and weighted runs of ``bench/bench_fairness.py``. vLLM's TTFT p99 beside the
tolerance curve is measured by ``vllm_compare.run_vllm`` when vllm is importable (``make
bench-vllm``'s ``.venv-vllm``), else quoted from the last run (``VLLM_TTFT_P99_QUOTED``).

Prints one markdown table, a row per mechanism (the figure with it, without it, FCFS's), the
tolerance curve, the anchors' table of every variant, then the matrix of every variant on the
common workloads. ``--json`` prints everything as one JSON object instead. ``--quick`` is a small
run (seconds), what ``tests/test_ablation.py`` runs.

``--gpu h100-llama3-8b`` reruns everything on a GPU's clock (``batch.sim.gpu_profile``: an
iteration costs what its prefill tokens, decode sequences and KV reads cost on an H100 with
Llama-3-8B) while every workload keeps its own cache and ``Scheduler()``'s limits, so that a
verdict that changes is the clock's doing (``docs/design.md`` says which do). The token-clock rows
of the isolation mechanism are left out there: every row is token-driven on that clock.

Usage, from the project root::

    python bench/ablation.py [--quick] [--seeds 10] [--only victim,tolerance] [--json]
    python bench/ablation.py --gpu h100-llama3-8b
    .venv-vllm/bin/python bench/ablation.py --only tolerance    # vLLM's figures measured, not quoted
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as _dt
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import bench  # bench/bench.py
import inference_stub
import bench_fairness as bf
import vllm_compare as vc
from batch.policies.policy import FCFSPolicy, Policy
from batch.policies.vtc import VTCPolicy
from batch.sim import simulate, workloads
from inference_stub import Request
from scheduler import MAX_RUNNING_REQUESTS, Scheduler
from spec import fairness_rules as fr

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: A tolerance no counter gap reaches: every backlogged user is eligible, admission is arrival order.
NO_ORDER_TOLERANCE = 2 ** 40
#: An aging bound no request reaches.
NEVER_TICKS = 10 ** 9
#: The token-driven clock of the isolation row (a real GPU's regime, ``tests/test_fairness.py``).
TOKEN_BASE_S = 0.008
TOKEN_PER_TOKEN_S = 0.00002
#: The overload's weighted run (``bench_fairness``'s): user ``short`` at weight 2.
WEIGHTS = {"short": 2}
#: The share of the largest prompts whose admission wait the aging row reports.
LARGEST_SHARE = 0.05
#: A figure "changes" when it moves by this share of its value with the mechanism on.
MOVED = 0.01
#: vLLM's TTFT p99 (s) on the anchor traces, ``vllm_compare.run_vllm`` (vllm 0.33.0, CPU, thr 64),
#: 2026-12-02, commit 5f96ec2: quoted when vllm is not importable here.
VLLM_TTFT_P99_QUOTED = {"poisson_n300_r30_seed0.csv": 9.356, "trace200_poisson20_seed0.csv": 2.617,
                        "trace2k.csv": 31.340, "ab_100A_5B_1s_seed0.csv": 4.598}


# ----------------------------------------------------------------------------- the variants


class NewestVictimVTC(VTCPolicy):
    """``VTCPolicy`` with vLLM's victim rule, the most recently admitted request (``Policy.victim``):
    the ablation's victim row switched off (no user of highest pressure first, no light-user
    shield, no fewest-preemptions or fewest-computed-tokens order). Everything else is VTC's."""

    victim = Policy.victim


class NoPressureVictimVTC(VTCPolicy):
    """``VTCPolicy`` whose victim ignores pressure: ``spec.fairness_rules.victim_before`` alone
    (light users' requests last, then fewest preemptions, fewest computed tokens, newest
    admission), never first restricted to the user of highest ``pressure_units``
    (``victim_user_first``). The pressure row switched off; room by pressure is unchanged."""

    def victim(self, candidates: Sequence[Any]) -> Any:
        blocks: dict[str, int] = {}
        for s in candidates:
            blocks[s.user_id] = blocks.get(s.user_id, 0) + len(s.block_table)
        total, total_w = sum(blocks.values()), sum(self.weight(u) for u in blocks)
        light = {u for u, b in blocks.items() if fr.within_share(b, self.weight(u), total, total_w, 1, 4)}
        best = candidates[0]
        for s in candidates[1:]:
            if fr.victim_before(s.user_id in light, s.num_preemptions, s.num_computed_tokens, s.admit_no,
                                best.user_id in light, best.num_preemptions, best.num_computed_tokens, best.admit_no):
                best = s
        return best


class NoRoomVTC(VTCPolicy):
    """``VTCPolicy`` that keeps no shares among resident requests for admission: ``pressure`` is
    ``None`` (``Policy.pressure``), so a waiting request that is neither a light user's nor the
    reservation holder's gets no room (``step._room``); its own victim rule still ranks users by
    pressure. The room row switched off."""

    _in_victim = False

    def pressure(self, user_id: str, resident_requests: int) -> int | None:
        return super().pressure(user_id, resident_requests) if self._in_victim else None

    def victim(self, candidates: Sequence[Any]) -> Any:
        self._in_victim = True
        try:
            return super().victim(candidates)
        finally:
            self._in_victim = False


class FrontRequeueVTC(VTCPolicy):
    """``VTCPolicy`` whose preempted decodes keep their arrival place (``order_no`` unchanged,
    ``requeue_behind = False``). The requeue-behind row switched off."""

    requeue_behind = False


class NoLightFirstVTC(VTCPolicy):
    """``VTCPolicy`` whose admission order ignores light users (``order(light)`` as ``order()``):
    light users' requests take their place in the band like anyone's. Room and isolation still
    favour them. The light-first row switched off."""

    def order(self, light: Callable[[str], bool] | None = None) -> Any:
        return super().order()


@dataclass(frozen=True)
class Variant:
    """A scheduler configuration: the default with one mechanism off (or FCFS, or the default).

    Attributes:
        key: short name (``--only``).
        name: the mechanism's name in the table.
        off: how it is switched off (the knob, as code).
        for_: what the mechanism is for.
        kwargs: builds ``Scheduler`` keyword arguments, given the user weights (fresh objects per call).
    """

    key: str
    name: str
    off: str
    for_: str
    kwargs: Callable[[dict | None], dict] = field(repr=False)

    def factory(self, weights: dict | None = None, cls: type = Scheduler) -> Callable[..., Scheduler]:
        """A ``make_scheduler`` for ``simulate.run_workload`` / a ``factory`` for ``vc.run_batch``."""
        return lambda **kw: cls(**self.kwargs(weights), **kw)


def _vtc(policy: type = VTCPolicy, **knobs: Any) -> Callable[[dict | None], dict]:
    """``policy(weights=w, **flags)`` with the Scheduler ``knobs``; ``tolerance_tokens`` goes to the policy."""
    flags = {k: knobs.pop(k) for k in ("tolerance_tokens",) if k in knobs}
    return lambda w: {"policy": policy(weights=w, **flags), **knobs}


DEFAULT = Variant("default", "default", "Scheduler()", "", lambda w: {"policy": VTCPolicy(weights=w)} if w else {})
FCFS = Variant("fcfs", "FCFS", "Scheduler(policy=FCFSPolicy())", "", lambda w: {"policy": FCFSPolicy()})
MECHANISMS: tuple[Variant, ...] = (
    Variant("vtc", "VTC order", "VTCPolicy(tolerance_tokens=2**40): arrival order",
            "equal (weighted) service for backlogged users", _vtc(tolerance_tokens=NO_ORDER_TOLERANCE)),
    Variant("isolation", "TTFT isolation", "isolation=False",
            "a light user's TTFT beside a heavy user (room, isolated prefill)", _vtc(isolation=False)),
    Variant("headroom", "admission headroom", "admission_headroom=False",
            "fewer preemptions under KV pressure", _vtc(admission_headroom=False)),
    Variant("resume-first", "preempted decodes resume first", "resume_first=False",
            "TPOT p99 under KV pressure", _vtc(resume_first=False)),
    Variant("victim", "VTC victim rule (light-user shield)", "NewestVictimVTC(): vLLM's newest admission",
            "light users' requests kept under KV pressure; the least recompute lost", _vtc(NewestVictimVTC)),
    Variant("aging", "aging with a reservation", "aging_ticks=10**9",
            "a bounded wait for a request that does not fit", _vtc(aging_ticks=NEVER_TICKS)),
    Variant("preemption-cap", "no preemption cap (the protected holder instead)",
            "max_preemptions=4: the cap switched on, pinning after 4",
            "waits bounded without pinning requests to their worst case", _vtc(max_preemptions=4)),
    Variant("pressure-victim", "victim from the user of highest pressure",
            "NoPressureVictimVTC(): victim_before alone",
            "resident requests shared by weight: victims from the user holding most", _vtc(NoPressureVictimVTC)),
    Variant("room", "room by pressure after the quantum", "NoRoomVTC(): no room by pressure",
            "a user under its share gets slots and blocks from one over it", _vtc(NoRoomVTC)),
    Variant("quantum", "quantum (anti-thrash)", "quantum_ticks=1",
            "few preemptions for room; the reservation holder's protection", _vtc(quantum_ticks=1)),
    Variant("hold", "hold behind a blocked head", "hold_ticks=0: pass it at once",
            "the blocked head's wait before its reservation", _vtc(hold_ticks=0)),
    Variant("requeue-behind", "preempted decodes requeued behind", "FrontRequeueVTC(): keep the arrival place",
            "a preempted decode waits behind arrivals (resume-first still tries it)", _vtc(FrontRequeueVTC)),
    Variant("light-first", "light users first in the order", "NoLightFirstVTC(): order ignores light",
            "light users' TTFT beside heavy ones", _vtc(NoLightFirstVTC)),
)
VARIANTS = {v.key: v for v in (DEFAULT, FCFS, *MECHANISMS)}
#: The tolerance row's key (a curve over ``Config.tolerances``, not a mechanism switched off).
TOLERANCE = "tolerance"
KEYS = (*(v.key for v in MECHANISMS), TOLERANCE)


def tolerance_variant(tolerance: int) -> Variant:
    """The default with ``VTCPolicy(tolerance_tokens=tolerance)``."""
    return Variant(f"T{tolerance}", f"T = {tolerance}", f"VTCPolicy(tolerance_tokens={tolerance})", "",
                   _vtc(tolerance_tokens=tolerance))


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    """What one ablation run measures (``full()``: the documented run; ``quick()``: seconds)."""

    seeds: int = 10  # A/B burst seeds (vllm_compare.ab_trace), for VTC, isolation, the victim
    workloads: tuple[str, ...] = ("stream-saturating", "ab-burst", "long-kv", "azure-conv", "mooncake-conv")
    anchors: tuple[str, ...] = vc.ORDER  # the four anchor traces (vllm_compare.run_batch)
    balanced: tuple[str, ...] = vc.ORDER[:3]  # the balanced anchors of the tolerance curve
    tolerances: tuple[int, ...] = (0, 512, 2048, fr.TOLERANCE_TOKENS, 32768)
    long_seeds: int = 8  # workloads.long_requests seeds (resume-first, aging)
    overload_per_user: int = 400
    flood: int = 1000
    cap_cases: int = 100
    wait_cases: int = 100
    longs_seeds: int = 2
    longs_shorts: int = 3000
    attack_streams: int = 64  # bench_fairness.attacker_first: streams per user
    attack_horizon_s: float = 62.0  # its windows: from 7 s to the horizon
    probe_streams: int = 100  # bench_fairness.long_streams_probe: long streams
    probe_ticks: tuple[int, ...] = (300, 1000, 2000, 3000, 4000)
    quick_workloads: bool = False  # the workloads from workloads.QUICK_WORKLOADS

    @classmethod
    def full(cls, seeds: int = 10) -> "Config":
        return cls(seeds=seeds)

    @classmethod
    def quick(cls) -> "Config":
        """One seed, the small workloads, one short anchor trace: what the test runs."""
        return cls(seeds=1, workloads=("long-kv",), anchors=(vc.AB_TRACE,), balanced=(vc.AB_TRACE,),
                   tolerances=(2048, fr.TOLERANCE_TOKENS), long_seeds=1, overload_per_user=80, flood=100, cap_cases=3,
                   wait_cases=3, longs_seeds=1, longs_shorts=100, attack_streams=8, attack_horizon_s=24.0,
                   probe_streams=20, probe_ticks=(300, 600), quick_workloads=True)


# ----------------------------------------------------------------------------- a recording scheduler


class _Recorder(Scheduler):
    """``Scheduler`` that records, per request, its preemptions and the ticks from submit to
    first admission; per user, its requests' preemptions; and counts the ticks in which the
    aging reservation is held, the isolated iterations and the tokens preempted requests had
    computed (``recomputed_tokens``: work lost to recompute)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.n_ticks = 0
        self.submit_tick: dict[str, int] = {}
        self.admit_tick: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.preempted: collections.Counter = collections.Counter()
        self.preempted_by_user: collections.Counter = collections.Counter()
        self.reserved_ticks = 0
        self.isolated_ticks = 0
        self.plan_tokens = 0  # the last plan's batched tokens (the token-driven clock reads it)
        self.recomputed_tokens = 0

    def submit(self, request: Request) -> None:
        super().submit(request)
        self.submit_tick.setdefault(request.request_id, self.n_ticks)
        self.prompt_tokens[request.request_id] = len(request.prompt)

    def schedule(self):
        plan = super().schedule()
        self.plan_tokens = plan.num_batched_tokens
        return plan

    def update_from_output(self, plan, tokens, **kw):
        for entry in plan.batch:
            if entry.admitted:
                self.admit_tick.setdefault(entry.seq.request_id, self.n_ticks)
        for q in plan.preempted:
            self.preempted[q.request_id] += 1
            self.preempted_by_user[q.user_id] += 1
            self.recomputed_tokens += q.num_computed_tokens
        out = super().update_from_output(plan, tokens, **kw)
        self.reserved_ticks += self.state.reserved is not None
        self.isolated_ticks += plan.isolated
        self.n_ticks += 1
        return out

    def waits(self) -> dict[str, int]:
        """Ticks from submit to first admission, per request."""
        return {rid: t - self.submit_tick[rid] for rid, t in self.admit_tick.items()}


# ----------------------------------------------------------------------------- measurements


def _pct(xs: Sequence[float], q: float) -> float:
    return vc.percentile(list(xs), q)


#: The clock of every run (``--gpu``): None, the stub's (5 ms + 1 ms per request an iteration); a
#: ``batch.sim.gpu_profile`` name, that deployment's step cost, with each workload's own cache and
#: Batch's default limits kept, so that only the iteration time changes.
GPU: str | None = None


def run_workload(reqs: Sequence[Request], **kw: Any) -> simulate.RunResult:
    """``simulate.run_workload`` on the ablation's clock (``GPU``): on a GPU profile, the workload's
    ``kv_cap_blocks`` (default 256), 256 resident requests and the whole cache as the token budget,
    as ``Scheduler()`` has them."""
    if GPU is not None and kw.get("gpu") is None:
        kw["gpu"] = GPU
        kv = kw.setdefault("kv_cap_blocks", inference_stub.MAX_KV_BLOCKS)
        kw.setdefault("max_running", MAX_RUNNING_REQUESTS)
        kw.setdefault("token_budget_tokens", kv * kw.get("block_tokens", inference_stub.KV_BLOCK_TOKENS))
    return simulate.run_workload(reqs, **kw)


def clock() -> vc.Clock:
    """The clock of the anchor replays (``vllm_compare.run_batch`` / ``run_vllm``): the stub's
    limits, on the stub's clock or ``GPU``'s step cost."""
    if GPU is None:
        return vc.STUB
    return dataclasses.replace(vc.STUB, name=GPU, profile=vc.clock_for(GPU).profile)


def _workload(name: str, quick: bool) -> workloads.Workload:
    pool = workloads.QUICK_WORKLOADS if quick else workloads.WORKLOADS
    return next(w for w in pool if w.name == name)


def run_requests(v: Variant, reqs: list[Request], *, kv_cap_blocks: int = 256, eos_probability: float = 0.0,
                 weights: dict | None = None) -> dict:
    """One replay through ``simulate.run_workload`` (the ablation's clock, token seed ``bench.GPU_SEED``)."""
    res = run_workload(reqs, make_scheduler=v.factory(weights, _Recorder), gpu_seed=bench.GPU_SEED,
                                eos_probability=eos_probability, kv_cap_blocks=kv_cap_blocks, record_itl=False)
    s: _Recorder = res.scheduler
    m = s.metrics()
    waits = s.waits()
    by_size = sorted(waits, key=lambda rid: -s.prompt_tokens[rid])
    largest = by_size[:max(1, math.ceil(LARGEST_SHARE * len(by_size)))]
    return {"throughput_tok_s": m["throughput_tokens_per_sec"], "ttft_p99_s": m["ttft_p99_s"],
            "tpot_p99_s": m["tpot_p99_s"], "preemptions": m["preemptions"],
            "max_preemptions_one_request": max(s.preempted.values(), default=0),
            "max_wait_ticks": max(waits.values(), default=0),
            "largest_prompts_max_wait_ticks": max((waits[r] for r in largest), default=0),
            "reserved_ticks": s.reserved_ticks, "isolated_ticks": s.isolated_ticks,
            "ticks": s.n_ticks, "sim_s": res.sim_s}


def run_batch(v: Variant, reqs: Sequence[vc.TraceRequest], **kw: Any) -> tuple[vc.Run, _Recorder]:
    """``vllm_compare.run_batch`` of ``reqs`` through ``v`` (its driver and clock), and the scheduler."""
    holder: dict[str, _Recorder] = {}
    inner = v.factory(None, _Recorder)

    def make(**k: Any) -> Scheduler:
        holder["s"] = inner(**k)
        return holder["s"]

    return vc.run_batch(reqs, factory=make, name=v.key, clock=clock(), **kw), holder["s"]


def vllm_ttft_p99(path: Path) -> tuple[float, str]:
    """vLLM's TTFT p99 (s) on the trace at ``path`` and where it comes from: ``"measured"``
    (``vllm_compare.run_vllm``, vllm importable here) or ``"quoted"`` (``VLLM_TTFT_P99_QUOTED``;
    NaN for a trace it does not have)."""
    try:
        vc._vllm()  # the import check vllm_compare.main makes
    except vc.VLLMUnavailable:
        return (VLLM_TTFT_P99_QUOTED.get(path.name, math.nan) if GPU is None else math.nan), "quoted"
    return vc.summarize(vc.run_vllm(vc.load_requests(path), clock=clock())).ttft_p99_s, "measured"


class Lab:
    """Every measurement, computed on first use and kept (so rows share the default's runs)."""

    def __init__(self, cfg: Config, traces: Path, log: Callable[[str], None] = lambda s: None) -> None:
        self.cfg = cfg
        self.traces = traces
        self.log = log
        self._memo: dict[tuple, Any] = {}

    def _get(self, key: tuple, fn: Callable[[], Any]) -> Any:
        if key not in self._memo:
            t = time.process_time()
            self._memo[key] = fn()
            self.log(f"  {key[0]:>10} {key[1]:<15} {' '.join(map(str, key[2:]))[:40]:<40} {time.process_time() - t:6.1f} s")
        return self._memo[key]

    # --- make bench's workloads (stub clock)
    def workload(self, v: Variant, name: str) -> dict:
        w = _workload(name, self.cfg.quick_workloads)
        return self._get(("workload", v.key, name), lambda: run_requests(
            v, w.build(), kv_cap_blocks=w.kv_cap_blocks, eos_probability=w.eos_probability))

    # --- the anchor traces (vllm_compare's driver: outputs end at their recorded length)
    def anchor(self, v: Variant, name: str) -> dict | None:
        """Throughput, TTFT p50 / p99, TPOT p99, preemptions; on the A/B anchor also B's median
        TTFT with A over alone at once / from submit / from arrival. ``None``: no such trace."""
        path = self.traces / name
        if not path.is_file():
            return None

        def go() -> dict:
            reqs = vc.load_requests(path)
            run, _ = run_batch(v, reqs)
            s = vc.summarize(run)
            out = {"throughput_tok_s": s.throughput_tok_s, "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
                   "tpot_p99_s": s.tpot_p99_s, "preemptions": s.preemptions}
            if name == vc.AB_TRACE:
                r = vc.ab_ratios(lambda rs, **kw: run_batch(v, rs, **kw)[0], reqs, timed_with=run)
                out.update({f"ab_{t.replace(' ', '_')}": r.ratio(t) for t in vc.AB_TIMINGS})
            return out
        return self._get(("anchor", v.key, name), go)

    def vllm(self, name: str) -> tuple[float, str] | None:
        """vLLM's TTFT p99 on an anchor trace (``vllm_ttft_p99``); ``None``: no such trace."""
        path = self.traces / name
        if not path.is_file():
            return None
        return self._get(("vllm", "vLLM", name), lambda: vllm_ttft_p99(path))

    # --- seeds of the long requests, for the spread
    def seeded(self, v: Variant, family: str = "long-kv") -> list[dict]:
        def go() -> list[dict]:
            n = 8 if self.cfg.quick_workloads else 30
            return [run_requests(v, workloads.long_requests(n=n, seed=seed)) for seed in range(self.cfg.long_seeds)]
        return self._get(("seeded", v.key, family), go)

    # --- the A/B burst (vllm_compare.ab_trace) on the stub's clock: B's ratios and preemptions
    def ab(self, v: Variant) -> dict:
        def go() -> dict:
            sub, arr, thr, pre, pre_b, iso = [], [], [], [], [], []
            for seed in range(self.cfg.seeds):
                reqs = vc.ab_trace(seed)
                with_a, s = run_batch(v, reqs)
                r = vc.ab_ratios(lambda rs, **kw: run_batch(v, rs, **kw)[0], reqs, timed_with=with_a)
                sub.append(r.ratio("from submit"))
                arr.append(r.ratio("from arrival"))
                summ = vc.summarize(with_a)
                thr.append(summ.throughput_tok_s)
                pre.append(summ.preemptions)
                pre_b.append(s.preempted_by_user["B"])
                iso.append(s.isolated_ticks)
            return {"submit_median": statistics.median(sub), "submit_worst": max(sub),
                    "arrival_median": statistics.median(arr), "arrival_worst": max(arr),
                    "throughput_tok_s": statistics.mean(thr), "preemptions": statistics.mean(pre),
                    "b_preemptions": statistics.mean(pre_b), "isolated_ticks": statistics.mean(iso)}
        return self._get(("ab", v.key), go)

    # --- the A/B burst on a token-driven clock (8 ms + 0.02 ms per batched token)
    def ab_tokens(self, v: Variant) -> dict:
        def run(reqs: list[vc.TraceRequest]) -> tuple[list[Request], _Recorder]:
            objs = [Request(user_id=r.user, prompt=[1] * r.prompt_tokens, max_tokens=r.output_tokens,
                            request_id=r.rid, submitted_at=r.arrival_s) for r in reqs]
            inner = v.factory(None, _Recorder)

            def make(*, clock: Callable[[], float], backend: Callable, **kw: Any) -> Scheduler:
                gpu_clock = backend.__self__.clock  # the SimulatedGPU's VirtualClock (its own costs are 0)
                holder: dict[str, _Recorder] = {}

                def forward(batch: list[Request]) -> list[int]:
                    gpu_clock.advance(TOKEN_BASE_S + TOKEN_PER_TOKEN_S * holder["s"].plan_tokens)
                    return backend(batch)

                holder["s"] = inner(clock=clock, backend=forward, **kw)
                return holder["s"]

            if GPU is not None:  # a GPU clock is token-driven already: run on it as is
                res = run_workload(objs, make_scheduler=inner, gpu_seed=None, eos_probability=0.0, record_itl=False)
                return res.finished, res.scheduler
            res = simulate.run_workload(objs, make_scheduler=make, gpu_seed=None, base_s=0.0, per_request_s=0.0,
                                        eos_probability=0.0, record_itl=False)
            return res.finished, res.scheduler

        def go() -> dict:
            ratios, thr, iso = [], [], []
            for seed in range(self.cfg.seeds):
                reqs = vc.ab_trace(seed)
                fin, s = run(reqs)
                alone, _ = run(vc.without_user(reqs, "A"))
                ratios.append(bf.median_ttft(fin, "B") / bf.median_ttft(alone, "B"))
                t0 = min(r.arrival_s for r in reqs)
                thr.append(sum(len(r.generated) for r in fin) / (max(r.completed_at for r in fin) - t0))
                iso.append(s.isolated_ticks)
            return {"ratio_median": statistics.median(ratios), "ratio_worst": max(ratios),
                    "throughput_tok_s": statistics.mean(thr), "isolated_ticks": statistics.mean(iso)}
        return self._get(("ab_tokens", v.key), go)

    # --- the four-user overload (bench_fairness.overload), unweighted and weighted
    def overload(self, v: Variant) -> dict:
        def go() -> dict:
            n = self.cfg.overload_per_user
            res = run_workload(bf.overload(0, n_per_user=n), record_itl=False,
                                        make_scheduler=v.factory(None, bf.RecordingScheduler))
            trace = res.scheduler.trace
            m = res.scheduler.metrics()
            return {"jain": bf.jain_while_all_backlogged(trace, list(bf.OVERLOAD_USERS)),
                    "max_gap": bf.max_service_gap(trace), "throughput_tok_s": m["throughput_tokens_per_sec"],
                    "preemptions": m["preemptions"], "weighted_share": self.weighted_share(v)}
        return self._get(("overload", v.key), go)

    def weighted_share(self, v: Variant) -> float:
        """``bench_fairness``'s weighted overload (``short`` at weight 2): the raw service of
        ``short`` over the mean of the other three's while all four are backlogged (exact: 2.0)."""
        def go() -> float:
            res = run_workload(
                bf.overload(0, n_per_user=self.cfg.overload_per_user), record_itl=False,
                make_scheduler=lambda **k: bf.RecordingScheduler(weights=WEIGHTS, **v.kwargs(WEIGHTS), **k))
            acc = bf.raw_service_while_backlogged(res.scheduler.trace, bf.OVERLOAD_USERS, WEIGHTS)
            others = [acc[u] for u in bf.OVERLOAD_USERS if u != "short"]
            return acc["short"] / (sum(others) / len(others))
        return self._get(("weighted", v.key), go)

    # --- the flood (bench_fairness.flood): light users' TTFT beside a large backlog of A's
    def flood(self, v: Variant) -> dict:
        def go() -> dict:
            res = run_workload(bf.flood(0, n_flood=self.cfg.flood), make_scheduler=v.factory(None, _Recorder),
                                        record_itl=False)
            s: _Recorder = res.scheduler
            light = [r.started_at - r.submitted_at for r in res.finished if r.user_id != "A"]
            return {"light_ttft_p99_s": _pct(light, 99), "light_ttft_p50_s": _pct(light, 50),
                    "light_preemptions": sum(n for u, n in s.preempted_by_user.items() if u != "A"),
                    "preemptions": s.metrics()["preemptions"],
                    "throughput_tok_s": s.metrics()["throughput_tokens_per_sec"]}
        return self._get(("flood", v.key), go)

    # --- long requests amid a saturating stream of short ones (aging)
    def longs(self, v: Variant) -> dict:
        def go() -> dict:
            worst, mean = [], []
            for seed in range(self.cfg.longs_seeds):
                r = run_workload(longs_amid_shorts(seed, n_short=self.cfg.longs_shorts),
                                          make_scheduler=v.factory(None, _Recorder), gpu_seed=bench.GPU_SEED,
                                          record_itl=False)
                w = [t for rid, t in r.scheduler.waits().items() if rid.startswith("L")]
                worst.append(max(w))
                mean.append(statistics.mean(w))
            return {"long_max_wait_ticks": max(worst), "long_mean_wait_ticks": statistics.mean(mean)}
        return self._get(("longs", v.key), go)

    # --- random tiny-cache cases (the preemption cap)
    def cap_cases(self, v: Variant) -> dict:
        def go() -> dict:
            most, total, over, span = 0, 0, 0, 0.0
            for case in range(self.cfg.cap_cases):
                kv, reqs = tiny_cache_case(case)
                r = run_requests(v, reqs, kv_cap_blocks=kv)
                most = max(most, r["max_preemptions_one_request"])
                over += r["max_preemptions_one_request"] > 4
                total += r["preemptions"]
                span += r["sim_s"]
            return {"max_preemptions_one_request": most, "cases_over_4": over, "preemptions": total,
                    "makespan_s": span}
        return self._get(("cap_cases", v.key), go)

    # --- issue 38's closed loops (bench_fairness): the attacker first, one user's long streams
    def attack(self, v: Variant) -> dict:
        """``attacker_first``: the second user's least and mean share of the 15-s windows, then
        the same at weights 2 : 1 for it (keys ``w_...``; its exact share 2/3); preemptions, the
        tokens preempted requests had computed (recomputed later), output tok/s."""
        def go() -> dict:
            cfg = self.cfg
            out = {}
            for tag, w in (("", None), ("w_", {"A": 2})):
                run = bf.attacker_first(v.factory(w, _Recorder), n_streams=cfg.attack_streams,
                                        horizon_s=cfg.attack_horizon_s)
                s: _Recorder = run.scheduler
                m = s.metrics()
                out.update({f"{tag}min_share": min(run.shares), f"{tag}mean_share": _mean(run.shares),
                            f"{tag}preemptions": m["preemptions"], f"{tag}recomputed_tokens": s.recomputed_tokens,
                            f"{tag}throughput_tok_s": sum(map(len, run.token_s.values())) / cfg.attack_horizon_s})
            return out
        return self._get(("attack", v.key), go)

    def probe(self, v: Variant) -> dict:
        """``long_streams_probe``: the most iterations a 2-token request waited for its first token."""
        def go() -> dict:
            probes = bf.long_streams_probe(v.factory(None), n_streams=self.cfg.probe_streams,
                                           probe_ticks=self.cfg.probe_ticks)
            return {"max_to_first_token": max(p.to_first_token for p in probes),
                    "mean_to_first_token": _mean([p.to_first_token for p in probes])}
        return self._get(("probe", v.key), go)

    # --- random small-cache cases with large prompts among small ones (aging)
    def wait_cases(self, v: Variant) -> dict:
        def go() -> dict:
            worst = []
            for case in range(self.cfg.wait_cases):
                kv, reqs = starvation_case(case)
                r = run_workload(reqs, make_scheduler=v.factory(None, _Recorder), gpu_seed=bench.GPU_SEED,
                                          eos_probability=0.0, kv_cap_blocks=kv, record_itl=False, max_ticks=10 ** 6)
                worst.append(max(r.scheduler.waits().values()))
            return {"max_wait_ticks": max(worst), "per_case_max_wait_ticks": worst}
        return self._get(("wait_cases", v.key), go)

def longs_amid_shorts(seed: int, *, n_short: int = 3000, rate_per_s: float = 60.0, n_long: int = 10,
                      every_s: float = 5.0) -> list[Request]:
    """A saturating stream of short requests (``request_gen.stream`` lengths, 60/s, four users) and
    ``n_long`` prompts of 1,500-3,000 tokens (94-188 blocks of the 256), one every ``every_s``."""
    rng = random.Random(seed)

    def req(rid: str, t: float, prompt: tuple[int, int], out: tuple[int, int]) -> Request:
        return Request(user_id=f"u{rng.randint(1, 4)}", prompt=[1] * rng.randint(*prompt),
                       max_tokens=rng.randint(*out), request_id=rid, submitted_at=t)

    reqs, t = [], 0.0
    for i in range(n_short):
        t += rng.expovariate(rate_per_s)
        reqs.append(req(f"s{i}", t, (5, 199), (10, 99)))
    span = t
    reqs += [req(f"L{j}", min(span, 1.0 + j * every_s), (1500, 3000), (10, 99)) for j in range(n_long)]
    return reqs


def starvation_case(case: int) -> tuple[int, list[Request]]:
    """A random no-starvation case: 20-80 requests of 2-4 users arriving at 20, 50 or 100 per second
    into a cache of 16, 32 or 64 blocks; one in ten has a prompt of half to nine tenths of the cache,
    the others 5-60 tokens; outputs 5-60 tokens (no early EOS). Returns (cache blocks, requests)."""
    rng = random.Random(case)
    kv = rng.choice([16, 32, 64])
    users = rng.randint(2, 4)
    rate = rng.choice([20.0, 50.0, 100.0])
    reqs, t = [], 0.0
    for i in range(rng.randint(20, 80)):
        t += rng.expovariate(rate)
        big = rng.random() < 0.1
        prompt = rng.randint(kv * 16 // 2, kv * 16 * 9 // 10) if big else rng.randint(5, 60)
        reqs.append(Request(user_id=f"u{rng.randint(1, users)}", prompt=[1] * prompt, max_tokens=rng.randint(5, 60),
                            request_id=f"r{i}", submitted_at=t))
    return kv, reqs


def tiny_cache_case(case: int) -> tuple[int, list[Request]]:
    """A random KV-pressure case: 3-12 requests of 1-4 users in a cache of 8, 16 or 32 blocks, each
    request growing to a large share of it (no early EOS). Returns (cache blocks, requests)."""
    rng = random.Random(case)
    kv = rng.choice([8, 16, 32])
    users = rng.randint(1, 4)
    reqs = [Request(user_id=f"u{rng.randint(1, users)}",
                    prompt=[1] * rng.randint(1, kv * 16 * rng.choice([1, 3, 6]) // 10),
                    max_tokens=rng.randint(10, kv * 16), request_id=f"r{i}",
                    submitted_at=rng.choice([0.0, 0.0, rng.uniform(0, 0.5)])) for i in range(rng.randint(3, 12))]
    return kv, reqs


# ----------------------------------------------------------------------------- the rows


@dataclass
class Figure:
    """One measured figure of a row: with the mechanism (the default), without it, FCFS's.
    ``with_`` is NaN for a figure that only exists without it (a paired change). ``outcome``:
    False for the mechanism's own count (isolated iterations, ticks with the reservation held),
    which switching it off zeroes by definition: shown, left out of the verdict."""

    label: str
    with_: float
    without: float
    fcfs: float | None
    fmt: str = "{:.2f}"
    outcome: bool = True

    def change(self) -> float:
        """The change without the mechanism, a share of the figure with it (NaN when undefined)."""
        if math.isnan(self.with_) or math.isnan(self.without):
            return math.nan
        if self.with_ == self.without:
            return 0.0
        return (self.without - self.with_) / abs(self.with_) if self.with_ != 0 else math.inf

    def cells(self) -> tuple[str, str, str, str]:
        """(with, without, FCFS, change without it in percent)."""
        def f(x: float | None) -> str:
            return "-" if x is None or math.isnan(x) else self.fmt.format(x)
        c = self.change()
        change = "-" if math.isnan(c) else "from 0" if math.isinf(c) else "0" if c == 0 else f"{100 * c:+.1f}%"
        return f(self.with_), f(self.without), f(self.fcfs), change

    def finite(self) -> bool:
        """Whether every number this figure has is finite (a paired change has no ``with_``)."""
        xs = [self.without] + ([] if math.isnan(self.with_) else [self.with_]) + ([] if self.fcfs is None else [self.fcfs])
        return all(math.isfinite(x) for x in xs)


@dataclass
class Row:
    """One mechanism: what it is for and its figures."""

    key: str
    mechanism: str
    off: str
    for_: str
    figures: list[Figure]

    def moved(self, threshold: float = MOVED) -> list[Figure]:
        """The outcome figures that change by ``threshold`` (a share) or more without the mechanism,
        largest change first (paired changes, which have no figure with it, are left out)."""
        got = [f for f in self.figures if f.outcome and not math.isnan(f.change()) and abs(f.change()) >= threshold]
        return sorted(got, key=lambda f: -abs(f.change()))

    def verdict(self, threshold: float = MOVED) -> str:
        """One line: which figures change by ``threshold`` or more without it, or that none does."""
        got = self.moved(threshold)
        n = sum(f.outcome for f in self.figures)
        if not got:
            return f"none of its {n} outcome figures changes by {100 * threshold:g}% or more without it"
        top = "; ".join(f"{f.label.strip()} {f.cells()[3]}" for f in got[:3])
        return f"{len(got)} of {n} outcome figures change by {100 * threshold:g}% or more without it; largest: {top}"


def _mean(xs: Sequence[float]) -> float:
    return statistics.mean(xs) if xs else math.nan


def _sd(xs: Sequence[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else math.nan


def _short(name: str) -> str:
    return name.split("_")[0].removesuffix(".csv")


def row_figures(lab: Lab, v: Variant) -> list[Figure]:
    """The figures that say what ``v``'s mechanism buys (see the module docstring)."""
    cfg = lab.cfg
    D, F = DEFAULT, FCFS
    wl = cfg.workloads
    figs: list[Figure] = []

    def trio(label: str, get: Callable[[Variant], float], fmt: str = "{:.2f}", fcfs: bool = True,
             outcome: bool = True) -> None:
        figs.append(Figure(label if outcome else f"{label} (its own count)", get(D), get(v), get(F) if fcfs else None,
                           fmt, outcome))

    def workload_trio(metric: str, label: str, names: Sequence[str], fmt: str, scale: float = 1.0,
                      outcome: bool = True) -> None:
        for n in names:
            if n in wl:
                trio(f"{n}: {label}", lambda x, n=n: lab.workload(x, n)[metric] * scale, fmt, outcome=outcome)

    def anchor_trio(metric: str, label: str, fmt: str, scale: float = 1.0, names: Sequence[str] | None = None) -> None:
        for n in cfg.anchors if names is None else names:
            if n in cfg.anchors and lab.anchor(D, n) is not None and metric in lab.anchor(D, n):
                trio(f"anchor `{_short(n)}`: {label}", lambda x, n=n: lab.anchor(x, n)[metric] * scale, fmt)

    def seeded(metric: str, label: str, fmt: str, scale: float = 1.0, lower_is_better: bool = True) -> None:
        """The mean over seeds, then the change paired by seed: its mean and sd, and on how many
        seeds the figure is worse / better without the mechanism."""
        d, x = lab.seeded(D), lab.seeded(v)
        trio(f"long-kv ({len(d)} seeds): {label}, mean",
             lambda y: _mean([r[metric] * scale for r in lab.seeded(y)]), fmt)
        diffs = [(b[metric] - a[metric]) * scale for a, b in zip(d, x)]
        worse = sum((c > 0) if lower_is_better else (c < 0) for c in diffs)
        better = sum((c < 0) if lower_is_better else (c > 0) for c in diffs)
        figs.append(Figure(f"  change without it, paired by seed: mean (sd {_sd(diffs):.2f}); worse on {worse}, "
                           f"better on {better} of {len(d)} seeds", math.nan, _mean(diffs), None, "{:+.2f}"))

    ab_n = f"A/B ({cfg.seeds} seeds)"
    if v.key == "vtc":
        trio(f"overload (4 users x {cfg.overload_per_user}): largest service gap, weighted tokens",
             lambda x: lab.overload(x)["max_gap"], "{:,.0f}")
        trio("overload: Jain's index while all backlogged", lambda x: lab.overload(x)["jain"], "{:.3f}")
        trio("overload, weights 2 : 1 : 1 : 1: share of the weight-2 user over the others' mean (exact 2.00)",
             lambda x: lab.overload(x)["weighted_share"])
        trio(f"{ab_n}: B's TTFT ratio from submit, median", lambda x: lab.ab(x)["submit_median"])
        anchor_trio("ab_at_once", "B's TTFT ratio at once", "{:.2f}", names=(vc.AB_TRACE,))
        anchor_trio("ab_from_submit", "B's TTFT ratio from submit", "{:.2f}", names=(vc.AB_TRACE,))
        anchor_trio("ttft_p99_s", "TTFT p99, s", "{:.2f}")
        trio("overload: output tok/s", lambda x: lab.overload(x)["throughput_tok_s"], "{:.0f}")
    elif v.key == "isolation":
        for k, lbl in (("submit_median", "from submit, median"), ("submit_worst", "from submit, worst seed"),
                       ("arrival_median", "from arrival, median"), ("arrival_worst", "from arrival, worst seed")):
            trio(f"{ab_n}: B's median TTFT with A / alone, {lbl}", lambda x, k=k: lab.ab(x)[k])
        anchor_trio("ab_at_once", "B's TTFT ratio at once", "{:.2f}", names=(vc.AB_TRACE,))
        anchor_trio("ab_from_submit", "B's TTFT ratio from submit", "{:.2f}", names=(vc.AB_TRACE,))
        trio(f"flood ({cfg.flood} requests of A): light users' TTFT p99, ms",
             lambda x: lab.flood(x)["light_ttft_p99_s"] * 1e3, "{:.0f}")
        if GPU is None:  # on a GPU clock the A/B rows above are token-driven already
            trio("token clock (8 ms + 0.02 ms per batched token), A/B: B's TTFT ratio, median",
                 lambda x: lab.ab_tokens(x)["ratio_median"])
            trio("token clock, A/B: B's TTFT ratio, worst seed", lambda x: lab.ab_tokens(x)["ratio_worst"])
        trio(f"{ab_n}: isolated iterations per run", lambda x: lab.ab(x)["isolated_ticks"], "{:.1f}", outcome=False)
        trio(f"{ab_n}: output tok/s, mean over seeds", lambda x: lab.ab(x)["throughput_tok_s"], "{:.1f}")
        if GPU is None:
            trio("token clock, A/B: output tok/s, mean", lambda x: lab.ab_tokens(x)["throughput_tok_s"], "{:.1f}")
        trio("flood: output tok/s", lambda x: lab.flood(x)["throughput_tok_s"], "{:.1f}")
        anchor_trio("throughput_tok_s", "output tok/s", "{:.1f}")
    elif v.key == "headroom":
        workload_trio("preemptions", "preemptions", ("stream-saturating", "long-kv", "azure-conv", "ab-burst"), "{:.0f}")
        trio("overload: preemptions", lambda x: lab.overload(x)["preemptions"], "{:.0f}")
        trio(f"{ab_n}: preemptions per run", lambda x: lab.ab(x)["preemptions"], "{:.1f}")
        anchor_trio("preemptions", "preemptions", "{:.0f}")
        workload_trio("throughput_tok_s", "output tok/s", ("stream-saturating", "long-kv", "azure-conv"), "{:.1f}")
        trio("overload: output tok/s", lambda x: lab.overload(x)["throughput_tok_s"], "{:.0f}")
        anchor_trio("throughput_tok_s", "output tok/s", "{:.1f}")
    elif v.key == "resume-first":
        workload_trio("tpot_p99_s", "TPOT p99, ms", ("long-kv", "azure-conv", "mooncake-conv", "stream-saturating"),
                      "{:.0f}", 1e3)
        anchor_trio("tpot_p99_s", "TPOT p99, ms", "{:.1f}", 1e3)
        seeded("tpot_p99_s", "TPOT p99, ms", "{:.1f}", 1e3)
        workload_trio("throughput_tok_s", "output tok/s", ("long-kv", "azure-conv", "mooncake-conv"), "{:.1f}")
        workload_trio("preemptions", "preemptions", ("long-kv", "azure-conv", "mooncake-conv"), "{:.0f}")
    elif v.key == "victim":
        trio(f"flood ({cfg.flood} requests of A): light users' requests preempted",
             lambda x: lab.flood(x)["light_preemptions"], "{:.0f}")
        trio("flood: light users' TTFT p99, ms", lambda x: lab.flood(x)["light_ttft_p99_s"] * 1e3, "{:.0f}")
        trio("flood: preemptions", lambda x: lab.flood(x)["preemptions"], "{:.0f}")
        trio(f"{ab_n}: B's requests preempted per run", lambda x: lab.ab(x)["b_preemptions"], "{:.2f}")
        trio(f"{ab_n}: B's TTFT ratio from submit, median", lambda x: lab.ab(x)["submit_median"])
        workload_trio("preemptions", "preemptions", ("stream-saturating", "long-kv", "azure-conv", "mooncake-conv"),
                      "{:.0f}")
        anchor_trio("preemptions", "preemptions", "{:.0f}")
        workload_trio("throughput_tok_s", "output tok/s", ("long-kv", "azure-conv", "mooncake-conv"), "{:.1f}")
        workload_trio("ttft_p99_s", "TTFT p99, s", ("long-kv", "azure-conv", "mooncake-conv"), "{:.1f}")
        anchor_trio("ttft_p99_s", "TTFT p99, s", "{:.2f}")
    elif v.key == "aging":
        workload_trio("largest_prompts_max_wait_ticks", "longest wait of the 5% largest prompts, ticks",
                      ("mooncake-conv", "azure-conv", "long-kv"), "{:,.0f}")
        seeded("largest_prompts_max_wait_ticks", "longest wait of the 5% largest prompts, ticks", "{:,.0f}")
        trio(f"{cfg.wait_cases} random small-cache cases: longest wait of any request, ticks",
             lambda x: lab.wait_cases(x)["max_wait_ticks"], "{:,.0f}")
        d, x = lab.wait_cases(D)["per_case_max_wait_ticks"], lab.wait_cases(v)["per_case_max_wait_ticks"]
        longer, shorter = sum(b > a for a, b in zip(d, x)), sum(b < a for a, b in zip(d, x))
        figs.append(Figure(f"  cases whose longest wait is longer / shorter without it: {longer} / {shorter}",
                           math.nan, longer, None, "{:.0f}"))
        figs.append(Figure("  longest wait without it over with it, mean over cases", math.nan,
                           _mean([b / max(a, 1) for a, b in zip(d, x)]), None, "{:.3f}"))
        trio(f"long prompts amid a 60/s stream ({cfg.longs_seeds} seeds): their longest wait, ticks",
             lambda x: lab.longs(x)["long_max_wait_ticks"], "{:,.0f}")
        workload_trio("reserved_ticks", "ticks with the reservation held", ("mooncake-conv", "azure-conv"), "{:,.0f}",
                      outcome=False)
        seeded("throughput_tok_s", "output tok/s", "{:.1f}", lower_is_better=False)
        workload_trio("throughput_tok_s", "output tok/s", ("mooncake-conv", "azure-conv"), "{:.1f}")
    elif v.key == "preemption-cap":
        for n in wl:
            trio(f"{n}: most preemptions of one request",
                 lambda x, n=n: lab.workload(x, n)["max_preemptions_one_request"], "{:.0f}")
        trio(f"{cfg.cap_cases} random tiny-cache cases: most preemptions of one request",
             lambda x: lab.cap_cases(x)["max_preemptions_one_request"], "{:.0f}")
        trio("  cases where a request is preempted more than 4 times", lambda x: lab.cap_cases(x)["cases_over_4"],
             "{:.0f}")
        trio("  preemptions, all cases", lambda x: lab.cap_cases(x)["preemptions"], "{:.0f}")
        trio("  makespan, all cases, s", lambda x: lab.cap_cases(x)["makespan_s"], "{:.1f}")
        trio(f"{cfg.wait_cases} random small-cache cases: longest wait of any request, ticks",
             lambda x: lab.wait_cases(x)["max_wait_ticks"], "{:,.0f}")
        workload_trio("largest_prompts_max_wait_ticks", "longest wait of the 5% largest prompts, ticks",
                      ("mooncake-conv", "azure-conv", "long-kv"), "{:,.0f}")
        workload_trio("throughput_tok_s", "output tok/s", ("long-kv", "azure-conv", "mooncake-conv"), "{:.1f}")
    elif v.key in ("pressure-victim", "room", "quantum"):
        att = f"attacker first ({cfg.attack_streams} streams each)"
        trio(f"{att}: second user's least 15-s window share", lambda x: lab.attack(x)["min_share"], "{:.3f}")
        trio(f"{att}: second user's mean window share", lambda x: lab.attack(x)["mean_share"], "{:.3f}")
        trio(f"{att}, weights 2 : 1 for it: its least window share (exact 0.667)",
             lambda x: lab.attack(x)["w_min_share"], "{:.3f}")
        trio(f"{att}: preemptions", lambda x: lab.attack(x)["preemptions"], "{:.0f}")
        trio(f"{att}: tokens computed by preempted requests (recomputed)",
             lambda x: lab.attack(x)["recomputed_tokens"], "{:,.0f}")
        trio(f"{att}: output tok/s", lambda x: lab.attack(x)["throughput_tok_s"], "{:.1f}")
        if v.key == "pressure-victim":
            trio(f"overload (4 users x {cfg.overload_per_user}): Jain's index while all backlogged",
                 lambda x: lab.overload(x)["jain"], "{:.3f}")
            trio("overload, weights 2 : 1 : 1 : 1: share of the weight-2 user over the others' mean (exact 2.00)",
                 lambda x: lab.overload(x)["weighted_share"])
        if v.key == "room":
            trio(f"{cfg.probe_streams} long streams of one user: another's 2-token request, most iterations "
                 "to its first token", lambda x: lab.probe(x)["max_to_first_token"], "{:.0f}")
        if v.key == "quantum":
            trio(f"{cfg.wait_cases} random small-cache cases: longest wait of any request, ticks",
                 lambda x: lab.wait_cases(x)["max_wait_ticks"], "{:,.0f}")
        workload_trio("preemptions", "preemptions", ("stream-saturating", "long-kv", "azure-conv", "mooncake-conv"),
                      "{:.0f}")
        anchor_trio("preemptions", "preemptions", "{:.0f}")
        anchor_trio("ttft_p99_s", "TTFT p99, s", "{:.2f}")
        anchor_trio("throughput_tok_s", "output tok/s", "{:.1f}")
    elif v.key == "hold":
        workload_trio("largest_prompts_max_wait_ticks", "longest wait of the 5% largest prompts, ticks",
                      ("mooncake-conv", "azure-conv", "long-kv"), "{:,.0f}")
        seeded("largest_prompts_max_wait_ticks", "longest wait of the 5% largest prompts, ticks", "{:,.0f}")
        trio(f"{cfg.wait_cases} random small-cache cases: longest wait of any request, ticks",
             lambda x: lab.wait_cases(x)["max_wait_ticks"], "{:,.0f}")
        trio(f"long prompts amid a 60/s stream ({cfg.longs_seeds} seeds): their longest wait, ticks",
             lambda x: lab.longs(x)["long_max_wait_ticks"], "{:,.0f}")
        workload_trio("ttft_p99_s", "TTFT p99, s", ("long-kv", "azure-conv", "mooncake-conv"), "{:.1f}")
        anchor_trio("ttft_p99_s", "TTFT p99, s", "{:.2f}")
        workload_trio("throughput_tok_s", "output tok/s", ("long-kv", "azure-conv", "mooncake-conv"), "{:.1f}")
        anchor_trio("throughput_tok_s", "output tok/s", "{:.1f}")
    elif v.key == "requeue-behind":
        workload_trio("ttft_p99_s", "TTFT p99, s", ("stream-saturating", "long-kv", "azure-conv", "mooncake-conv"),
                      "{:.1f}")
        anchor_trio("ttft_p99_s", "TTFT p99, s", "{:.2f}")
        workload_trio("tpot_p99_s", "TPOT p99, ms", ("long-kv", "azure-conv", "mooncake-conv"), "{:.0f}", 1e3)
        seeded("tpot_p99_s", "TPOT p99, ms", "{:.1f}", 1e3)
        workload_trio("preemptions", "preemptions", ("long-kv", "azure-conv", "mooncake-conv"), "{:.0f}")
        anchor_trio("preemptions", "preemptions", "{:.0f}")
    elif v.key == "light-first":
        trio(f"flood ({cfg.flood} requests of A): light users' TTFT p99, ms",
             lambda x: lab.flood(x)["light_ttft_p99_s"] * 1e3, "{:.0f}")
        trio(f"{ab_n}: B's TTFT ratio from submit, median", lambda x: lab.ab(x)["submit_median"])
        anchor_trio("ab_at_once", "B's TTFT ratio at once", "{:.2f}", names=(vc.AB_TRACE,))
        trio(f"{cfg.probe_streams} long streams of one user: another's 2-token request, most iterations "
             "to its first token", lambda x: lab.probe(x)["max_to_first_token"], "{:.0f}")
        anchor_trio("ttft_p99_s", "TTFT p99, s", "{:.2f}")
        trio("flood: output tok/s", lambda x: lab.flood(x)["throughput_tok_s"], "{:.1f}")
    return figs


def tolerance_curve(lab: Lab) -> list[dict]:
    """Per tolerance of ``Config.tolerances``: TTFT p99 (s) on each balanced anchor and the
    weight-2 user's share on the weighted overload; then FCFS's, and vLLM's TTFT p99 (measured or
    quoted, ``Lab.vllm``). ``[{"name", "tolerance", "ttft_p99_s": {trace: s}, "weighted_share"}]``."""
    names = [n for n in lab.cfg.balanced if lab.anchor(DEFAULT, n) is not None]
    out = []
    for t in lab.cfg.tolerances:
        v = DEFAULT if t == fr.TOLERANCE_TOKENS else tolerance_variant(t)
        out.append({"name": f"T = {t}" + (" (default)" if v is DEFAULT else ""), "tolerance": t,
                    "ttft_p99_s": {n: lab.anchor(v, n)["ttft_p99_s"] for n in names},
                    "weighted_share": lab.weighted_share(v)})
    out.append({"name": "FCFS", "tolerance": None, "ttft_p99_s": {n: lab.anchor(FCFS, n)["ttft_p99_s"] for n in names},
                "weighted_share": lab.weighted_share(FCFS)})
    got = {n: lab.vllm(n) for n in names}
    out.append({"name": "vLLM (" + "/".join(sorted({src for _, src in got.values()})) + ")" if got else "vLLM",
                "tolerance": None, "ttft_p99_s": {n: x for n, (x, _) in got.items()}, "weighted_share": None})
    return out


def tolerance_figures(lab: Lab, curve: list[dict]) -> list[Figure]:
    """The tolerance row: each tolerance other than the default's against the default
    (``fairness_rules.TOLERANCE_TOKENS``):
    TTFT p99 per balanced anchor (vLLM's in the label) and the weight-2 user's share."""
    base = next(c for c in curve if c["tolerance"] == fr.TOLERANCE_TOKENS)
    fcfs, vllm = curve[-2], curve[-1]
    figs = []
    for c in curve:
        if c["tolerance"] is None or c is base:
            continue
        for n, x in c["ttft_p99_s"].items():
            figs.append(Figure(f"T = {c['tolerance']}: anchor `{_short(n)}` TTFT p99, s (vLLM "
                               f"{vllm['ttft_p99_s'][n]:.2f})", base["ttft_p99_s"][n], x, fcfs["ttft_p99_s"][n]))
        figs.append(Figure(f"T = {c['tolerance']}: weighted overload, weight-2 user's share (exact 2.00)",
                           base["weighted_share"], c["weighted_share"], fcfs["weighted_share"]))
    return figs


def ablate(cfg: Config, *, only: Sequence[str] | None = None, traces: Path | None = None, matrix: bool = True,
           log: Callable[[str], None] = lambda s: None) -> tuple[list[Row], dict, list[dict]]:
    """Run the ablation.

    Returns:
        (one ``Row`` per mechanism and the tolerance row, the matrix: variant -> workload or
        anchor -> figures, the tolerance curve of ``tolerance_curve``; empty without its row).
    """
    lab = Lab(cfg, traces if traces is not None else vc.traces_dir(), log)
    rows = [Row(v.key, v.name, v.off, v.for_, row_figures(lab, v)) for v in MECHANISMS if not only or v.key in only]
    curve: list[dict] = []
    if not only or TOLERANCE in only:
        curve = tolerance_curve(lab)
        ts = ", ".join(str(t) for t in cfg.tolerances if t != fr.TOLERANCE_TOKENS)
        rows.append(Row(TOLERANCE, "tolerance band (a trade-off curve)", f"VTCPolicy(tolerance_tokens=T), T = {ts}",
                        "balanced load served close to arrival order (TTFT p99) against exact weighted shares",
                        tolerance_figures(lab, curve)))
    mat: dict[str, dict[str, dict]] = {}
    if matrix:
        for v in (DEFAULT, *MECHANISMS, FCFS):
            if only and v.key not in (*only, "default", "fcfs"):
                continue
            mat[v.key] = {n: lab.workload(v, n) for n in cfg.workloads}
            for n in cfg.anchors:
                a = lab.anchor(v, n)
                if a is not None:
                    mat[v.key][n] = a
    return rows, mat, curve


# ----------------------------------------------------------------------------- output


def table(rows: Sequence[Row]) -> list[str]:
    """The markdown table: a line per figure, the mechanism named on its first, its verdict last."""
    out = ["| mechanism (switched off by) | what it is for | figure | with it (default) | without it | change | FCFS |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        for i, f in enumerate(r.figures):
            w, wo, fc, ch = f.cells()
            head = f"**{r.mechanism}** (`{r.off}`) | {r.for_}" if i == 0 else " | "
            out.append(f"| {head} | {f.label} | {w} | {wo} | {ch} | {fc} |")
        out.append(f"|  |  | **verdict**: {r.verdict()} |  |  |  |  |")
    return out


def curve_table(curve: list[dict]) -> list[str]:
    """The tolerance curve: a line per tolerance, then FCFS and vLLM."""
    if not curve:
        return []
    names = list(curve[0]["ttft_p99_s"])
    head = ["tolerance", *(f"`{_short(n)}` TTFT p99 (s)" for n in names), "weighted overload: weight-2 share (exact 2.00)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in curve:
        share = "-" if c["weighted_share"] is None else f"{c['weighted_share']:.2f}"
        out.append("| " + " | ".join([c["name"], *(f"{c['ttft_p99_s'][n]:.2f}" for n in names), share]) + " |")
    return out


def anchors_table(mat: dict[str, dict[str, dict]], anchors: Sequence[str]) -> list[str]:
    """Every variant on the anchor traces: tok/s, TTFT p50 / p99 (s), TPOT p99 (ms), preemptions;
    and B's TTFT ratio at once / from submit on the A/B anchor."""
    if not mat:
        return []
    names = [n for n in anchors if n in next(iter(mat.values()))]
    if not names:
        return []
    ab = vc.AB_TRACE in names
    out = ["| variant | " + " | ".join(f"`{_short(n)}`" for n in names) + (" | A/B: at once / from submit |" if ab
                                                                          else " |"),
           "|---|" + "---|" * (len(names) + ab)]
    label = {"default": "default", "fcfs": "FCFS"}
    for key, cells in mat.items():
        name = label.get(key, f"{VARIANTS[key].name} off")
        row = [f"{c['throughput_tok_s']:.1f} / {c['ttft_p50_s']:.2f} / {c['ttft_p99_s']:.2f} / "
               f"{c['tpot_p99_s'] * 1e3:.1f} / {c['preemptions']:.0f}" for c in (cells[n] for n in names)]
        if ab:
            c = cells[vc.AB_TRACE]
            row.append(f"{c['ab_at_once']:.2f} / {c['ab_from_submit']:.2f}")
        out.append(f"| {name} | " + " | ".join(row) + " |")
    return out


def matrix_table(mat: dict[str, dict[str, dict]]) -> list[str]:
    """Every variant on the common workloads: output tok/s, preemptions, TTFT p99 (s), TPOT p99 (ms)."""
    if not mat:
        return []
    names = list(next(iter(mat.values())))
    out = ["| variant | " + " | ".join(f"`{n.removesuffix('.csv')}`" for n in names) + " |",
           "|---|" + "---|" * len(names)]
    label = {"default": "default", "fcfs": "FCFS"}
    for key, cells in mat.items():
        name = label.get(key, f"{VARIANTS[key].name} off")
        out.append(f"| {name} | " + " | ".join(
            f"{c['throughput_tok_s']:.1f} / {c['preemptions']:.0f} / {c['ttft_p99_s']:.1f} / {c['tpot_p99_s'] * 1e3:.0f}"
            for c in cells.values()) + " |")
    return out


def _plain(x: Any) -> Any:
    """``x`` with every NaN as ``None`` (strict JSON)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _plain(y) for k, y in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(y) for y in x]
    return x


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run: one seed, the small workloads (seconds)")
    p.add_argument("--seeds", type=int, default=10, help="A/B burst seeds for VTC, isolation and the victim (default 10)")
    p.add_argument("--only", default=None, help="comma-separated rows: " + ",".join(KEYS))
    p.add_argument("--no-matrix", action="store_true", help="leave out the tables of every variant on every workload")
    p.add_argument("--traces", default=None, help="folder of the anchor traces (default as bench/vllm_compare.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("-v", "--verbose", action="store_true", help="log each measurement and its CPU time on stderr")
    p.add_argument("--gpu", default="stub",
                   help="the clock: stub (5 ms + 1 ms per request, the default) or a GPU profile (h100-llama3-8b: "
                        "its step cost; each workload's cache and Batch's default limits kept)")
    a = p.parse_args(argv)
    global GPU
    if a.gpu != "stub":
        try:
            vc.clock_for(a.gpu)
        except ValueError as e:
            p.error(str(e))
        GPU = a.gpu
    only = [x.strip() for x in a.only.split(",")] if a.only else None
    if only and (bad := [x for x in only if x not in KEYS]):
        p.error(f"unknown row {bad[0]!r}; choose from {', '.join(KEYS)}")
    if a.seeds < 1:
        p.error("--seeds must be >= 1")
    cfg = Config.quick() if a.quick else Config.full(a.seeds)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.verbose else (lambda s: None)
    t0 = time.perf_counter()
    c0 = time.process_time()
    rows, mat, curve = ablate(cfg, only=only, traces=Path(a.traces) if a.traces else None, matrix=not a.no_matrix,
                              log=log)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    meta = {"date": _dt.date.today().isoformat(), "commit": _commit(), "clock": a.gpu, "config": dataclasses.asdict(cfg),
            "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
    if a.json:
        print(json.dumps(_plain({"meta": meta, "rows": [{**dataclasses.asdict(r), "verdict": r.verdict()} for r in rows],
                                 "tolerance_curve": curve, "matrix": mat})))
        return 0
    what = "the stub's simulated clock" if GPU is None else f"GPU clock {GPU} (batch.sim.gpu_profile; caches and limits as on the stub)"
    print(f"ablation: the default with one mechanism off; {what}; {meta['date']}, commit {meta['commit']}; "
          f"{cpu:.0f} s CPU, {wall:.0f} s wall")
    print()
    print("\n".join(table(rows)))
    if curve:
        print()
        print("The tolerance band: VTCPolicy(tolerance_tokens=T) on the balanced anchors (TTFT from nominal "
              "arrival) and the weighted overload")
        print()
        print("\n".join(curve_table(curve)))
    if anchors := anchors_table(mat, cfg.anchors):
        print()
        print("Every variant on the anchor traces: tok/s / TTFT p50 (s) / TTFT p99 (s) / TPOT p99 (ms) / preemptions")
        print()
        print("\n".join(anchors))
    if mat:
        print()
        print("Every variant on the common workloads: output tok/s / preemptions / TTFT p99 (s) / TPOT p99 (ms)")
        print()
        print("\n".join(matrix_table(mat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
