"""Head-of-line admission without backfilling (EASY backfilling and ``batch/core/backfill.py`` are
gone): nothing passes the first waiting request that does not fit; a head passed by requests ahead
of it in the order gets the aging reservation (``spec.fairness_rules.reserved_after``) and is
admitted within ``admission_wait_bound``; a light user's request behind a blocked head."""
from __future__ import annotations

import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req
from test_fairness import Spy

from spec import fairness_rules as fr


def _admission_ticks(s):
    return {b.seq.request_id: t for t, p in enumerate(s.plans) for b in p.batch if b.admitted}


def test_nothing_passes_a_head_that_does_not_fit():
    """A 32-block cache. User a's 300-token prompt runs first (19 blocks, 24 iterations: 5 chunks
    and 19 decodes); user b's 448-token prompt (29 blocks + 1 headroom) does not fit until it
    finishes. c's request would finish within 3 iterations and d's fits now (4 blocks): both
    wait behind b. The scripted backend never emits EOS."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, isolation=False)
    for r in (make_req("a", "a", 300, 20), make_req("b", "b", 448, 5), make_req("d", "d", 60, 100),
              make_req("c", "c", 20, 3)):
        s.submit(r)
    drain(s)
    at = _admission_ticks(s)
    assert at["a"] == 0
    assert at["b"] == 24  # when a finishes
    assert at["c"] > at["b"] and at["d"] > at["b"]
    assert all(p.blocked is None or p.blocked.request_id == "b" for p in s.plans[:24])


def _passed_head(aging_ticks):
    """a (300-token prompt, 24 iterations) is resident in a 32-block cache; b's 400-token prompt
    (26 blocks + 1 headroom) waits, with 1000 weighted tokens of service more than anyone. A new
    user arrives each tick for 60 ticks (4 blocks, 12 tokens): lifted one counter unit below b
    (``lift_floor``), each goes before b in the order while it fits."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, isolation=False, aging_ticks=aging_ticks)
    s.submit(make_req("a", "a", 300, 20))
    s.tick()
    s.submit(make_req("b", "b", 400, 5))
    s.policy.charge("b", 1000, 0)
    reserved_at = None
    for t in range(60):
        s.submit(make_req(f"n{t}", f"n{t}", 60, 12))
        s.tick()
        if reserved_at is None and s.state.reserved is not None:
            reserved_at = (len(s.plans), s.state.reserved.request_id)
    drain(s)
    return _admission_ticks(s), reserved_at


def test_a_head_passed_by_newer_users_gets_the_reservation_and_then_nothing_passes_it():
    at, reserved_at = _passed_head(aging_ticks=2)
    assert reserved_at == (3, "b")  # the first non-fitting candidate in ticks 1 and 2
    assert at["n0"] == 1 and at["n1"] == 2  # before the reservation they pass it
    assert at["b"] == 24  # a's blocks come back: nothing was admitted in between
    assert all(v >= at["b"] for k, v in at.items() if k not in ("a", "n0", "n1"))
    assert at["b"] - 1 <= fr.admission_wait_bound(2, 24)  # waited from tick 1; a needs 24 iterations
    at_off, reserved_off = _passed_head(aging_ticks=10 ** 6)
    assert reserved_off is None and at_off["b"] > 60  # without aging the newer users pass it until they stop


def test_a_head_is_admitted_when_blocks_come_back_under_a_binding_token_budget():
    """r0 decodes to tick 3 (2 blocks), r1 prefills 64 tokens an iteration to tick 10 (41 blocks):
    h (22 blocks + 1 headroom) fits once r0 is done, and is admitted then (tick 4); c, behind it
    and with 1-2 budget tokens left a tick, does not pass it."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=64, isolation=False,
            token_budget_tokens=66)
    s.submit(make_req("r0", "r0", 20, 4))
    s.submit(make_req("r1", "r1", 640, 1))
    s.tick()
    s.submit(make_req("h", "h", 340, 2))
    s.submit(make_req("c", "c", 16, 1))
    drain(s)
    at = _admission_ticks(s)
    assert at["h"] == 4
    assert at["c"] >= at["h"]


def test_a_light_user_behind_two_requests_that_do_not_fit_runs_at_once():
    """User a holds the cache (4 x 7 blocks growing to 19, 200 iterations); h's two 940-token
    prompts (59 blocks) do not fit until a's requests finish, and h (2 waiting) is not light; p
    (one 10-token request) is light: its first iteration comes at once, not after h0's wait."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=64)
    for i in range(4):
        s.submit(make_req(f"a{i}", "a", 100, 200))
    s.tick()
    s.submit(make_req("h0", "h", 940, 5))
    s.submit(make_req("h1", "h", 940, 5))
    s.submit(make_req("p", "p", 10, 500))
    drain(s)
    first = {}
    for t, plan in enumerate(s.plans):
        for b in plan.batch:
            first.setdefault(b.seq.request_id, t)
    assert first["p"] == 1
