"""Throughput of Batch on Ray Serve: 1 replica against N on the saturating stream, real time.

``request_gen.stream`` at 60 requests/s per replica (about 2.2x one replica's capacity), each
request sent at its arrival time through ``ScaleoutClient`` (the deployment handle); throughput is
output tokens over first send to last answer, seconds of wall time. The simulated GPU runs at the
stub's latency (``--time-scale 1``). Needs the ``scaleout`` extra.

    .venv/bin/python bench/scaleout_ray.py --replicas 1,2 --per-replica 300 --overload 50

``--overload N`` adds the overload of ``bench/scaleout_sim.py`` (4 users x N requests per replica,
sent at once) on the largest replica count, with the counters actor measuring the global counter
gap between users waiting on every replica, and the bound's terms, at every sync.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Sequence

import ray
from ray import serve

import request_gen
from batch.scaleout.ray_serve import ScaleoutClient, deploy
from spec import fairness_rules as fr

from bench_fairness import MAX_TOKENS_RANGE, PROMPT_RANGE
from scaleout_sim import overload


def overload_gap(replicas: int, per_user: int, time_scale: float) -> None:
    """The overload (4 users x ``per_user`` requests per replica, sent at once) on Ray: the counter
    gap the counters actor measured against the derived bound (docs/scale-out.md section 2)."""
    handle, counters = deploy(replicas, time_scale=time_scale, name=f"gap{replicas}", observe_gap=True)
    reqs = overload(0, per_user * replicas)
    client = ScaleoutClient(handle)
    out, wall_s = asyncio.new_event_loop().run_until_complete(replay(client, reqs))
    st = ray.get(counters.gap_stats.remote())
    per_request = fr.PROMPT_PRICE * PROMPT_RANGE[1] + fr.OUTPUT_PRICE * MAX_TOKENS_RANGE[1]
    top = sorted(st["max_resident"].values(), reverse=True)[:2] + [0, 0]
    resident = (top[0] + top[1]) * per_request
    bound = resident + st["max_window_tokens"]
    lost = len(reqs) - sum(1 for o in out if "error" not in o)
    print(f"overload on {replicas} replicas ({len(reqs)} requests at once, {lost} lost, {wall_s:.1f} s): counter gap "
          f"{st['max_gap_tokens']:,.0f} weighted tokens <= bound {bound:,.0f} (U_p+U_q {resident:,.0f} with max N_u "
          f"{top[0]}, D {st['max_window_tokens']:,.0f} over S = {st['staleness_s']:.2f} s): "
          f"{st['max_gap_tokens'] / bound:.3f} of it", flush=True)
    serve.delete(f"gap{replicas}")


async def replay(client: ScaleoutClient, reqs) -> tuple[list[dict], float]:
    """Send each request at its arrival offset; (answers, wall seconds from first send to last answer)."""
    t0 = time.perf_counter()

    async def one(r):
        await asyncio.sleep(max(0.0, r.submitted_at - (time.perf_counter() - t0)))
        return await client.generate({"user": r.user_id, "prompt": r.prompt, "max_tokens": r.max_tokens,
                                      "request_id": r.request_id})

    out = await asyncio.gather(*(one(r) for r in reqs))
    return out, time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    """Print one line per replica count: requests, output tokens, tok/s, x one replica, per replica."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--per-replica", type=int, default=300, help="stream requests per replica")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--overload", type=int, default=0,
                    help="also the overload's counter gap on the largest replica count: requests per user per replica")
    a = ap.parse_args(argv)
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    one = None
    try:
        for n in (int(x) for x in a.replicas.split(",")):
            handle, _ = deploy(n, time_scale=a.time_scale, name=f"bench{n}")
            reqs = request_gen.stream(n=a.per_replica * n, lam=60.0 * n, seed=a.seed)
            client = ScaleoutClient(handle)
            out, wall_s = asyncio.new_event_loop().run_until_complete(replay(client, reqs))
            tokens = sum(len(o["tokens"]) for o in out)
            thr = tokens / wall_s
            one = one or thr
            lost = len(reqs) - sum(1 for o in out if "error" not in o)
            per = {}
            for o in out:
                per[o["replica"]] = per.get(o["replica"], 0) + len(o["tokens"])
            print(f"{n} replicas: {len(out)} requests, {lost} lost, {tokens} output tokens in {wall_s:.2f} s: "
                  f"{thr:,.0f} tok/s, x{thr / one:.2f} of one replica ({thr / one / n:.2f} per replica); "
                  f"balance (max/min tokens per replica) {max(per.values()) / min(per.values()):.3f}", flush=True)
            serve.delete(f"bench{n}")
        if a.overload:
            overload_gap(max(int(x) for x in a.replicas.split(",")), a.overload, a.time_scale)
    finally:
        # Ray's raylet reports the Serve controller it kills at shutdown on the driver's standard
        # output (colour-coded "Task ServeController... failed" lines): keep them out of the figures.
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            os.dup2(saved, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
