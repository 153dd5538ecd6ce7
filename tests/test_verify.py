"""The z3 proofs (``python -m spec.verify`` at its default bounds), the model against the real
scheduler, and the checks' teeth (at small bounds):
each planted bug must make z3 return a counterexample AND make the runtime check or the
stateful test fail (and the counterexample must replay on the real, bugged scheduler)."""
from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ScriptedBackend, StepClock, make_req

import scheduler
from batch.core import step
from batch.core.kv_cache import BlockPool
from batch.core.state import Seq
from batch.policies import policy
from scheduler import Scheduler
from spec import fairness_rules as fr
from spec import invariants as inv
from spec import model, rules, verify
from spec.invariants import InvariantViolation
from spec.logic import Min
from test_stateful import run_machine

#: Bounds for the planted bugs (seconds); the proofs themselves run at the defaults below.
SMALL = verify.Options(tick_slots=3, bmc_depth=3)
ROOT = Path(__file__).resolve().parent.parent


def run(*names: str) -> dict[str, verify.Result]:
    return {r.name: r for r in verify.run_checks(names, SMALL, out=None)}


@pytest.mark.slow
def test_python_m_spec_verify_proves_every_check():
    """The proofs in CI (``make test``): ``python -m spec.verify`` itself, at its default bounds,
    exactly what ``make verify`` proves (about 30 s on 2 cores with z3 4.15 or 5.4; each check
    has its time budget, so a solver that gets stuck makes this fail, not hang)."""
    verify._load_plugins()
    assert set(verify.CHECKS) >= {"kv_cap_per_transition", "kv_cap_tick", "kv_cap_bmc", "no_starvation_fcfs",
                                  "no_starvation_fcfs_inductive", "vtc_counter_gap", "no_starvation_holder",
                                  "anti_thrash", "vtc_counter_gap_paths", "kv_cap_tick_loop"}
    proc = subprocess.run([sys.executable, "-m", "spec.verify"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30 + 2 * len(verify.CHECKS) * verify.Options().budget_s)
    n = len(verify.CHECKS)
    assert proc.returncode == 0 and f"{n} of {n} checks proved" in proc.stdout, proc.stdout[-4000:] + proc.stderr


def test_cli_prints_property_bound_result_and_time(capsys):
    assert verify.main(["--only", "kv_cap_per_transition", "no_starvation_fcfs", "--bmc-depth", "2"]) == 0
    out = capsys.readouterr().out
    assert "[proved] kv_cap_per_transition (" in out and "property: " in out and "bound: depth 2 ticks" in out
    assert "2 of 2 checks proved" in out
    assert verify.main(["--list"]) == 0 and "no_starvation_fcfs_inductive" in capsys.readouterr().out


def test_a_counterexample_program_is_python_that_replays(capsys):
    trace = verify.Trace({"kv_cap_blocks": 3, "block_tokens": 2, "prefill_chunk_tokens": 2, "token_budget_tokens": 4,
                          "max_running": 256}, [(0, "r0", 3, 2, 0), (1, "r1", 1, 3, 2)], 6, ["demo"])
    exec(compile(trace.program(), "<trace>", "exec"), {})  # noqa: S102 - the program under test
    printed = capsys.readouterr().out.splitlines()
    out = trace.replay()
    assert out["error"] is None and sorted(out["finished"]) == ["r0", "r1"]
    # r0 stops at max_tokens = 2, r1 at its EOS, the 2nd token: both print 2 tokens
    assert printed == [f"tick {t} finished {rid} 2" for rid, t in sorted(out["finished"].items(), key=lambda x: x[1])]


def test_a_check_over_its_time_budget_is_unknown():
    """``Options.budget_s`` bounds a check's queries together: once spent, the check is
    ``unknown`` (and the run goes on), however many queries it still had to ask."""
    t0 = time.perf_counter()
    (r,) = verify.run_checks(["kv_cap_tick"], verify.Options(budget_s=0.5), out=None)
    assert r.outcome.status == "unknown" and time.perf_counter() - t0 < 10, (r.outcome, r.time_s)
    (r,) = verify.run_checks(["vtc_lift"], verify.Options(budget_s=30), out=None)
    assert r.proved


def test_solver_parameters_are_set_where_z3_knows_them():
    """``SOLVER_PARAMS`` pins what z3 5.x changed by default (``rewriter.bv_sort_ac``); a
    parameter the installed z3 does not know is left out instead of failing every check."""
    assert verify.SOLVER_PARAMS["rewriter.bv_sort_ac"] is False
    assert verify._param_known("rewriter.bv_sort_ac", False)
    assert not verify._param_known("no_such_module.no_such_param", 1)


def test_a_bounded_run_is_posed_one_query_per_depth():
    """``Run.stages`` cuts the unrolling at each tick: together the stages' assumptions are the
    run's, in order, and the goals of tick ``t`` come with ticks ``0..t`` only."""
    run = verify.unroll(SMALL)
    stages = run.stages([[(f"g{t}", True)] for t in range(SMALL.bmc_depth)])
    assert [label for label, _, _ in stages] == [f"depth {t + 1}" for t in range(SMALL.bmc_depth)]
    assert [id(a) for _, asm, _ in stages for a in asm] == [id(a) for a in run.assumptions]
    assert len(run.marks) == SMALL.bmc_depth and run.marks[-1] == len(run.assumptions)


def test_cli_prints_every_query_when_asked(capsys):
    assert verify.main(["--only", "kv_cap_bmc", "--bmc-depth", "2", "--queries"]) == 0
    out = capsys.readouterr().out
    assert "query assumptions: sat" in out and "query depth 1: unsat" in out and "query depth 2: unsat" in out


def test_registry_takes_new_checks(monkeypatch):
    monkeypatch.setitem(verify.CHECKS, "demo", verify.Check("demo", "1 + 1 == 2", lambda o: verify.Outcome(
        "proved", "none")))
    (r,) = verify.run_checks(["demo"], SMALL, out=None)
    assert r.proved and r.property == "1 + 1 == 2"
    with pytest.raises(KeyError):
        verify.run_checks(["no such check"], SMALL, out=None)


def test_the_proof_model_covers_every_lifecycle_event():
    from spec import lifecycle as lc
    modelled = {name: (tuple(src), dst) for name, src, dst, _ in model.TRANSITIONS}
    for event, src, dst in lc.TRANSITIONS:
        assert modelled[event] == (tuple(src), dst)
    assert set(modelled) - set(lc.EVENTS) == set(model.INTERNAL_STEPS)


# ---------------------------------------------------------------- the model is the code


def _model_vs_scheduler(rng: random.Random) -> int:
    """Run a random workload through the int model and the real Scheduler side by side; every
    request's (state, generated, computed, blocks, preemptions) and the free blocks must agree
    after every tick. Returns the number of preemptions seen."""
    C, B = rng.choice([3, 4, 6, 8]), rng.choice([2, 4, 16])
    cfg = model.Cfg(C, B, rng.choice([2, 4, 64]), rng.choice([3, 5, 1000]), rng.choice([2, 256]))
    specs = sorted((rng.randint(0, 8), rng.randint(1, C * B - 1), rng.randint(1, 6), rng.choice([0, rng.randint(1, 7)]))
                   for _ in range(rng.randint(1, 5)))
    be = ScriptedBackend(eos_at={f"r{j}": e for j, (_, _, _, e) in enumerate(specs) if e}, block_tokens=B)
    s = Scheduler(kv_cap_blocks=C, block_tokens=B, prefill_chunk_tokens=cfg.chunk_tokens,
                  token_budget_tokens=cfg.budget_tokens, max_running=cfg.max_running, backend=be,
                  **verify.fcfs_kwargs())
    reqs = tuple(model.Req(inv.ABSENT, p, m, e, arrival=a) for a, p, m, e in specs)
    free, records = C, [None] * len(specs)
    for t in range(40):
        for j, (a, p, m, _) in enumerate(specs):
            if a == t:
                r = make_req(f"r{j}", n_prompt=p, max_tokens=m)
                s.submit(r)
                records[j] = s.state.by_obj[id(r)]
        reqs = model.arrive(reqs, t)
        res = model.tick(reqs, free, cfg)
        reqs, free = res.reqs, res.free_blocks
        s.tick()
        real = [(inv.ABSENT, 0, 0, 0, 0) if q is None else (inv.STATE_CODE[q.state], len(q.req.generated),
                q.num_computed_tokens, len(q.block_table), q.num_preemptions) for q in records]
        assert real == [(r.st, r.g, r.nc, r.h, r.pre) for r in reqs], (t, cfg, specs)
        assert free == s.pool.num_free
        assert all(ok for _, ok in res.facts) and model.system_valid(reqs, free, cfg)
    return sum(q.num_preemptions for q in records if q is not None)


@pytest.mark.slow
def test_model_matches_the_scheduler_tick_by_tick():
    rng = random.Random(7)
    preemptions = sum(_model_vs_scheduler(rng) for _ in range(150))
    assert preemptions > 0  # the comparison covered preemption by recompute


def _plans(seed: int) -> list[list[tuple[str, int, int, bool]]]:
    """Every tick's plan (request, tokens, new blocks, admitted) for a seeded run under KV pressure.

    The clock is a StepClock, so the run does not depend on the machine's speed."""
    rng = random.Random(seed)
    be = ScriptedBackend(eos_at={f"r{j}": rng.randint(1, 40) for j in range(0, 30, 3)}, block_tokens=4)
    s = Scheduler(kv_cap_blocks=40, block_tokens=4, prefill_chunk_tokens=8, backend=be, clock=StepClock())
    for j in range(30):
        s.submit(make_req(f"r{j}", user=f"u{j % 3}", n_prompt=rng.randint(1, 30), max_tokens=rng.randint(1, 40)))
    plans = []
    while s.has_active():
        plan = s.schedule()  # pure: the plan the tick below runs
        s.tick()
        plans.append([(e.seq.request_id, e.num_new_tokens, e.new_blocks, e.admitted) for e in plan.batch])
    return plans


def test_the_decode_fast_path_plans_what_the_rules_plan(monkeypatch):
    """``rules.decode_ready`` lets ``schedule()`` skip growth_blocks / chunk_tokens for a plain
    decode (proved by ``decode_fast_path``); turned off, every plan of the run is the same, and
    it was taken for most decodes."""
    calls = []
    real = rules.decode_ready
    monkeypatch.setattr(rules, "decode_ready", lambda *a: calls.append(real(*a)) or calls[-1])
    fast = [_plans(seed) for seed in range(3)]
    assert sum(calls) > len(calls) // 2
    monkeypatch.setattr(rules, "decode_ready", lambda *a: False)
    assert [_plans(seed) for seed in range(3)] == fast


def test_model_drift_is_caught(monkeypatch):
    """A policy change the model does not know about (victim = oldest) must show up."""
    monkeypatch.setattr(policy.FCFSPolicy, "victim", lambda self, running: min(running, key=lambda s: s.admit_no))
    rng = random.Random(7)
    with pytest.raises(AssertionError):
        for _ in range(150):
            _model_vs_scheduler(rng)


# ---------------------------------------------------------------- teeth: planted bugs


class _BigPool(BlockPool):
    """A pool with more blocks than the cap it was asked for (so the pool cannot refuse)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks + 8)


PLANTS = {
    # name: (module, attribute, bugged function, {z3 check: the property (or properties) its
    # counterexample must name}, the property the runtime check or stateful test names; for the
    # dropped guard it is the block pool, which refuses to hand out more than the cap)
    "admission guard dropped": (fr, "can_admit", lambda free, need, headroom: True,
                                {"kv_cap_per_transition": "kv_within_cap", "kv_cap_tick": "kv_within_cap",
                                 "kv_cap_tick_loop": "free >= 0",
                                 "kv_cap_bmc": ("kv_within_cap", "batch_kv_within_cap")}, "plan_within_free"),
    "growth dropped": (rules, "growth_blocks", lambda held, n, B: 0,
                       {"kv_cap_per_transition": "resident_covered", "kv_cap_tick": "resident_covered",
                        "kv_cap_tick_loop": "resident_covered", "kv_cap_bmc": "resident_covered"}, "resident_covered"),
    "lookahead slot removed": (rules, "blocks_needed", lambda n, B: rules.blocks_for(n, B),
                               # prompt_fits uses blocks_needed too: a prompt filling the cache is let in
                               {"kv_cap_per_transition": "resident_covered", "kv_cap_tick": "resident_covered",
                                "kv_cap_tick_loop": "resident_covered",
                                "kv_cap_bmc": ("resident_covered", "live_below_limits")},
                               ("resident_covered", "live_below_limits")),
    "chunk cap dropped": (rules, "chunk_tokens", lambda n, nc, chunk, budget: Min(n - nc, budget),
                          {"kv_cap_per_transition": "chunk_within_limit", "kv_cap_tick": "chunk_within_limit",
                           "kv_cap_tick_loop": "chunk_within_limit", "kv_cap_bmc": "chunk_within_limit"}, "chunk_within_limit"),
    "max_tokens ignored": (rules, "reached_length", lambda g, M, n, max_len: n >= max_len,
                           {"kv_cap_per_transition": "live_below_limits", "kv_cap_tick": "live_below_limits",
                            "kv_cap_tick_loop": "live_below_limits", "kv_cap_bmc": "live_below_limits"}, "live_below_limits"),
    "decode fast path ignores the lookahead slot": (  # the reference plan (it never takes the fast path) sees it
        rules, "decode_ready", lambda held, n, nc, B: nc + 1 == n,
        {"decode_fast_path": "growth_is_zero"}, ("resident_covered", "reference_plan")),
    "admission needs a spare block (starvation)": (
        fr, "can_admit", lambda free, need, headroom: need + headroom < free,
        {"no_starvation_fcfs": "r",
         "no_starvation_fcfs_inductive": ("oldest_admitted", "oldest_never_preempted", "oldest_progress")},
        # the default policy's wait bound, or the refinement check (the model admits where the plant does not)
        ("FCFS bound", "did not drain", "was the first not to fit", "refines_model_tick")),
}


def test_kv_cap_tick_loop_proves_for_any_number_of_requests_and_its_steps_are_not_vacuous():
    """The loop-invariant proof of the whole tick: proved, and each step's guard is satisfiable
    with a non-empty batch and other residents (so no step holds vacuously)."""
    z3 = pytest.importorskip("z3")
    assert verify.check_kv_cap_tick_loop(verify.Options()).status == "proved"
    cfg = verify._sym_cfg(16)
    lp = verify._Loop("0")
    for name, guard, _, _ in verify._loop_steps(lp, cfg):
        solver = z3.Solver()
        solver.add(cfg.ok(), *(g for _, g in lp.inv(cfg.cap_blocks, cfg.budget_tokens)), *guard,
                   lp.held_in >= 1, lp.held_out >= 1, lp.spent >= 1)
        assert solver.check() == z3.sat, name


def _violated(r: verify.Result) -> list[str]:
    assert r.outcome.status == "counterexample", (r.name, r.outcome.status, r.outcome.detail)
    return r.outcome.counterexample.violated


@pytest.mark.slow
@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_gives_a_counterexample_that_replays(monkeypatch, plant):
    module, attr, bug, expected, _ = PLANTS[plant]
    monkeypatch.setattr(module, attr, bug)
    results = run(*expected)
    for name, prop in expected.items():
        assert any(v.startswith(prop) for v in _violated(results[name])), (name, _violated(results[name]))
    for r in results.values():
        trace = r.outcome.counterexample
        if isinstance(trace, verify.Trace):  # a bounded run: it replays on the real, bugged scheduler
            out = trace.replay()
            if trace.target is None:  # an invariant broke: the runtime check or the pool says so
                assert isinstance(out["error"], AssertionError), (plant, out, str(trace))
            else:
                rid, what = trace.target
                assert out["error"] is None
                assert out["states"][rid] == "queued" if what == "admitted" else rid not in out["finished"]
    monkeypatch.undo()  # without the bug the same runs are fine (or refuse what only the bug let in)
    for r in results.values():
        trace = r.outcome.counterexample
        if isinstance(trace, verify.Trace):
            out = trace.replay()
            assert out["error"] is None or isinstance(out["error"], scheduler.PromptTooLongError), out
            if trace.target is not None and trace.target[1] == "finished":
                assert trace.target[0] in out["finished"]


@pytest.mark.slow
@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_fails_the_stateful_test(monkeypatch, plant):
    module, attr, bug, _, runtime_prop = PLANTS[plant]
    monkeypatch.setattr(module, attr, bug)
    with pytest.raises((InvariantViolation, AssertionError)) as e:
        run_machine(steps=200, examples=40)
    expected = runtime_prop if isinstance(runtime_prop, tuple) else (runtime_prop,)
    if isinstance(e.value, InvariantViolation):
        assert e.value.property in expected
    else:
        assert any(x in str(e.value) for x in expected), str(e.value)[:300]


@pytest.mark.slow
def test_eos_ignored_fails_z3_and_the_stateful_test(monkeypatch):
    monkeypatch.setattr(model, "is_eos", lambda eos_position, g: False)
    results = run("kv_cap_per_transition", "kv_cap_tick", "kv_cap_bmc")
    for r in results.values():
        assert any(v.startswith(("none_after_eos", "live_below_limits")) for v in _violated(r)), r.name
    monkeypatch.undo()
    monkeypatch.setattr(scheduler.inference_stub, "EOS_TOKEN", 99)  # the scheduler looks for the wrong EOS id
    with pytest.raises(AssertionError):
        run_machine(steps=200, examples=40)


def test_pool_larger_than_the_cap_fails_the_runtime_check(monkeypatch):
    monkeypatch.setattr(scheduler, "BlockPool", _BigPool)
    s = Scheduler(backend=ScriptedBackend(), kv_cap_blocks=8, check_invariants=True)
    s.submit(make_req("a"))
    with pytest.raises(InvariantViolation) as e:
        s.tick()
    assert e.value.property == "ledger_consistent"


def test_request_in_two_places_fails_the_runtime_check(monkeypatch):
    monkeypatch.setattr(policy.FCFSPolicy, "remove", lambda self, seq: None)  # admitted but still queued
    s = Scheduler(backend=ScriptedBackend(), check_invariants=True, policy=policy.FCFSPolicy())
    s.submit(make_req("a"))
    with pytest.raises(InvariantViolation) as e:
        s.tick()
    assert e.value.property == "exactly_one_state" and "a: 1x waiting, 1x running" in e.value.detail


def test_two_forwards_in_a_tick_fail_the_runtime_check():
    s = Scheduler(backend=ScriptedBackend(), check_invariants=False)
    s.submit(make_req("a"))
    checker = inv.InvariantChecker()
    plan = s.schedule()
    step.commit(s.state, plan)
    _, be = checker.count_forward(None, ScriptedBackend())
    tokens = be(plan.requests)
    be(plan.requests)  # a second model iteration in the same tick
    finished = s.update_from_output(plan, tokens)
    with pytest.raises(InvariantViolation) as e:
        checker.after_tick(s, plan, finished)
    assert e.value.property == "one_forward_per_tick"


def test_runtime_check_does_not_take_a_new_request_for_a_retired_one(monkeypatch):
    """CPython reuses a freed record's address, so a new request's ``id()`` can be that of a
    request the retry policy failed (in a tick the check does not see end). The one-token
    check must compare each record with its own count: here an ``id()`` that names records
    by request id makes the reuse certain (seen for real in seeded runs: "-2 tokens")."""
    real_id = id
    monkeypatch.setattr(inv, "id", lambda o: ("seq", o.request_id) if isinstance(o, Seq) else real_id(o),
                        raising=False)
    down = []
    be = ScriptedBackend()

    def backend(batch):
        if down:
            raise RuntimeError("device lost")
        return be(batch)

    s = Scheduler(backend=backend, check_invariants=True, max_backend_tries=1, prefill_chunk_tokens=1)
    s.submit(make_req("x", n_prompt=1, max_tokens=5))
    s.tick()  # x's first token: the check records 1 token for it
    down.append(1)
    assert [r.request_id for r in s.tick()] == ["x"]  # failed by the retry policy
    down.clear()
    x = make_req("x", n_prompt=3, max_tokens=5)
    s.submit(x)  # a new record with the same id()
    for _ in range(3):
        s.tick()  # two prompt chunks with no token (0 tokens this tick, not -1), then the first
    assert len(x.generated) == 1


def test_runtime_check_is_on_in_the_test_suite():
    assert scheduler.CHECK_INVARIANTS is True
    assert Scheduler()._checker is not None and Scheduler(check_invariants=False)._checker is None


def test_violation_names_the_property_and_the_state(monkeypatch):
    monkeypatch.setattr(rules, "growth_blocks", lambda held, n, B: 0)
    s = Scheduler(backend=ScriptedBackend(), kv_cap_blocks=8, check_invariants=True)
    s.submit(make_req("a", n_prompt=15, max_tokens=5))
    s.tick()
    with pytest.raises(InvariantViolation) as e:
        s.tick()
    v = e.value
    assert v.property == "resident_covered" and "a: holds 1 blocks for 17 tokens" in str(v)
    assert v.state["running"][0][:2] == ("a", "decoding") and v.state["cap_blocks"] == 8


def test_the_lifecycle_table_has_its_properties():
    assert run("lifecycle_table")["lifecycle_table"].proved


@pytest.mark.parametrize("event, sources, dest, names", [
    ("prefill_done", ("prefilling", "done"), "decoding", "leaves the final state 'done'"),
    ("preempt", ("prefilling", "decoding"), "queued", "queued"),
    ("finish", ("queued", "prefilling", "decoding"), "done", "finish: must take exactly the resident states"),
    ("prefill_done", ("prefilling", "preempted"), "decoding", "without a grant"),
    ("abort", ("queued", "prefilling", "decoding"), "aborted", "abort: must take every live state"),
    ("resume", ("queued",), "prefilling", "from preempted: reaches only"),
])
def test_a_planted_lifecycle_row_gives_a_counterexample(monkeypatch, event, sources, dest, names):
    """A wrong row of the table the scheduler's machine is built from (done -> decoding, a
    preempted request back in the queue, finish before admission, abort that misses a state, no
    way back from preemption, a preempted request decoding without blocks) is named by ``lifecycle_table``."""
    from spec import lifecycle as lc
    rows = tuple((e, sources, dest) if e == event else (e, s, d) for e, s, d in lc.TRANSITIONS)
    monkeypatch.setattr(lc, "TRANSITIONS", rows)
    out = run("lifecycle_table")["lifecycle_table"].outcome
    assert out.status == "counterexample"
    assert any(names in v for v in out.counterexample.violated), out.counterexample.violated
