"""Preempted decodes resume first (``VTCPolicy(resume_decodes_first=True)``, the default)."""
from __future__ import annotations

import random

import pytest
from conftest import ScriptedBackend, StepClock, make_req
from test_fairness import Spy
from test_throughput_rules import Seq

from policy import VTCPolicy


def _decode(user: str, arrival_no: int, generated: int = 2) -> Seq:
    """A scheduler-like record that was preempted after ``generated`` output tokens."""
    q = Seq(user, arrival_no, num_preemptions=1)
    q.req.generated.extend([5] * generated)
    return q


def test_a_preempted_decode_is_offered_before_the_counter_order():
    p = VTCPolicy()
    fresh_b = Seq("b", 0)
    p.add(fresh_b)
    p.on_service("a", 500, 100)  # user a has been served: b comes first in counter order
    resumed = _decode("a", 1)
    p.requeue(resumed)
    assert list(p.admission_order()) == [resumed, fresh_b]
    assert list(p.counter_order()) == [fresh_b, resumed]


def test_off_or_preempted_in_prefill_it_waits_in_counter_order():
    off = VTCPolicy(resume_decodes_first=False)
    on = VTCPolicy()
    for p in (off, on):
        p.add(Seq("b", 0))
        p.on_service("a", 500, 100)
    off.requeue(_decode("a", 1))
    on.requeue(Seq("a", 1, num_preemptions=1))  # preempted while prefilling: no output to stall
    assert [q.user_id for q in off.admission_order()] == ["b", "a"]
    assert [q.user_id for q in on.admission_order()] == ["b", "a"]


def test_resumed_decodes_go_oldest_first_and_each_once_and_leave_when_admitted_or_aborted():
    p = VTCPolicy()
    fresh = [Seq("c", 0), Seq("a", 3)]
    for q in fresh:
        p.add(q)
    late, early, mid = _decode("a", 7), _decode("b", 1), _decode("a", 4)
    for q in (late, early, mid):
        p.requeue(q)
    order = list(p.admission_order())
    assert order[:3] == [early, mid, late]
    assert sorted(map(id, order)) == sorted(map(id, fresh + [late, early, mid]))  # each once
    p.remove(early)  # admitted
    p.discard(late)  # aborted while waiting
    order = list(p.admission_order())
    assert order[0] is mid and early not in order and late not in order and len(order) == len(p) == 3
    p.remove(mid)
    assert list(p.admission_order()) == list(p.counter_order())


@pytest.mark.parametrize("flag", ["backfill", "isolation", "admission_headroom", "easy_backfill",
                                  "drain_longest_first", "resume_decodes_first"])
def test_a_flag_that_is_not_a_bool_is_refused(flag):
    with pytest.raises(ValueError, match=flag):
        VTCPolicy(**{flag: 1})


def _stalls(seed: int, on: bool) -> list[int]:
    """Ticks from each preemption of a request with output tokens to its next output token,
    on a seeded 3-user workload under KV pressure."""
    rng = random.Random(seed)
    s = Spy(backend=ScriptedBackend(block_tokens=4), clock=StepClock(), kv_cap_blocks=24, block_tokens=4,
            prefill_chunk_tokens=8, policy=VTCPolicy(resume_decodes_first=on))
    reqs = [make_req(f"r{j}", user=f"u{j % 3}", n_prompt=rng.randint(4, 20), max_tokens=rng.randint(5, 30))
            for j in range(18)]
    for r in reqs:
        s.submit(r)
    since: dict[str, tuple[int, int]] = {}
    stalls = []
    t = 0
    while s.has_active():
        s.tick()
        t += 1
        for q in s.plans[-1].preempted:
            if q.req.generated:
                since[q.request_id] = (t, len(q.req.generated))
        for r in reqs:
            if r.request_id in since and len(r.generated) > since[r.request_id][1]:
                stalls.append(t - since.pop(r.request_id)[0])
    assert not since and all(r.completed_at is not None for r in reqs)
    return stalls


def test_preempted_decodes_stall_for_fewer_ticks_than_in_counter_order():
    on = [_stalls(seed, True) for seed in range(6)]
    off = [_stalls(seed, False) for seed in range(6)]
    assert all(on_s and off_s for on_s, off_s in zip(on, off))  # preemptions of decodes happened
    assert all(sum(a) < sum(b) for a, b in zip(on, off))
    assert sum(map(max, on)) < sum(map(max, off))
