#!/usr/bin/env python3
"""Memory per user of the Ray counters actor: N distinct users, each charged on one replica's
sync and idle from then on; the actor's resident memory (RSS) and user count at start, after a
warm-up, and after the N users.

What it drives: the counters actor itself, made as ``batch-llm serve --replicas N`` makes it
(``batch.scaleout.ray_serve._counters_actor``: ``CountersActor``, i.e. ``GlobalCounters`` as a
Ray actor, with ``forget_idle=POLICY_FORGETS`` and the replicas' tolerance) on a local Ray
instance, called the way each ``EngineReplica`` calls it (``_sync_once``): ``reply(replica)`` at
the replica's start, then ``sync(replica, deltas, state, lifts)`` with the service granted since
the replica's last sync (counter units), the lift levels it raised and its state (the users
waiting and resident there). ``--replicas`` replica ids take turns; each sync carries ``--batch``
new users, each lifted on arrival as ``VTCPolicy.lift`` would on that replica's view (to the heavy
user's counter as last read, minus the tolerance, minus one unit), charged one short request
(``--prompt-tokens``, ``--output-tokens``), and reported resident at that sync; from the
replica's next sync on it is idle everywhere and never seen again. A heavy user is waiting on
every replica throughout and charged ``--heavy-tokens`` weighted tokens per replica per sync, so
that someone is always backlogged: a user's counter can only be forgotten when the lift would
give it back on return, which needs a backlog to be lifted against (as in ``bench/user_churn.py``;
docs/scale-out.md, "Forgetting idle users"). Each reading comes after one idle sync per replica
(no new users), so the last batch is idle by then. ``--keep`` starts the actor with
``forget_idle=False`` instead: the control, what the same users cost a store that keeps them.

Why not over HTTP: ``bench/user_churn.py --replicas 2`` measures the same actor through the
``Ingress``'s ``/metrics``, but Ray Serve passes only about 10 users a second on this project's
2-core machine, so 100,000 users would take about 3 hours; the actor only ever sees the replicas'
syncs, which this drives directly (the replicas' and the ingress's own memory is not measured
here). RSS is read by the actor itself (``GlobalCounters.process``, what ``/metrics`` exports as
``batch:counter_store_resident_memory_bytes``) and the user count by ``size()``
(``batch:counter_store_users``). Freed memory is not always handed back to the OS, so RSS reads
the high-water mark of what the process holds: growth after the warm-up is what per-user state
costs; the Python heap's allocated blocks (``sys.getallocatedblocks`` in the actor's process,
after a collection) tell whether the objects it holds grew, or only the allocator's high-water
mark.

Usage, from the project root::

    .venv/bin/python bench/counters_churn.py --users 100000 --warmup 5000
    .venv/bin/python bench/counters_churn.py --users 100000 --warmup 5000 --keep   # the control
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import ray

from batch.scaleout.ray_serve import POLICY_FORGETS, CountersActor, _counters_actor
from spec import fairness_rules as fr

HEAVY = "heavy"
TOLERANCE_UNITS = fr.TOLERANCE_TOKENS * fr.COUNTER_SCALE  # what _counters_actor gives the actor


class Replica:
    """What one ``EngineReplica`` sends the actor: its heavy user's service, its view of the heavy
    user's counter (own service plus the others' as last read), the new users' lifts and charges."""

    def __init__(self, rid: str, actor: Any, heavy_streams: int) -> None:
        self.rid, self.actor, self.heavy_streams = rid, actor, heavy_streams
        self.own_heavy = 0  # counter units granted to the heavy user here
        self.offset_heavy = 0  # the others' service to it, as last read (raise-only, as set_offsets)
        self.take(ray.get(actor.reply.remote(rid)))  # EngineReplica.__init__: the others' service now

    def take(self, reply: Any) -> None:
        self.offset_heavy = max(self.offset_heavy, reply.service.get(HEAVY, 0))

    def sync(self, users: list[str], heavy_units: int, user_units: int) -> None:
        """One ``sync``: ``users`` arrived here since the last one (lifted against the heavy user,
        charged, still resident now); the heavy user waited and was charged ``heavy_units``."""
        view = self.own_heavy + self.offset_heavy  # the heavy user's counter on this replica's view
        level = max(0, view - TOLERANCE_UNITS - 1)  # lift_floor(0, view, True, T): the new users' lift
        lifts = {u: level for u in users} if level else {}
        deltas = {u: user_units for u in users}
        deltas[HEAVY] = heavy_units
        self.own_heavy += heavy_units
        resident = {u: 1 for u in users}
        resident[HEAVY] = self.heavy_streams
        state = {"waiting": [HEAVY], "resident": resident}
        self.take(ray.get(self.actor.sync.remote(self.rid, deltas, state, lifts)))


def _heap_blocks(store: Any) -> int:
    """In the actor's process: the Python heap's allocated blocks after a collection."""
    gc.collect()
    return sys.getallocatedblocks()


def reading(actor: Any) -> dict[str, Any]:
    """The actor's RSS (MB), ``size()`` and Python heap blocks (read last: it collects garbage)."""
    proc, size = ray.get([actor.process.remote(), actor.size.remote()])
    blocks = ray.get(actor.__ray_call__.remote(_heap_blocks))
    return {"rss_mb": proc["rss_bytes"] / 2**20, "pid": proc["pid"], **size, "heap_blocks": blocks}


def run(users: int, warmup: int, batch: int, replicas: int, heavy_tokens: int, prompt_tokens: int,
        output_tokens: int, keep: bool) -> dict[str, Any]:
    """Start the actor, the readings and the syncs (module doc); the figures (MB, bytes a user)."""
    actor = (CountersActor.remote(forget_idle=False, tolerance_units=TOLERANCE_UNITS) if keep
             else _counters_actor())
    streams = [4 // replicas + (i < 4 % replicas) for i in range(replicas)]  # 4 heavy streams, spread
    reps = [Replica(f"r{i}", actor, streams[i]) for i in range(replicas)]
    heavy_units = fr.charged_counter(0, heavy_tokens, 1)
    user_units = fr.charged_counter(0, fr.service_units(prompt_tokens, output_tokens, fr.PROMPT_PRICE,
                                                        fr.OUTPUT_PRICE), 1)
    out: dict[str, Any] = {"users": users, "warmup": warmup, "batch": batch, "replicas": replicas,
                           "forget_idle": (not keep) and POLICY_FORGETS, "heavy_tokens": heavy_tokens,
                           "user_tokens": user_units // fr.COUNTER_SCALE}
    syncs = 0
    turn = 0

    def idle_round() -> None:
        nonlocal syncs
        for r in reps:
            r.sync([], heavy_units, user_units)
            syncs += 1

    def churn(first: int, n: int) -> None:
        nonlocal syncs, turn
        for lo in range(first, first + n, batch):
            reps[turn % replicas].sync([f"u{i}" for i in range(lo, min(lo + batch, first + n))], heavy_units,
                                       user_units)
            turn += 1
            syncs += 1
        idle_round()

    idle_round()
    out["before"] = reading(actor)
    t0 = time.perf_counter()
    churn(0, warmup)
    out["after_warmup"] = reading(actor)
    t1 = time.perf_counter()
    churn(warmup, users)
    out["churn_s"] = time.perf_counter() - t1
    out["after"] = reading(actor)
    out["total_s"] = time.perf_counter() - t0
    out["syncs"] = syncs
    grow = out["after"]["rss_mb"] - out["after_warmup"]["rss_mb"]
    out["counters_rss_growth_mb"] = grow
    out["counters_bytes_per_user"] = grow * 2**20 / users
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=100_000, help="distinct users after the warm-up (default 100,000)")
    p.add_argument("--warmup", type=int, default=5_000, help="distinct users before the first reading (default 5,000)")
    p.add_argument("--batch", type=int, default=500, help="new users in one replica's sync (default 500)")
    p.add_argument("--replicas", type=int, default=2, help="replica ids taking turns to sync (default 2)")
    p.add_argument("--heavy-tokens", type=int, default=200,
                   help="weighted tokens the heavy user is charged per replica per sync (default 200)")
    p.add_argument("--prompt-tokens", type=int, default=5, help="prompt tokens of a user's request (default 5)")
    p.add_argument("--output-tokens", type=int, default=4, help="output tokens of a user's request (default 4)")
    p.add_argument("--keep", action="store_true", help="the control: the actor with forget_idle=False")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    if a.users < 1 or a.warmup < 0 or a.batch < 1 or a.replicas < 1 or a.heavy_tokens < 1 \
            or a.prompt_tokens < 0 or a.output_tokens < 0:
        p.error("--users, --batch, --replicas and --heavy-tokens must be >= 1, the others >= 0")
    ray.init(num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        out = run(a.users, a.warmup, a.batch, a.replicas, a.heavy_tokens, a.prompt_tokens, a.output_tokens, a.keep)
    finally:
        ray.shutdown()
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    b, w, f = out["before"], out["after_warmup"], out["after"]
    print(f"{a.users:,} users after a warm-up of {a.warmup:,} ({a.batch} a sync, {a.replicas} replicas taking turns, "
          f"a heavy user waiting on each charged {a.heavy_tokens} tokens a sync; "
          f"forget_idle {'on' if out['forget_idle'] else 'off'}); {out['syncs']} syncs; churn {out['churn_s']:.1f} s")
    print(f"counters actor RSS: {b['rss_mb']:.1f} MB at start, {w['rss_mb']:.1f} MB after the warm-up, "
          f"{f['rss_mb']:.1f} MB after the users: {out['counters_rss_growth_mb']:+.1f} MB, "
          f"{out['counters_bytes_per_user']:.0f} bytes a user")
    print(f"counters actor users: {b['users']} at start, {w['users']} after the warm-up, {f['users']} after "
          f"(per-replica entries {f['entries']}, forgotten {f['forgotten']:,}, news pending {f['pending_news']})")
    print(f"counters actor Python heap: {b['heap_blocks']:,} allocated blocks at start, {w['heap_blocks']:,} after the "
          f"warm-up, {f['heap_blocks']:,} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
