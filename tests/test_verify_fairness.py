"""The fairness proofs of ``spec/verify_fairness.py`` and their teeth.

Each check must prove its property on the rules as written, and return a counterexample when a
bug is planted in the rule it is about (``monkeypatch`` on ``spec.fairness_rules``: the checks
and the scheduler look the rules up at call time). For the lift and the aging rule the same
planted bug also makes a scenario on the real ``Scheduler`` (virtual time) misbehave.
"""
import pytest
from conftest import ScriptedBackend, StepClock, make_req
from test_fairness import _long_amid_small

from batch.policies.policy import VTCPolicy
from scheduler import Scheduler
from spec import fairness_rules as fr
from spec import verify, verify_fairness as vf
from spec.verify import Options

OPTS = Options(timeout_s=60.0)


def test_fairness_checks_are_registered_with_spec_verify():
    verify._load_plugins()
    for name in ("vtc_counter_gap", "vtc_counter_gap_bmc", "vtc_lift", "no_starvation_aging", "sit_out_bound",
                 "sit_out_bound_with_target", "vtc_counter_gap_replicas"):
        assert name in verify.CHECKS


@pytest.mark.slow
@pytest.mark.parametrize("check", [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_bmc, vf.check_vtc_lift,
                                   vf.check_no_starvation_aging, vf.check_sit_out_bound,
                                   vf.check_sit_out_bound_with_target, vf.check_vtc_counter_gap_replicas])
def test_check_proves_the_rules_as_written(check):
    out = check(OPTS)
    assert out.status == "proved", out


@pytest.mark.slow
def test_paper_bound_is_not_inductive_for_continuous_batching_but_the_derived_one_is():
    out = vf.check_vtc_counter_gap(OPTS)
    assert "398 as G with N=2 resident requests per user: counterexample" in out.detail
    # the derived bound, two users of weight 1 with one resident request each, in weighted tokens
    assert vf.vtc_counter_gap_bound_units(vf.max_resident_units(1, 199, 99), 1, 1) == 794 * fr.COUNTER_SCALE
    # and in a bounded run from equal counters the paper's bound is exceeded, the derived one is not
    assert "the paper's 8 weighted tokens is exceeded" in vf.check_vtc_counter_gap_bmc(OPTS).detail


def test_the_replica_bound_needs_every_view_at_or_below_the_global_counter():
    # with the lifts published the step proof holds; a view above c_u (a private lift) breaks it
    out = vf.check_vtc_counter_gap_replicas(OPTS)
    assert out.status == "proved", out
    assert "kept on one replica, as before 2026-12-01): counterexample (admission of a request of p" in out.detail


def test_aging_model_reaches_a_pass_of_the_reservation_and_an_early_finish():
    """The proof of ``no_starvation_aging`` is not bought by a model that never passes the
    reservation holder or never finishes early: runs with both exist."""
    z3 = pytest.importorskip("z3")
    asm, _, trace = vf._aging_run(vf.AGING_T, vf.AGING_K, vf.AGING_L, vf.AGING_SLOTS, vf.AGING_CAP_BLOCKS,
                                  vf.AGING_BLOCK_TOKENS, fr.admission_wait_bound(vf.AGING_T, vf.AGING_K, vf.AGING_L))
    ticks = trace["ticks"]
    passes = [z3.And(before["reserved"], z3.Not(before["admitted"]), tick["other admitted"])
              for before, tick in zip(ticks, ticks[1:])]
    solver = z3.Solver()
    solver.add(*asm, z3.Or(*passes), z3.Or(*(e for tick in ticks for e in tick["early finish"])))
    assert solver.check() == z3.sat


# ---------------------------------------------------------------- teeth: planted bugs


BUGS = {
    "charged_counter skips the weight": ("charged_counter", lambda c, units, w: c + units * fr.COUNTER_SCALE,
                                         [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_replicas]),
    "no lift": ("lifted_counter", lambda own, m, others, tol: own, [vf.check_vtc_lift, vf.check_vtc_counter_gap]),
    "lift to the band's edge only": ("lifted_counter", lambda own, m, others, tol: fr.If(others, m - tol - 1, own),
                                     [vf.check_vtc_lift]),
    "lift ignores the tolerance": ("lifted_counter", lambda own, m, others, tol: fr.If(others, fr.Max(own, m), own),
                                   [vf.check_vtc_lift]),
    "lift banks twice the tolerance": ("lifted_counter",
                                       lambda own, m, others, tol: fr.If(others, fr.Max(own, m - 2 * tol - 1), own),
                                       [vf.check_vtc_lift, vf.check_vtc_counter_gap]),
    "lift above the band": ("lifted_counter",
                            lambda own, m, others, tol: fr.If(others, fr.Max(own, m + tol + 1), own),
                            [vf.check_vtc_lift, vf.check_vtc_counter_gap_replicas]),
    "eligibility band twice the tolerance": ("vtc_eligible", lambda local, least, tol: local <= least + 2 * tol,
                                             [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_replicas]),
    "any user eligible": ("vtc_eligible", lambda local, least, tol: local == local,
                          [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_bmc,
                           vf.check_vtc_counter_gap_replicas]),
    "reservation never fires": ("reserved_after", lambda b, t: False, [vf.check_no_starvation_aging]),
    "sit-out cap removed": ("sit_out_allowed", lambda s, k: True,
                            [vf.check_sit_out_bound, vf.check_no_starvation_aging]),
    "streak never counts": ("next_streak", lambda s, iso: 0, [vf.check_sit_out_bound]),
    "trim cap off by one": ("may_trim", lambda run, k: run <= k, [vf.check_sit_out_bound_with_target]),
    "trim never capped": ("may_trim", lambda run, k: run == run, [vf.check_sit_out_bound_with_target]),
    "streak reset by every iteration": ("streak_after", lambda s, iso, trim: 0 * s, [vf.check_sit_out_bound_with_target]),
    "wait bound one tick short": ("admission_wait_bound", lambda t, k, l: t + (k + 1) * l,
                                  [vf.check_no_starvation_aging]),
    "may_pass_reservation non-strict": ("may_pass_reservation", lambda c, m: c <= m, [vf.check_no_starvation_aging]),
    "may_pass_reservation always": ("may_pass_reservation", lambda c, m: True, [vf.check_no_starvation_aging]),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_gives_a_counterexample(bug, monkeypatch):
    name, wrong, checks = BUGS[bug]
    monkeypatch.setattr(fr, name, wrong)
    for check in checks:
        out = check(OPTS)
        assert out.status == "counterexample", (bug, check.__name__, out)
        assert out.counterexample is not None and out.counterexample.violated
        assert str(out.counterexample)  # printable


# ---------------------------------------------------------------- teeth on the real Scheduler


def _returning_user(tol=0, warm_ticks=30, backlog=40):
    """A and C keep 40 requests each waiting; after 30 ticks B submits 20. Returns B's counter
    right after its return, the least counter among A and C then (counter units), and how many
    of the next 20 admissions were B's. ``tol``: the policy's tolerance, weighted tokens;
    ``warm_ticks``: ticks before B returns (30); ``backlog``: requests of A and of C (40)."""
    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=16, policy=VTCPolicy(tolerance_tokens=tol),
                  isolation=False)
    for user in ("A", "C"):
        for i in range(backlog):
            s.submit(make_req(f"{user}{i}", user=user, n_prompt=20, max_tokens=6))
    for _ in range(warm_ticks):
        s.tick()
    for i in range(20):
        s.submit(make_req(f"B{i}", user="B", n_prompt=20, max_tokens=6))
    b_counter = s.policy.counter("B")
    least = min(s.policy.counter("A"), s.policy.counter("C"))
    admitted = []
    for _ in range(500):
        if len(admitted) >= 20:
            break
        before = set(s.running)
        s.tick()
        admitted += [q.user_id for q in s.running if q not in before]
    return b_counter, least, admitted[:20].count("B")


def test_scenario_lift_keeps_a_returning_user_to_its_share():
    b_counter, least, b_admits = _returning_user()
    assert b_counter == least - 1 and least > 0  # lifted to one unit below the least counter
    assert b_admits <= 12  # about a third of the admissions (A, B, C alternate), not all of them


def test_scenario_without_the_lift_a_returning_user_takes_almost_every_admission(monkeypatch):
    monkeypatch.setattr(fr, "lifted_counter", lambda own, m, others, tol: own)
    b_counter, least, b_admits = _returning_user()
    assert b_counter < least  # banked credit: B kept its old counter
    assert b_admits >= 18  # with the lift: 7 (test above)


def test_scenario_a_returning_user_is_not_queued_behind_the_tolerance_band():
    """With a tolerance of 640 weighted tokens (20 of these requests) B is lifted to 640 (and a unit) below
    the least counter: A and C, at the band's top, may not run further ahead, so B gets about a
    third of the admissions at once, as under strict VTC."""
    b_counter, least, b_admits = _returning_user(tol=640, warm_ticks=100, backlog=100)
    assert b_counter == least - 640 * fr.COUNTER_SCALE - 1 > 0
    assert 5 <= b_admits <= 12


def test_scenario_a_lift_that_ignores_the_tolerance_queues_a_returning_user_behind_the_band(monkeypatch):
    """The teeth of the test above: lifted to the least counter itself, B is inside the band with
    the newest arrivals and waits until A and C are 640 tokens ahead of it."""
    monkeypatch.setattr(fr, "lifted_counter", lambda own, m, others, tol: fr.If(others, fr.Max(own, m), own))
    _, _, b_admits = _returning_user(tol=640, warm_ticks=100, backlog=100)
    assert b_admits <= 2


def test_scenario_aging_bound_holds_on_the_scheduler():
    _, _, submitted, admitted = _long_amid_small(aging_ticks=5)
    assert admitted - submitted <= fr.admission_wait_bound(5, 0, 13)


def test_scenario_aging_rule_removed_starves_the_long_request(monkeypatch):
    """The aging rule planted away: no reservation, and backfill passes the blocked request forever
    (with ``may_backfill_past`` intact, no backfill after ``T`` ticks already admits it here)."""
    monkeypatch.setattr(fr, "reserved_after", lambda b, t: False)
    monkeypatch.setattr(fr, "may_backfill_past", lambda b, t, backfill: backfill)
    _, _, submitted, admitted = _long_amid_small(aging_ticks=5)
    assert admitted - submitted > fr.admission_wait_bound(5, 0, 13)
