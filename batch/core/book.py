"""The scheduler's request records: lookup, admission, per-user counts, retirement, integrity.

A mixin of ``scheduler.Scheduler``: every method expects the scheduler's state lock held
(``tick()``, ``abort()`` and ``submit()`` take it) and reads or changes the records
(``_by_obj``, ``_by_id``), the running list, the policy's queue, the KV pool and the per-user
resident and waiting counts that isolation and the fair share read in O(1)
(``spec.invariants.user_counts_agree`` checks them every tick).
"""
from __future__ import annotations

from typing import Any

from batch.core.plan import EVENTS, ScheduledSeq, SchedulePlan
from batch.core.plan import Seq as _Seq
from batch.core.validation import BackendError
from inference_stub import Request
from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import rules


class RequestBook:
    """Request bookkeeping of ``Scheduler`` (lookup, admit, retire, the per-user counts)."""

    def _lookup(self, request: Any) -> _Seq | None:
        """The live record for a ``Request`` object or a non-empty ``request_id``, else None."""
        if isinstance(request, str):
            cur = self._by_id.get(request) if request else None
            if type(cur) is list:  # a repeated id: the oldest in flight not already being aborted
                return next((q for q in cur if all(p is not q for p in self._pending_aborts)), cur[0])
            return cur
        return self._by_obj.get(id(request))

    def _retire(self, seq: _Seq, reason: str, now_s: float) -> Request:
        """Take a live request out without completing it (``abort`` event, reason ``abort`` / ``error``).

        Frees its blocks (a resident request) or takes it off the waiting queue. Expects the
        state lock held and ``seq`` not in an in-flight plan.
        """
        if seq.state in lc.WAITING_STATES:
            discard = getattr(self.policy, "discard", None)  # an abort is not an admission (VTCPolicy.discard)
            (discard or self.policy.remove)(seq)
            self._leave_waiting(seq)
            if seq is self._reserved:
                self._reserved = None
        else:
            self.pool.free(seq.block_table)
            seq.block_table = []
            self.running.remove(seq)
            self._leave_resident(seq)
        seq.finish_reason = reason
        EVENTS["abort"].trigger(seq)
        seq.req.completed_at = now_s
        self._forget(seq)
        self.stats.on_cancel(reason)
        return seq.req

    def _end_inflight(self) -> None:
        """The in-flight tick is over (applied or rolled back): retire the aborts deferred to its end.

        Expects the state lock held. Requests the tick finished are left alone (``tick()``
        returns them); the waiting ``abort`` calls are woken. If the clock raises (anything,
        ``KeyboardInterrupt`` included), the aborts are retired at each request's last known
        time (``_last_event_s``) and the callers woken before the exception is re-raised.
        """
        self._inflight = None
        if self._pending_aborts:
            try:
                now_s, err = self.clock(), None
            except BaseException as e:  # the aborts still apply and their callers wake; re-raised after
                now_s, err = None, e
            for seq in self._pending_aborts:
                if self._by_obj.get(id(seq.req)) is seq:
                    self._retire(seq, "abort", now_s if err is None else self._last_event_s(seq))
            self._pending_aborts.clear()
            self._tick_done.notify_all()
            if err is not None:
                raise err

    @staticmethod
    def _last_event_s(seq: _Seq) -> float:
        """The latest clock reading known for ``seq`` (last token, admission or submit), seconds:
        the completion time of an abort applied when the clock could not be read."""
        for t in (seq.last_token_s, seq.admitted_s):
            if t is not None:
                return t
        return seq.req.submitted_at

    def _on_backend_failure(self, plan: SchedulePlan, e: Exception) -> list[Request]:
        """After a rolled-back tick: raise ``BackendError``, or fail the batch (``max_backend_tries``)."""
        with self._lock:
            self._backend_failures += 1
            if self.max_backend_tries is None or self._backend_failures < self.max_backend_tries:
                if isinstance(e, BackendError):
                    raise e
                raise BackendError(f"forward raised {type(e).__name__}: {e}",
                                   [r.request_id for r in plan.requests]) from e
            self._backend_failures = 0
            now = self.clock()
            failed = [self._retire(s.seq, "error", now) for s in plan.batch
                      if self._by_obj.get(id(s.seq.req)) is s.seq]  # not aborted meanwhile
            self._last_tick = (plan, failed, "error")
            return failed

    # ------------------------------------------------------------ admission and per-user counts

    def _admission_blocks(self, seq: _Seq) -> int:
        """KV blocks reserved when ``seq`` is admitted: its tokens plus the lookahead slot, or
        its worst case once it is pinned (``spec.fairness_rules.pinned``).

        An override point for baselines (``baselines.ReservationScheduler`` reserves prompt +
        ``max_tokens``); an override must return at least this and at most ``kv_cap_blocks``.
        """
        need = rules.blocks_needed(seq.num_tokens, self.block_tokens)
        if fr.pinned(seq.num_preemptions, self.max_preemptions):
            need = max(need, fr.worst_case_blocks(seq.num_prompt_tokens, seq.req.max_tokens,
                                                  self.max_model_len_tokens, self.block_tokens))
        return need

    def _admit(self, seq: _Seq, tick_no: int, start_s: float) -> None:
        """``seq`` leaves the waiting queue for the running list (admission or resume)."""
        self.policy.remove(seq)
        if seq.decode_entry is None:  # its plan entry on every decode tick (the fast path)
            seq.decode_entry = ScheduledSeq(seq, 1, 0, False)
        EVENTS["resume" if seq.state == lc.PREEMPTED else "admit"].trigger(seq)
        seq.admit_no = self._admissions
        self._admissions += 1
        seq.admit_tick = tick_no
        seq.pinned = fr.pinned(seq.num_preemptions, self.max_preemptions)
        seq.blocked_ticks = 0
        if seq.admitted_s is None:
            seq.admitted_s = start_s
        self.running.append(seq)
        self._enter_resident(seq)
        self._leave_waiting(seq)
        if seq is self._reserved:
            self._reserved = None

    def _enter_resident(self, seq: _Seq) -> None:
        c = self._resident_by_user.get(seq.user_id, 0)
        if c == 0:
            self._resident_weight += self._weight_of(seq.user_id)
        self._resident_by_user[seq.user_id] = c + 1

    def _leave_waiting(self, seq: _Seq) -> None:
        """``seq`` leaves the waiting queue (admitted or aborted): per-user counts follow."""
        c = self._waiting_by_user[seq.user_id] - 1
        if c:
            self._waiting_by_user[seq.user_id] = c
        else:
            del self._waiting_by_user[seq.user_id]

    def _leave_resident(self, seq: _Seq) -> None:
        """``seq`` stops being resident (preempted, finished or aborted): per-user counts follow."""
        c = self._resident_by_user[seq.user_id] - 1
        if c == 0:
            del self._resident_by_user[seq.user_id]
            self._resident_weight -= self._weight_of(seq.user_id)
        else:
            self._resident_by_user[seq.user_id] = c

    def _forget(self, seq: _Seq) -> None:
        seq.decode_entry = None  # it points back at seq: break the cycle so refcounting frees the request
        self._by_obj.pop(id(seq.req), None)
        rid = seq.rid
        cur = self._by_id.get(rid) if rid else None
        if cur is seq:
            del self._by_id[rid]
        elif type(cur) is list:  # a repeated id
            cur[:] = [q for q in cur if q is not seq]
            if len(cur) == 1:
                self._by_id[rid] = cur[0]

    # ------------------------------------------------------------ introspection

    def check_integrity(self) -> None:
        """Check the KV ledger against every block table and each request's state.

        Raises:
            AssertionError: naming the broken property. Cheap enough to call after every tick
                in tests; ``kv_cache.BlockPoolError`` from the pool's own check.
        """
        with self._lock:
            self.pool.check([s.block_table for s in self.running])
            held = [len(s.block_table) for s in self.running]
            assert rules.ledger_consistent(self.pool.num_free, held, self.kv_cap_blocks), "ledger_consistent"
            assert rules.kv_within_cap(self.pool.num_used, self.kv_cap_blocks), "kv_within_cap"
            for s in self.running:
                assert s.state in lc.RESIDENT_STATES, f"{s.request_id}: running but {s.state}"
                assert rules.resident_covered(len(s.block_table), s.num_tokens, self.block_tokens), \
                    f"{s.request_id}: holds {len(s.block_table)} blocks for {s.num_tokens} tokens"
                assert s.num_computed_tokens <= s.num_tokens, f"{s.request_id}: num_computed_tokens > num_tokens"
            by_user: dict[str, int] = {}
            for s in self.running:
                by_user[s.user_id] = by_user.get(s.user_id, 0) + 1
            assert by_user == self._resident_by_user, "resident counts per user"
            assert sum(self._waiting_by_user.values()) == len(self.policy) and all(
                self._waiting_by_user.values()), "waiting counts per user"
            assert self._resident_weight == sum(self._weight_of(u) for u in by_user), "resident weight"
