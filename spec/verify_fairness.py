"""z3 checks of the fairness rules: the VTC counter gap (inductive, every admission path, bounded,
across replicas), the lift, no starvation (aging and the reservation holder), anti-thrash, sit-outs.

A plugin of ``spec.verify`` (listed in its ``PLUGINS``): importing this module registers eight
checks, run with the others by ``python -m spec.verify`` (``--only vtc_counter_gap`` etc.).
Every check evaluates the functions of ``spec.fairness_rules`` that ``batch/core/step.py`` and
``batch/policies/vtc.py`` call, on z3 terms, looked up as ``fr.NAME`` at call time
so a test can plant a bug in a rule (``monkeypatch.setattr(fr, "lifted_counter", ...)``) and see
the check fail. What each check assumes and what it leaves out is ``docs/fairness.md``
section 8.

Units as in ``spec.fairness_rules``: counters in counter units (``COUNTER_SCALE`` per weighted
token), service in weighted tokens, time in ticks.
"""
from __future__ import annotations

from typing import Any

from spec import fairness_rules as fr
from spec import rules
from spec.logic import And, If, Implies, Max, Min, Not, Or, Sum
from spec.verify import Options, Outcome, StateCounterexample, _outcome, _prove, _val, _z3, register

#: ``(w_p, w_q)`` share weights of the two users in the counter-gap proof. Each divides
#: ``COUNTER_SCALE`` (weights 1..16), so a charge has no rounding and the proof is exact.
GAP_WEIGHTS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 3), (16, 5))

#: Limits of the workload in ``docs/fairness.md`` section 5, for the printed comparison.
EXAMPLE_MAX_PROMPT_TOKENS = 199
EXAMPLE_MAX_OUTPUT_TOKENS = 99

#: Sit-out caps ``K`` of the bounded sit-out check (plus the symbolic inductive step).
SIT_OUT_KS: tuple[int, ...] = (0, 1, 3, 8)


def vtc_counter_gap_bound_units(max_resident_units: Any, weight_p: int, weight_q: int) -> Any:
    """The derived counter-gap bound of two continuously backlogged users, counter units.

    ``max_resident_units`` bounds the service (weighted tokens, not yet charged) that one
    user's resident requests can still receive; the bound is
    ``U_p + U_q = max_resident_units * SCALE / w_p + max_resident_units * SCALE / w_q``
    (``docs/fairness.md`` section 5). Computed here, not with ``charged_counter``, so a bug
    planted in the rule does not move the bound.
    """
    return max_resident_units * (fr.COUNTER_SCALE // weight_p) + max_resident_units * (fr.COUNTER_SCALE // weight_q)


def max_resident_units(max_resident_requests: int, max_prompt_tokens: int, max_output_tokens: int) -> int:
    """``N * (w_p * L_input + w_q * M)``: the most service one user's resident requests hold."""
    return max_resident_requests * fr.service_units(max_prompt_tokens, max_output_tokens, fr.PROMPT_PRICE,
                                                    fr.OUTPUT_PRICE)


# ---------------------------------------------------------------- 1. the VTC counter gap


class _User:
    """One user of the gap proof: counter ``c``, committed service ``rho`` (weighted tokens the
    resident requests can still be charged), ``nu`` of it admitted this tick, and this tick's
    advance ``a`` (the admission order's local prompt charges, counter units)."""

    def __init__(self, tag: str, weight: int) -> None:
        z3 = _z3()
        self.tag, self.w = tag, weight
        self.c, self.rho, self.nu, self.a = z3.Ints(f"counter_{tag} committed_units_{tag} admitted_units_{tag} "
                                                    f"advance_{tag}")

    def committed(self, c: Any = None, rho: Any = None) -> Any:
        """``c + R``: the counter plus the charge still to come from resident requests."""
        return (self.c if c is None else c) + (self.rho if rho is None else rho) * (fr.COUNTER_SCALE // self.w)


def _gap_steps(p: _User, q: _User, cap: Any, tol: Any) -> list[tuple[str, list, list]]:
    """The steps of the gap proof: ``(name, guard, [(variable, value after)])``; ``tol`` is the
    fairness tolerance, counter units."""
    z3 = _z3()
    steps = []
    for who, other in ((p, q), (q, p)):
        x_in, x_out = z3.Ints(f"admit_prompt_{who.tag} admit_output_{who.tag}")
        units = fr.service_units(x_in, x_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
        local = who.c + who.a  # the admission order's local copy of the counter
        guard = [x_in >= 0, x_out >= 0, who.rho + units <= cap,
                 # VTC with a tolerance: within tol of the least (local) counter among backlogged users
                 fr.vtc_eligible(local, Min(local, other.c + other.a), tol)]
        after = [(who.a, fr.charged_counter(local, fr.PROMPT_PRICE * x_in, who.w) - who.c), (who.rho, who.rho + units),
                 (who.nu, who.nu + units)]
        steps.append((f"admission of a request of {who.tag}", guard, after))
    sp_in, sp_out, sq_in, sq_out = z3.Ints("served_prompt_p served_output_p served_prompt_q served_output_q")
    up = fr.service_units(sp_in, sp_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
    uq = fr.service_units(sq_in, sq_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
    guard = [sp_in >= 0, sp_out >= 0, sq_in >= 0, sq_out >= 0, up <= p.rho, uq <= q.rho]
    after = [(p.c, fr.charged_counter(p.c, up, p.w)), (p.rho, p.rho - up), (p.a, 0), (p.nu, 0),
             (q.c, fr.charged_counter(q.c, uq, q.w)), (q.rho, q.rho - uq), (q.a, 0), (q.nu, 0)]
    steps.append(("service of one iteration (charge both users, end of tick)", guard, after))
    yp, yq = z3.Ints("preempted_units_p preempted_units_q")
    # growth preemption, or room made for a light user's admission later in the same tick: the
    # victims were admitted in earlier ticks (may_preempt), so the tick's advances stay
    steps.append(("preemption (of requests admitted before this tick; admission may go on after room)",
                  [yp >= 0, yp <= p.rho - p.nu, yq >= 0, yq <= q.rho - q.nu],
                  [(p.rho, p.rho - yp), (q.rho, q.rho - yq)]))
    return steps


def _gap_inv(p: _User, q: _User, cap: Any, g_pq: Any, g_qp: Any, sub: list | None = None) -> list[tuple[str, Any]]:
    z3 = _z3()
    sub = sub or []

    def v(x: Any) -> Any:
        return next((val for var, val in sub if z3.eq(var, x)), x)

    inv = []
    for u in (p, q):
        inv += [(f"0 <= admitted_{u.tag} <= committed_{u.tag} <= cap",
                 And(0 <= v(u.nu), v(u.nu) <= v(u.rho), v(u.rho) <= cap)),
                (f"0 <= advance_{u.tag} <= admitted_{u.tag}",
                 And(0 <= v(u.a), v(u.a) <= v(u.nu) * (fr.COUNTER_SCALE // u.w)))]
    inv += [("J(p,q): c_p + R_p - c_q <= G", p.committed(v(p.c), v(p.rho)) - v(q.c) <= g_pq),
            ("J(q,p): c_q + R_q - c_p <= G", q.committed(v(q.c), v(q.rho)) - v(p.c) <= g_qp)]
    return inv


def _gap_step_proof(weights: tuple[int, int], cap_of: Any, g_of: Any, timeout_s: float) -> tuple[str, Any]:
    """Every step preserves the invariant; returns ``("proved", None)`` or the failing step's record."""
    z3 = _z3()
    p, q = _User("p", weights[0]), _User("q", weights[1])
    cap, tol = z3.Ints("max_resident_units tolerance")
    g_pq, g_qp = z3.Ints("G_pq G_qp")
    base = [cap >= 0, tol >= 0, cap_of(cap, tol), g_of(g_pq, cap, tol), g_of(g_qp, cap, tol)]
    pre = [g for _, g in _gap_inv(p, q, cap, g_pq, g_qp)]
    for name, guard, after in _gap_steps(p, q, cap, tol):
        status, info = _prove([*base, *pre, *guard], _gap_inv(p, q, cap, g_pq, g_qp, after), timeout_s)
        if status != "proved":
            return status, (name, info, p, q, cap, g_pq, g_qp, tol)
    return "proved", None


def _lift_establishes(timeout_s: float) -> tuple[str, Any]:
    """A third user ``n`` becomes backlogged beside backlogged ``p`` and ``q`` (equal weights),
    with the lift floor at or below every backlogged counter: after the lift (``lift_floor``,
    ``lifted_counter``) with any lift tolerance ``0 <= t <= T`` (``VTCPolicy``'s is
    ``LIFT_TOLERANCE_TOKENS`` = 0; before issue 38 it was the band ``T``), ``J(p, n)`` and
    ``J(q, n)`` hold with ``G + t + 1`` (the newcomer starts up to ``t`` and one unit below the
    least counter), ``J(n, .)`` holds with ``G`` when the lift raised ``n``, and the floor stays at
    or below every backlogged counter."""
    z3 = _z3()
    cp, cq, cn, rp, rq, rn, cap, g, tol, lift_tol, floor = z3.Ints(
        "counter_p counter_q counter_n R_p R_q R_n max_resident_units G tolerance lift_tolerance floor")
    unit = fr.COUNTER_SCALE
    U = cap * unit
    floor1 = fr.lift_floor(floor, Min(cp, cq), True, lift_tol)
    lifted = fr.lifted_counter(cn, floor1)
    pre = [cap >= 0, tol >= 0, 0 <= lift_tol, lift_tol <= tol, g >= 2 * U + tol,
           *(And(0 <= r, r <= U) for r in (rp, rq, rn)),
           cp + rp - cq <= g, cq + rq - cp <= g, floor <= cp, floor <= cq]
    goals = [("J(p,n) after the lift", cp + rp - lifted <= g + lift_tol + 1),
             ("J(q,n) after the lift", cq + rq - lifted <= g + lift_tol + 1),
             ("J(n,p), J(n,q) when the lift raised n",
              Implies(cn < floor1, And(lifted + rn - cp <= g, lifted + rn - cq <= g))),
             ("the floor stays at or below every backlogged counter",
              And(floor1 <= cp, floor1 <= cq, floor1 <= lifted))]
    status, info = _prove(pre, goals, timeout_s)
    if status == "counterexample":
        m, bad = info
        return status, StateCounterexample("lift of a third user n beside backlogged p, q", bad, {
            "counters p, q, n": (_val(m, cp), _val(m, cq), _val(m, cn)),
            "R p, q, n": (_val(m, rp), _val(m, rq), _val(m, rn)), "floor": _val(m, floor),
            "G": _val(m, g), "tolerance": _val(m, tol), "lift tolerance": _val(m, lift_tol),
            "n after the lift": _val(m, lifted)})
    return status, info


@register("vtc_counter_gap",
          "two continuously backlogged users p, q (weights w_p, w_q): J(p,q) = c_p + R_p - c_q <= G is "
          "inductive for every tolerance T >= 0 and G >= U_p + U_q + T, U_u = N*(w_p*L_in + w_q*M)*SCALE/w_u "
          "(R_u: charge still to come from u's resident requests, <= U_u), under admission of any user within T "
          "of the least counter (vtc_eligible, with the tick's advance prompt charges), charge per iteration "
          "(charged_counter, service_units), preemption (growth, or room for a light user's admission in the same tick); "
          "hence c_p - c_q <= U_p + U_q + T (docs/fairness.md section 5); a newcomer lifted to the floor "
          "(lift_floor, lifted_counter) with a lift tolerance t <= T (VTCPolicy: LIFT_TOLERANCE_TOKENS = 0) starts "
          "within G + t + 1 of the others and the floor stays below them")
def check_vtc_counter_gap(opts: Options) -> Outcome:
    """Inductive step per step kind, per weight pair in ``GAP_WEIGHTS``; symbolic service per step."""
    bound = (f"unbounded (any counters, any service per iteration up to what is resident, any resident cap "
             f"N*(w_p*L_in+w_q*M)); weight pairs {list(GAP_WEIGHTS)}")
    for w in GAP_WEIGHTS:
        status, info = _gap_step_proof(w, lambda cap, tol: True,
                                       lambda g, cap, tol, w=w: g >= vtc_counter_gap_bound_units(cap, *w) + tol,
                                       opts.timeout_s)
        if status == "counterexample":
            name, (m, bad), p, q, cap, g_pq, g_qp, tol = info
            values = {"weights (p, q)": w, "max_resident_units": _val(m, cap), "tolerance": _val(m, tol),
                      "G_pq, G_qp": (_val(m, g_pq), _val(m, g_qp))}
            for u in (p, q):
                values[f"user {u.tag}: counter, committed units, advance"] = (
                    _val(m, u.c), _val(m, u.rho), _val(m, u.a))
            values["step's choices"] = ", ".join(f"{d.name()}={m[d]}" for d in m.decls()
                                                 if d.name().startswith(("admit_", "served_", "preempted_")))
            return Outcome("counterexample", bound, counterexample=StateCounterexample(name, bad, values))
        if status != "proved":
            return Outcome("unknown", bound, f"weights {w}: {status} {info[0] if info else ''}")
    status, info = _lift_establishes(opts.timeout_s)
    if status == "counterexample":
        return Outcome("counterexample", bound, counterexample=info)
    if status != "proved":
        return Outcome("unknown", bound, f"lift step: {status}")
    # The paper's bound, 2*max(w_p*L_in, w_q*M) with M the longest output, as the invariant's G:
    # not inductive once a user holds two resident requests (continuous batching).
    paper = fr.vtc_service_gap_bound(fr.PROMPT_PRICE, EXAMPLE_MAX_PROMPT_TOKENS, fr.OUTPUT_PRICE,
                                     EXAMPLE_MAX_OUTPUT_TOKENS)
    paper_cap = max_resident_units(2, EXAMPLE_MAX_PROMPT_TOKENS, EXAMPLE_MAX_OUTPUT_TOKENS)
    st_paper, _ = _gap_step_proof((1, 1), lambda cap, tol: And(cap == paper_cap, tol == 0),
                                  lambda g, cap, tol: g == paper * fr.COUNTER_SCALE, opts.timeout_s)
    ours = [(n, max_resident_units(n, EXAMPLE_MAX_PROMPT_TOKENS, EXAMPLE_MAX_OUTPUT_TOKENS) * 2) for n in (1, 2, 30)]
    detail = ("proved for every weight pair and every step; lift step proved. Weights 1,1, L_in=199, M=99: "
              f"paper 2*max(w_p*L_in, w_q*M) = {paper} weighted tokens; derived U_p+U_q = 2*N*(w_p*L_in+w_q*M) = "
              + ", ".join(f"{v} (N={n})" for n, v in ours)
              + f"; the paper's {paper} as G with N=2 resident requests per user: {st_paper} (not inductive)")
    return Outcome("proved", bound, detail)


# ---------------------------------------------------------------- 2. the lift


@register("vtc_lift",
          "with the floor at or below every backlogged counter and >= 0: after a lift (lift_floor, lifted_counter) "
          "the newcomer is >= the least other backlogged counter - T - 1 (idle time banks at most T and one unit; T "
          "the lift's tolerance, VTCPolicy's LIFT_TOLERANCE_TOKENS = 0), >= its own (never decreases), <= max(own, "
          "least) (no penalty beyond the least counter), <= max(own, floor, least - T - 1) (it starts T and a unit "
          "below the least counter unless already higher), and the floor "
          "never decreases and stays at or below every backlogged counter; alone: max(own, floor); an idle user at "
          "or below the floor (forgettable) returns to the same counter as one read as 0 (forgetting is exact); "
          "once no user is active, idle_floor makes every counter forgettable")
def check_vtc_lift(opts: Options) -> Outcome:
    """Up to ``n`` other users, each backlogged or not, with any counters; then any later floor."""
    z3 = _z3()
    n = 4
    own, tol, floor, later, biggest = z3.Ints("own tolerance floor later_floor largest_counter")
    cs = z3.Ints(" ".join(f"counter_{i}" for i in range(n)))
    bl = [z3.Bool(f"backlogged_{i}") for i in range(n)]
    m = z3.Int("min_backlogged")  # what the policy passes: the least counter among backlogged users
    anyb = Or(*bl)
    pre = [own >= 0, tol >= 0, floor >= 0, *(Implies(b, And(m <= c, floor <= c)) for b, c in zip(bl, cs)),
           Implies(anyb, Or(*(And(b, m == c) for b, c in zip(bl, cs))))]
    floor1 = fr.lift_floor(floor, m, anyb, tol)
    lifted = fr.lifted_counter(own, floor1)
    goals = [("banks at most the tolerance", Implies(anyb, lifted >= m - tol - 1)),
             ("never decreases", lifted >= own),
             ("no penalty beyond the least counter", Implies(anyb, lifted <= If(own >= m, own, m))),
             ("below the band unless the floor or its own counter is higher",
              Implies(anyb, lifted <= Max(own, Max(floor, m - tol - 1)))),
             ("the floor never decreases", floor1 >= floor),
             ("the floor stays at or below every backlogged counter",
              And(floor1 <= lifted, *(Implies(b, floor1 <= c) for b, c in zip(bl, cs)))),
             ("alone: max(own, floor)", Implies(Not(anyb), lifted == If(own >= floor, own, floor))),
             ("forgetting is exact: a forgettable counter returns as one read as 0",
              Implies(And(fr.forgettable(own, floor), later >= floor),
                      fr.lifted_counter(own, later) == fr.lifted_counter(0, later))),
             ("once nothing is active (idle_floor over the largest counter) every counter is forgettable, "
              "and the floor never decreases",
              And(fr.idle_floor(floor, biggest) >= floor,
                  *(Implies(c <= biggest, fr.forgettable(c, fr.idle_floor(floor, biggest))) for c in (own, *cs))))]
    status, info = _prove(pre, goals, opts.timeout_s)
    bound = f"unbounded counters, up to {n} other users"

    def cex(mo: Any, bad: list[str]) -> StateCounterexample:
        values = {"own": _val(mo, own), "floor": _val(mo, floor),
                  "others (counter, backlogged)": [(_val(mo, c), _val(mo, b)) for c, b in zip(cs, bl)],
                  "min_backlogged": _val(mo, m), "tolerance": _val(mo, tol), "lifted": _val(mo, lifted)}
        return StateCounterexample("lift", bad, values)
    return _outcome(status, info, bound, cex)


# ---------------------------------------------------------------- 3. no starvation: aging and the reservation


def _aging_step() -> tuple[list, list[tuple[str, Any]]]:
    """Phase A, the blocked head's count (``step.apply``): in a tick where ``b`` is the plan's
    blocked head (``counted``) its ``blocked_ticks`` grows by one, whether or not the hold
    (``hold_elapsed``, any ``W``) lets later candidates pass it; the reservation goes to it when
    ``reserved_after`` holds and no one holds the reservation after the tick's admissions."""
    z3 = _z3()
    T, W, b = z3.Ints("aging_T hold_W blocked_ticks")
    counted, held = z3.Bools("counted held_by_another")
    passed = fr.hold_elapsed(b, W)  # later candidates pass b or wait: its count is the same
    b1 = b + If(counted, 1, 0)
    reserved = And(counted, Not(held), fr.reserved_after(b1, T))
    rank, rank1 = Max(T - b, 0), Max(T - b1, 0)
    pre = [T >= 1, W >= 0, b >= 0, Or(passed, Not(passed))]
    goals = [("a counted tick brings the reservation one tick nearer (ranking max(T - blocked, 0))",
              Implies(And(counted, rank >= 1), rank1 == rank - 1)),
             ("after T counted ticks, at the first with no reservation held, it holds the reservation",
              Implies(And(counted, Not(held), rank <= 1), reserved)),
             ("not before T counted ticks", Implies(b1 < T, Not(reserved)))]
    return pre, goals


def _holder_step() -> tuple[list, list[tuple[str, Any]], dict[str, Any]]:
    """Phases P and D: one tick of a waiting reservation holder ``h``, any ``Q``, ``K``, ``L``,
    slot cap and cache (``docs/fairness.md`` section 4).

    State: the tick ``t``; whether ``State.protected`` is set (``hp``) and its admission tick
    ``ap``; the residents ``n`` and ``D``, the most iterations any of them still needs (``0 <= D
    <= L``, ``D = 0`` iff ``n = 0``); the streak of isolated ticks; the free blocks, the blocks of
    resident requests that are not pinned and of those that are. The tick: while the protected
    request is ``protected`` (phase P) ``h`` is an ordinary candidate (admitted or not, the
    adversary's choice) and the residents change in any way the assumptions allow; otherwise
    (phase D) ``h`` is tried first in a tick without a growth preemption below the slot cap, and
    admitted if its blocks fit (``can_admit``, no headroom) or fit once every resident request is
    preempted (all were admitted before the tick and none is protected; the pinned ones are not
    victims, ``may_preempt``): so no other request is admitted, the residents only leave, and each
    runs in a tick that is not isolated (the budget never binds). Isolated ticks within
    ``sit_out_allowed``, ``next_streak``.
    """
    z3 = _z3()
    Q, K, L, S, cap, need = z3.Ints("quantum_Q sit_out_K work_L max_running cap_blocks need_h")
    t, ap, D, n, s, free, used, pin = z3.Ints("tick protected_admit_tick work_left residents streak free_blocks "
                                              "nonpinned_blocks pinned_blocks")
    D1, n1, s1, free1, used1, pin1 = z3.Ints("work_left' residents' streak' free_blocks' nonpinned_blocks' "
                                             "pinned_blocks'")
    hp, hp1, ordinary, growth, iso = z3.Bools("protected_set protected_set' admitted_as_ordinary "
                                              "growth_preempted isolated")
    t1 = t + 1
    params = [Q >= 1, K >= 0, L >= 1, S >= 1, cap >= 1, need >= 1, need <= cap]

    def env(D: Any, n: Any, free: Any, used: Any, pin: Any, hp: Any, ap: Any, t: Any) -> list:
        """The code's invariants the proof assumes of every state (``docs/fairness.md`` section 4)."""
        return [0 <= D, D <= L, n >= 0, n <= S, (n == 0) == (D == 0), Implies(hp, And(n >= 1, ap <= t - 1)),
                free >= 0, used >= 0, pin >= 0, free + used + pin == cap, need + pin <= cap]

    def rank(t: Any, s: Any, D: Any, hp: Any) -> Any:
        prot = And(hp, fr.protected(True, ap, t, Q))
        return If(prot, Q - (t - ap) + (K + 1) * L + 1, Max((K + 1) * D - s, 0) + 1)

    prot = And(hp, fr.protected(True, ap, t, Q))
    tried = And(Not(prot), Not(growth), n < S)  # the holder is the first candidate
    fits = Or(fr.can_admit(free, need, 0), rules.can_allocate(free + used, need))
    admitted = Or(And(prot, ordinary), And(tried, fits))
    pre = [*params, *env(D, n, free, used, pin, hp, ap, t), 0 <= s, s <= K,
           Implies(iso, fr.sit_out_allowed(s, K)), s1 == fr.next_streak(s, iso),
           Implies(growth, n >= 1),  # a growth preemption has a victim among the residents
           Implies(hp1, hp),  # only h becomes protected (at its admission); the protected one only leaves
           *env(D1, n1, free1, used1, pin1, hp1, ap, t1),
           # phase D: no admission but h's; residents only leave (a growth victim leaves), pinned ones too,
           # and in a tick that is not isolated each runs one iteration (D = 0: none left)
           Implies(Not(prot), And(n1 <= n - If(growth, 1, 0), pin1 <= pin,
                                  D1 <= D - If(iso, 0, 1) + If(D == 0, 1, 0), D1 <= D))]
    v, v1 = rank(t, s, D, hp), rank(t1, s1, D1, hp1)
    goals = [("the ranking is at most holder_wait_bound(Q, K, L) = Q + (K+1) L",
              v <= fr.holder_wait_bound(Q, K, L)),
             ("while a request is protected, its protection ends within Q ticks",
              Implies(prot, And(Q - (t - ap) >= 1, Q - (t - ap) <= Q))),
             ("the ranking is positive", v >= 1),
             ("h is admitted, or the ranking drops by at least one", Or(admitted, v1 <= v - 1)),
             ("0 <= streak' <= K", And(s1 >= 0, s1 <= K))]
    named = {"Q": Q, "K": K, "L": L, "max_running": S, "cap": cap, "need_h": need, "tick": t,
             "protected set, admitted at": (hp, ap), "residents, work left": (n, D), "streak": s,
             "free, non-pinned, pinned blocks": (free, used, pin), "growth preempted": growth, "isolated": iso,
             "after: residents, work left, streak, protected set": (n1, D1, s1, hp1), "admitted": admitted,
             "ranking before, after": (v, v1)}
    return pre, goals, named


@register("no_starvation_holder",
          "the default policy's no-starvation bound, for any T, W, Q >= 1, K, L, slot cap and cache: a blocked head "
          "(the first candidate getting no room) is granted the reservation at the end of its T-th counted tick "
          "(a tick it is the blocked head; the hold W lets others pass but does not stop its count), or of its first "
          "counted tick after that with no reservation held (reserved_after; ranking max(T - blocked_ticks, 0)); "
          "a reservation holder is admitted within holder_wait_bound(Q, K, L) = Q + (K+1) L ticks after the tick "
          "it took it (ranking: Q - (t - a_p) + (K+1) L + 1 while a request is protected, else "
          "max((K+1) D - streak, 0) + 1, D the most iterations a resident still needs): at most Q ticks behind the "
          "protected request (protected), then tried first, with room from every resident admitted before the "
          "tick that is not pinned and not admitted as a holder (can_admit, can_allocate, may_preempt, not_a_holder), "
          "held back only by the slot cap or a growth preemption, neither of which admits another request; "
          "isolated ticks sit_out_allowed / next_streak. Assumptions: the token budget never binds, a resident needs <= L more iterations, "
          "need_h + the blocks of residents pinned or admitted as a holder <= cap (not implied at the defaults), "
          "no prefix caching, tick() keeps being called")
def check_no_starvation_holder(opts: Options) -> Outcome:
    """Two inductive steps over z3 integers (nonlinear: ``(K+1) * D``): the aging count, the holder's tick."""
    bound = "unbounded: any T >= 1, W >= 0, Q >= 1, K >= 0, L >= 1, max_running >= 1, cap, need_h <= cap; any tick"
    pre, goals = _aging_step()
    status, info = _prove(pre, goals, opts.timeout_s)
    if status == "counterexample":
        m, bad = info
        return Outcome("counterexample", bound, counterexample=StateCounterexample(
            "a tick of the blocked head", bad, {d.name(): m[d] for d in m.decls()}))
    if status != "proved":
        return Outcome("unknown", bound, f"aging step: {status} {info or ''}")
    pre, goals, named = _holder_step()
    status, info = _prove(pre, goals, opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> StateCounterexample:
        values = {k: tuple(_val(m, x) for x in v) if isinstance(v, tuple) else _val(m, v) for k, v in named.items()}
        return StateCounterexample("a tick of the reservation holder", bad, values)
    out = _outcome(status, info, bound, cex)
    if out.status == "proved":
        out.detail = ("aging step and holder step unsat; assumptions sat. At the defaults (T=32, W=8, Q=128, K=8): "
                      f"holder_wait_bound = 128 + 9 L ticks, e.g. {fr.holder_wait_bound(128, 8, 64)} for L = 64; the "
                      "stateful test asserts one tick more")
    return out


# ---------------------------------------------------------------- 3'. anti-thrash


@register("anti_thrash",
          "for any Q >= 1, any ticks and preemption counts: a request admitted at tick a is no room-by-pressure "
          "victim at any tick t < a + Q (quantum_elapsed), and may be one from a + Q on; no request is a victim in "
          "the tick it is admitted (may_preempt); the protected holder admitted at a is protected at every tick "
          "a <= t < a + Q, so no victim of any preemption then (the victims exclude it), and not from a + Q on; a "
          "new holder becomes protected only when the previous protection has ended (at most one at a time); two "
          "room-by-pressure preemptions of one request are at least Q + 1 ticks apart; a request admitted as a holder is "
          "no victim of a later holder's room nor of room by pressure (not_a_holder); a request not yet past its "
          "prompt high-water mark since its admission is no victim of room by pressure nor of a light user's room, "
          "and one past it at tick p is no room-by-pressure victim before p + Q (past_high_water)")
def check_anti_thrash(opts: Options) -> Outcome:
    """Rule-level lemmas over z3 integers (``quantum_elapsed``, ``protected``, ``may_preempt``)."""
    z3 = _z3()
    Q, a, t, t1, a2, t2, npre, maxp = z3.Ints("quantum_Q admit_tick tick tick_1 admit_tick_2 tick_2 "
                                              "num_preemptions max_preemptions")
    p, p1, p2 = z3.Ints("progress_tick progress_tick_1 progress_tick_2")  # any ticks: the rule relates them

    def pressure_victim(adm: Any, tick: Any, prog: Any = p) -> Any:
        """``step._room``'s candidates for another user's room: may be preempted, admitted before the
        tick, not pinned, not admitted as a holder, past its high-water mark Q iterations."""
        return And(fr.may_preempt(npre, maxp, adm, tick), Not(fr.pinned(npre, maxp)), fr.not_a_holder(was_holder),
                   fr.past_high_water(prog, adm), fr.quantum_elapsed(prog, tick, Q))

    def light_victim(adm: Any, tick: Any) -> Any:
        """``step._room``'s candidates for a light user's room (the share test aside): may be
        preempted, not pinned, past its high-water mark."""
        return And(fr.may_preempt(npre, maxp, adm, tick), Not(fr.pinned(npre, maxp)), fr.past_high_water(p, adm))

    was_holder = z3.Bool("admitted_as_holder")

    def holder_victim(adm: Any, tick: Any) -> Any:
        """``step._room``'s candidates for the reservation holder's room (none protected: the holder
        is admitted only when no protection holds)."""
        return And(fr.may_preempt(npre, maxp, adm, tick), Not(fr.pinned(npre, maxp)), fr.not_a_holder(was_holder))

    pre = [Q >= 1, npre >= 0, maxp >= 0]
    goals = [("no room-by-pressure victim before a + Q", Implies(t < a + Q, Not(pressure_victim(a, t)))),
             ("resident Q iterations: quantum_elapsed from a + Q on", Implies(t >= a + Q, fr.quantum_elapsed(a, t, Q))),
             ("never a victim in its admission tick", Not(fr.may_preempt(npre, maxp, t, t))),
             ("the holder is protected from a to a + Q - 1",
              Implies(And(a <= t, t < a + Q), fr.protected(True, a, t, Q))),
             ("protection ends at a + Q", Implies(t >= a + Q, Not(fr.protected(True, a, t, Q)))),
             ("only the holder is protected", Not(fr.protected(False, a, t, Q))),
             ("a new protection starts only after the previous one ended",
              Implies(And(a <= t, Not(fr.protected(True, a, t, Q))), t >= a + Q)),
             ("two room-by-pressure preemptions of one request are > Q ticks apart",
              Implies(And(pressure_victim(a, t1, p1), a2 >= t1 + 1, pressure_victim(a2, t2, p2)), t2 - t1 >= Q + 1)),
             ("not past its high-water mark: no victim of room by pressure nor of a light user's room",
              Implies(p < a, Not(Or(pressure_victim(a, t), light_victim(a, t))))),
             ("past it at tick p: no room-by-pressure victim before p + Q",
              Implies(t < p + Q, Not(pressure_victim(a, t)))),
             ("a request admitted as a holder is no victim of a later holder's room nor of room by pressure",
              Implies(was_holder, Not(Or(holder_victim(a, t), pressure_victim(a, t)))))]
    status, info = _prove(pre, goals, opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> StateCounterexample:
        return StateCounterexample("rule lemmas", bad, {d.name(): m[d] for d in m.decls()})
    return _outcome(status, info, "unbounded: any Q >= 1, any admission and preemption ticks, any preemption counts",
                    cex)


# ---------------------------------------------------------------- 4. the sit-out bound


@register("sit_out_bound",
          "isolation never runs more than K consecutive isolated iterations, so a decode never sits out "
          "more than K in a row: 0 <= streak <= K is inductive under sit_out_allowed / next_streak (any K), "
          "and no K+1 consecutive isolated iterations exist from any reachable streak")
def check_sit_out_bound(opts: Options) -> Outcome:
    z3 = _z3()
    k, s = z3.Ints("K streak")
    iso = z3.Bool("isolated")
    s1 = fr.next_streak(s, iso)
    status, info = _prove([k >= 0, s >= 0, s <= k, Implies(iso, fr.sit_out_allowed(s, k))],
                          [("0 <= streak' <= K", And(s1 >= 0, s1 <= k)),
                           ("streak counts consecutive isolated iterations", s1 == If(iso, s + 1, 0))],
                          opts.timeout_s)
    bound = f"inductive step for any K >= 0; runs of K+1 iterations for K in {list(SIT_OUT_KS)}"
    if status == "counterexample":
        m, bad = info
        return Outcome("counterexample", bound, counterexample=StateCounterexample(
            "one iteration", bad,
            {"K": _val(m, k), "streak": _val(m, s), "isolated": _val(m, iso), "streak'": _val(m, s1)}))
    if status != "proved":
        return Outcome("unknown", bound, f"{status} {info or ''}")
    for K in SIT_OUT_KS:
        st = z3.Int("streak_0")
        isos = [z3.Bool(f"isolated_{t}") for t in range(K + 1)]
        asm = [st >= 0, st <= K]
        cur: Any = st
        for t in range(K + 1):
            asm.append(Implies(isos[t], fr.sit_out_allowed(cur, K)))
            nxt = z3.Int(f"streak_{t + 1}")
            asm.append(nxt == fr.next_streak(cur, isos[t]))
            cur = nxt
        status, info = _prove(asm, [(f"not {K + 1} isolated in a row", Not(And(*isos)))], opts.timeout_s, split=False)
        if status == "counterexample":
            m, bad = info
            return Outcome("counterexample", bound, counterexample=StateCounterexample(
                f"{K + 1} iterations, K={K}", bad, {"streak_0": _val(m, st), "isolated": [_val(m, x) for x in isos]}))
        if status != "proved":
            return Outcome("unknown", bound, f"K={K}: {status} {info or ''}")
    return Outcome("proved", bound, "unsat; assumptions sat")


# ---------------------------------------------------------------- 1''. the counter gap, every admission path


def _paths_steps(p: _User, q: _User, cap: Any, tol: Any, one: Any, xs: dict) -> list[tuple[str, list, list]]:
    """The gap proof's steps with every admission path the default takes (``step._admission``):
    the band pick (``vtc_eligible`` at ``band_tolerance``: ``tol`` for equal weights, 0 otherwise),
    a light user's pick (``light_first`` at the same tolerance against the other user's local
    counter), the reservation holder and a resume-first trial (any counters; at most ``one``
    request's worth, the charge added to the user's out-of-order account ``xs[user]``, counter
    units), the service and preemption steps of ``_gap_steps``. Candidates admitted past a blocked
    head after the hold are band or light picks (the order is the same)."""
    z3 = _z3()
    band = fr.band_tolerance(tol, p.w == q.w)
    steps = []
    for who, other in ((p, q), (q, p)):
        for kind in ("band", "light", "holder or resume-first trial"):
            x_in, x_out = z3.Ints(f"admit_prompt_{who.tag}_{kind[:5]} admit_output_{who.tag}_{kind[:5]}")
            units = fr.service_units(x_in, x_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
            local = who.c + who.a
            guard = [x_in >= 0, x_out >= 0, who.rho + units <= cap]
            after = [(who.rho, who.rho + units), (who.nu, who.nu + units)]
            if kind == "band":
                guard.append(fr.vtc_eligible(local, Min(local, other.c + other.a), band))
            elif kind == "light":
                guard.append(fr.light_first(local, other.c + other.a, band))
            else:
                guard.append(units <= one)
                after.append((xs[who.tag], xs[who.tag] + units * (fr.COUNTER_SCALE // who.w)))
            if kind != "holder or resume-first trial":  # the order's picks charge the local counter
                after.append((who.a, fr.charged_counter(local, fr.PROMPT_PRICE * x_in, who.w) - who.c))
            steps.append((f"{kind} admission of a request of {who.tag}", guard, after))
    return steps + _gap_steps(p, q, cap, tol)[2:]


def _paths_proof(weights: tuple[int, int], timeout_s: float) -> tuple[str, Any]:
    """Every step keeps ``J_X(p,q) = c_p + R_p - c_q - X_p <= G`` (and for q), ``X >= 0`` and
    ``_gap_inv``'s ranges; ``G >= U_p + U_q + T``."""
    z3 = _z3()
    p, q = _User("p", weights[0]), _User("q", weights[1])
    cap, tol, one, g = z3.Ints("max_resident_units tolerance one_request_units G")
    xs = {"p": z3.Int("out_of_order_p"), "q": z3.Int("out_of_order_q")}
    base = [cap >= 0, tol >= 0, one >= 0, one <= cap, g >= vtc_counter_gap_bound_units(cap, *weights) + tol]

    def inv(sub: list) -> list[tuple[str, Any]]:
        def v(x: Any) -> Any:
            return next((val for var, val in sub if z3.eq(var, x)), x)
        out = [(name, f) for name, f in _gap_inv(p, q, cap, g, g, sub) if not name.startswith("J(")]
        out += [(f"X_{u.tag} >= 0", v(xs[u.tag]) >= 0) for u in (p, q)]
        return out + [("J_X(p,q): c_p + R_p - c_q - X_p <= G",
                       p.committed(v(p.c), v(p.rho)) - v(q.c) - v(xs["p"]) <= g),
                      ("J_X(q,p): c_q + R_q - c_p - X_q <= G",
                       q.committed(v(q.c), v(q.rho)) - v(p.c) - v(xs["q"]) <= g)]
    pre = [goal for _, goal in inv([])]
    for name, guard, after in _paths_steps(p, q, cap, tol, one, xs):
        status, info = _prove([*base, *pre, *guard], inv(after), timeout_s)
        if status != "proved":
            return status, (name, info, p, q, cap, g, tol, xs)
    return "proved", None


@register("vtc_counter_gap_paths",
          "two continuously backlogged users p, q: with X_u the charge (counter units) of u's requests admitted out "
          "of counter order (the reservation holder, resume-first trials; each at most one request's worth m), "
          "J_X(p,q) = c_p + R_p - c_q - X_p <= G is inductive for every tolerance T >= 0 and G >= U_p + U_q + T under "
          "every admission path the default takes: the band pick (vtc_eligible at band_tolerance: T for equal "
          "weights, 0 otherwise), a light user's pick (light_first at the same tolerance), the holder and trials "
          "(any counters), candidates past a blocked head (band or light picks), service (charged_counter, "
          "service_units) and preemption (growth, room for any admission); hence c_p - c_q <= U_p + U_q + T + X_p, "
          "X_p <= (p's out-of-order admissions) * m * SCALE / w_p")
def check_vtc_counter_gap_paths(opts: Options) -> Outcome:
    """Inductive step per step kind, per weight pair in ``GAP_WEIGHTS``; symbolic service per step."""
    bound = (f"unbounded (any counters, tolerance, service per iteration up to what is resident, resident cap "
             f"N*(w_p*L_in+w_q*M), request worth m <= it); weight pairs {list(GAP_WEIGHTS)}")
    for w in GAP_WEIGHTS:
        status, info = _paths_proof(w, opts.timeout_s)
        if status == "counterexample":
            name, (m, bad), p, q, cap, g, tol, xs = info
            values = {"weights (p, q)": w, "max_resident_units": _val(m, cap), "tolerance": _val(m, tol),
                      "G": _val(m, g)}
            for u in (p, q):
                values[f"user {u.tag}: counter, committed units, advance, out of order"] = (
                    _val(m, u.c), _val(m, u.rho), _val(m, u.a), _val(m, xs[u.tag]))
            values["step's choices"] = ", ".join(f"{d.name()}={m[d]}" for d in m.decls()
                                                 if d.name().startswith(("admit_", "served_", "preempted_")))
            return Outcome("counterexample", bound, counterexample=StateCounterexample(name, bad, values))
        if status != "proved":
            return Outcome("unknown", bound, f"weights {w}: {status} {info[0] if info else ''}")
    return Outcome("proved", bound, "proved for every weight pair and every step (band, light, holder or trial "
                                    "admission of either user, service, preemption)")


# ---------------------------------------------------------------- 1'. the counter gap, bounded runs

#: The bounded runs of the VTC pick: depth (ticks), resident slots per user, admissions per
#: tick, longest prompt ``L_in`` and output ``M`` (tokens).
GAP_BMC_DEPTH, GAP_BMC_SLOTS, GAP_BMC_ADMITS, GAP_BMC_MAX_PROMPT, GAP_BMC_MAX_OUTPUT = 6, 2, 2, 3, 2
#: The bounded runs: (weights, tolerance in weighted tokens). Tolerance 0 is the VTC paper's pick;
#: 2 weighted tokens is under one iteration's service, so both users are often eligible at once.
GAP_BMC_RUNS: tuple[tuple[tuple[int, int], int], ...] = (((1, 1), 0), ((2, 1), 2))


def _gap_run(weights: tuple[int, int], depth: int, slots: int, admits: int, max_prompt: int,
             max_output: int, tolerance_tokens: int = 0) -> tuple[list, list, Any]:
    """Unroll ``depth`` ticks of two backlogged users from equal counters and nothing resident.

    Each tick: up to ``admits`` admissions, each of either user within ``tolerance_tokens`` of
    the least local counter (``vtc_eligible``; when both are, either: arrival order is the
    adversary's; the tick's advance prompt charges with ``charged_counter``), stopping
    when that user's request does not fit (no free slot, or the adversary's KV/budget stop);
    then every resident request receives any service up to what it still needs and at most one
    iteration's worth (its prompt as one chunk plus one output token), charged with
    ``service_units`` / ``charged_counter``. Returns (assumptions, the counter terms per tick
    ``[(c_p, c_q)]``, the derived bound plus the tolerance, counter units).
    """
    z3 = _z3()
    tol = tolerance_tokens * fr.COUNTER_SCALE
    users = (0, 1)
    c = [z3.IntVal(0), z3.IntVal(0)]
    rem = [[z3.IntVal(0)] * slots for _ in users]  # weighted tokens still to serve, 0: empty slot
    asm: list = []
    counters = []
    # one iteration serves a request at most its whole (short) prompt as one chunk and one output token
    per_iteration = fr.service_units(max_prompt, 1, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
    for t in range(depth):
        local = list(c)
        stopped: Any = z3.BoolVal(False)
        for i in range(admits):
            tie, stop = z3.Bools(f"tie_{t}_{i} stop_{t}_{i}")
            x_in, x_out = z3.Ints(f"prompt_{t}_{i} output_{t}_{i}")
            asm += [x_in >= 0, x_in <= max_prompt, x_out >= 1, x_out <= max_output]
            least = Min(local[0], local[1])
            elig_p, elig_q = fr.vtc_eligible(local[0], least, tol), fr.vtc_eligible(local[1], least, tol)
            pick_p = And(elig_p, Or(Not(elig_q), tie))
            units = fr.service_units(x_in, x_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
            new_rem, new_local = [], []
            admitted_any: Any = z3.BoolVal(False)
            for u in users:
                chosen = pick_p if u == 0 else Not(pick_p)
                placed = z3.BoolVal(False)
                row = []
                for j in range(slots):
                    here = And(Not(stopped), Not(stop), chosen, Not(placed), rem[u][j] == 0)
                    row.append(If(here, units, rem[u][j]))
                    placed = Or(placed, here)
                new_rem.append(row)
                advanced = fr.charged_counter(local[u], fr.PROMPT_PRICE * x_in, weights[u])
                new_local.append(If(placed, advanced, local[u]))
                admitted_any = Or(admitted_any, placed)
            rem, local = new_rem, new_local
            stopped = Or(stopped, Not(admitted_any))  # the least user's request did not fit: stop
        for u in users:
            served = []
            for j in range(slots):
                s = z3.Int(f"served_{u}_{j}_{t}")
                asm += [s >= 0, s <= rem[u][j], s <= per_iteration]
                served.append(s)
            c[u] = fr.charged_counter(c[u], Sum(served), weights[u])
            rem[u] = [r - s for r, s in zip(rem[u], served)]
        cu = z3.Ints(f"counter_p_{t + 1} counter_q_{t + 1}")
        asm += [cu[0] == c[0], cu[1] == c[1]]
        c = list(cu)
        rem = [[_name(rem[u][j], f"rem_{u}_{j}_{t + 1}", asm) for j in range(slots)] for u in users]
        counters.append((c[0], c[1]))
    cap = max_resident_units(slots, max_prompt, max_output)
    return asm, counters, vtc_counter_gap_bound_units(cap, *weights) + tol


def _name(term: Any, name: str, asm: list) -> Any:
    v = _z3().Int(name)
    asm.append(v == term)
    return v


@register("vtc_counter_gap_bmc",
          "from equal counters and nothing resident, every state of two backlogged users reachable within the "
          "depth has |c_p - c_q| <= U_p + U_q + T (the derived bound with the tolerance T); the paper's "
          "2*max(w_p*L_in, w_q*M) is exceeded in some reachable state even with T = 0 (printed)")
def check_vtc_counter_gap_bmc(opts: Options) -> Outcome:
    """Bounded model checking of ``_gap_run`` for each (weights, tolerance) in ``GAP_BMC_RUNS``."""
    d, n, a, lin, mo = GAP_BMC_DEPTH, GAP_BMC_SLOTS, GAP_BMC_ADMITS, GAP_BMC_MAX_PROMPT, GAP_BMC_MAX_OUTPUT
    bound = (f"depth {d} ticks, {n} resident slots per user, {a} admissions per tick, prompts <= {lin}, "
             f"outputs 1..{mo} tokens, per iteration any service up to a prompt chunk and one output token; "
             f"(weights, tolerance in weighted tokens) {list(GAP_BMC_RUNS)}")
    paper_hit = ""
    for w, tol in GAP_BMC_RUNS:
        asm, counters, g = _gap_run(w, d, n, a, lin, mo, tol)
        goals = [(f"|c_p - c_q| <= {g} after tick {t}", And(cp - cq <= g, cq - cp <= g))
                 for t, (cp, cq) in enumerate(counters)]
        status, info = _prove(asm, goals, opts.timeout_s, split=False)
        if status == "counterexample":
            m, bad = info
            values = {"weights": w, "tolerance": tol} | {f"counters after tick {t}": (_val(m, cp), _val(m, cq))
                                       for t, (cp, cq) in enumerate(counters)}
            return Outcome("counterexample", bound,
                           counterexample=StateCounterexample(f"run of {d} ticks", bad[:1], values))
        if status != "proved":
            return Outcome("unknown", bound, f"weights {w}, tolerance {tol}: {status} {info or ''}")
        if w == (1, 1) and tol == 0:
            paper = fr.vtc_service_gap_bound(fr.PROMPT_PRICE, lin, fr.OUTPUT_PRICE, mo) * fr.COUNTER_SCALE
            st, info = _prove(asm, [("paper", And(*(cp - cq <= paper for cp, cq in counters)))], opts.timeout_s,
                              split=False)
            if st == "counterexample":
                m, _ = info
                worst = max(_val(m, cp) - _val(m, cq) for cp, cq in counters) // fr.COUNTER_SCALE
                paper_hit = (f"; weights 1,1: the paper's {paper // fr.COUNTER_SCALE} weighted tokens is exceeded "
                             f"(a reachable gap of {worst}), derived bound {g // fr.COUNTER_SCALE}")
            else:
                paper_hit = f"; weights 1,1: the paper's bound held within the depth ({st})"
    return Outcome("proved", bound, "unsat; assumptions sat" + paper_hit)


# ---------------------------------------------------------------- 5. the counter gap across replicas


def _replica_gap_steps(p: _User, q: _User, cap: Any, tol: Any, stale: Any,
                       upper: bool = True) -> list[tuple[str, list, list]]:
    """The steps of the cross-replica gap proof (``docs/scale-out.md`` section 2).

    ``p.c``, ``q.c`` are the *true* global counters ``c_u = S_u + L_u`` (service on all replicas
    plus lift level) and ``rho`` the charge still to come from the user's resident requests on all
    replicas. Each step acts on one replica, whose views ``v`` of the two counters are whatever
    the sandwich ``c - D <= v <= c`` allows (``stale`` is ``D``, counter units): every sync, and
    every other replica's service, moves views only within it. ``upper=False`` drops the upper
    half, ``v <= c``: a replica whose view of a user includes a lift it never published.
    """
    z3 = _z3()

    def views(tag: str) -> tuple[Any, Any, list]:
        vp, vq = z3.Ints(f"view_p_{tag} view_q_{tag}")
        sandwich = [p.c - stale <= vp, q.c - stale <= vq]
        if upper:
            sandwich += [vp <= p.c, vq <= q.c]
        return vp, vq, sandwich

    steps = []
    for who, other, w_tag in ((p, q, "p"), (q, p, "q")):
        vp, vq, sandwich = views(f"admit_{w_tag}")
        v_who, v_other = (vp, vq) if who is p else (vq, vp)
        a_who, a_other = z3.Ints(f"advance_{w_tag}_{w_tag} advance_{w_tag}_other")
        x_in, x_out = z3.Ints(f"admit_prompt_{who.tag} admit_output_{who.tag}")
        units = fr.service_units(x_in, x_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
        local, local_other = v_who + a_who, v_other + a_other  # the replica's local copies this tick
        guard = [*sandwich, x_in >= 0, x_out >= 0, who.rho + units <= cap,
                 0 <= a_who, a_who <= who.rho * (fr.COUNTER_SCALE // who.w),
                 0 <= a_other, a_other <= other.rho * (fr.COUNTER_SCALE // other.w),
                 # the other user is backlogged on this replica: admission within tol of the least local counter
                 fr.vtc_eligible(local, Min(local, local_other), tol)]
        steps.append((f"admission of a request of {who.tag} on a replica where {other.tag} is backlogged",
                      guard, [(who.rho, who.rho + units)]))
        vp, vq, sandwich = views(f"lift_{w_tag}")
        v_who, v_other = (vp, vq) if who is p else (vq, vp)
        least = z3.Int(f"least_view_{w_tag}")  # the least view among the others backlogged there
        floor = z3.Int(f"floor_{w_tag}")  # the replica's lift floor: at or below its backlogged views
        lifted = fr.lifted_counter(v_who, fr.lift_floor(floor, least, True, tol))
        steps.append((f"lift of {who.tag} on a replica where {other.tag} is backlogged",
                      [*sandwich, least >= 0, least <= v_other, floor <= least],
                      [(who.c, who.c + (lifted - v_who))]))
    sp_in, sp_out, sq_in, sq_out = z3.Ints("served_prompt_p served_output_p served_prompt_q served_output_q")
    up = fr.service_units(sp_in, sp_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
    uq = fr.service_units(sq_in, sq_out, fr.PROMPT_PRICE, fr.OUTPUT_PRICE)
    steps.append(("service on any replicas (charge both users)",
                  [sp_in >= 0, sp_out >= 0, sq_in >= 0, sq_out >= 0, up <= p.rho, uq <= q.rho],
                  [(p.c, fr.charged_counter(p.c, up, p.w)), (p.rho, p.rho - up),
                   (q.c, fr.charged_counter(q.c, uq, q.w)), (q.rho, q.rho - uq)]))
    yp, yq = z3.Ints("preempted_units_p preempted_units_q")
    steps.append(("preemption on any replica", [yp >= 0, yp <= p.rho, yq >= 0, yq <= q.rho],
                  [(p.rho, p.rho - yp), (q.rho, q.rho - yq)]))
    return steps


def _replica_gap_proof(weights: tuple[int, int], timeout_s: float, upper: bool = True) -> tuple[str, Any]:
    """Every step keeps ``J(p,q), J(q,p) <= G + D`` (``G >= U_p + U_q + T``) and
    ``0 <= R <= cap``; returns ``("proved", None)`` or the failing step's record."""
    z3 = _z3()
    p, q = _User("p", weights[0]), _User("q", weights[1])
    cap, tol, stale, g = z3.Ints("max_resident_units tolerance staleness_D G")
    base = [cap >= 0, tol >= 0, stale >= 0, g >= vtc_counter_gap_bound_units(cap, *weights) + tol]

    def inv(sub: list) -> list[tuple[str, Any]]:
        def v(x: Any) -> Any:
            return next((val for var, val in sub if z3.eq(var, x)), x)
        out = [(f"0 <= committed_{u.tag} <= cap", And(0 <= v(u.rho), v(u.rho) <= cap)) for u in (p, q)]
        return out + [("J(p,q): c_p + R_p - c_q <= G + D", p.committed(v(p.c), v(p.rho)) - v(q.c) <= g + stale),
                      ("J(q,p): c_q + R_q - c_p <= G + D", q.committed(v(q.c), v(q.rho)) - v(p.c) <= g + stale)]
    pre = [goal for _, goal in inv([])]
    for name, guard, after in _replica_gap_steps(p, q, cap, tol, stale, upper):
        status, info = _prove([*base, *pre, *guard], inv(after), timeout_s)
        if status != "proved":
            return status, (name, info, p, q, cap, g, tol, stale)
    return "proved", None


@register("vtc_counter_gap_replicas",
          "across replicas sharing counters with staleness D (every replica's view v of a user's global counter "
          "c = service on all replicas + lift level within c - D <= v <= c): J(p,q) = c_p + R_p - c_q <= "
          "U_p + U_q + T + D is inductive under admission of p on a replica where q is backlogged (vtc_eligible "
          "on that replica's views, with the tick's advance), a lift of p there (lift_floor, lifted_counter on its "
          "views, its floor at or below them), "
          "the same for q, service on any replicas, preemption; hence c_p - c_q <= U_p + U_q + T + D "
          "(docs/scale-out.md section 2); without the sandwich's upper half (a lift kept private) it is not")
def check_vtc_counter_gap_replicas(opts: Options) -> Outcome:
    """Inductive step per step kind, per weight pair in ``GAP_WEIGHTS``; any D, views, service."""
    bound = (f"unbounded (any counters, any staleness D >= 0, any views within the sandwich, any service up to "
             f"what is resident); weight pairs {list(GAP_WEIGHTS)}")
    for w in GAP_WEIGHTS:
        status, info = _replica_gap_proof(w, opts.timeout_s)
        if status == "counterexample":
            name, (m, bad), p, q, cap, g, tol, stale = info
            values = {"weights (p, q)": w, "max_resident_units": _val(m, cap), "tolerance": _val(m, tol),
                      "G": _val(m, g), "D": _val(m, stale)}
            for u in (p, q):
                values[f"user {u.tag}: global counter, committed units"] = (_val(m, u.c), _val(m, u.rho))
            values["step's choices"] = ", ".join(f"{d.name()}={m[d]}" for d in m.decls()
                                                 if d.name().startswith(("admit_", "served_", "preempted_", "view_",
                                                                         "least_", "advance_", "floor_")))
            return Outcome("counterexample", bound, counterexample=StateCounterexample(name, bad, values))
        if status != "proved":
            return Outcome("unknown", bound, f"weights {w}: {status} {info[0] if info else ''}")
    st_private, info = _replica_gap_proof((1, 1), opts.timeout_s, upper=False)
    hole = f"{st_private} ({info[0]})" if info else st_private
    return Outcome("proved", bound, "proved for every weight pair and every step; without the upper half of the "
                                    f"sandwich (a lift kept on one replica, as before 2026-12-01): {hole}")
