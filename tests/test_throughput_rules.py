"""The VTC policy's throughput rules: the victim that loses the least, and the drain phase.

Each test fails without its rule (``policy.VTCPolicy.choose_victim`` with
``spec.fairness_rules.victim_before``; ``VTCPolicy.before_admission``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batch.policies.policy import MAX_DRAIN_PASSES, VTCPolicy, remaining_iterations
from inference_stub import Request
from spec import fairness_rules as fr


@dataclass(eq=False)
class Seq:
    """The fields the policy reads from the scheduler's record."""

    user_id: str
    arrival_no: int
    num_prompt_tokens: int = 10
    max_tokens: int = 10
    admit_no: int = 0
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=lambda: [0])
    num_prompt_tokens_served: int = 0

    def __post_init__(self) -> None:
        self.req = Request(user_id=self.user_id, prompt=[1] * self.num_prompt_tokens, max_tokens=self.max_tokens)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.req.generated)


def test_victim_is_the_request_with_the_least_recompute_not_the_newest_and_never_a_light_users():
    old_cheap = Seq("a", 0, admit_no=1, num_computed_tokens=20, block_table=[0] * 4)
    new_costly = Seq("a", 1, admit_no=2, num_computed_tokens=500, block_table=[0] * 4)
    light = Seq("b", 2, admit_no=3, num_computed_tokens=1, block_table=[0])
    # b holds 1 of 9 blocks: under a quarter of its share (4.5), so never the victim while a's can be
    assert VTCPolicy().choose_victim([old_cheap, new_costly, light]) is old_cheap
    assert VTCPolicy().choose_victim([light]) is light  # nobody else: a light user's request can go


def test_victim_may_belong_to_a_user_below_its_share_when_it_loses_the_least():
    a_cheap = Seq("a", 0, admit_no=1, num_computed_tokens=400, block_table=[0] * 6)
    a_costly = Seq("a", 1, admit_no=2, num_computed_tokens=500, block_table=[0] * 6)
    b_cheapest = Seq("b", 2, admit_no=3, num_computed_tokens=30, block_table=[0] * 2)
    # b holds 2 of 14 blocks: below its share (7) but not light (under 1.75): least recompute lost
    assert VTCPolicy().choose_victim([a_cheap, a_costly, b_cheapest]) is b_cheapest
    assert fr.light_user(1, 1, 9, 2) and not fr.light_user(2, 1, 14, 2) and not fr.light_user(2, 1, 16, 2)


def test_victim_spreads_preemptions_before_it_looks_at_recompute():
    twice = Seq("a", 0, admit_no=5, num_computed_tokens=10, num_preemptions=2)
    never = Seq("a", 1, admit_no=1, num_computed_tokens=300, num_preemptions=0)
    assert VTCPolicy().choose_victim([twice, never]) is never


def test_victim_ties_go_to_the_latest_admitted():
    a, b = Seq("a", 0, admit_no=1), Seq("a", 1, admit_no=2)
    assert VTCPolicy().choose_victim([a, b]) is b


def _policy_with(seqs: list[Seq]) -> VTCPolicy:
    p = VTCPolicy(tolerance_tokens=0)  # strict counter order: these tests check the drain order within it
    for q in seqs:
        p.add(q)
    return p


def test_drain_phase_offers_each_users_longest_request_first():
    short, long_, mid = Seq("u", 0, max_tokens=10), Seq("u", 1, max_tokens=90), Seq("u", 2, max_tokens=40)
    p = _policy_with([short, long_, mid])
    p.before_admission(6)  # 3 waiting <= half of 6 resident: the drain phase
    assert list(p.admission_order()) == [long_, mid, short]
    p.before_admission(5)  # 3 waiting > half of 5 resident: first come, first served
    assert list(p.admission_order()) == [short, long_, mid]


def test_drain_phase_is_off_when_asked_and_before_the_scheduler_calls_it():
    seqs = [Seq("u", 0, max_tokens=10), Seq("u", 1, max_tokens=90)]
    assert list(_policy_with(seqs).admission_order()) == seqs
    off = VTCPolicy(drain_longest_first=False)
    for q in seqs:
        off.add(q)
    off.before_admission(100)
    assert list(off.admission_order()) == seqs


def test_drain_phase_counts_prompt_chunks_in_the_work_left():
    long_prompt = Seq("u", 0, num_prompt_tokens=640, max_tokens=10)  # 10 chunks + 9 decodes
    long_output = Seq("u", 1, num_prompt_tokens=10, max_tokens=15)   # 1 chunk + 14 decodes
    assert remaining_iterations(long_prompt, 64) == 19 and remaining_iterations(long_output, 64) == 15
    p = _policy_with([long_output, long_prompt])
    p.before_admission(100)
    assert next(iter(p.admission_order())) is long_prompt


def test_drain_phase_keeps_users_in_counter_order():
    a = [Seq("a", i, max_tokens=10 + i) for i in range(2)]
    b = Seq("b", 2, max_tokens=99)
    p = _policy_with([*a, b])
    p.on_service("a", 0, 50)  # a is ahead in service: b goes first whatever the lengths
    p.before_admission(100)
    assert [q.user_id for q in p.admission_order()][0] == "b"


def test_a_short_request_is_passed_at_most_max_drain_passes_times():
    short = Seq("u", 0, max_tokens=5)
    p = _policy_with([short])
    passes, n = 0, 1
    while True:
        longer = Seq("u", n, max_tokens=50)
        p.add(longer)
        n += 1
        p.before_admission(100)
        first = next(iter(p.admission_order()))
        p.remove(first)
        if first is short:
            break
        passes += 1
        assert passes <= MAX_DRAIN_PASSES
    assert passes == MAX_DRAIN_PASSES


def test_a_zero_or_negative_prefill_chunk_is_refused_at_construction():
    import pytest
    for bad in (0, -64, 1.5, True):
        with pytest.raises(ValueError):
            VTCPolicy(prefill_chunk_tokens=bad)


def test_drain_phase_counts_prompt_chunks_of_the_schedulers_chunk_size():
    from scheduler import Scheduler
    # With the scheduler's 512-token chunk, a 1024-token prompt is 2 chunks: 2 + 9 = 11
    # iterations, less than the short prompt's 1 + 13 = 14 (64-token chunks would say 16 + 9).
    s = Scheduler(prefill_chunk_tokens=512, kv_cap_blocks=256, backend=lambda b: [5] * len(b), clock=lambda: 0.0)
    for i in range(4):
        s.submit(Request(user_id="v", prompt=[1] * 8, max_tokens=100, request_id=f"v{i}"))
    s.tick()
    long_prompt = Request(user_id="u", prompt=[1] * 1024, max_tokens=10, request_id="long_prompt")
    long_output = Request(user_id="u", prompt=[1] * 10, max_tokens=14, request_id="long_output")
    s.submit(long_prompt)
    s.submit(long_output)  # 2 waiting <= half of 4 resident: the drain phase
    plan = s.schedule()
    assert [e.seq.request_id for e in plan.batch if e.admitted][0] == "long_output"


def test_an_extra_schedule_call_changes_no_later_decision_even_with_aborts():
    """schedule() changes no state: a twin that calls it between steps decides the same.

    The drain phase is entered by one twin's extra call while other waiting requests are
    aborted; the passes counted on those aborts must not depend on that call."""
    from scheduler import Scheduler

    def make() -> Scheduler:
        s = Scheduler(kv_cap_blocks=512, backend=lambda b: [5] * len(b), clock=lambda: 0.0)
        for i in range(40):
            s.submit(Request(user_id="v", prompt=[1] * 8, max_tokens=1000, request_id=f"v{i}"))
        s.tick()  # its admission pass saw a backlog (40 waiting, none resident): no drain phase
        return s

    a, b = make(), make()
    for s in (a, b):
        s.submit(Request(user_id="u", prompt=[1] * 8, max_tokens=2, request_id="short"))
        for i in range(60):  # a backlog: no drain phase at the tick below
            s.submit(Request(user_id="w", prompt=[1] * 8, max_tokens=5, request_id=f"w{i}"))
        for i in range(MAX_DRAIN_PASSES):
            s.submit(Request(user_id="u", prompt=[1] * 8, max_tokens=50 + i, request_id=f"late{i}"))
    for i in range(60):
        a.abort(f"w{i}")
        b.abort(f"w{i}")
    b.schedule()  # b alone looks at the next plan: the drain phase now
    for i in range(MAX_DRAIN_PASSES):
        a.abort(f"late{i}")
        b.abort(f"late{i}")
    for i in range(3):
        for s in (a, b):
            s.submit(Request(user_id="u", prompt=[1] * 8, max_tokens=100 + i, request_id=f"later{i}"))
    pa, pb = a.schedule(), b.schedule()
    assert [e.seq.request_id for e in pa.batch] == [e.seq.request_id for e in pb.batch]


def test_a_preempting_plan_peeks_at_waiting_requests_in_its_own_drain_phase():
    """A plan that preempts skips admission, but isolation still peeks at the policy's order
    (``isolation.Isolation._peek``): that order must be the one of the plan's own state, not
    of whichever admission pass ran last (here: a backlog since aborted)."""
    from scheduler import Scheduler
    s = Scheduler(kv_cap_blocks=24, block_tokens=4, max_running=8, backend=lambda b: [5] * len(b),
                  clock=lambda: 0.0, admission_headroom=False)
    for i in range(6):
        s.submit(Request(user_id="v", prompt=[1] * 13, max_tokens=100, request_id=f"v{i}"))
    s.tick()
    for i in range(6):
        s.submit(Request(user_id="w", prompt=[1] * 60, max_tokens=5, request_id=f"w{i}"))
    s.submit(Request(user_id="u", prompt=[1] * 60, max_tokens=2, request_id="short"))
    s.submit(Request(user_id="u", prompt=[1] * 60, max_tokens=50, request_id="long"))
    for _ in range(2):
        s.tick()  # their admission passes see a backlog (8 waiting, 6 resident): no drain phase
    for i in range(6):
        s.abort(f"w{i}")
    plan = s.schedule()
    assert plan.admission_stop == "preempted" and len(s.running) - len(plan.preempted) >= 4
    assert [q.request_id for q in s.policy.admission_order()] == ["long", "short"]  # 2 waiting <= 4 / 2
