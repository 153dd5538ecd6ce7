"""Fairness benchmark: VTC with TTFT isolation against VTC alone, FCFS and per-user round robin.

    python bench/bench_fairness.py                 # every workload, virtual clock
    python bench/bench_fairness.py --quick         # small sizes (what the test suite runs)
    python bench/bench_fairness.py --overhead      # only the scheduler's CPU time per tick
    python bench/bench_fairness.py --resume-search # only a large prompt's wait amid preemptions,
                                             # preempted decodes resuming first or not

Workloads (seeded; virtual clock through ``simulate.run_workload`` unless stated):

* ``ab-at-once``: the seed's test: 100 requests of user A and 5 of user B (prompts 5..199,
  ``max_tokens`` 10..99), all submitted before the first tick. ``ab-spread``: the same with
  arrivals spread uniformly over one second, submitted between ticks. B's median TTFT with A
  present over B's median when A is absent (same policy, same requests).
* ``flood``: user A submits ``--flood`` requests at once; users B and C send small requests
  (Poisson, 2/s each) while A's backlog lasts. Their TTFT, and the bound of ``docs/fairness.md``.
* ``overload``: four users (short, long-prompt, long-output, mixed requests), each with a
  backlog for the whole run: Jain's index of their weighted service while all are backlogged
  and the largest service gap between two backlogged users against the VTC paper's bound.
* ``returning``: users A and C backlogged throughout; B works, goes idle, and returns with a
  backlog: B's share of the service in the window after its return (fair: 1/3).

Measured per policy: the TTFT ratio, A's output throughput relative to FCFS, Jain's index,
the largest service gap (weighted tokens: w_p per first-time prompt token, w_q per output
token), preemptions and isolated iterations.

Closed loops of issue 38 (``attacker_first``: one user's endless streams first, another's two
seconds later, the second's share per 15-s window; ``long_streams_probe``: one user's long streams
and another's 2-token request, iterations to its first token) are run by
``tests/test_fair_running.py`` and ``bench/ablation.py``.

The A/B burst on the real-time stub is measured by ``bench/cold_fairness.py``, each
measurement in a fresh process as an outside harness runs it (a warm in-process run hides
first-call costs).
"""
from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import inference_stub
from batch.core.goodput import jain_index
from batch.policies.policy import FCFSPolicy
from batch.policies.roundrobin import RoundRobinPolicy
from batch.policies.vtc import VTCPolicy
from batch.sim import simulate
from inference_stub import Request
from scheduler import Scheduler
from spec import fairness_rules as fr

PROMPT_RANGE = (5, 199)
MAX_TOKENS_RANGE = (10, 99)


# ---------------------------------------------------------------- workloads


def _req(rng: random.Random, user: str, i: int, t_s: float, prompt: tuple[int, int] = PROMPT_RANGE,
         max_tokens: tuple[int, int] = MAX_TOKENS_RANGE) -> Request:
    return Request(user_id=user, prompt=[rng.randint(1, 63) for _ in range(rng.randint(*prompt))],
                   max_tokens=rng.randint(*max_tokens), request_id=f"{user}{i}", submitted_at=t_s)


def ab_burst(seed: int, *, spread: bool, with_a: bool = True, n_a: int = 100, n_b: int = 5) -> list[Request]:
    """The seed's fairness test: ``n_a`` requests of user A and ``n_b`` of user B.

    Args:
        seed: the workload seed (the same seed gives the same B requests with or without A).
        spread: arrivals uniform over one second; else all at offset 0.
        with_a: include user A (False gives the "B alone" run).
    """
    rng = random.Random(seed)
    out = []
    for user, n in (("A", n_a), ("B", n_b)):
        for i in range(n):
            r = _req(rng, user, i, rng.uniform(0.0, 1.0) if spread else 0.0)
            if with_a or user == "B":
                out.append(r)
    return out


def flood(seed: int, *, n_flood: int = 10_000, others: Sequence[str] = ("B", "C"), rate_per_s: float = 2.0,
          horizon_s: float | None = None) -> list[Request]:
    """User A submits ``n_flood`` requests at once; ``others`` send small requests (Poisson)."""
    rng = random.Random(seed)
    out = [_req(rng, "A", i, 0.0) for i in range(n_flood)]
    horizon = horizon_s if horizon_s is not None else n_flood * 0.04  # about A's backlog, seconds
    for user in others:
        t, i = 0.05, 0
        while t < horizon:
            out.append(_req(rng, user, i, t, prompt=(5, 120), max_tokens=(5, 40)))
            i += 1
            t += rng.expovariate(rate_per_s)
    return out


#: The overload scenario's users: (prompt range, max_tokens range).
OVERLOAD_USERS = {"short": ((5, 40), (5, 20)), "longprompt": ((150, 199), (5, 20)),
                  "longout": ((5, 40), (80, 99)), "mixed": (PROMPT_RANGE, MAX_TOKENS_RANGE)}


def overload(seed: int, *, n_per_user: int = 400) -> list[Request]:
    """Four users with different request shapes, each with ``n_per_user`` requests at offset 0."""
    rng = random.Random(seed)
    return [_req(rng, u, i, 0.0, p, m) for i in range(n_per_user) for u, (p, m) in OVERLOAD_USERS.items()]


def returning(seed: int, *, n_backlog: int = 600, idle_until_s: float = 8.0, n_return: int = 200) -> list[Request]:
    """A and C backlogged throughout; B sends 20 requests at 0, idles, returns at ``idle_until_s``."""
    rng = random.Random(seed)
    out = [_req(rng, u, i, 0.0) for i in range(n_backlog) for u in ("A", "C")]
    out += [_req(rng, "B", i, 0.0) for i in range(20)]
    out += [_req(rng, "B", 20 + i, idle_until_s) for i in range(n_return)]
    return out


# ---------------------------------------------------------------- closed loops (issue 38)


@dataclass
class AttackRun:
    """An ``attacker_first`` run: per user, the clock time of every token generated
    (``on_tokens``), the 15-s windows' starts and the second user's share in each, the scheduler."""

    token_s: dict[str, list[float]]
    window_starts_s: list[float]
    shares: list[float]
    scheduler: Scheduler


def attacker_first(make_scheduler: Callable[..., Scheduler] = Scheduler, *, n_streams: int = 64,
                   arrive_s: float = 2.0, horizon_s: float = 62.0, from_s: float = 5.0, window_s: float = 15.0,
                   step_s: float = 1.0, prompt_tokens: int = 8, max_tokens: int = 100_000,
                   first: str = "M", second: str = "A") -> AttackRun:
    """Issue 38's "first comes, first keeps", in-process on the virtual clock: user ``first``
    opens ``n_streams`` endless streams (``max_tokens`` tokens, EOS probability 0, a closed loop:
    a finished request is resubmitted at once), user ``second`` opens as many ``arrive_s`` later.
    ``second``'s share of the generated tokens in every ``window_s`` window starting from
    ``from_s`` after it arrives, every ``step_s``, while the window ends by ``horizon_s``.
    ``make_scheduler(backend=, clock=, on_tokens=)`` builds the scheduler."""
    clock = inference_stub.VirtualClock()
    gpu = inference_stub.SimulatedGPU(eos_probability=0.0, seed=1, clock=clock)
    token_s: dict[str, list[float]] = {first: [], second: []}

    def on_tokens(pairs) -> None:
        now = clock()
        for r, _ in pairs:
            token_s[r.user_id].append(now)

    s = make_scheduler(backend=gpu, clock=clock, on_tokens=on_tokens)
    count = {first: 0, second: 0}

    def submit(user: str) -> None:
        count[user] += 1
        k = count[user]
        s.submit(Request(user_id=user, prompt=[1 + (k + j) % 60 for j in range(prompt_tokens)],
                         max_tokens=max_tokens, request_id=f"{user}{k}"))

    for _ in range(n_streams):
        submit(first)
    arrived = False
    while clock() < horizon_s:
        if not arrived and clock() >= arrive_s:
            for _ in range(n_streams):
                submit(second)
            arrived = True
        for r in s.tick():
            submit(r.user_id)
    starts, shares = [], []
    t0 = arrive_s + from_s
    while t0 + window_s <= horizon_s:
        a = bisect.bisect(token_s[second], t0 + window_s) - bisect.bisect(token_s[second], t0)
        m = bisect.bisect(token_s[first], t0 + window_s) - bisect.bisect(token_s[first], t0)
        starts.append(t0)
        shares.append(a / (a + m) if a + m else float("nan"))
        t0 += step_s
    return AttackRun(token_s, starts, shares, s)


@dataclass
class Probe:
    """One probe of ``long_streams_probe``: the tick it was submitted at, the requests resident
    then, and the iterations from its submit to its first token (its admission: its prompt is
    one chunk) and to its completion."""

    submit_tick: int
    resident: int
    to_first_token: int
    to_done: int


def long_streams_probe(make_scheduler: Callable[..., Scheduler] = Scheduler, *, n_streams: int = 100,
                       max_tokens: int = 3000, probe_ticks: Sequence[int] = (300, 1000, 2000, 3000, 4000),
                       prompt_tokens: int = 8, probe_max_tokens: int = 2) -> list[Probe]:
    """Issue 38's "one key stalls everyone", on the virtual clock: user H keeps ``n_streams``
    requests of ``max_tokens`` (EOS probability 0) in flight, a closed loop; at each of
    ``probe_ticks`` user L submits one ``probe_max_tokens``-token request and the run goes on
    until it completes. ``make_scheduler(backend=, clock=)`` builds the scheduler."""
    clock = inference_stub.VirtualClock()
    gpu = inference_stub.SimulatedGPU(eos_probability=0.0, seed=1, clock=clock)
    s = make_scheduler(backend=gpu, clock=clock)
    n = 0

    def submit(user: str, m: int) -> Request:
        nonlocal n
        n += 1
        r = Request(user_id=user, prompt=[1 + (n + j) % 60 for j in range(prompt_tokens)], max_tokens=m,
                    request_id=f"{user}{n}")
        s.submit(r)
        return r

    def tick() -> None:
        for r in s.tick():
            if r.user_id == "H":
                submit("H", max_tokens)

    for _ in range(n_streams):
        submit("H", max_tokens)
    out = []
    t = 0
    for target in probe_ticks:
        while t < target:
            tick()
            t += 1
        probe = submit("L", probe_max_tokens)
        resident = len(s.state.running)
        k, first = 0, None
        while probe.completed_at is None:
            tick()
            t += 1
            k += 1
            if first is None and probe.generated:
                first = k
        out.append(Probe(target, resident, first, k))
    return out


# ---------------------------------------------------------------- recording service


class RecordingScheduler(Scheduler):
    """A ``Scheduler`` that records, after every tick, each user's cumulative service and
    whether it is backlogged (has a waiting request): what the fairness figures need; and
    counts the isolated iterations (``Plan.isolated``) in ``isolated_ticks``.

    Service is counted as the VTC counter charges it: w_p per prompt token computed for the
    first time (``Seq.prompt_charged_tokens``), w_q per output token, divided by the user's
    weight (``weights``, default the policy's ``weight``).
    """

    def __init__(self, *args, weights: dict[str, int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rec_weights = weights
        self.service: dict[str, float] = {}
        self.trace: list[tuple[float, dict[str, float], frozenset[str]]] = []
        self.isolated_ticks = 0

    def _weight(self, user: str) -> int:
        return self.policy.weight(user) if self.rec_weights is None else self.rec_weights.get(user, 1)

    def update_from_output(self, plan, tokens, **kw):
        before = [(e.seq, e.seq.prompt_charged_tokens, len(e.seq.req.generated)) for e in plan.batch]
        out = super().update_from_output(plan, tokens, **kw)
        for seq, charged, gen in before:
            units = fr.service_units(seq.prompt_charged_tokens - charged, len(seq.req.generated) - gen,
                                     fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
            self.service[seq.user_id] = self.service.get(seq.user_id, 0.0) + units / self._weight(seq.user_id)
        self.isolated_ticks += plan.isolated
        self.trace.append((self.clock(), dict(self.service), frozenset(self.state.waiting_by_user)))
        return out


def raw_service_while_backlogged(trace, users: Sequence[str], weights: dict[str, int]) -> dict[str, float]:
    """Each user's raw (unweighted) service over the spans in which all ``users`` are backlogged:
    the recorded weighted service times the user's weight, summed."""
    acc = {u: 0.0 for u in users}
    prev = None
    for _, svc, backlogged in trace:
        if prev is not None and all(u in backlogged for u in users):
            for u in users:
                acc[u] += (svc.get(u, 0.0) - prev.get(u, 0.0)) * weights.get(u, 1)
        prev = svc
    return acc


def max_service_gap(trace: list[tuple[float, dict[str, float], frozenset[str]]]) -> float:
    """Largest |service_f(t1, t2) - service_g(t1, t2)| over intervals where f and g are both backlogged.

    Source: the VTC paper's fairness measure (service difference of backlogged clients).
    """
    users = sorted({u for _, _, b in trace for u in b})
    worst = 0.0
    for i, f in enumerate(users):
        for g in users[i + 1:]:
            lo = hi = None
            prev = None
            for _, svc, backlogged in trace:
                d = svc.get(f, 0.0) - svc.get(g, 0.0)
                if f in backlogged and g in backlogged:
                    if lo is None:
                        lo = hi = prev if prev is not None else d  # the interval starts at the last tick boundary
                    lo, hi = min(lo, d), max(hi, d)
                    worst = max(worst, hi - lo)
                else:
                    lo = hi = None
                prev = d
    return worst


def jain_while_all_backlogged(trace, users: Sequence[str]) -> float | None:
    """Jain's index of the users' service over the ticks in which all of them were backlogged."""
    acc = {u: 0.0 for u in users}
    prev: dict[str, float] | None = None
    n = 0
    for _, svc, backlogged in trace:
        if prev is not None and all(u in backlogged for u in users):
            for u in users:
                acc[u] += svc.get(u, 0.0) - prev.get(u, 0.0)
            n += 1
        prev = svc
    return jain_index(acc.values()) if n else None


# ---------------------------------------------------------------- policies and runs


@dataclass(frozen=True)
class Contender:
    """A named scheduler configuration."""

    name: str
    kwargs: Callable[[], dict] = field(default=dict)


CONTENDERS = (
    Contender("VTC+isolation", lambda: {}),  # the default Scheduler()
    Contender("VTC", lambda: {"isolation": False}),
    Contender("FCFS", lambda: {"policy": FCFSPolicy()}),
    Contender("RR", lambda: {"policy": RoundRobinPolicy()}),
)


def run(requests: list[Request], contender: Contender, *, weights: dict[str, int] | None = None,
        **kw) -> simulate.RunResult:
    """Replay ``requests`` on the virtual clock (seeded tokens) through a recording scheduler."""
    kwargs = contender.kwargs()
    if weights and contender.name.startswith("VTC"):
        kwargs["policy"] = VTCPolicy(weights=weights)
    return simulate.run_workload(requests, make_scheduler=lambda **k: RecordingScheduler(weights=weights, **k),
                                 record_itl=False, **kwargs, **kw)


def median_ttft(finished: Sequence[Request], user: str) -> float:
    """Median ``started_at - submitted_at`` of the user's finished requests, seconds."""
    return statistics.median(r.started_at - r.submitted_at for r in finished if r.user_id == user)


def user_throughput(res: simulate.RunResult, user: str) -> float:
    """The user's output tokens per second of clock time, from the first submit to its last completion."""
    mine = [r for r in res.finished if r.user_id == user]
    t0 = min(r.submitted_at for r in res.finished)
    return sum(len(r.generated) for r in mine) / (max(r.completed_at for r in mine) - t0)


def ab_row(contender: Contender, seeds: Sequence[int], spread: bool, fcfs_thr: dict[int, float] | None) -> dict:
    """B/alone TTFT ratios and A's throughput for one contender over seeds."""
    ratios, thr_rel, pre, iso = [], [], 0, 0
    for seed in seeds:
        res = run(ab_burst(seed, spread=spread), contender)
        alone = run(ab_burst(seed, spread=spread, with_a=False), contender)
        ratios.append(median_ttft(res.finished, "B") / median_ttft(alone.finished, "B"))
        thr = user_throughput(res, "A")
        if fcfs_thr is not None:
            thr_rel.append(thr / fcfs_thr[seed])
        m = res.scheduler.metrics()
        pre += m["preemptions"]
        iso += res.scheduler.isolated_ticks
    return {"ratio_med": statistics.median(ratios), "ratio_max": max(ratios),
            "thr_vs_fcfs": statistics.mean(thr_rel) if thr_rel else None, "preemptions": pre / len(seeds),
            "isolated": iso / len(seeds)}


def fcfs_a_throughput(seeds: Sequence[int], spread: bool) -> dict[int, float]:
    """A's throughput under FCFS per seed (the reference of the ``A thr/FCFS`` column)."""
    return {s: user_throughput(run(ab_burst(s, spread=spread), CONTENDERS[2]), "A") for s in seeds}


# ---------------------------------------------------------------- the report


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the workloads and print the tables; returns the exit status."""
    p = argparse.ArgumentParser(prog="bench_fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="A/B burst seeds (default 10)")
    p.add_argument("--flood", type=int, default=10_000, help="requests of the flooding user (default 10000)")
    p.add_argument("--quick", action="store_true", help="small sizes: 2 seeds, a 1000-request flood")
    p.add_argument("--overhead", action="store_true", help="only the per-tick CPU time of the policies")
    p.add_argument("--resume-search", action="store_true",
                   help="only the wait of a large prompt amid preemptions, preempted decodes resuming first or not")
    a = p.parse_args(argv)
    if a.resume_search:
        rows = [(seed, iso, large_prompt_wait_ticks(seed, True, iso), large_prompt_wait_ticks(seed, False, iso))
                for seed in range(40) for iso in (False, True)]
        print("== a large prompt amid a flood of small requests and preemptions: ticks from its arrival to its"
              " admission ==")
        print("   40 seeds x isolation off/on; resume_first=True (shipped) against False")
        on, off = [r[2] for r in rows], [r[3] for r in rows]
        print(f"   runs: {len(rows)}; same wait {sum(x == y for x, y in zip(on, off))}, longer "
              f"{sum(x > y for x, y in zip(on, off))}, shorter {sum(x < y for x, y in zip(on, off))}; "
              f"longest wait {max(on)} ticks (rule off: {max(off)}); total {sum(on)} ({sum(off)})")
        return 0
    if a.overhead:
        print("== scheduler CPU time per tick outside forward (null backend, 4 users, best of 5 x 100 ticks) ==")
        print(f"{'policy':14} {'16 run/100 wait':>15} {'256/100':>8} {'256/100000':>10}")
        for c in (CONTENDERS[0], CONTENDERS[2], CONTENDERS[3]):
            cells = [tick_cpu_us(c, r, w) for r, w in ((16, 100), (256, 100), (256, 100_000))]
            print(f"{c.name:14} {cells[0]:13.0f}us {cells[1]:6.0f}us {cells[2]:8.0f}us")
        return 0
    seeds = range(2 if a.quick else a.seeds)
    n_flood = 1000 if a.quick else a.flood
    scale = 4 if a.quick else 1
    t_start = time.perf_counter()

    print("== A/B burst (virtual clock): 100 requests of A, 5 of B; B's median TTFT with A / B alone ==")
    print(f"   seeds 0..{len(seeds) - 1}; 'A thr/FCFS' = A's output tokens/s over FCFS's on the same seed")
    print(f"{'workload':12} {'policy':14} {'B/alone med':>11} {'B/alone max':>11} {'A thr/FCFS':>10} "
          f"{'preempt':>7} {'isolated':>8}")
    for spread in (False, True):
        ref = fcfs_a_throughput(seeds, spread)
        for c in CONTENDERS:
            r = ab_row(c, seeds, spread, ref)
            print(f"{'ab-spread' if spread else 'ab-at-once':12} {c.name:14} {r['ratio_med']:11.2f} "
                  f"{r['ratio_max']:11.2f} {_f(r['thr_vs_fcfs'], '{:.3f}'):>10} {r['preemptions']:7.1f} "
                  f"{r['isolated']:8.1f}")

    bound = fr.vtc_service_gap_bound(fr.PROMPT_PRICE, PROMPT_RANGE[1], fr.OUTPUT_PRICE, MAX_TOKENS_RANGE[1])
    print(f"\n== overload: 4 users x {400 // scale} requests at once (short / long prompt / long output / mixed); seed 0, virtual clock ==")
    print(f"   VTC paper's gap bound 2*max(w_p*L_in, w_q*M) = 2*max(1*{PROMPT_RANGE[1]}, 2*{MAX_TOKENS_RANGE[1]})"
          f" = {bound} weighted tokens")
    print(f"   (with M = the tokens the KV cache holds, {256 * 16}, the bound is "
          f"{fr.vtc_service_gap_bound(fr.PROMPT_PRICE, PROMPT_RANGE[1], fr.OUTPUT_PRICE, 256 * 16)})")
    print(f"{'policy':14} {'Jain (backlogged)':>17} {'max gap':>8} {'gap/bound':>9} {'thr tok/s':>9} {'preempt':>7}")
    for c in CONTENDERS:
        res = run(overload(0, n_per_user=400 // scale), c)
        tr = res.scheduler.trace
        j = jain_while_all_backlogged(tr, list(OVERLOAD_USERS))
        g = max_service_gap(tr)
        m = res.scheduler.metrics()
        print(f"{c.name:14} {_f(j, '{:.3f}'):>17} {g:8.0f} {g / bound:9.2f} "
              f"{m['throughput_tokens_per_sec']:9.0f} {m['preemptions']:7d}")

    print("\n== weighted VTC: the overload workload with weights short=2, others 1; seed 0, virtual clock ==")
    w = {"short": 2}
    res = run(overload(0, n_per_user=400 // scale), CONTENDERS[0], weights=w)
    acc = raw_service_while_backlogged(res.scheduler.trace, OVERLOAD_USERS, w)
    others = statistics.mean(acc[u] for u in OVERLOAD_USERS if u != "short")
    print(f"   raw service while all backlogged: {', '.join(f'{u}={v:.0f}' for u, v in acc.items())}; "
          f"short / mean(others) = {acc['short'] / others:.2f} (weight ratio 2)")

    print(f"\n== flood: A submits {n_flood} requests at once; B and C send small requests (Poisson 2/s each); seed 0, virtual clock ==")
    print(f"{'policy':14} {'B+C TTFT p50':>12} {'p99':>8} {'max':>8} {'max wait ticks':>14} {'A thr tok/s':>11} "
          f"{'all tok/s':>9} {'isolated':>8}")
    flood_reqs = flood(0, n_flood=n_flood)
    for c in CONTENDERS[:3] if not a.quick else CONTENDERS[:1] + CONTENDERS[2:3]:
        res = run([Request(user_id=r.user_id, prompt=r.prompt, max_tokens=r.max_tokens, request_id=r.request_id,
                           submitted_at=r.submitted_at) for r in flood_reqs], c)
        t = sorted(r.started_at - r.submitted_at for r in res.finished if r.user_id != "A")
        p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
        ticks = max_wait_ticks(res, ("B", "C"))
        iso = res.scheduler.isolated_ticks
        print(f"{c.name:14} {statistics.median(t) * 1e3:10.1f}ms {p99 * 1e3:6.1f}ms {t[-1] * 1e3:6.1f}ms "
              f"{ticks:14d} {user_throughput(res, 'A'):11.0f} "
              f"{res.scheduler.metrics()['throughput_tokens_per_sec']:9.0f} {iso:8d}")
    cfg = res.scheduler.config
    k, aging = cfg.max_sit_out_ticks, cfg.aging_ticks
    work = -(-PROMPT_RANGE[1] // cfg.prefill_chunk_tokens) + MAX_TOKENS_RANGE[1]
    print(f"   derived bound at the front of the order: aging_ticks + (chunks+max_tokens) + 1 = "
          f"{fr.admission_wait_bound(aging, work)} counted ticks (not isolated; aging {aging}, work {work}; "
          f"isolated ticks at most K={k} in a row)")

    print("\n== returning user: A and C backlogged; B idles, then returns with 200 requests at t = 8 s; seed 0, virtual clock ==")
    print(f"{'policy':14} {'B share after return':>20} {'fair':>5}")
    series = None
    for c in CONTENDERS:
        res = run(returning(0, n_backlog=600 // scale, n_return=200 // scale), c)
        print(f"{c.name:14} {share_after(res.scheduler.trace, 'B', 8.0, window_s=3.0):20.3f} {1 / 3:5.3f}")
        if series is None:
            series = service_per_window(res.scheduler.trace, ("A", "B", "C"), 6.0, 12.0, 1.0)
    print("   per-user service over time, VTC+isolation (weighted tokens per 1 s window):")
    print("      " + " ".join(f"{'t=%.0fs' % t:>8}" for t, _ in series))
    for u in ("A", "B", "C"):
        print(f"   {u}: " + " ".join(f"{w[u]:8.0f}" for _, w in series))

    print(f"\n(bench took {time.perf_counter() - t_start:.0f} s of wall time)")
    return 0


class _AdmissionTicks(Scheduler):
    """A scheduler that records the tick at which each request was admitted."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.admitted_at: dict[str, int] = {}

    def update_from_output(self, plan, tokens, **kw):
        for e in plan.batch:
            if e.admitted:
                self.admitted_at.setdefault(e.seq.request_id, self.stats.ticks)
        return super().update_from_output(plan, tokens, **kw)


def large_prompt_wait_ticks(seed: int, resume_first: bool, isolation: bool) -> int:
    """Ticks from the arrival of one large prompt (user ``x``, a third of the cache or more,
    arriving at tick 20) to its admission, while one or two other users submit 1-3 small
    requests every tick into a cache of 16-48 blocks of 4 tokens (so decodes are preempted
    and come back): the search that compared the versions of ``resume_first``
    (``docs/fairness.md``, section 3). Seeded; a step clock; no EOS.

    Raises:
        RuntimeError: the prompt was not admitted within the run (300-600 ticks).
    """
    rng = random.Random(seed)
    cap, B = rng.choice([16, 24, 32, 48]), 4
    per_tick = rng.choice([1, 2, 3])
    ticks = iter(range(1, 1 << 62))
    s = _AdmissionTicks(backend=lambda batch: [1 + (len(r.prompt) + len(r.generated)) % 63 for r in batch],
                        clock=lambda: next(ticks) * 1e-3, kv_cap_blocks=cap, block_tokens=B,
                        prefill_chunk_tokens=rng.choice([8, 16, 64]), aging_ticks=rng.choice([4, 8, 32]),
                        resume_first=resume_first, isolation=isolation,
                        max_preemptions=rng.choice([None, 2, 4]))

    def req(rid: str, user: str, n_prompt: int, max_tokens: int) -> Request:
        return Request(user_id=user, prompt=[1 + i % 63 for i in range(n_prompt)], max_tokens=max_tokens,
                       request_id=rid)

    x = req("x", "x", rng.randint(cap * B // 3, cap * B - 2 * B), 2)
    n_ticks, t_sub = rng.randint(300, 600), 20
    users = rng.choice([["a"], ["a", "b"]])
    for t in range(n_ticks):
        for k in range(per_tick):
            s.submit(req(f"a{t}_{k}", rng.choice(users), rng.randint(2, 12), rng.randint(5, 40)))
        if t == t_sub:
            s.submit(x)
        s.tick()
        if "x" in s.admitted_at:
            return s.admitted_at["x"] - t_sub
    raise RuntimeError(f"seed {seed}: the large prompt was not admitted")


def tick_cpu_us(contender: Contender, n_running: int, n_waiting: int, users: int = 4) -> float:
    """CPU microseconds per ``tick()`` with a null backend, ``n_running`` decoding and
    ``n_waiting`` waiting (``time.process_time``, best of 5 runs of 100 ticks)."""
    s = Scheduler(backend=lambda batch: [1] * len(batch), clock=lambda: 0.0, kv_cap_blocks=100_000,
                  record_itl=False, max_running=n_running, **contender.kwargs())
    for i in range(n_running + n_waiting):
        s.submit(Request(user_id=f"u{i % users}", prompt=[1] * 8, max_tokens=10 ** 6, request_id=f"r{i}"))
    for _ in range(20):
        s.tick()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(100):
            s.tick()
        best = min(best, (time.process_time() - t) / 100 * 1e6)
    return best


def max_wait_ticks(res: simulate.RunResult, users: Sequence[str]) -> int:
    """Most ticks a request of ``users`` waited from submit to its first token (from the trace)."""
    times = [t for t, _, _ in res.scheduler.trace]
    from bisect import bisect_left, bisect_right
    worst = 0
    for r in res.finished:
        if r.user_id in users:
            worst = max(worst, bisect_right(times, r.started_at) - bisect_left(times, r.submitted_at))
    return worst


def service_per_window(trace, users: Sequence[str], t0_s: float, t1_s: float, step_s: float):
    """``[(window start, {user: service in the window})]`` over ``[t0_s, t1_s)`` (clock seconds)."""
    out = []
    t = t0_s
    while t < t1_s - 1e-9:
        a = next((svc for tt, svc, _ in trace if tt >= t), trace[-1][1])
        b = next((svc for tt, svc, _ in trace if tt >= t + step_s), trace[-1][1])
        out.append((t, {u: b.get(u, 0.0) - a.get(u, 0.0) for u in users}))
        t += step_s
    return out


def share_after(trace, user: str, t_s: float, *, window_s: float) -> float:
    """The user's fraction of all service delivered in ``[t_s, t_s + window_s]`` (clock seconds)."""
    start = next((svc for t, svc, _ in trace if t >= t_s), None)
    end = next((svc for t, svc, _ in trace if t >= t_s + window_s), trace[-1][1])
    if start is None:
        return 0.0
    total = sum(end.values()) - sum(start.values())
    return (end.get(user, 0.0) - start.get(user, 0.0)) / total if total else 0.0


if __name__ == "__main__":
    sys.exit(main())
