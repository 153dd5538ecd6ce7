"""Head-of-line admission with a bounded hold (EASY backfilling and ``batch/core/backfill.py`` are
gone; issue 38 brought the hold): a request that fits waits behind the first waiting request that
does not fit (the blocked head) while that head has been blocked fewer than ``hold_ticks`` (W = 8)
iterations, then passes it (``spec.fairness_rules.hold_elapsed``); the head gets the aging
reservation (``reserved_after``), takes room from resident requests and is admitted within
``admission_wait_bound``; a light user's request behind a blocked head."""
from __future__ import annotations

import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req
from test_fairness import Spy

from batch.policies.vtc import VTCPolicy
from spec import fairness_rules as fr


def _admission_ticks(s):
    """Each request's first admission tick (a request preempted and readmitted keeps its first)."""
    at = {}
    for t, p in enumerate(s.plans):
        for b in p.batch:
            if b.admitted:
                at.setdefault(b.seq.request_id, t)
    return at


def _big_head(**kw):
    """A 32-block cache. User a's 300-token prompt runs first (19 blocks, 24 iterations: 5 chunks
    and 19 decodes); user b's 448-token prompt (29 blocks) does not fit until it finishes. c's
    request (2 blocks, 3 tokens) and d's (4 blocks, 100 tokens) fit now; all four users are in
    VTC's band, so the order is by arrival: a, b, d, c. The scripted backend never emits EOS."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, isolation=False, **kw)
    for r in (make_req("a", "a", 300, 20), make_req("b", "b", 448, 5), make_req("d", "d", 60, 100),
              make_req("c", "c", 20, 3)):
        s.submit(r)
    drain(s)
    return s, _admission_ticks(s)


def test_a_head_that_does_not_fit_holds_the_requests_that_fit_for_hold_ticks_then_they_pass():
    s, at = _big_head()
    hold = s.config.hold_ticks
    assert hold == fr.HOLD_TICKS == 8
    assert at["a"] == 0
    assert at["c"] == at["d"] == hold  # b was the blocked head in ticks 0..7: blocked 8 ticks at tick 8
    assert all(p.blocked is not None and p.blocked.request_id == "b" for p in s.plans[:hold])
    # b ages past them: the reservation after aging_ticks (32) blocked ticks, then it takes d's room
    aging = s.config.aging_ticks
    assert at["b"] == aging and [q.request_id for q in s.plans[aging].preempted] == ["d"]
    assert at["b"] <= fr.admission_wait_bound(aging, 0)  # the holder waits for no resident to drain


@pytest.mark.parametrize("hold_ticks, passes_at, b_at", [
    (0, 0, 32),  # no hold: c and d pass the blocked head in its first tick
    (10 ** 6, 35, 24),  # a hold longer than the run: nothing passes b (the old head-of-line rule)
])
def test_the_hold_is_a_knob_from_passing_at_once_to_never(hold_ticks, passes_at, b_at):
    s, at = _big_head(hold_ticks=hold_ticks)
    assert at["c"] == at["d"] == passes_at
    assert at["b"] == b_at  # with no hold, b waits for the reservation; with no passing, for a's blocks


def _passed_head(aging_ticks):
    """Strict VTC (tolerance 0). a (300-token prompt, 24 iterations) is resident in a 32-block
    cache; b's 400-token prompt (26 blocks) waits, with 1000 weighted tokens of service more than
    anyone. A new user arrives each tick for 60 ticks (4 blocks, 12 tokens): lifted one counter
    unit below the least counter (``lift_floor``), each goes before b in the order while it fits."""
    s = Spy(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, aging_ticks=aging_ticks,
            policy=VTCPolicy(tolerance_tokens=0, isolation=False))
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
    return s, _admission_ticks(s), reserved_at


def test_a_head_passed_by_newer_users_gets_the_reservation_and_takes_room_at_once():
    s, at, reserved_at = _passed_head(aging_ticks=2)
    assert reserved_at == (3, "b")  # the first non-fitting candidate in ticks 1 and 2
    assert at["n0"] == 1 and at["n1"] == 2  # before the reservation they pass it
    # the holder takes room from any resident request (n0, n1 and a, newest first)
    assert at["b"] == 3 and {q.request_id for q in s.plans[3].preempted} == {"a", "n0", "n1"}
    assert s.plans[3].batch[0].seq.request_id == "b"  # tried (and admitted) first
    assert at["b"] - 1 <= fr.admission_wait_bound(2, 0)  # waited from tick 1
    _, at_off, reserved_off = _passed_head(aging_ticks=10 ** 6)
    # without aging the newer users pass it until a resident request has held its room a quantum
    assert reserved_off is None and at_off["b"] > 60


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
