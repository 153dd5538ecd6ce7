"""The fairness proofs of ``spec/verify_fairness.py`` and their teeth.

Each check must prove its property on the rules as written, and return a counterexample when a
bug is planted in the rule it is about (``monkeypatch`` on ``spec.fairness_rules``: the checks
and the scheduler look the rules up at call time). For the lift and the aging rule the same
planted bug also makes a scenario on the real ``Scheduler`` (virtual time) misbehave.
"""
import pytest
from conftest import ScriptedBackend, StepClock, make_req

from batch.policies.vtc import VTCPolicy
from scheduler import Scheduler
from spec import fairness_rules as fr
from spec import verify, verify_fairness as vf
from spec.verify import Options

OPTS = Options(timeout_s=60.0)


def test_fairness_checks_are_registered_with_spec_verify():
    verify._load_plugins()
    for name in ("vtc_counter_gap", "vtc_counter_gap_bmc", "vtc_lift", "no_starvation_holder", "anti_thrash",
                 "sit_out_bound", "vtc_counter_gap_replicas", "vtc_counter_gap_paths"):
        assert name in verify.CHECKS


@pytest.mark.slow
@pytest.mark.parametrize("check", [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_bmc, vf.check_vtc_lift,
                                   vf.check_no_starvation_holder, vf.check_anti_thrash, vf.check_sit_out_bound,
                                   vf.check_vtc_counter_gap_replicas, vf.check_vtc_counter_gap_paths])
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


def test_gap_with_every_path_needs_the_out_of_order_account(monkeypatch):
    """The holder's and the resume-first trials' charges are what widens the bound: without
    adding them to ``X`` the invariant is not inductive (the holder admitted above the band)."""
    plain = vf._paths_steps

    def without_account(p, q, cap, tol, one, xs):
        return [(name, guard, [(var, val) for var, val in after if not any(var is x for x in xs.values())])
                for name, guard, after in plain(p, q, cap, tol, one, xs)]
    monkeypatch.setattr(vf, "_paths_steps", without_account)
    out = vf.check_vtc_counter_gap_paths(OPTS)
    assert out.status == "counterexample" and "holder or resume-first trial" in out.counterexample.step, out


def test_holder_step_is_not_vacuous_in_either_phase():
    """The holder's step proof is not bought by assumptions that exclude a phase: states exist
    where a protected request shields its blocks and h is not admitted, and where no protection
    runs, the slot cap is full and h waits while the residents drain."""
    z3 = pytest.importorskip("z3")
    pre, _, named = vf._holder_step()
    hp, _ = named["protected set, admitted at"]
    n, _ = named["residents, work left"]
    for extra in ([hp, z3.Not(named["admitted"])],
                  [z3.Not(hp), n == named["max_running"], z3.Not(named["admitted"]), named["L"] >= 3]):
        solver = z3.Solver()
        solver.add(*pre, *extra)
        assert solver.check() == z3.sat


# ---------------------------------------------------------------- teeth: planted bugs


BUGS = {
    "charged_counter skips the weight": ("charged_counter", lambda c, units, w: c + units * fr.COUNTER_SCALE,
                                         [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_replicas,
                                          vf.check_vtc_counter_gap_paths]),
    "no lift": ("lifted_counter", lambda own, floor: own, [vf.check_vtc_lift, vf.check_vtc_counter_gap]),
    "lift ignores its own counter (may lower it)": ("lifted_counter", lambda own, floor: floor,
                                                    [vf.check_vtc_lift, vf.check_vtc_counter_gap_replicas]),
    "lift ignores the tolerance": ("lift_floor", lambda floor, m, others, tol: fr.If(others, fr.Max(floor, m), floor),
                                   [vf.check_vtc_lift]),
    "lift banks twice the tolerance": (
        "lift_floor", lambda floor, m, others, tol: fr.If(others, fr.Max(floor, m - 2 * tol - 1), floor),
        [vf.check_vtc_lift, vf.check_vtc_counter_gap]),
    "lift above the band": (
        "lift_floor", lambda floor, m, others, tol: fr.If(others, fr.Max(floor, m + tol + 1), floor),
        [vf.check_vtc_lift, vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_replicas]),
    "the floor may go down": ("lift_floor", lambda floor, m, others, tol: fr.If(others, m - tol - 1, floor),
                              [vf.check_vtc_lift]),
    "an idle user above the floor forgotten": ("forgettable", lambda c, floor: c <= floor + 1, [vf.check_vtc_lift]),
    "eligibility band twice the tolerance": ("vtc_eligible", lambda local, least, tol: local <= least + 2 * tol,
                                             [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_replicas]),
    "any user eligible": ("vtc_eligible", lambda local, least, tol: local == local,
                          [vf.check_vtc_counter_gap, vf.check_vtc_counter_gap_bmc,
                           vf.check_vtc_counter_gap_replicas, vf.check_vtc_counter_gap_paths]),
    "light users first whatever their counter": ("light_first", lambda local, least, tol: True,
                                                 [vf.check_vtc_counter_gap_paths]),
    "light users first within twice the band": ("light_first", lambda local, least, tol: local <= least + 2 * tol + 1,
                                                [vf.check_vtc_counter_gap_paths]),
    "the band wider than the tolerance": ("band_tolerance", lambda tol, equal: 2 * tol + 1,
                                          [vf.check_vtc_counter_gap_paths]),
    "reservation never fires": ("reserved_after", lambda b, t: False, [vf.check_no_starvation_holder]),
    "reservation a tick late": ("reserved_after", lambda b, t: b >= t + 1, [vf.check_no_starvation_holder]),
    "sit-out cap removed": ("sit_out_allowed", lambda s, k: True,
                            [vf.check_sit_out_bound, vf.check_no_starvation_holder]),
    "streak never counts": ("next_streak", lambda s, iso: 0, [vf.check_sit_out_bound, vf.check_no_starvation_holder]),
    # the ranking reaches Q + (K+1) L: one tick less has a counterexample
    "holder bound one tick short": ("holder_wait_bound", lambda q, k, w: q + (k + 1) * w - 1,
                                    [vf.check_no_starvation_holder]),
    "protection never ends": ("protected", lambda h, a, t, q: h,
                              [vf.check_no_starvation_holder, vf.check_anti_thrash]),
    "protection a tick short": ("protected", lambda h, a, t, q: fr.And(h, t - a < q - 1), [vf.check_anti_thrash]),
    "quantum a tick short": ("quantum_elapsed", lambda a, t, q: t - a >= q - 1, [vf.check_anti_thrash]),
    "a request admitted this tick may be a victim": ("may_preempt", lambda n, m, a, t: n < m,
                                                     [vf.check_anti_thrash]),
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
    monkeypatch.setattr(fr, "lifted_counter", lambda own, floor: own)
    b_counter, least, b_admits = _returning_user()
    assert b_counter < least  # banked credit: B kept its old counter
    assert b_admits >= 18  # with the lift: 7 (test above)


def test_scenario_a_returning_user_is_lifted_one_unit_below_the_least_counter_whatever_the_band():
    """``VTCPolicy`` lifts with ``LIFT_TOLERANCE_TOKENS`` (0), not its tolerance band (640 weighted
    tokens here, 20 of these requests): B starts one unit below the least counter, so the band is
    not credited to it (it would read as A's and C's lead in ``pressure_units``). Not light here
    (isolation off), B waits in the band's arrival order behind A's and C's backlog."""
    b_counter, least, b_admits = _returning_user(tol=640, warm_ticks=100, backlog=100)
    assert fr.LIFT_TOLERANCE_TOKENS == 0 and b_counter == least - 1 and least > 0
    assert b_admits <= 2


def test_scenario_a_lift_that_credits_the_band_lets_a_returning_user_in_ahead_of_it(monkeypatch):
    """The teeth of the test above: lifted with the band's tolerance (the rule before issue 38),
    B starts 640 tokens (and a unit) below the least counter and takes about half the next
    admissions at once."""
    monkeypatch.setattr(fr, "LIFT_TOLERANCE_TOKENS", 640)
    b_counter, least, b_admits = _returning_user(tol=640, warm_ticks=100, backlog=100)
    assert b_counter == least - 640 * fr.COUNTER_SCALE - 1 > 0
    assert b_admits >= 5


def _long_amid_growing(ticks_of_stream=120, max_tokens=40):
    """Users y and z submit two requests a tick (20-token prompts growing to ``max_tokens``
    output tokens: 2 blocks, then up to 4) into a 32-block cache under the default policy without
    isolation; user x's 300-token prompt (19 blocks) arrives at tick 10, when the cache is full.
    Growth preempts decodes; within the band x waits behind earlier arrivals, and resume-first
    tries preempted decodes before it in every tick that does not preempt. Returns (the first
    tick x is the plan's blocked head: the front of the order, not fitting; the tick the stream
    admits it, or None)."""
    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=32, aging_ticks=5, isolation=False)
    x = make_req("x", user="x", n_prompt=300, max_tokens=4)
    front = admitted = None
    for t in range(ticks_of_stream):
        for user in ("y", "z"):
            s.submit(make_req(f"{user}{t}", user=user, n_prompt=20, max_tokens=max_tokens))
        if t == 10:
            s.submit(x)
        plan = s.schedule()  # pure: the plan of the tick below
        s.tick()
        if front is None and plan.blocked is not None and plan.blocked.req is x:
            front = t
        if admitted is None and any(e.seq.req is x and e.admitted for e in plan.batch):
            admitted = t
    assert front is not None, "x never reached the front of the order"
    return front, admitted


#: The bound of the scenario above, from x's first tick at the front: aging 5 ticks to the
#: reservation, at most a quantum behind a protected request (Q = 128), then a small request's
#: work 1 + 40 (no sit-outs: K = 0), as the stateful machine's holder bound counts it.
LONG_AMID_GROWING_BOUND = fr.admission_wait_bound(5, 1 + 40) + fr.QUANTUM_TICKS


def test_scenario_aging_bound_holds_on_the_scheduler():
    front, admitted = _long_amid_growing()
    assert admitted is not None and admitted - front <= LONG_AMID_GROWING_BOUND


def test_scenario_aging_rule_removed_the_long_request_is_never_admitted_amid_the_stream(monkeypatch):
    """The aging rule planted away: no reservation, so growth and resume-first keep the cache
    for the small requests and x is not admitted while the stream runs (with the rule: 11 ticks
    after it reached the front)."""
    monkeypatch.setattr(fr, "reserved_after", lambda b, t: False)
    _, admitted = _long_amid_growing()
    assert admitted is None
