"""The fairness rules the scheduler and ``VTCPolicy`` run, as pure integer functions.

Like ``spec.rules``, each function uses only ``+ - * <= ==`` and ``spec.logic`` (``And``, ``Or``,
``Not``, ``If``, ``Min``, ``Max``, ``cdiv``), so it evaluates on Python ints inside
``batch/policies/vtc.py`` and ``batch/core/step.py`` and on ``z3.Int`` terms in the proofs.
The prose behind each rule, with its derivation, is ``docs/fairness.md``.

Units: ``*_tokens`` token counts, ``*_blocks`` KV blocks, ``*_ticks`` scheduler iterations,
``*_us`` integer microseconds, counters in *counter units* (``COUNTER_SCALE`` units are one
weighted token of service).

Source: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024: the algorithm and its fairness bound), artifact ``Ying1123/VTC-artifact``.
"""
from __future__ import annotations

from typing import Any

from spec.logic import And, If, Max, Min, Not, Or, cdiv

Int = Any  # a Python int or a z3 integer term
Bool = Any  # a Python bool or a z3 boolean term

#: Service price of one prompt token processed (the VTC paper's w_p).
PROMPT_PRICE = 1
#: Service price of one output token generated (the VTC paper's w_q).
OUTPUT_PRICE = 2
#: Counter units per weighted token: lcm(1..16), so any weight 1..16 divides a charge exactly.
COUNTER_SCALE = 720720


# ---------------------------------------------------------------- the virtual token counter


def service_units(prompt_tokens: Int, output_tokens: Int, prompt_price: Int, output_price: Int) -> Int:
    """Service of one request in one iteration, in weighted tokens: w_p * prompt + w_q * output."""
    return prompt_price * prompt_tokens + output_price * output_tokens


def charged_counter(counter: Int, units: Int, weight: Int) -> Int:
    """A user's counter after it received ``units`` of service: ``counter + ceil(units * SCALE / weight)``.

    ``weight >= 1`` is the user's share weight (weighted VTC divides every charge by it);
    rounding up never under-charges. Monotone: the counter never decreases.
    """
    return counter + cdiv(units * COUNTER_SCALE, weight)


#: Default fairness tolerance of ``VTCPolicy``, weighted tokens: users whose counters lie within
#: this of the least backlogged counter are served in arrival order (``vtc_eligible``), so a
#: balanced load is served first come first served and its TTFT tail is FCFS's; a user more than
#: this ahead waits behind the others. Shares among resident requests are kept by
#: ``pressure_units`` (victims and room), not by the band. ``docs/fairness.md`` ("Tolerance")
#: has the measurements behind the value.
TOLERANCE_TOKENS = 8192


def lift_floor(floor: Int, min_others: Int, others_backlogged: Bool, tolerance: Int) -> Int:
    """The lift floor once a user becomes backlogged: ``max(floor, m - tolerance - 1)`` with ``m``
    the least counter among the other backlogged users (or, when none is, among the other users
    with a request resident), unchanged when there is none.

    The floor only grows, and every backlogged counter is at or above it (a new one is lifted to
    it, ``lifted_counter``), so a returning user starts one unit (1/``COUNTER_SCALE`` of a
    weighted token) below ``m - tolerance``, or at the floor when that is higher: idle time banks
    no credit. ``VTCPolicy`` lifts with ``tolerance = 0`` (``LIFT_TOLERANCE_TOKENS``): a newcomer
    starts just below the least counter, not below the eligibility band, so the band is not
    credited to it (it would read as the others' service lead in ``pressure_units``). With
    ``tolerance = 0`` and others backlogged this is the VTC paper's lift (artifact
    ``VTCReqQueue.append``), ties to the newcomer. Because the floor does not depend on who is
    backlogged at the return, a user idle at or below it can be forgotten (``forgettable``): its
    return restores the same counter.
    """
    return If(others_backlogged, Max(floor, min_others - tolerance - 1), floor)


#: The tolerance ``VTCPolicy`` lifts with (``lift_floor``), weighted tokens: 0, the VTC paper's lift.
LIFT_TOLERANCE_TOKENS = 0


def lifted_counter(own: Int, floor: Int) -> Int:
    """A user's counter when its waiting queue goes from empty to non-empty: ``max(own, floor)``
    (a forgotten user's ``own`` reads as the floor)."""
    return Max(own, floor)


def idle_floor(floor: Int, max_counter: Int) -> Int:
    """The floor once nothing is waiting or resident: ``max(floor, the largest counter)``. With no
    user active the history is over: everyone starts again level, and every counter is forgettable.
    """
    return Max(floor, max_counter)


def forgettable(counter: Int, floor: Int) -> Bool:
    """An idle user's counter carries no information: at or below the floor, which its return
    would lift it to anyway (``lifted_counter``), so it may be dropped and read as the floor."""
    return counter <= floor


def vtc_eligible(local_counter: Int, least_counter: Int, tolerance: Int) -> Bool:
    """Whether a backlogged user may be served next: its counter is within ``tolerance`` (counter
    units, >= 0) of the least counter among backlogged users. Among the eligible users admission
    goes by arrival; ``tolerance = 0`` is VTC's least-counter rule (ties by arrival).
    """
    return local_counter <= least_counter + tolerance


def band_tolerance(tolerance: Int, equal_weights: Bool) -> Int:
    """The tolerance VTC's order uses (counter units): ``tolerance`` while every backlogged user
    has the same weight, 0 (strict least counter) otherwise. Within the band admission is FCFS,
    which serves users alike whatever their weights, so with unequal weights the band would cap
    the weighted share's effect at the band's width; measured on a finite 2:1 backlog (issue 38):
    the heavier user got 1.27-1.63x the other's service with the band, 1.84-1.98x without."""
    return If(equal_weights, tolerance, 0)


def light_first(local_counter: Int, least_other_counter: Int, tolerance: Int) -> Bool:
    """Whether a light user's next request still goes ahead of the other users' (VTC's order): its
    local counter is within ``tolerance`` of the least counter of the backlogged users that are
    not light (``vtc_eligible``). Past it, its requests wait in the band like anyone's, so a user
    that became light as its backlog drained cannot take more than the band beyond its share."""
    return vtc_eligible(local_counter, least_other_counter, tolerance)


def new_prompt_tokens(num_computed_tokens: Int, num_new_tokens: Int, num_prompt_tokens: Int,
                      prompt_high_water_tokens: Int) -> Int:
    """Prompt tokens a chunk processes for the first time in the request's life (charged once).

    ``prompt_high_water_tokens`` is the most prompt tokens ever computed for the request; a
    recompute after preemption stays below it and is not charged again.
    """
    return Max(0, Min(num_computed_tokens + num_new_tokens, num_prompt_tokens) - prompt_high_water_tokens)


def prompt_high_water(prompt_high_water_tokens: Int, num_computed_tokens: Int, num_new_tokens: Int,
                      num_prompt_tokens: Int) -> Int:
    """The high-water mark after a chunk: ``max(old, min(computed + new, prompt))``."""
    return Max(prompt_high_water_tokens, Min(num_computed_tokens + num_new_tokens, num_prompt_tokens))


def vtc_service_gap_bound(prompt_price: Int, max_prompt_tokens: Int, output_price: Int,
                          max_output_tokens: Int) -> Int:
    """The VTC paper's bound on the service difference of two backlogged users, weighted tokens.

    ``2 * max(w_p * L_input, w_q * M)``; ``docs/fairness.md`` section 5 discusses what ``M``
    stands for (the longest output, or the tokens one batch holds).
    """
    return 2 * Max(prompt_price * max_prompt_tokens, output_price * max_output_tokens)


# ---------------------------------------------------------------- fair while running

#: Quantum Q, iterations: a resident request is taken for another user's room only after Q
#: iterations resident (``quantum_elapsed``), and the reservation holder is never preempted
#: within Q iterations of its admission (``protected``): the anti-thrash rule.
QUANTUM_TICKS = 128

#: Pressure scale S, weighted tokens: in ``pressure_units`` one resident request per unit of
#: weight weighs as much as S weighted tokens of service received.
PRESSURE_TOKENS = 1024

#: Hold W, iterations: a waiting request that fits waits behind a blocked head (the first
#: candidate that does not fit) at most W iterations; then it is admitted past it
#: (``hold_elapsed``). Light users' requests never wait behind it.
HOLD_TICKS = 8


def light_user(demand: Int, weight: Int, total_demand: Int, total_weight: Int) -> Bool:
    """A light user: its demand (requests resident and waiting) is at most half its weighted
    fair share of all users' demand (``within_share`` at 1/2, ``total_weight`` the weights of
    the users with demand). Its requests are tried first, get room by preempting users over
    their share, and prefill toward their first token in isolated iterations."""
    return within_share(demand, weight, total_demand, total_weight, 1, 2)


def pressure_units(resident_requests: Int, weight: Int, counter: Int) -> Int:
    """A user's residency pressure, counter units: ``resident * S / weight + counter``, its
    resident requests per unit weight (each worth ``PRESSURE_TOKENS`` weighted tokens) plus the
    service it received (its VTC counter, ``charged_counter``).

    The first term is the rate the user is served at now (a resident request gets one token an
    iteration), the second what it received so far: the user of highest pressure gives up a
    resident request first (``victim_user_first``), and a waiting user may take a request from
    one whose pressure stays at or above its own once the request has moved (``may_take``).
    Only differences between users matter (the counters' origin cancels). Exact for weights
    dividing ``S * COUNTER_SCALE`` (1..16 and powers of two up to 2**10 times that).
    """
    return cdiv(resident_requests * PRESSURE_TOKENS * COUNTER_SCALE, weight) + counter


def victim_user_first(max_pressure: Int, min_pressure: Int) -> Bool:
    """Victims come from the user of highest pressure (among the candidates' users) when it is
    at least one resident request (``S`` weighted tokens) above the lowest; otherwise the
    victim order alone (``victim_before``) decides: small differences do not reorder victims."""
    return max_pressure - min_pressure >= PRESSURE_TOKENS * COUNTER_SCALE


def may_take(taker_pressure_after: Int, victim_pressure_after: Int) -> Bool:
    """A waiting user may take one resident request of another user for room: its pressure with
    the request admitted is at most the other's with the request gone (hysteresis: the move
    never makes the taker the one over pressure)."""
    return taker_pressure_after <= victim_pressure_after


def quantum_elapsed(admit_tick: Int, tick: Int, quantum_ticks: Int) -> Bool:
    """A resident request has been resident ``quantum_ticks`` iterations: it may give up its
    room to another user's waiting request."""
    return tick - admit_tick >= quantum_ticks


def past_high_water(progress_tick: Int, admit_tick: Int) -> Bool:
    """A resident request has computed past its prompt high-water mark (``prompt_charged_tokens``,
    the most prompt tokens it ever computed) since its admission at ``admit_tick``:
    ``progress_tick`` is the tick it first did (``Seq.progress_tick``; an earlier tick while it
    is still recomputing what a preemption took). A fresh request is past it in its admission
    tick. Room by pressure counts its quantum from ``progress_tick``, and neither pressure nor a
    light user's room takes a request that is not past it: without it a request whose recompute
    outlasts the quantum was taken again before it made new progress, over and over (the Mooncake
    conversation trace, 400 rows under a 2,048-block cap: ``bench/long_prompts.py``)."""
    return progress_tick >= admit_tick


def not_a_holder(victim_was_holder: Bool) -> Bool:
    """Room (a later reservation holder's, or another user's by pressure) is taken only from
    requests not admitted as a holder themselves (``Seq.holder``): a request that got in as a
    holder is protected ``quantum_ticks`` iterations and after that can still give room to
    growth or to a light user, but to no later holder and not by pressure. Without it an aged
    request whose prefill needs more than ``quantum_ticks`` iterations is taken again before it
    gets past its recompute, for ever (found on the Mooncake conversation trace: two holders
    with prompts of 23k and 27k tokens under a 2,048-block cap took each other's room, and once
    that was excluded a 20k-token holder was taken by pressure after each quantum; neither
    finished); with it the later request waits for the holder to finish."""
    return Not(victim_was_holder)


def protected(holder: Bool, admit_tick: Int, tick: Int, quantum_ticks: Int) -> Bool:
    """The reservation holder is no victim of any preemption within ``quantum_ticks`` of its
    admission (at most one request is protected at a time, so it can always grow)."""
    return And(holder, tick - admit_tick < quantum_ticks)


def hold_elapsed(blocked_ticks: Int, hold_ticks: Int) -> Bool:
    """Requests behind a blocked head may be admitted past it: it has been the blocked head
    ``hold_ticks`` iterations."""
    return blocked_ticks >= hold_ticks


# ---------------------------------------------------------------- share of the batch


def within_share(count: Int, weight: Int, total_count: Int, total_weight: Int, num: Int = 1, den: Int = 1) -> Bool:
    """The weighted fair share, the one rule every share test uses: a user holding ``count`` of
    ``total_count`` (requests or blocks) is within ``num/den`` of its share, ``count / total <=
    (num/den) * weight / W``, with ``W`` the weights of the users holding them.

    ``num/den = 1``: not over-served (room is made by preempting users beyond it); ``1/2`` with
    ``count`` the user's demand (resident + waiting requests): a light user, whose requests
    prefilling toward their first token are isolated (``batch.core.step``).
    """
    return count * total_weight * den <= num * weight * total_count


def victim_before(light_a: Bool, preempts_a: Int, computed_a: Int, admit_a: Int,
                  light_b: Bool, preempts_b: Int, computed_b: Int, admit_b: Int) -> Bool:
    """Request a is preempted before request b.

    A request of a light user (``within_share`` by KV blocks at 1/4: a user holding at most a
    quarter of its weighted fair share of the blocks, user B of the A/B burst) goes last; among
    equals, the one preempted fewer times (spreading preemptions keeps requests from being
    pinned), then the one with the fewest computed tokens (the recompute lost), then the latest
    admitted (``admit_*``: the admission sequence number). Close to SGLang's decode retraction
    (fewest output tokens first); vLLM V1 takes the latest admitted.
    """
    return Or(And(Not(light_a), light_b),
              And(light_a == light_b,
                  Or(preempts_a < preempts_b,
                     And(preempts_a == preempts_b,
                         Or(computed_a < computed_b, And(computed_a == computed_b, admit_a > admit_b))))))


# ---------------------------------------------------------------- preemption


def pinned(num_preemptions: Int, max_preemptions: Int) -> Bool:
    """A request preempted ``max_preemptions`` times is pinned: admitted with its worst-case
    blocks reserved and never preempted again."""
    return num_preemptions >= max_preemptions


def worst_case_blocks(num_prompt_tokens: Int, max_tokens: Int, max_model_len_tokens: Int, block_tokens: Int) -> Int:
    """Blocks a request can ever hold before an iteration: ``ceil(min(P + max_tokens, max_len) / B)``.

    Before its last iteration a request has at most ``min(P + max_tokens, max_len) - 1``
    tokens, and ``spec.rules.blocks_needed`` adds one lookahead slot.
    """
    return cdiv(Min(num_prompt_tokens + max_tokens, max_model_len_tokens), block_tokens)


def may_preempt(num_preemptions: Int, max_preemptions: Int, admit_tick: Int, tick: Int) -> Bool:
    """A resident request may be a victim: below the preemption cap and not admitted this tick."""
    return And(num_preemptions < max_preemptions, admit_tick < tick)


def growth_headroom_blocks(resident_requests: Int, block_tokens: Int) -> Int:
    """Free blocks an admission must leave for the next iteration's growth: ``ceil(R / B)``.

    Each resident request needs a new block once every ``block_tokens`` decode iterations, so
    ``R`` of them need about ``R / B`` a tick; admitting into those blocks makes the next
    iteration preempt the request just admitted (vLLM V0 kept a 1% watermark for this).
    Zero when nothing else is resident, so every admissible request can still be admitted.
    """
    return cdiv(resident_requests, block_tokens)


def can_admit(free_blocks: Int, need_blocks: Int, headroom_blocks: Int) -> Bool:
    """The admission guard with headroom: ``need + headroom <= free``."""
    return need_blocks + headroom_blocks <= free_blocks


# ---------------------------------------------------------------- no starvation


def reserved_after(blocked_ticks: Int, aging_ticks: Int) -> Bool:
    """A request that was the first non-fitting candidate in ``aging_ticks`` ticks gets the
    reservation: it is tried first (before resume-first trials, which it turns off), and until
    it fits nothing else is admitted."""
    return blocked_ticks >= aging_ticks


def ticks_to_drain_bound(max_sit_out_ticks: Int, max_work_ticks: Int) -> Int:
    """Ticks within which every resident request finishes or is preempted, when none is admitted.

    ``max_work_ticks`` bounds the iterations a resident request still needs (its prefill
    chunks plus ``max_tokens``); it runs in at least one of every ``K + 1`` consecutive ticks.
    """
    return (max_sit_out_ticks + 1) * max_work_ticks


def admission_wait_bound(aging_ticks: Int, max_work_ticks: Int) -> Int:
    """Counted ticks an admissible request waits at the front of the admission order, at most:
    ``T + L + 1``. Counted: ticks that are not isolated and, before its reservation, ran admission
    (no growth preemption). In each such tick it is admitted, or is the first candidate that does
    not fit (it ages: at most ``T``), then it holds the reservation while the residents drain (each
    runs in every counted tick and needs at most ``L`` more) and is admitted on the next. Isolated
    ticks come at most ``K`` in a row (``sit_out_allowed``); growth preemptions each remove a
    resident.
    """
    return aging_ticks + max_work_ticks + 1


def holder_wait_bound(quantum_ticks: Int, max_sit_out_ticks: Int, max_work_ticks: Int) -> Int:
    """Ticks within which the reservation holder is admitted after the tick it took the
    reservation: ``Q + ticks_to_drain_bound(K, L) = Q + (K + 1) L``. A protected request (at most
    one, admitted in an earlier tick) shields its blocks fewer than ``Q`` more ticks
    (``protected``); after that the holder is tried first in every tick that runs admission and
    takes room from every resident request admitted before the tick that is not pinned, so only
    the slot cap (``max_running``) or a growth preemption holds it back, and neither admits anyone
    else: the residents drain within ``(K + 1) L`` ticks, counting the tick that admits it.
    Assumptions (the proof ``no_starvation_holder``, ``docs/fairness.md`` section 4): the token
    budget never binds, a resident request needs at most ``L`` more iterations, the pinned
    requests' blocks leave room for the holder's (none are pinned at the default
    ``max_preemptions=None``), no prefix caching. The stateful test asserts one tick more."""
    return quantum_ticks + ticks_to_drain_bound(max_sit_out_ticks, max_work_ticks)


# ---------------------------------------------------------------- TTFT isolation


def sit_out_allowed(streak_ticks: Int, max_sit_out_ticks: Int) -> Bool:
    """An isolated iteration (over-served decodes sit out) may run: fewer than K in a row so far."""
    return streak_ticks < max_sit_out_ticks


def next_streak(streak_ticks: Int, isolated: Bool) -> Int:
    """Consecutive isolated iterations after this one."""
    return If(isolated, streak_ticks + 1, 0)
