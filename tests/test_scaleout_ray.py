"""Two Batch replicas on Ray Serve (batch/scaleout/ray_serve.py) on a local Ray with 2 CPUs and the
simulated GPU at the stub's latency: a replica killed mid-run loses nothing (its requests are
retried on the other from scratch and come back with the same tokens), the A/B burst over both
replicas keeps B's median TTFT within 1.5x of alone, and a flooding user gets no more than its share
of either replica when each light user is pinned to one replica, which holds only with the shared
counters (the same run without them is the control). Skipped without the ``scaleout`` extra (``make test-scaleout`` installs it)."""
from __future__ import annotations

import asyncio
import random
import statistics

import pytest

ray = pytest.importorskip("ray", reason="needs the 'scaleout' extra (ray[serve]): make test-scaleout")
serve = pytest.importorskip("ray.serve")

from batch.scaleout.ray_serve import ScaleoutClient, deploy  # noqa: E402
from batch.server.engine import SeededGPU, ServedRequest  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from spec import fairness_rules as fr  # noqa: E402

pytestmark = pytest.mark.slow

TIME_SCALE = 1.0  # the stub's latency: 5 ms + 1 ms per request an iteration
KV_CAP_BLOCKS = 96  # a smaller cache than the stub's 256: a burst of 60 requests per user is a backlog


@pytest.fixture(scope="module")
def handle():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        h, counters = deploy(2, time_scale=TIME_SCALE, period_s=0.05, kv_cap_blocks=KV_CAP_BLOCKS)
        h.counters = counters
        yield h
    finally:
        serve.shutdown()
        ray.shutdown()


def bodies(user: str, n: int, seed: int, max_tokens: tuple[int, int] = (10, 99)) -> list[dict]:
    rng = random.Random(f"{user}/{seed}")
    return [{"user": user, "prompt": [rng.randint(1, 63) for _ in range(rng.randint(5, 199))],
             "max_tokens": rng.randint(*max_tokens), "request_id": f"{user}{seed}-{i}"} for i in range(n)]


def expected_tokens(items: list[dict]) -> dict[str, list[int]]:
    """What the seeded GPU produces for each prompt, run here on one scheduler."""
    s = Scheduler(backend=SeededGPU(time_scale=1e-6, seed=0))
    reqs = [ServedRequest(user_id=b["user"], prompt=b["prompt"], max_tokens=b["max_tokens"],
                          request_id=b["request_id"], seed_key=SeededGPU.prompt_key(b["prompt"])) for b in items]
    for r in reqs:
        s.submit(r)
    while s.has_active():
        s.tick()
    return {r.request_id: list(r.generated) for r in reqs}


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_a_killed_replica_loses_nothing_its_requests_are_retried_from_scratch(handle):
    client = ScaleoutClient(handle)
    items = bodies("A", 40, 1, max_tokens=(80, 99)) + bodies("B", 40, 1, max_tokens=(80, 99))
    victim = run(client.generate(bodies("W", 1, 0)[0]))["actor_name"]

    async def main():
        tasks = [asyncio.ensure_future(client.generate(b)) for b in items]
        await asyncio.sleep(0.5)
        assert not all(t.done() for t in tasks), "the run ended before the kill"
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return await asyncio.gather(*tasks)

    out = run(main())
    assert len(out) == len(items) and all("error" not in o for o in out)
    assert client.retries > 0, "the kill hit requests in flight"
    assert {o["request_id"]: o["tokens"] for o in out} == expected_tokens(items)
    assert all(o["actor_name"] != victim for o in out if o["tries"] > 1)
    print(f"kill: {len(out)} requests, {sum(o['tries'] > 1 for o in out)} retried on the other replica, none lost, "
          f"tokens equal to a single scheduler's")


def test_ab_burst_over_both_replicas_keeps_b_ttft_within_1_5x_of_alone(handle):
    client = ScaleoutClient(handle)

    async def burst(items):
        return await asyncio.gather(*(client.generate(b) for b in items))

    ratios = []
    for seed in (2, 3, 4):
        b_items = bodies("B", 5, seed)
        alone = statistics.median(o["ttft_s"] for o in run(burst(b_items)))
        mixed = run(burst(bodies("A", 100, seed) + [dict(b, request_id=b["request_id"] + "x") for b in b_items]))
        with_a = statistics.median(o["ttft_s"] for o in mixed if o["request_id"].startswith("B"))
        assert len(mixed) == 105 and all("error" not in o for o in mixed)
        assert len({o["replica"] for o in mixed if o["request_id"].startswith("A")}) == 2, "A's burst used one replica"
        ratios.append(with_a / alone)
    print(f"A/B over two replicas: B's median TTFT with A / alone, per seed: {[round(r, 2) for r in ratios]}")
    assert statistics.median(ratios) <= 1.5, ratios


PINS = {"L1": 0, "L2": 1}  # the light users' replicas: index into the sorted live replica ids
SHARED_BOUND = 0.45  # F's share of a replica with shared counters at most this (fair: 1/3; unshared: 1/2)


@pytest.fixture(params=[True, False], ids=["shared", "control-unshared"])
def pinned_app(request, handle):
    """Two more replicas (the module's two stay up, idle: 4 x 0.5 CPU fill the 2), with L1 pinned to
    replica 0 and L2 to replica 1; counters shared (the test) or not (the control)."""
    share = request.param
    name = f"flood-{'shared' if share else 'unshared'}"
    h, counters = deploy(2, time_scale=TIME_SCALE, period_s=0.05, kv_cap_blocks=KV_CAP_BLOCKS, share=share,
                         name=name, pin_users=PINS)
    try:
        yield share, h
    finally:
        serve.delete(name)
        if counters is not None:
            ray.kill(counters)


def test_a_flooding_user_gets_a_third_of_each_replica_only_with_shared_counters(pinned_app):
    # F floods (240 requests, spread over both replicas by load) while L1 (pinned to replica 0) and
    # L2 (to replica 1) send 120 each, all in one burst. Fair is F getting a third of each replica
    # (its global counter counts both replicas); without shared counters each replica splits evenly
    # between F and its light user, so F gets half. Measured when the first light user has all its
    # answers, from each replica's own service() (the same measure with and without the actor).
    share, h = pinned_app
    client = ScaleoutClient(h)
    flood, l1, l2 = bodies("F", 240, 5), bodies("L1", 120, 5), bodies("L2", 120, 5)
    order = [b for i in range(240) for b in ([flood[i]] + ([l1[i // 2], l2[i // 2]] if i % 2 else []))]
    assert len(order) == 480

    async def services() -> dict[str, dict]:
        # each pinned light user's replica: the router sends service({"user": u}) where u's requests go
        outs = await asyncio.gather(*(h.service.remote({"user": u}) for u in PINS))
        return {u: o for u, o in zip(PINS, outs)}

    async def main():
        before = await services()
        tasks = {b["request_id"]: asyncio.ensure_future(client.generate(b)) for b in order}
        light = [[tasks[b["request_id"]] for b in items] for items in (l1, l2)]
        await asyncio.wait([asyncio.gather(*ts) for ts in light], return_when=asyncio.FIRST_COMPLETED)
        after = await services()
        return before, after, await asyncio.gather(*tasks.values())

    before, after, out = run(main())
    assert len(out) == 480 and all("error" not in o for o in out)
    replica_of = {u: {o["replica"] for o in out if o["request_id"].startswith(u)} for u in ("F", "L1", "L2")}
    assert replica_of["L1"] == {before["L1"]["replica"]} and replica_of["L2"] == {before["L2"]["replica"]}
    assert replica_of["L1"] != replica_of["L2"] and replica_of["F"] == replica_of["L1"] | replica_of["L2"]
    shares = []
    for light_user in PINS:
        got = {u: after[light_user]["granted"].get(u, 0.0) - before[light_user]["granted"].get(u, 0.0)
               for u in ("F", "L1", "L2")}
        shares.append(got["F"] / sum(got.values()))
        assert got["L1" if light_user == "L2" else "L2"] == 0, "a pinned user's request reached the other replica"
        print(f"pinned flood ({'shared counters' if share else 'control: no sharing'}): replica of {light_user}: "
              f"service since the burst, weighted tokens: { {u: round(v) for u, v in got.items()} }; "
              f"F's share {shares[-1]:.3f}")
    if share:  # fair is 1/3; the requests resident before the first sync are served whatever the counters
        assert max(shares) <= SHARED_BOUND, shares
    else:  # the control: without sharing each replica splits between F and its light user (about 1/2),
        # so the shared run's assertion fails on both replicas: the test measures the sharing
        assert min(shares) > SHARED_BOUND + 0.02, shares
