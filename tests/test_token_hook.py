"""The scheduler's per-token output hook (``Scheduler(on_tokens=...)``, issue 19)."""
from __future__ import annotations

import threading

import pytest

from conftest import ScriptedBackend, drain, make_req

from batch.policies.policy import FCFSPolicy
from scheduler import Scheduler


def test_hook_sees_every_token_once_in_order_and_tick_returns_the_same():
    seen: dict[str, list[int]] = {}
    calls: list[int] = []

    def hook(pairs):
        calls.append(len(pairs))
        for req, tok in pairs:
            seen.setdefault(req.request_id, []).append(tok)

    backend = ScriptedBackend(eos_at={"r1": 3})
    s = Scheduler(backend=backend, on_tokens=hook, prefill_chunk_tokens=8)
    reqs = [make_req("r0", n_prompt=20, max_tokens=6), make_req("r1", "u2", max_tokens=9),
            make_req("r2", "u3", n_prompt=3, max_tokens=1)]
    for r in reqs:
        s.submit(r)
    done = drain(s)
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    for r in reqs:  # exactly the tokens appended to generated, EOS and the last one included
        assert seen[r.request_id] == r.generated
    assert all(n >= 1 for n in calls)  # never called with an empty list (prefill-only ticks)


def test_hook_unset_changes_nothing_and_can_be_set_later():
    a, b = Scheduler(backend=ScriptedBackend()), Scheduler(backend=ScriptedBackend())
    got = []
    b.on_tokens = got.extend
    for s in (a, b):
        s.submit(make_req("r0", max_tokens=4))
    ra, rb = drain(a), drain(b)
    assert ra[0].generated == rb[0].generated == [t for _, t in got]


def test_hook_runs_outside_the_state_lock_and_may_abort():
    s = Scheduler(backend=ScriptedBackend())
    victim = make_req("v", max_tokens=50)
    aborted = []

    def hook(pairs):
        if any(r is victim for r, _ in pairs) and not aborted:
            aborted.append(s.abort("v"))  # from the ticking thread, after the tick: allowed

    s.on_tokens = hook
    s.submit(victim)
    s.submit(make_req("w", "u2", max_tokens=5))
    drain(s)
    assert aborted == [victim] and len(victim.generated) == 1
    assert s.pool.num_free == s.config.kv_cap_blocks


def test_hook_must_be_callable():
    with pytest.raises(ValueError, match="on_tokens"):
        Scheduler(on_tokens=3)


def test_hook_calling_tick_raises_instead_of_deadlocking():
    s = Scheduler(backend=ScriptedBackend())
    s.submit(make_req("r0", max_tokens=5))
    raised = []

    def hook(pairs):
        try:
            s.tick()
        except RuntimeError as e:
            raised.append(e)

    s.on_tokens = hook
    t = threading.Thread(target=drain, args=(s,), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "tick() from the hook deadlocked"
    assert raised and "on_tokens" in str(raised[0])
    assert not s.has_active() and s.pool.num_free == s.config.kv_cap_blocks


def test_a_raising_hook_leaves_the_tick_applied_and_its_finished_in_last_finished():
    s = Scheduler(backend=ScriptedBackend(eos_at={"r0": 1}))
    r = make_req("r0", max_tokens=5)
    s.submit(r)

    def hook(pairs):
        raise ValueError("hook bug")

    s.on_tokens = hook
    with pytest.raises(ValueError, match="hook bug"):
        while s.has_active():
            s.tick()
    assert r.completed_at is not None and [(q.request_id, why) for q, why in s.last_finished] == [("r0", "stop")]
    s.on_tokens = None
    s.submit(make_req("r1", max_tokens=2))  # the scheduler goes on: the next tick works
    assert [q.request_id for q in drain(s)] == ["r1"]


@pytest.mark.parametrize("n_prompt", [65, 129])
def test_hook_skips_a_prefill_chunk_that_ends_one_token_short_of_the_prompt(n_prompt):
    """A chunk that leaves exactly one prompt token uncomputed produces no token (65 tokens: 64,
    then 1); the hook is not called for it (it raised IndexError on the empty ``generated``)."""
    seen = []
    s = Scheduler(backend=ScriptedBackend(), on_tokens=seen.extend)
    r = make_req("r", n_prompt=n_prompt, max_tokens=3)
    s.submit(r)
    assert drain(s) == [r] and [t for _, t in seen] == r.generated and len(r.generated) == 3


def test_hook_does_not_report_a_token_again_when_a_preempted_request_recomputes():
    """Under preemption by recompute, prompt and generated tokens are prefilled again (chunks of
    2 here); the chunk that ends one token short of them produces nothing: the old last token is
    not reported a second time."""
    seen: dict[str, list[int]] = {}

    def hook(pairs):
        for req, tok in pairs:
            seen.setdefault(req.request_id, []).append(tok)

    s = Scheduler(backend=ScriptedBackend(block_tokens=4), on_tokens=hook, kv_cap_blocks=4, block_tokens=4,
                  prefill_chunk_tokens=2, policy=FCFSPolicy())
    reqs = [make_req("a", n_prompt=6, max_tokens=12), make_req("b", "u2", n_prompt=4, max_tokens=12)]
    for r in reqs:
        s.submit(r)
    drain(s)
    assert s.metrics()["preemptions"] >= 1
    assert all(seen[r.request_id] == r.generated for r in reqs)  # a stops at the cache length (16 tokens)
