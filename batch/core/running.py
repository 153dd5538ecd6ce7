"""Step 1 of ``Scheduler.schedule``: the running requests, grown or preempted.

In admission order, each resident request catches ``num_computed_tokens`` up by a prefill
chunk or one decode token within the token budget, after growing its block table by
``spec.rules.growth_blocks``; when the free blocks cannot cover the growth, the policy's victim
is preempted by recompute (possibly the request itself; never a pinned one). A request the
spent budget cannot run is left out: it neither grows nor preempts. The rule behind each step
is a function of ``spec.rules`` / ``spec.fairness_rules`` (called in its compiled plain-int
form, ``spec.concrete.fast``); vLLM V1's ``schedule()`` does the same for its running queue.
"""
from __future__ import annotations

from typing import Any, Sequence

from batch.core.plan import DECODE_GRANT, PlanDraft, Seq
from spec import fairness_rules as fr
from spec import rules
from spec.concrete import fast


def schedule_running(sched: Any) -> PlanDraft:
    """The draft of the next iteration with the running requests decided and nothing admitted.

    Args:
        sched: the ``Scheduler`` (read only): ``running``, ``pool.num_free``, the token budget,
            chunk and block sizes, ``policy.choose_victim``, ``max_preemptions``, the tick count.

    Returns:
        A ``PlanDraft``: ``live`` (resident, not preempted), ``order`` and ``grants`` (who runs,
        with ``(num_new_tokens, new_blocks)``), ``preempted``, ``pending`` (prefilling toward a
        first token), free blocks and budget left; ``admitted`` and ``blocked`` empty.

    Raises:
        AssertionError: the policy chose a victim ``spec.fairness_rules.may_preempt`` forbids
            (a policy bug).
    """
    free = sched.pool.num_free
    budget = sched.token_budget_tokens
    chunk = sched.prefill_chunk_tokens
    B = sched.block_tokens
    grants: dict[Seq, Sequence[int]] = {}  # seq -> (num_new_tokens, new_blocks)
    order: list[Seq] = []
    preempted: list[Seq] = []
    pending: list[Seq] = []  # scheduled requests prefilling toward their first token
    tick_no = sched.stats.ticks
    live = list(sched.running)  # resident requests not (yet) preempted in this plan
    # the rules' plain-int forms (spec.concrete), looked up now so that a replaced rule is seen
    growth_blocks, can_allocate, chunk_tokens = fast(rules.growth_blocks), fast(rules.can_allocate), \
        fast(rules.chunk_tokens)
    decode_ready = fast(rules.decode_ready)
    i = 0
    while i < len(live):
        seq = live[i]
        num_tokens = seq.num_prompt_tokens + len(seq.req.generated)
        if budget > 0 and decode_ready(len(seq.block_table), num_tokens, seq.num_computed_tokens, B):
            # what growth_blocks, can_allocate and chunk_tokens give here (spec.verify: decode_fast_path)
            grants[seq] = DECODE_GRANT
            order.append(seq)
            budget -= 1
            if num_tokens == seq.num_prompt_tokens:  # a 1-token last prompt chunk
                pending.append(seq)
            i += 1
            continue
        if budget <= 0:  # the token budget is spent: it cannot run, so it neither grows nor preempts
            i += 1
            continue
        need = growth_blocks(len(seq.block_table), num_tokens, B)
        preempted_self = False
        while not can_allocate(free, need):
            # Pinned requests are never victims; seq itself is not pinned (pinned ones never grow).
            victim = sched.policy.choose_victim([s for s in live if not s.pinned])
            if not fr.may_preempt(victim.num_preemptions, sched.max_preemptions, victim.admit_tick, tick_no):
                raise AssertionError(f"policy chose {victim.request_id}, which may not be preempted")
            v = live.index(victim)
            del live[v]
            preempted.append(victim)
            free += len(victim.block_table)
            if victim in grants:  # an earlier request of this plan: undo its share
                n_undo, blocks_undo = grants.pop(victim)
                order.remove(victim)
                free += blocks_undo
                budget += n_undo
            if victim is seq:
                preempted_self = True
                break
            if v < i:
                i -= 1
        if preempted_self:
            continue  # live[i] is now the next request
        n = chunk_tokens(num_tokens, seq.num_computed_tokens, chunk, budget)
        if n > 0:
            grants[seq] = (n, need)
            order.append(seq)
            free -= need
            budget -= n
            if num_tokens == seq.num_prompt_tokens:  # no output token yet
                pending.append(seq)
        i += 1
    return PlanDraft(live=live, order=order, admitted=[], grants=grants, preempted=preempted, free_blocks=free,
                     budget_tokens=budget, blocked=[], stop="empty", pending=pending)
