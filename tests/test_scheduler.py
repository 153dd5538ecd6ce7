"""The original workspace's public tests, run against the real-time stub as written there."""
import dataclasses

from conftest import make_req

import request_gen
from inference_stub import Request
from scheduler import Scheduler


def test_single_request_completes():
    sched = Scheduler()
    sched.submit(Request(user_id="u1", prompt=[1, 2, 3], max_tokens=10, request_id="r1"))
    finished = []
    while sched.has_active():
        finished += sched.tick()
    assert [r.request_id for r in finished] == ["r1"]
    r = finished[0]
    assert 1 <= len(r.generated) <= 10
    assert r.generated[-1] == 0 or len(r.generated) == 10
    assert r.submitted_at <= r.started_at <= r.completed_at


def test_five_concurrent_requests_complete_and_share_batches():
    sched = Scheduler()
    for i in range(5):
        sched.submit(make_req(f"r{i}", user=f"u{i}", n_prompt=8, max_tokens=20))
    finished = []
    sizes = []
    import scheduler as sched_mod
    real = sched_mod.forward

    def spy(batch):
        sizes.append(len(batch))
        return real(batch)

    sched_mod.forward = spy
    try:
        while sched.has_active():
            finished += sched.tick()
    finally:
        sched_mod.forward = real
    assert sorted(r.request_id for r in finished) == [f"r{i}" for i in range(5)]
    assert sizes[0] == 5, "all five are admitted into the first iteration"


def test_metrics_has_the_four_keys_after_a_run():
    sched = Scheduler()
    for r in request_gen.stream(n=5, lam=50.0, seed=3):
        sched.submit(r)
    while sched.has_active():
        sched.tick()
    m = sched.metrics()
    for k in ("throughput_tokens_per_sec", "avg_latency_s", "p99_latency_s", "gpu_utilization"):
        assert isinstance(m[k], float)
    assert m["throughput_tokens_per_sec"] > 0 and 0 < m["gpu_utilization"] <= 1
    assert m["p99_latency_s"] >= m["avg_latency_s"] * 0.5


def test_stream_submitted_at_once_drains_within_5000_ticks():
    sched = Scheduler()
    for r in request_gen.stream(n=20, lam=10.0, seed=1):
        sched.submit(r)
    ticks = 0
    done = []
    while sched.has_active():
        done += sched.tick()
        ticks += 1
        assert ticks < 5000
    assert len(done) == 20


def test_a_request_the_spent_token_budget_cannot_run_neither_grows_nor_preempts():
    """With the budget spent by earlier requests, a running request at a block boundary with no
    free block is left out of the iteration; it does not preempt anyone (itself included)."""
    from conftest import ScriptedBackend
    from batch.policies.policy import FCFSPolicy
    from spec import rules

    s = Scheduler(kv_cap_blocks=4, block_tokens=4, prefill_chunk_tokens=4, policy=FCFSPolicy(),
                  backend=ScriptedBackend(eos_at={}, block_tokens=4))
    s.submit(make_req("r1", n_prompt=1, max_tokens=12))
    s.submit(make_req("r2", n_prompt=3, max_tokens=12))

    def growth(q):
        return rules.growth_blocks(len(q.block_table), q.num_tokens, 4)

    for _ in range(12):
        s.tick()
        r1, r2 = s.running
        if s.pool.num_free == 0 and growth(r2) > 0 and growth(r1) == 0:
            break
    assert s.pool.num_free == 0 and growth(r2) > 0 and growth(r1) == 0
    assert s.schedule().preempted  # with budget, r2's growth preempts (FCFS: the newest, r2 itself)
    s.config = dataclasses.replace(s.config, token_budget_tokens=1)  # r1's decode spends it
    plan = s.schedule()
    assert plan.preempted == () and [e.seq for e in plan.batch] == [r1]
