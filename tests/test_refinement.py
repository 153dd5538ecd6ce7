"""Trace validation (``spec.refinement``): every tick is a step of ``spec.model.tick``."""
import pytest
from conftest import make_req

import request_gen
import scheduler as sched_mod
from scheduler import Scheduler
from spec.invariants import InvariantViolation
from spec.refinement import MAX_SLOTS


def _eos_at_max(batch):
    return [0 if len(r.generated) >= r.max_tokens - 1 else 5 for r in batch]


def _run(s, reqs, limit=20_000):
    for r in reqs:
        s.submit(r)
    n = 0
    while s.has_active() and n < limit:
        s.tick()
        n += 1
    return n


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_every_tick_under_kv_pressure_is_a_step_of_the_model(policy):
    from batch.policies.policy import FCFSPolicy
    s = Scheduler(check_invariants=True, kv_cap_blocks=24, backend=_eos_at_max, clock=lambda: 0.0,
                  policy=FCFSPolicy() if policy == "fcfs" else None)
    ticks = _run(s, request_gen.stream(n=30, lam=10.0, seed=1))
    v = s._checker.validator
    assert s.metrics()["preemptions"] > 0  # the run exercised preemption by recompute
    assert v.checked == ticks and v.skipped == 0


def test_ticks_with_more_slots_than_the_limit_are_counted_not_validated():
    s = Scheduler(check_invariants=True, kv_cap_blocks=2048, backend=_eos_at_max, clock=lambda: 0.0)
    for i in range(MAX_SLOTS + 5):
        s.submit(make_req(f"r{i}", user=f"u{i % 3}", n_prompt=8, max_tokens=4))
    s.tick()  # admits all of them: more slots than MAX_SLOTS
    assert s._checker.validator.skipped == 1


def test_an_admission_in_a_tick_that_preempted_is_not_a_step_of_the_model(monkeypatch):
    """The scheduler admits nothing in a tick that preempted (``Scheduler.schedule``); no state
    invariant sees a violation of that rule, the trace validation does."""
    real = sched_mod.admit_waiting

    def admits_anyway(sched, d):
        preempted, d.preempted = d.preempted, []
        try:
            real(sched, d)
        finally:
            d.preempted = preempted

    monkeypatch.setattr(sched_mod, "admit_waiting", admits_anyway)
    s = Scheduler(check_invariants=True, kv_cap_blocks=24, backend=_eos_at_max, clock=lambda: 0.0)
    with pytest.raises(InvariantViolation) as e:
        _run(s, request_gen.stream(n=30, lam=10.0, seed=1))
    assert e.value.property == "refines_model_tick" and "in batch" in str(e.value)


def test_a_running_request_left_out_without_a_reason_is_not_a_step_of_the_model(monkeypatch):
    """A resident request dropped from the batch (neither sat out nor out of budget) would
    stall: the model runs every resident request it can."""
    real = sched_mod.schedule_running

    def drops_one(sched):
        d = real(sched)
        if len(d.order) >= 2:  # silently: not through PlanDraft.drop, which marks the plan revised
            q = d.order.pop()
            n, blocks = d.grants.pop(q)
            d.free_blocks += blocks
            d.budget_tokens += n
        return d

    monkeypatch.setattr(sched_mod, "schedule_running", drops_one)
    s = Scheduler(check_invariants=True, kv_cap_blocks=256, backend=_eos_at_max, clock=lambda: 0.0, isolation=False)
    with pytest.raises(InvariantViolation) as e:
        _run(s, [make_req(f"r{i}", n_prompt=8, max_tokens=6) for i in range(4)])
    assert e.value.property == "refines_model_tick"
