"""``Scheduler(production_checks=True)`` (``spec.invariants.ProductionChecker``), on by default in
``batch-llm serve``: the cheap subset of the checks, O(batch) per tick. A plan past the KV cap
never reaches the backend (the tick is rolled back as a failed backend call); a ledger violation
is logged and counted (``/metrics``)."""
from __future__ import annotations

import logging

import pytest

from batch.core import step
from batch.policies.policy import FCFSPolicy
from conftest import ScriptedBackend, StepClock, make_req
from scheduler import PlanPastCapError, Scheduler


def _sched(**kw) -> tuple[Scheduler, ScriptedBackend]:
    b = ScriptedBackend()
    return Scheduler(kv_cap_blocks=kw.pop("kv_cap_blocks", 8), backend=b, clock=StepClock(), production_checks=True,
                     check_invariants=False, **kw), b


def test_a_correct_run_has_no_violation_and_counts_its_ticks():
    s, _ = _sched(policy=FCFSPolicy(), admission_headroom=False)  # packs the cache: growth preempts
    for i in range(10):
        s.submit(make_req(f"r{i}", user=f"u{i % 2}", n_prompt=14, max_tokens=20))
    ticks = 0
    while s.has_active():
        s.tick()
        ticks += 1
    assert s.metrics()["preemptions"] > 0  # the ledger was checked through preemptions too
    assert s._guard.ticks == ticks and not s._guard.violations


def test_a_plan_past_the_cap_never_reaches_the_backend_and_fails_its_batch(monkeypatch, caplog):
    real = step.commit

    def over_granting(state, plan):  # planted: the first row gets every free block beside its own
        journal = real(state, plan)
        if plan.seqs and state.pool.num_free:
            s = plan.seqs[0]
            s.block_table = s.block_table + state.pool.allocate(state.pool.num_free)
        return journal
    monkeypatch.setattr(step, "commit", over_granting)
    s, backend = _sched(kv_cap_blocks=6, max_backend_tries=2)  # both admitted (2 blocks each), 2 left over
    s.submit(make_req("r0", n_prompt=20, max_tokens=4))
    s.submit(make_req("r1", n_prompt=20, max_tokens=4))
    with caplog.at_level(logging.ERROR, logger="batch.checks"), pytest.raises(PlanPastCapError):
        s.tick()
    assert backend.batches == []  # rolled back before forward
    assert s.pool.num_used == 0
    failed = s.tick()  # the retry policy: the second try fails the batch
    assert backend.batches == [] and {r.request_id for r in failed} == {"r0", "r1"}
    assert s._guard.violations["ledger_delta"] == 2
    assert "invariant ledger_delta violated" in caplog.text


def test_a_block_not_freed_at_finish_is_logged_and_counted(monkeypatch, caplog):
    real = step.apply

    def keeps_a_block(state, policy, config, plan, tokens, now, start):  # planted: a finished row's block leaks
        first = {s: s.block_table[0] for s in plan.seqs if s.block_table}
        out = real(state, policy, config, plan, tokens, now, start)
        for s, b in first.items():
            if s.state == "done":
                state.pool._free.remove(b)
                state.pool._is_free[b] = 0
        return out
    monkeypatch.setattr(step, "apply", keeps_a_block)
    s, _ = _sched()
    s.submit(make_req("r0", n_prompt=5, max_tokens=1))
    with caplog.at_level(logging.ERROR, logger="batch.checks"):
        s.tick()
    assert s._guard.violations == {"ledger_delta": 1} and "ledger_delta" in caplog.text


def test_prefix_caching_runs_clean_under_the_production_checks():
    s, _ = _sched(kv_cap_blocks=16, prefix_caching=True)
    for i in range(6):
        s.submit(make_req(f"r{i}", user=f"u{i % 2}", n_prompt=40, max_tokens=6))  # the same prompt: hits
    while s.has_active():
        s.tick()
    assert s.metrics()["prefix_cache_hits"] > 0 and s._guard.ticks > 0 and not s._guard.violations


def test_production_checks_must_be_a_bool():
    with pytest.raises(ValueError, match="production_checks"):
        Scheduler(production_checks="yes")
