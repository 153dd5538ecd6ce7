"""The scheduler's per-token output hook (``Scheduler(on_tokens=...)``, issue 19)."""
from __future__ import annotations

import pytest

from conftest import ScriptedBackend, drain, make_req
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


def test_hook_runs_outside_the_lock_and_may_abort():
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
    assert s.pool.num_free == s.kv_cap_blocks


def test_hook_must_be_callable():
    with pytest.raises(ValueError, match="on_tokens"):
        Scheduler(on_tokens=3)
