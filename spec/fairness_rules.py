"""The fairness rules the scheduler and ``VTCPolicy`` run, as pure integer functions.

Like ``spec.rules``, each function uses only ``+ - * <= ==`` and ``spec.logic`` (``And``, ``Or``,
``Not``, ``If``, ``Min``, ``Max``, ``cdiv``), so it evaluates on Python ints inside
``policy.py``, ``isolation.py`` and ``scheduler.py`` and on ``z3.Int`` terms in the proofs.
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
#: this of the least backlogged counter are served in arrival order (``vtc_eligible``). 0, the
#: VTC paper's order: a tolerance of one KV cache's worth (4096) serves balanced load close to
#: arrival order, but lets weighted shares drift by that much (on the overload a weight-2 user
#: got 1.38x, not 1.94x, of the others' service); ``docs/fairness.md`` section 6 has the
#: measurements.
TOLERANCE_TOKENS = 0


def lifted_counter(own: Int, min_backlogged: Int, others_backlogged: Bool, tolerance: Int) -> Int:
    """A user's counter when its waiting queue goes from empty to non-empty.

    With other users backlogged it becomes ``max(own, min over their counters - tolerance - 1)``:
    idle time banks at most ``tolerance + 1`` counter units of credit, and a returning user
    starts one unit (1/``COUNTER_SCALE`` of a weighted token) below the band of the least
    backlogged counter, so every user in that band is past its own band (``vtc_eligible``) and
    is passed over until the newcomer has been served: it does not queue behind their older
    requests (some of which, preempted decodes, cost no prompt charge to admit). With none
    backlogged it keeps its own. ``tolerance = 0`` is the VTC paper's lift (artifact
    ``VTCReqQueue.append``) with the tie going to the newcomer.
    """
    return If(others_backlogged, Max(own, min_backlogged - tolerance - 1), own)


def vtc_eligible(local_counter: Int, least_counter: Int, tolerance: Int) -> Bool:
    """Whether a backlogged user may be served next: its counter is within ``tolerance`` (counter
    units, >= 0) of the least counter among backlogged users. Among the eligible users admission
    goes by arrival; ``tolerance = 0`` is VTC's least-counter rule (ties by arrival).
    """
    return local_counter <= least_counter + tolerance


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


# ---------------------------------------------------------------- share of the batch


def over_served(count: Int, weight: Int, total_count: Int, total_weight: Int) -> Bool:
    """The user holds more than its weighted fair share of the batch: ``count/total > weight/W``.

    ``count`` is the user's resident requests, ``total_count`` all resident requests,
    ``total_weight`` the weights of the users holding them.
    """
    return count * total_weight > weight * total_count


def protected_next(was_protected: Bool, demand: Int, weight: Int, total_count: Int, total_weight: Int,
                   enter_num: Int = 1, enter_den: Int = 2) -> Bool:
    """Hysteresis of TTFT protection for a user with a request prefilling toward its first token.

    ``demand`` is the user's resident plus waiting requests; ``total_count`` the resident
    requests of the batch, ``total_weight`` the weights of the users holding them. Enter when
    the user's whole demand is at most ``enter_num/enter_den`` of its weighted fair share of
    the batch (a light user, hence also below its share now); leave when its demand reaches
    its fair share; in between keep the previous state. Ranked by share of the batch, not by
    counter: right after the lift, a user's own first prompt charge can put its counter above
    the dominant user's (``docs/fairness.md``). A user whose demand exceeds its share (every
    user of an overload) is never protected: VTC order alone gives it its share.
    """
    enter = demand * total_weight * enter_den <= enter_num * weight * total_count
    leave = demand * total_weight >= weight * total_count
    return Or(enter, And(Not(leave), was_protected))


def light_user(count: Int, weight: Int, total_count: Int, total_weight: Int,
               num: Int = 1, den: Int = 4) -> Bool:
    """The user holds less than ``num/den`` of its weighted fair share of the batch:
    ``count/total < (num/den) * weight/W`` (``count``, ``total_count``: KV blocks held).

    Such a user is shielded from growth preemption (``victim_before``): a light user, e.g.
    user B of the A/B burst, keeps its few requests while a heavy one holds the cache.
    """
    return count * total_weight * den < num * weight * total_count


def victim_before(light_a: Bool, preempts_a: Int, computed_a: Int, admit_a: Int,
                  light_b: Bool, preempts_b: Int, computed_b: Int, admit_b: Int) -> Bool:
    """Request a is preempted before request b.

    A request of a user that is not light (``light_user`` by KV blocks: holding at least a
    quarter of its weighted fair share) goes first; among equals, the one preempted fewer
    times (``preempts_*``: spreading preemptions keeps requests from being pinned, and a
    pinned request holds its worst-case blocks); then the one with the fewest computed tokens
    (``computed_*``: the recompute it loses); then the latest admitted (``admit_*``, the
    admission sequence number). The cost order is close to SGLang's decode retraction, which
    retracts the request with the fewest output tokens first (``retract_decode``); vLLM V1
    takes the latest admitted.
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


def may_backfill_past(blocked_ticks: Int, aging_ticks: Int, backfill: Bool) -> Bool:
    """Admission may try later candidates past a request that does not fit."""
    return And(backfill, blocked_ticks < aging_ticks)


def reserved_after(blocked_ticks: Int, aging_ticks: Int) -> Bool:
    """A request that was the first non-fitting candidate in ``aging_ticks`` ticks gets the
    reservation: it is tried first, and until it fits nothing else is admitted except past
    it under ``may_pass_reservation``."""
    return blocked_ticks >= aging_ticks


def may_pass_reservation(candidate_worst_iters: Int, resident_worst_iters_max: Int) -> Bool:
    """Another request may be admitted past the reservation holder (it does not fit yet) only if
    its worst-case remaining iterations (prompt chunks plus ``max_tokens``) are strictly fewer
    than the largest of the resident requests'.

    Then the largest worst-case remaining work among resident requests never grows while the
    reservation waits, and it shrinks whenever the requests holding it run, so the resident
    set still drains within ``ticks_to_drain_bound`` (EASY backfilling's rule, Lifka 1995:
    a job may pass the reserved head only if it ends before the head's start; the scheduler
    also checks the head's start against its worst-case block profile, ``backfill.py``).
    """
    return candidate_worst_iters < resident_worst_iters_max


def ticks_to_drain_bound(max_sit_out_ticks: Int, max_work_ticks: Int) -> Int:
    """Ticks within which every resident request finishes or is preempted, when none is admitted
    or only requests with less worst-case work than the most a resident still needs
    (``may_pass_reservation``).

    ``max_work_ticks`` bounds the iterations a resident request still needs (its prefill
    chunks plus ``max_tokens``); it runs in at least one of every ``K + 1`` consecutive ticks.
    """
    return (max_sit_out_ticks + 1) * max_work_ticks


def admission_wait_bound(aging_ticks: Int, max_sit_out_ticks: Int, max_work_ticks: Int) -> Int:
    """Ticks an admissible request waits at the front of the admission order, at most.

    ``aging_ticks`` ticks as the first non-fitting candidate, then the reservation: the
    resident requests drain within ``ticks_to_drain_bound`` and it is admitted on the next.
    """
    return aging_ticks + ticks_to_drain_bound(max_sit_out_ticks, max_work_ticks) + 1


# ---------------------------------------------------------------- TTFT isolation


def sit_out_allowed(streak_ticks: Int, max_sit_out_ticks: Int) -> Bool:
    """An isolated iteration (over-served decodes sit out) may run: fewer than K in a row so far."""
    return streak_ticks < max_sit_out_ticks


def next_streak(streak_ticks: Int, isolated: Bool) -> Int:
    """Consecutive isolated iterations after this one."""
    return If(isolated, streak_ticks + 1, 0)


def isolation_pays(full_us: Int, isolated_us: Int, speedup_num: Int, speedup_den: Int) -> Bool:
    """The learned latency model predicts the isolated iteration at least ``num/den`` times faster."""
    return full_us * speedup_den >= speedup_num * isolated_us


def may_trim(sat_out_run: Int, max_sit_out_ticks: Int) -> Bool:
    """A request may sit out to bring an iteration under the latency target (``Isolation``'s
    ``iteration_target_s``) while it has sat out fewer than K iterations in a row (isolated or
    trimmed ones; ``sat_out_run``)."""
    return sat_out_run < max_sit_out_ticks


def streak_after(streak_ticks: Int, isolated: Bool, trimmed: Bool) -> Int:
    """The isolation streak after an iteration: ``next_streak``; a trimmed iteration is not
    isolated, so it ends the streak like a full one."""
    return next_streak(streak_ticks, And(isolated, Not(trimmed)))


def target_sit_out_bound(max_sit_out_ticks: Int) -> Int:
    """Most consecutive iterations one request sits out with an iteration target: ``2K`` (fewer
    than K before a trimmed one, ``may_trim``, then at most K isolated ones before the next full
    or trimmed iteration, in which it cannot be cut again; ``spec.verify_fairness``:
    ``sit_out_bound_with_target``)."""
    return 2 * max_sit_out_ticks


def over_target(predicted_us: Int, target_us: Int) -> Bool:
    """The learned latency model predicts the iteration longer than the target, microseconds."""
    return predicted_us > target_us
