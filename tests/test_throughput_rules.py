"""The VTC policy's throughput rules: the victim that loses the least, and the drain phase.

Each test fails without its rule (``policy.VTCPolicy.choose_victim`` with
``spec.fairness_rules.victim_before``; ``VTCPolicy.before_admission``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from inference_stub import Request
from policy import MAX_DRAIN_PASSES, VTCPolicy, remaining_iterations


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


def test_victim_is_the_over_served_request_with_the_least_recompute_not_the_newest():
    old_cheap = Seq("a", 0, admit_no=1, num_computed_tokens=20, block_table=[0] * 4)
    new_costly = Seq("a", 1, admit_no=2, num_computed_tokens=500, block_table=[0] * 4)
    light = Seq("b", 2, admit_no=3, num_computed_tokens=1, block_table=[0])
    assert VTCPolicy().choose_victim([old_cheap, new_costly, light]) is old_cheap  # b is below its share


def test_victim_spreads_preemptions_before_it_looks_at_recompute():
    twice = Seq("a", 0, admit_no=5, num_computed_tokens=10, num_preemptions=2)
    never = Seq("a", 1, admit_no=1, num_computed_tokens=300, num_preemptions=0)
    assert VTCPolicy().choose_victim([twice, never]) is never


def test_victim_ties_go_to_the_latest_admitted():
    a, b = Seq("a", 0, admit_no=1), Seq("a", 1, admit_no=2)
    assert VTCPolicy().choose_victim([a, b]) is b


def _policy_with(seqs: list[Seq]) -> VTCPolicy:
    p = VTCPolicy()
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
