"""Adversarial review: defects found under faults and extreme configurations, one test each.

Each test failed before its fix (see the commit that added it) and pins the corrected rule.
"""
from __future__ import annotations

import pytest

from conftest import StepClock, make_req
from scheduler import Scheduler


def _ones(batch):
    """A backend that never emits EOS (token 1 for every request)."""
    return [1] * len(batch)


# ---------------------------------------------------------------- the reservation vs. TTFT isolation


def _reserved_heavy_request(num_heavy: int, num_aborted: int) -> tuple[Scheduler, object]:
    """Default policy (VTC with isolation), 24 blocks of 4 tokens, aging after 2 ticks.

    ``num_heavy`` decodes of user h fill the cache, then h's request r (36-token prompt, 10
    blocks) does not fit for 2 ticks and holds the reservation; aborting ``num_aborted`` of
    the decodes frees enough for r (10 blocks, no headroom for the reservation holder).
    """
    s = Scheduler(kv_cap_blocks=24, block_tokens=4, backend=_ones, clock=StepClock(), aging_ticks=2)
    for i in range(num_heavy):
        s.submit(make_req(f"h{i}", "h", 3, 1000))
    s.tick()
    r = make_req("r", "h", 36, 1000)
    s.submit(r)
    for _ in range(3):
        s.tick()
    assert s._reserved is not None and s._reserved.req is r and s.pool.num_free < 10
    for i in range(num_aborted):
        s.abort(f"h{i}")
    assert s.pool.num_free >= 10  # r fits now
    return s, r


@pytest.mark.parametrize("num_aborted, light_prompt_tokens, how", [
    (3, 4, "sit-out: r and the light request both fit; isolation cut r's admission"),
    (2, 4, "room-making: the light request does not fit after r; r's admission was deferred for it"),
    (2, 60, "room-making by preemption: the reservation moved from r to the light request"),
])
def test_the_reservation_holder_that_fits_is_admitted_before_anyone_isolation_protects(
        num_aborted, light_prompt_tokens, how):
    """docs/fairness.md section 4: once r holds the reservation "nothing is admitted before r"
    (the no_starvation_aging model: a reservation admits nothing else). A light user's request
    that TTFT isolation protects arrives in the tick where r fits: r must still be admitted."""
    s, r = _reserved_heavy_request(8, num_aborted)
    s.submit(make_req("t", "light", light_prompt_tokens, 5))
    s.tick()
    assert any(q.req is r for q in s.running), how
    assert s._reserved is None, how
