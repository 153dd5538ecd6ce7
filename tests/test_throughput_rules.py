"""The VTC policy's victim rule: the request that loses the least, never a light user's first,
and ``schedule()`` as a pure decision.

Each victim test fails without its part of the rule (``batch.policies.vtc.VTCPolicy.victim`` with
``spec.fairness_rules.victim_before``).
"""
from __future__ import annotations

from batch.core.state import Seq
from batch.policies.vtc import VTCPolicy
from inference_stub import Request
from spec import fairness_rules as fr


def make_seq(user_id: str, arrival_no: int, *, num_prompt_tokens: int = 10, max_tokens: int = 10,
             admit_no: int = 0, num_computed_tokens: int = 0, num_preemptions: int = 0,
             block_table: list[int] | None = None) -> Seq:
    """A scheduler record (``batch.core.state.Seq``) of a request of ``user_id``, outside a scheduler."""
    req = Request(user_id=user_id, prompt=[1] * num_prompt_tokens, max_tokens=max_tokens,
                  request_id=f"{user_id}{arrival_no}")
    return Seq(req=req, user_id=user_id, rid=req.request_id, arrival_no=arrival_no,
               num_prompt_tokens=num_prompt_tokens, num_computed_tokens=num_computed_tokens,
               block_table=[0] if block_table is None else block_table, num_preemptions=num_preemptions,
               admit_no=admit_no)


def test_victim_is_the_request_with_the_least_recompute_not_the_newest_and_never_a_light_users():
    old_cheap = make_seq("a", 0, admit_no=1, num_computed_tokens=20, block_table=[0] * 4)
    new_costly = make_seq("a", 1, admit_no=2, num_computed_tokens=500, block_table=[0] * 4)
    light = make_seq("b", 2, admit_no=3, num_computed_tokens=1, block_table=[0])
    # b holds 1 of 9 blocks: under a quarter of its share (4.5), so never the victim while a's can be
    assert VTCPolicy().victim([old_cheap, new_costly, light]) is old_cheap
    assert VTCPolicy().victim([light]) is light  # nobody else: a light user's request can go


def _a_two_b_one():
    """a: two requests (6 blocks each, 400 and 500 tokens computed); b: one (2 blocks, 30)."""
    return (make_seq("a", 0, admit_no=1, num_computed_tokens=400, block_table=[0] * 6),
            make_seq("a", 1, admit_no=2, num_computed_tokens=500, block_table=[0] * 6),
            make_seq("b", 2, admit_no=3, num_computed_tokens=30, block_table=[0] * 2))


def test_victim_may_belong_to_a_user_below_its_share_when_it_loses_the_least():
    a_cheap, a_costly, b_cheapest = _a_two_b_one()
    p = VTCPolicy()
    p.charge("b", 0, fr.PRESSURE_TOKENS // fr.OUTPUT_PRICE)  # b's service makes up its one request less
    assert p.pressure("a", 2) == p.pressure("b", 1)  # so no user goes first (``victim_user_first``)
    # b holds 2 of 14 blocks: below its share (7) but not light (over 1.75): least recompute lost
    assert p.victim([a_cheap, a_costly, b_cheapest]) is b_cheapest
    # light: at most a quarter of the weighted share of the blocks (within_share at 1/4)
    assert fr.within_share(1, 1, 9, 2, 1, 4) and not fr.within_share(2, 1, 14, 2, 1, 4)
    assert fr.within_share(2, 1, 16, 2, 1, 4)  # exactly a quarter (2 of 16, share 8): light


def test_victim_comes_from_the_user_of_highest_pressure_once_it_is_a_request_ahead():
    """``victim_user_first``: the user of highest ``pressure_units`` (resident requests per weight,
    each worth ``PRESSURE_TOKENS`` weighted tokens, plus its counter) gives the victim when it is
    at least one request's worth above the lowest; below that, ``victim_before`` alone decides."""
    a_cheap, a_costly, b_cheapest = _a_two_b_one()
    assert VTCPolicy().victim([a_cheap, a_costly, b_cheapest]) is a_cheap  # a: 2 requests, b: 1
    served = VTCPolicy()
    served.charge("b", 0, 1)  # b one output token ahead: a is less than a request's worth above it
    assert served.victim([a_cheap, a_costly, b_cheapest]) is b_cheapest
    ahead = VTCPolicy()
    ahead.charge("a", 0, 1)  # a one token more: the gap is above a request's worth again
    assert ahead.victim([a_cheap, a_costly, b_cheapest]) is a_cheap
    heavy = VTCPolicy(weights={"a": 2})  # a's two requests at weight 2 weigh as b's one
    assert heavy.pressure("a", 2) == heavy.pressure("b", 1) and heavy.victim([a_cheap, a_costly, b_cheapest]) is b_cheapest
    assert fr.victim_user_first(fr.PRESSURE_TOKENS * fr.COUNTER_SCALE, 0)
    assert not fr.victim_user_first(fr.PRESSURE_TOKENS * fr.COUNTER_SCALE - 1, 0)


def test_victim_spreads_preemptions_before_it_looks_at_recompute():
    twice = make_seq("a", 0, admit_no=5, num_computed_tokens=10, num_preemptions=2)
    never = make_seq("a", 1, admit_no=1, num_computed_tokens=300, num_preemptions=0)
    assert VTCPolicy().victim([twice, never]) is never


def test_victim_ties_go_to_the_latest_admitted():
    a, b = make_seq("a", 0, admit_no=1), make_seq("a", 1, admit_no=2)
    assert VTCPolicy().victim([a, b]) is b


def test_an_extra_schedule_call_changes_no_later_decision_even_with_aborts():
    """schedule() changes no state: a twin that calls it between steps decides the same, with
    waiting requests aborted before and after that call."""
    from scheduler import Scheduler

    def make() -> Scheduler:
        s = Scheduler(kv_cap_blocks=512, backend=lambda b: [5] * len(b), clock=lambda: 0.0)
        for i in range(40):
            s.submit(Request(user_id="v", prompt=[1] * 8, max_tokens=1000, request_id=f"v{i}"))
        s.tick()
        return s

    late = 8
    a, b = make(), make()
    for s in (a, b):
        s.submit(Request(user_id="u", prompt=[1] * 8, max_tokens=2, request_id="short"))
        for i in range(60):
            s.submit(Request(user_id="w", prompt=[1] * 8, max_tokens=5, request_id=f"w{i}"))
        for i in range(late):
            s.submit(Request(user_id="u", prompt=[1] * 8, max_tokens=50 + i, request_id=f"late{i}"))
    for i in range(60):
        a.abort(f"w{i}")
        b.abort(f"w{i}")
    b.schedule()  # b alone looks at the next plan
    for i in range(late):
        a.abort(f"late{i}")
        b.abort(f"late{i}")
    for i in range(3):
        for s in (a, b):
            s.submit(Request(user_id="u", prompt=[1] * 8, max_tokens=100 + i, request_id=f"later{i}"))
    pa, pb = a.schedule(), b.schedule()
    assert [e.seq.request_id for e in pa.batch] == [e.seq.request_id for e in pb.batch]
    assert [e.seq.request_id for e in pa.batch if e.admitted] == ["short", "later0", "later1", "later2"]
    assert a.tick() == b.tick() and [r.request_id for r in a.running] == [r.request_id for r in b.running]
