"""Scale-out on the virtual clock: R replicas (each a ``Scheduler`` on its own simulated GPU), the
router in front, the per-user counters shared every ``--period`` seconds (``batch.scaleout``).

For each replica count it runs two workloads (docs/scale-out.md has the table this prints):

* **overload**: four users of different shapes (``bench_fairness.OVERLOAD_USERS``), ``--overload``
  requests each per replica, all at t = 0. Every user is backlogged from the start; the global
  counter gap is the largest difference of global counter (service plus lift level) between two
  users backlogged on every replica (``counter_gap_tokens``); it is checked against the bound
  derived in docs/scale-out.md:
  ``U_p + U_q + T + D``, with ``U_u = N_u * (w_p * L_input + w_q * M) / w_u`` for ``N_u`` the most
  requests user ``u`` held resident on all replicas together (measured after every tick),
  ``T = 0`` (the default tolerance) and ``D`` the most one user's global counter rose (service on
  all replicas, and lifts) within one sync period (measured). The same run with no sharing (``period None``) shows
  what the shared counters buy; ``--flood`` adds the flooding-user case where they matter.
* **returning** (``--returning B``): three of those users backlogged from t = 0 (``--overload``
  requests each per replica) while the fourth (``mixed``) sends ``B`` bursts of 6 requests per
  replica, one every ``--returning-gap`` seconds from 0.5 s: it drains between bursts and comes
  back behind, so it is lifted (and so are the others, on replicas where they drain first). The
  same gap as the overload; a return starts the pair within ``G_R + D + T + 1`` (docs/scale-out.md
  section 2, "where it starts"), so that is the bound checked here (``T = 0``: ``U_p + U_q + 2D``
  and one counter unit); ``lifts`` is the users' lift levels in the store at the end.
* **stream**: ``request_gen.stream`` at 60 requests/s per replica (``stream-saturating``, about
  2.2x one replica's capacity), ``--stream`` requests per replica: throughput against R times one
  replica's, and the router's balance (max/min output tokens and requests routed per replica).

    .venv/bin/python bench/scaleout_sim.py                       # 1, 2, 8, 16, 32, 64 replicas
    .venv/bin/python bench/scaleout_sim.py --replicas 2,8 --period 0.02 --json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Sequence

import request_gen
from batch.scaleout.cluster import ClusterResult, LocalCluster
from bench_fairness import MAX_TOKENS_RANGE, OVERLOAD_USERS, PROMPT_RANGE, _req
from inference_stub import Request
from spec import fairness_rules as fr


def overload(seed: int, per_user: int) -> list[Request]:
    """Four users of different shapes, ``per_user`` requests each, all at offset 0, interleaved."""
    rng = random.Random(seed)
    return [_req(rng, u, i, 0.0, p, m) for i in range(per_user) for u, (p, m) in OVERLOAD_USERS.items()]


def flood(seed: int, replicas: int, n_flood: int, n_each: int) -> list[Request]:
    """User A floods (``n_flood`` requests); ``replicas`` light users ``L0``, ``L1``, ... send
    ``n_each`` each; all at t = 0. ``run_flood`` pins ``Lk`` to replica ``rk`` (an affinity
    constraint), A goes where the router sends it."""
    rng = random.Random(seed)
    out = [_req(rng, "A", i, 0.0) for i in range(n_flood)]
    others = [f"L{k}" for k in range(replicas)]
    out += [_req(rng, u, i, 0.0) for i in range(n_each) for u in others]
    return out


def returning(seed: int, per_user: int, bursts: int, burst: int, gap_s: float) -> list[Request]:
    """Three ``OVERLOAD_USERS`` with ``per_user`` requests each at t = 0; the fourth, ``mixed``,
    ``bursts`` bursts of ``burst`` requests at 0.5 s, 0.5 + ``gap_s``, ... (it returns, lifted)."""
    rng = random.Random(seed)
    users = list(OVERLOAD_USERS.items())
    out = [_req(rng, u, i, 0.0, p, m) for i in range(per_user) for u, (p, m) in users[:3]]
    u, (p, m) = users[3]
    out += [_req(rng, u, b * burst + i, 0.5 + b * gap_s, p, m) for b in range(bursts) for i in range(burst)]
    return out


def gap_bound_tokens(res: ClusterResult) -> tuple[float, float]:
    """(the derived bound, weighted tokens, for the two users with the largest ``N_u``; the
    resident part ``U_p + U_q`` alone). ``L_input``/``M``: the overload's largest prompt and output."""
    per_request = fr.PROMPT_PRICE * PROMPT_RANGE[1] + fr.OUTPUT_PRICE * MAX_TOKENS_RANGE[1]
    top = sorted(res.max_resident.values(), reverse=True)[:2] + [0, 0]
    resident = (top[0] + top[1]) * per_request
    return resident + 0 + res.max_period_rise_tokens, resident


def run_overload(replicas: int, period: float | None, per_user: int, seed: int) -> dict:
    t0 = time.perf_counter()
    res = LocalCluster(replicas, period_s=period, seed=seed).run(overload(seed, per_user * replicas))
    bound, resident = gap_bound_tokens(res)
    return {"replicas": replicas, "period_s": period, "requests": len(res.finished),
            "counter_gap": res.counter_gap_tokens, "counter_gap_any": res.counter_gap_any_tokens,
            "interval_gap": res.gap_tokens,
            "period_D": res.max_period_rise_tokens, "resident_part": resident, "bound": bound,
            "max_resident": max(res.max_resident.values()), "wall_s": time.perf_counter() - t0}


def run_returning(replicas: int, period: float, per_user: int, bursts: int, gap_s: float, seed: int) -> dict:
    t0 = time.perf_counter()
    cl = LocalCluster(replicas, period_s=period, seed=seed)
    res = cl.run(returning(seed, per_user * replicas, bursts, 6 * replicas, gap_s))
    g_r, resident = gap_bound_tokens(res)
    bound = g_r + res.max_period_rise_tokens + 1 / fr.COUNTER_SCALE  # G_R + D + T + 1 unit, T = 0
    return {"replicas": replicas, "period_s": period, "requests": len(res.finished),
            "counter_gap": res.counter_gap_tokens, "counter_gap_any": res.counter_gap_any_tokens,
            "period_D": res.max_period_rise_tokens, "resident_part": resident, "bound": bound,
            "lifts": {u: v / fr.COUNTER_SCALE for u, v in sorted(cl.store.lifts().items())},
            "wall_s": time.perf_counter() - t0}


def run_flood(replicas: int, period: float | None, seed: int, n_flood: int, n_each: int) -> dict:
    ids = {f"r{k}" for k in range(replicas)}

    def pin(r: Request) -> set[str]:
        return ids - {"r" + r.user_id[1:]} if r.user_id.startswith("L") else set()

    res = LocalCluster(replicas, period_s=period, seed=seed).run(flood(seed, replicas, n_flood * replicas, n_each),
                                                                 exclude=pin)
    shares = []
    for d in res.share_service.values():
        tot = sum(d.values())
        if tot > 0:
            shares.append(d["A"] / tot)
    if not shares:
        raise ValueError("no sample had every user backlogged: give the flood more requests (--flood, --light)")
    return {"replicas": replicas, "period_s": period, "flooder_share_max": max(shares),
            "flooder_share_min": min(shares), "fair_share": 1 / (replicas + 1),
            "interval_gap": res.gap_tokens}


def run_stream(replicas: int, period: float | None, per_replica: int, seed: int) -> dict:
    t0 = time.perf_counter()
    reqs = request_gen.stream(n=per_replica * replicas, lam=60.0 * replicas, seed=seed)
    res = LocalCluster(replicas, period_s=period, seed=seed).run(reqs)
    routed = list(res.routed.values())
    return {"replicas": replicas, "period_s": period, "requests": len(res.finished), "lost": len(reqs) - len(
        res.finished) - len(res.refused), "throughput": res.throughput_tokens_per_s,
            "balance_tokens": res.balance(), "balance_routed": max(routed) / min(routed),
            "wall_s": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print the tables (or one JSON object with ``--json``); exit status 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,2,8,16,32,64", help="comma-separated replica counts")
    ap.add_argument("--period", type=float, default=0.05, help="counter sync period, simulated seconds")
    ap.add_argument("--overload", type=int, default=25, help="overload requests per user per replica")
    ap.add_argument("--returning", type=int, default=0,
                    help="returning case: bursts of the returning user (0: skip); the others send --overload each")
    ap.add_argument("--returning-gap", type=float, default=1.0, help="returning case: seconds between bursts")
    ap.add_argument("--stream", type=int, default=150, help="stream requests per replica")
    ap.add_argument("--flood", type=int, default=0,
                    help="flood case: the flooder's requests per replica (0: skip); 40 requests of each other user")
    ap.add_argument("--light", type=int, default=150, help="flood case: requests of each light user")
    ap.add_argument("--flood-periods", default=None,
                    help="flood case: comma-separated sync periods, 'none' for no sharing (default: --period,none)")
    ap.add_argument("--flood-only", action="store_true", help="run only the flood case")
    ap.add_argument("--no-share", action="store_true", help="also run the overload without shared counters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.replicas.split(",")]
    out: dict[str, list] = {"overload": [], "stream": [], "flood": [], "returning": []}
    periods = [None if x == "none" else float(x) for x in (a.flood_periods or f"{a.period},none").split(",")]
    for r in counts:
        if not a.flood_only:
            out["overload"].append(run_overload(r, a.period, a.overload, a.seed))
            if a.no_share:
                out["overload"].append(run_overload(r, None, a.overload, a.seed))
            out["stream"].append(run_stream(r, a.period, a.stream, a.seed))
        if a.returning:
            out["returning"].append(run_returning(r, a.period, a.overload, a.returning, a.returning_gap, a.seed))
        if a.flood:
            for period in periods:
                out["flood"].append(run_flood(r, period, a.seed, a.flood, a.light))
        if not a.json:
            print(f"... {r} replicas done", file=sys.stderr)
    if a.json:
        print(json.dumps(out))
        return 0
    if not a.flood_only:
        print_main(a, out)
    if out["returning"]:
        print(f"\nReturning user: 3 users x {a.overload} requests per replica at t=0, 'mixed' {a.returning} bursts of "
              f"6 per replica every {a.returning_gap} s from 0.5 s; sync period {a.period} s; D includes lifts; "
              f"bound G_R + D + T + 1 unit")
        print(f"{'replicas':>8} {'counter gap':>11} {'G_R + D':>9} {'gap/bound':>9} {'D (1 period)':>12} {'U_p+U_q':>9} "
              f"{'gap, any':>9}  lift levels (tokens)")
        for o in out["returning"]:
            lifts = ", ".join(f"{u} {v:,.0f}" for u, v in o["lifts"].items()) or "none"
            print(f"{o['replicas']:>8} {o['counter_gap']:>11,.0f} {o['bound']:>9,.0f} {o['counter_gap'] / o['bound']:>9.3f} "
                  f"{o['period_D']:>12,.0f} {o['resident_part']:>9,.0f} {o['counter_gap_any']:>9,.0f}  {lifts}")
    if out["flood"]:
        print(f"\nFlood: A sends {a.flood} requests per replica, light user Lk {a.light} requests pinned to replica k, "
              f"all at t=0; A's share of each replica's service while all are backlogged (fair: 1/(R+1) of each)")
        print(f"{'replicas':>8} {'period':>7} {'A share max':>11} {'A share min':>11} {'fair':>6}")
        for f in out["flood"]:
            per = "none" if f["period_s"] is None else f"{f['period_s']:g}"
            print(f"{f['replicas']:>8} {per:>7} {f['flooder_share_max']:>11.3f} {f['flooder_share_min']:>11.3f} "
                  f"{f['fair_share']:>6.3f}")
    return 0


def print_main(a: argparse.Namespace, out: dict) -> None:
    """The overload and stream tables."""
    print(f"Overload (4 users x {a.overload} requests per replica at t=0), weighted tokens; sync period "
          f"{a.period} s")
    print(f"{'replicas':>8} {'period':>7} {'counter gap':>11} {'bound':>9} {'gap/bound':>9} {'D (1 period)':>12} "
          f"{'U_p+U_q':>9} {'max N_u':>7} {'interval gap':>12} {'gap, any':>9} {'wall s':>6}")
    for o in out["overload"]:
        per = "none" if o["period_s"] is None else f"{o['period_s']:g}"
        if o["period_s"] is None:  # no sharing: the bound's derivation does not apply (D unbounded)
            bound, ratio, d = f"{'-':>9}", f"{'-':>9}", f"{'-':>12}"
        else:
            bound, ratio = f"{o['bound']:>9,.0f}", f"{o['counter_gap'] / o['bound']:>9.3f}"
            d = f"{o['period_D']:>12,.0f}"
        print(f"{o['replicas']:>8} {per:>7} {o['counter_gap']:>11,.0f} {bound} {ratio} {d} {o['resident_part']:>9,.0f} "
              f"{o['max_resident']:>7} {o['interval_gap']:>12,.0f} {o['counter_gap_any']:>9,.0f} {o['wall_s']:>6.1f}")
    one = next((s["throughput"] for s in out["stream"] if s["replicas"] == 1), None)
    print(f"\nSaturating stream (request_gen.stream, 60 req/s per replica, {a.stream} requests per replica)")
    print(f"{'replicas':>8} {'out tok/s':>10} {'x one':>6} {'/ R':>5} {'balance tok':>11} {'balance routed':>14} "
          f"{'lost':>4} {'wall s':>6}")
    for s in out["stream"]:
        x = s["throughput"] / one if one else float("nan")
        print(f"{s['replicas']:>8} {s['throughput']:>10,.0f} {x:>6.2f} {x / s['replicas']:>5.2f} "
              f"{s['balance_tokens']:>11.3f} {s['balance_routed']:>14.3f} {s['lost']:>4} {s['wall_s']:>6.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
