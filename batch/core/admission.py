"""Step 2 of ``Scheduler.schedule``: admission of waiting requests.

Unless the running step preempted (then nothing is admitted this iteration), waiting
requests are tried in the policy's admission order (``Policy.admission_order``; VTC's is the
least virtual token counter first), the aging reservation's holder first and, with
``VTCPolicy.resume_first``, preempted decodes as trials before the order. A request is
admitted while a slot, token budget and its blocks with the admission headroom fit
(``spec.fairness_rules.can_admit``). When the first candidate does not fit it is *blocked*
(it ages toward the reservation, ``reserved_after``) and, with EASY backfilling, later
candidates are admitted past it only if its worst-case shadow start does not move
(``batch.core.backfill``; Lifka's EASY for batch jobs, here per KV block and iteration),
at most ``BACKFILL_WINDOW`` tried per tick.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

from batch.core.backfill import Shadow, WorstCaseProfile, budget_never_binds, worst_case_iterations
from batch.core.plan import PlanDraft, Seq
from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import rules

#: With backfill (plain or EASY), most waiting requests tried and not admitted past the first
#: that does not fit, per tick.
BACKFILL_WINDOW = 16


def admit_waiting(sched: Any, d: PlanDraft) -> None:
    """Admit waiting requests into the draft ``d`` (after ``running.schedule_running``).

    Args:
        sched: the ``Scheduler`` (read only): the policy, the reservation holder, the slot,
            budget, headroom, aging and EASY settings, ``_admission_blocks`` (an override
            point) and ``_easy_shadow``.
        d: the draft: ``admitted``, ``blocked``, ``stop``, ``grants``, ``pending``, free
            blocks and budget are updated in place.
    """
    live, grants, preempted, pending = d.live, d.grants, d.preempted, d.pending
    free, budget = d.free_blocks, d.budget_tokens
    chunk, B = sched.prefill_chunk_tokens, sched.block_tokens
    admitted: list[Seq] = []
    blocked: list[Seq] = []  # waiting candidates that did not fit, in the order tried
    before_admission = getattr(sched.policy, "before_admission", None)
    if before_admission is not None:  # every plan, so isolation's peek sees it too (VTC's drain phase)
        before_admission(len(live), min(chunk, sched.token_budget_tokens))
    if preempted:
        stop = "preempted"
    elif len(live) >= sched.max_running and len(sched.policy):
        stop = "max_running"  # no slot: the policy's order is not needed
    else:
        stop = "empty"
        resident = len(live)
        easy: tuple[WorstCaseProfile, Shadow] | None = None  # the head's shadow, once EASY passes it
        easy_headroom = 0  # the admission headroom the head's shadow counts, blocks
        passed = 0  # candidates EASY tried past the head
        reserved = sched._reserved
        if reserved is not None and reserved.state not in lc.WAITING_STATES:
            reserved = None
        # (candidate, trial): a trial is a preempted decode (VTCPolicy.resume_first) tried before
        # the policy's order and admitted only if it fits now; one that does not is skipped
        # (neither blocked nor passed) and tried again at its place in the order. An order whose
        # first request is already blocked keeps it first: past it, trials are EASY-checked.
        candidates: Iterator[tuple[Seq, bool]] = zip(sched.policy.admission_order(), itertools.repeat(False))
        resume_first = getattr(sched.policy, "resume_first", None)
        if resume_first is not None:
            trials = [(s, True) for s in itertools.islice(resume_first(), BACKFILL_WINDOW)]  # minus the holder, below
            if trials:  # a trial admitted is in grants when the order reaches it
                head = next(candidates, None)
                rest = ((s, t) for s, t in candidates if s not in grants)
                if head is None:
                    candidates = iter(trials)
                elif head[0].blocked_ticks > 0:  # the order's head is blocked: trials go behind it (EASY)
                    candidates = itertools.chain((head,), (x for x in trials if x[0] is not head[0]), rest)
                else:
                    candidates = itertools.chain(trials, ((s, t) for s, t in (head,) if s not in grants), rest)
        if reserved is not None:  # the reservation goes first
            candidates = itertools.chain(((reserved, False),), ((s, t) for s, t in candidates if s is not reserved))
        for seq, trial in candidates:
            if resident + len(admitted) >= sched.max_running:
                stop = "max_running"
                break
            if budget <= 0:
                stop = "budget"
                break
            need = sched._admission_blocks(seq)
            headroom = (fr.growth_headroom_blocks(resident + len(admitted), B)
                        if sched.admission_headroom and seq is not reserved else 0)
            if not fr.can_admit(free, need, headroom):
                if trial:
                    continue
                stop = "kv"
                if easy is not None:  # EASY passes it too; blocked stays [head] for isolation's peek
                    passed += 1
                    if len(blocked) + passed > BACKFILL_WINDOW:
                        break
                    continue
                blocked.append(seq)
                if len(blocked) == 1 and (seq is reserved or not fr.may_backfill_past(
                        seq.blocked_ticks, sched.aging_ticks, sched.policy.backfill)):
                    easy = (sched._easy_shadow(live, admitted, grants, need + headroom)
                            if sched.easy_backfill else None)
                    easy_headroom = headroom
                    if easy is None:
                        break  # no backfill, or the reservation: nothing passes it
                    continue
                if len(blocked) + passed > BACKFILL_WINDOW:
                    break
                continue
            if easy is not None:  # EASY: past the head only what cannot delay it
                profile, shadow = easy
                pre_iters, iters = worst_case_iterations_of(sched, seq)
                done = iters <= shadow.iteration  # finished by the head's shadow iteration
                passes = (
                    not easy_over_served(sched, seq, resident + len(admitted), admitted)
                    and profile.admits(seq.num_tokens, pre_iters, iters, need, shadow)
                    # still resident at the shadow: the head's headroom there must not grow past what it counted
                    and (done or not easy_headroom or fr.growth_headroom_blocks(
                        profile.rows_after(shadow.iteration) + 1, B) <= easy_headroom)
                    # past the reservation holder: done by its shadow, shorter than the longest resident
                    and (blocked[0] is not reserved
                         or (done and fr.may_pass_reservation(iters, profile.max_iters))))
                if not passes:
                    if trial:
                        continue
                    passed += 1
                    if len(blocked) + passed > BACKFILL_WINDOW:
                        break
                    continue
                profile.add(seq.num_tokens, pre_iters, iters, need)
            n = rules.chunk_tokens(seq.num_tokens, 0, chunk, budget)
            grants[seq] = (n, need)
            admitted.append(seq)
            free -= need
            budget -= n
            if not seq.req.generated:
                pending.append(seq)
    d.admitted, d.blocked, d.stop, d.free_blocks, d.budget_tokens = admitted, blocked, stop, free, budget


def worst_case_iterations_of(sched: Any, seq: Seq) -> tuple[int, int]:
    """``backfill.worst_case_iterations`` for ``seq``: (prefill chunks, iterations) it may still need."""
    return worst_case_iterations(seq.num_tokens, seq.num_computed_tokens,
                                 seq.num_prompt_tokens, len(seq.req.generated), seq.req.max_tokens,
                                 sched.max_model_len_tokens,
                                 min(sched.prefill_chunk_tokens, sched.token_budget_tokens))


def easy_over_served(sched: Any, seq: Seq, resident: int, admitted: list[Seq]) -> bool:
    """Whether admitting ``seq`` would leave its user above its weighted fair share of the
    ``resident + 1`` requests of the batch (``spec.fairness_rules.over_served``; ``admitted``:
    this plan's admissions so far). EASY does not pass the head with such a request: out of
    counter order it would widen the service gap (``docs/fairness.md``, section 3)."""
    u, weight_of = seq.user_id, sched._weight_of
    count = sched._resident_by_user.get(u, 0) + 1 + sum(1 for q in admitted if q.user_id == u)
    users = set(sched._resident_by_user) | {q.user_id for q in admitted}
    total_w = sched._resident_weight + sum(weight_of(v) for v in users - set(sched._resident_by_user))
    if u not in users:
        total_w += weight_of(u)
    return bool(fr.over_served(count, weight_of(u), resident + 1, total_w))


def easy_shadow(sched: Any, live: list[Seq], admitted: list[Seq], grants: dict[Seq, Sequence[int]],
                need_blocks: int) -> tuple[WorstCaseProfile, Shadow] | None:
    """The worst-case profile of this plan's resident requests (``live`` with their growth
    this tick, and ``admitted``) and the shadow of a head needing ``need_blocks``; ``None``
    when it never fits or when the token budget may bind (``backfill.budget_never_binds``)."""
    if not budget_never_binds(sched.token_budget_tokens, sched.kv_cap_blocks, sched.block_tokens,
                              sched.max_running, sched.prefill_chunk_tokens):
        return None
    profile = WorstCaseProfile(sched.kv_cap_blocks, sched.block_tokens)
    for s in live:
        g = grants.get(s)
        held = len(s.block_table) + (g[1] if g is not None else 0)
        profile.add(s.num_tokens, *worst_case_iterations_of(sched, s), held)
    for s in admitted:
        profile.add(s.num_tokens, *worst_case_iterations_of(sched, s), grants[s][1])
    shadow = profile.shadow(need_blocks)
    return None if shadow is None else (profile, shadow)
