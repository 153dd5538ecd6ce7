"""The second half of a tick: commit the plan's blocks, and apply the iteration's output.

``Scheduler.tick()`` runs ``schedule()`` (a pure decision), then ``_commit_blocks`` (victims'
blocks freed, the plan's blocks granted: what a paged backend reads), then ``forward``, then
``update_from_output``; a failure in between undoes the commit (``_rollback_blocks``), so the
scheduler is as it was before the tick. A mixin of ``scheduler.Scheduler``: the methods read
the scheduler's state (``pool``, ``running``, ``policy``, ``stats``, ``isolation``, the
per-user counts) and the request bookkeeping of ``batch.core.book.RequestBook``.
"""
from __future__ import annotations

import collections
from typing import Sequence

from batch.core.plan import EVENTS, SchedulePlan
from batch.core.plan import Seq as _Seq
from inference_stub import Request
from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import rules
from spec.concrete import fast


class OutputStep:
    """``_commit_blocks``, ``_rollback_blocks`` and ``update_from_output`` of ``Scheduler``."""

    def _commit_blocks(self, plan: SchedulePlan) -> list[tuple[_Seq, list[int]]]:
        """Before ``forward``: free the victims' blocks and grant the plan's blocks.

        Afterwards every request in ``plan.batch`` holds its final block table for this
        iteration (what a paged backend reads). Returns the undo journal for
        ``_rollback_blocks``: ``(seq, block table before)`` per changed request.
        """
        journal: list[tuple[_Seq, list[int]]] = []
        for seq in plan.preempted:
            journal.append((seq, seq.block_table))
            self.pool.free(seq.block_table)
            seq.block_table = []
        for s in plan.batch:
            if s.new_blocks:
                blocks = self.pool.allocate(s.new_blocks)
                if blocks is None:  # schedule() budgets free blocks exactly; this is a bug
                    self._rollback_blocks(journal)
                    raise AssertionError(f"plan granted {s.new_blocks} blocks, {self.pool.num_free} free")
                journal.append((s.seq, s.seq.block_table))
                s.seq.block_table = s.seq.block_table + blocks
        return journal

    def _rollback_blocks(self, journal: list[tuple[_Seq, list[int]]]) -> None:
        """Undo ``_commit_blocks``: return granted blocks, give victims back their exact block ids."""
        for seq, before in reversed(journal):  # grants come after preemptions: undo them first
            current = seq.block_table
            if len(current) > len(before):
                self.pool.free(current[len(before):])  # a grant: return the added tail
            else:
                self.pool.reclaim(before)  # a victim: its exact block ids are free again
            seq.block_table = before

    def update_from_output(self, plan: SchedulePlan, tokens: Sequence[int], *,
                           iteration_start_s: float | None = None) -> list[Request]:
        """Apply a plan whose iteration returned ``tokens`` (one per ``plan.batch`` entry).

        Expects ``_commit_blocks(plan)`` to have run (``tick()`` does both). Moves the
        preempted to the waiting queue, admits, advances ``num_computed_tokens``, appends the token of every
        request whose last known token was computed (others' tokens are discarded prefill
        output), stamps ``started_at`` at the first token, and finishes requests on EOS
        (reason ``stop``), ``max_tokens`` or the cache length (reason ``length``), freeing
        their blocks in the same tick.

        Args:
            plan: the plan ``schedule()`` returned, with no state change since.
            tokens: ``len(plan.batch)`` token ids from ``forward``.
            iteration_start_s: clock reading before ``forward`` (admission time for queue-time
                metrics); defaults to the clock now.

        Token and completion times are the clock now, or the reading ``tick()`` took right
        before calling (so that a clock that raises there leaves the tick undone).

        Returns:
            The requests finished in this iteration, in batch order.
        """
        now, self._tick_end_s = (self.clock() if self._tick_end_s is None else self._tick_end_s), None
        start_s = now if iteration_start_s is None else iteration_start_s
        pool = self.pool
        tick_no = self.stats.ticks
        for seq in plan.preempted:  # blocks were freed by _commit_blocks
            seq.num_computed_tokens = 0
            seq.num_preemptions += 1
            EVENTS["preempt"].trigger(seq)
            self.policy.requeue(seq)
            self.stats.preemptions += 1
            self._leave_resident(seq)
            self._waiting_by_user[seq.user_id] = self._waiting_by_user.get(seq.user_id, 0) + 1
        gone = set(plan.preempted)
        finished: list[Request] = []
        produces_token, reached_length = fast(rules.produces_token), fast(rules.reached_length)
        eos, max_len, prefilling = self.eos_token_id, self.max_model_len_tokens, lc.PREFILLING
        itl = self.stats.itl_s if self.stats.record_itl else None
        pairs: list[tuple[Request, int]] | None = [] if self.on_tokens is not None else None  # the hook's
        prompt_served: dict[str, int] = {}  # user -> first-time prompt tokens this iteration (VTC charges)
        output_users: list[str] = []  # the user of each token produced this iteration
        add_output = output_users.append
        new_prompt_tokens, prompt_high_water = fast(fr.new_prompt_tokens), fast(fr.prompt_high_water)
        for (seq, num_new_tokens, _, admitted), token in zip(plan.batch, tokens):
            if admitted:
                self._admit(seq, tick_no, start_s)
            nc = seq.num_computed_tokens
            num_prompt = seq.num_prompt_tokens
            req = seq.req
            generated = req.generated
            num_tokens = num_prompt + len(generated)
            if nc < num_prompt:  # a prompt chunk: charged once per request
                part = new_prompt_tokens(nc, num_new_tokens, num_prompt, seq.num_prompt_tokens_served)
                prompt_served[seq.user_id] = prompt_served.get(seq.user_id, 0) + part
                seq.num_prompt_tokens_served = prompt_high_water(
                    seq.num_prompt_tokens_served, nc, num_new_tokens, num_prompt)
            seq.num_computed_tokens = nc + num_new_tokens
            if not produces_token(nc, num_new_tokens, num_tokens):
                continue
            token = token if type(token) is int else int(token)
            generated.append(token)
            add_output(seq.user_id)
            if pairs is not None:
                pairs.append((req, token))
            if req.started_at is None:
                req.started_at = now
            elif itl is not None and seq.last_token_s is not None:
                itl.append(now - seq.last_token_s)
            seq.last_token_s = now
            if token == eos:
                reason = "stop"
            elif reached_length(num_tokens - num_prompt + 1, req.max_tokens, num_tokens + 1, max_len):
                reason = "length"
            else:
                if seq.state == prefilling:
                    EVENTS["prefill_done"].trigger(seq)
                continue
            pool.free(seq.block_table)
            seq.block_table = []
            seq.finish_reason = reason
            EVENTS["finish"].trigger(seq)
            req.completed_at = now
            gone.add(seq)
            self._forget(seq)
            self._leave_resident(seq)
            finished.append(req)
            self.stats.on_finish(user_id=seq.user_id, reason=reason, submitted_s=req.submitted_at,
                                 first_token_s=req.started_at, admitted_s=seq.admitted_s, completed_s=now,
                                 prompt_tokens=seq.num_prompt_tokens, output_tokens=len(req.generated))
        output_by_user = collections.Counter(output_users)
        for user_id in {**prompt_served, **output_by_user}:  # batch order (not a set's: runs must repeat)
            self.policy.on_service(user_id, prompt_served.get(user_id, 0), output_by_user[user_id])
        if gone:
            self.running = [s for s in self.running if s not in gone]
        if plan.reserve is not None and plan.reserve.state in lc.WAITING_STATES:
            self._reserved = plan.reserve  # room was made for it: nothing else takes the blocks
        b = plan.blocked
        if b is not None and b.state in lc.WAITING_STATES:
            b.blocked_ticks += 1
            if self._reserved is None and fr.reserved_after(b.blocked_ticks, self.aging_ticks):
                self._reserved = b
        if self.isolation is not None:
            self.isolation.commit(plan.isolated, plan.protected_updates, plan.sat_out, plan.trimmed)
            if plan.batch and iteration_start_s is not None:  # learn the latency of our own forward
                self.isolation.model.observe(len(plan.batch), plan.num_batched_tokens, now - start_s)
        self.stats.on_tick(len(plan.batch), plan.num_batched_tokens, pool.num_used)
        self._tick_tokens = pairs
        return finished
