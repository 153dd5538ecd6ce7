"""Time-to-first-token isolation for under-served users, decided by a learned latency model.

A newcomer's prefill inside a batch of 30 decodes runs in 30-request iterations: on the stub
(5 ms + 1 ms per request) that is 5-6x slower than alone, and VTC admission order alone cannot
fix it. ``Isolation.refine`` post-processes each iteration's plan:

1. *Protection* (with hysteresis, by share of the batch): a user with a request prefilling
   toward its first token is protected when its demand (resident + waiting requests) is at
   most half its weighted fair share of the resident requests, and stays protected until its
   demand reaches its fair share (``spec.fairness_rules.protected_next``).
2. *Room*: protected users' requests that do not fit first take back the blocks of this
   iteration's admissions of over-served users; failing that, requests of the over-served
   users are preempted by recompute (the policy's victim rule, never pinned ones, never one
   admitted this tick) and the first of them holds the reservation for the next iteration.
   No request is admitted in an iteration that preempted.
3. *Isolation*: while a protected request is prefilling toward its first token, every other
   request sits out (keeping its KV) when the latency model predicts the iteration at least
   ``min_speedup`` times faster that way, for at most ``max_sit_out_ticks`` consecutive
   iterations (``sit_out_allowed`` / ``next_streak``).

The latency model is fitted online from the durations of the scheduler's own ``forward``
calls on its clock, so on a real GPU, where batched tokens rather than requests drive
latency, the same rule stops isolating when it would not pay.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any, Sequence

from batch.core.latency import LatencyModel
from batch.core.plan import PlanDraft
from spec import fairness_rules as fr
from spec import rules
from spec.lifecycle import WAITING_STATES

#: Default bound on consecutive iterations an over-served request may sit out.
MAX_SIT_OUT_TICKS = 8
#: Default: isolate only when the isolated iteration is predicted this many times faster.
MIN_SPEEDUP = Fraction(3, 2)
#: Default window after a light user's request was prefilling in which the iteration target applies,
#: seconds (bench/target_sweep.py: 0.25 s halved the throughput cost of 1 s at the same A/B ratios).
ACTIVE_WINDOW_S = 0.25


class Isolation:
    """TTFT protection for under-served users: its parameters, its state and its rule.

    Args:
        max_sit_out_ticks: K, the most consecutive iterations a request sits out (>= 1).
        min_speedup: isolate only when the model predicts the iteration this many times faster.
        enter_share: a user is protected at or below this fraction of its fair share.
        model: the ``LatencyModel`` (a fresh one by default).
        iteration_target_s: a latency target for each iteration, seconds, or ``None`` (off, the
            default). While a protected user is *active* (one of its requests was prefilling
            toward its first token within the last ``active_window_s``, and it still has a
            request in flight), an iteration the latency model predicts longer than the target
            sits out over-served users' requests (this iteration's admissions first, then
            residents that sat out the fewest iterations in a row, newest admission first; none
            that sat out K in a row: ``spec.fairness_rules.may_trim``) until the prediction
            meets it. A light user's next request then waits behind a short iteration rather
            than a full one. In the spirit of Sarathi-Serve sizing its token budget from a TBT
            SLO (Agrawal et al., OSDI 2024), applied through the learned latency model and only
            while a light user is active. It costs throughput while active (``docs/fairness.md``,
            section 6, "Iteration target").
        active_window_s: how long after a protected user's request was last prefilling toward
            its first token the target applies, seconds (a light user that just sent a request
            is likely to send the next one soon).

    Raises:
        ValueError: a parameter is out of range.

    Invariant: ``0 <= streak <= max_sit_out_ticks`` (``sit_out_allowed`` guards every isolated
    iteration and ``streak_after`` resets on every other one). A request sits out at most ``K``
    iterations in a row without a target, ``target_sit_out_bound(K) = 2K`` with one.
    """

    def __init__(self, *, max_sit_out_ticks: int = MAX_SIT_OUT_TICKS, min_speedup: float | Fraction = MIN_SPEEDUP,
                 enter_share: float | Fraction = Fraction(1, 2), model: LatencyModel | None = None,
                 iteration_target_s: float | None = None, active_window_s: float = ACTIVE_WINDOW_S) -> None:
        if isinstance(max_sit_out_ticks, bool) or not isinstance(max_sit_out_ticks, int) or max_sit_out_ticks < 1:
            raise ValueError(f"max_sit_out_ticks must be an int >= 1, got {max_sit_out_ticks!r}")
        if iteration_target_s is not None and (isinstance(iteration_target_s, bool)
                                               or not isinstance(iteration_target_s, (int, float))
                                               or not 0.0 < iteration_target_s < math.inf):
            raise ValueError(f"iteration_target_s must be None or a finite number of seconds > 0, "
                             f"got {iteration_target_s!r}")
        if isinstance(active_window_s, bool) or not isinstance(active_window_s, (int, float)) \
                or not 0.0 <= active_window_s < math.inf:
            raise ValueError(f"active_window_s must be a finite number of seconds >= 0, got {active_window_s!r}")
        speed = Fraction(min_speedup).limit_denominator(1000)
        share = Fraction(enter_share).limit_denominator(1000)
        if speed < 1 or not 0 < share < 1:
            raise ValueError(f"min_speedup must be >= 1 and enter_share in (0, 1), got {min_speedup}, {enter_share}")
        self.max_sit_out_ticks = max_sit_out_ticks
        self.min_speedup = speed
        self.enter_share = share
        self.model = model if model is not None else LatencyModel()
        self.peek_candidates = 16  # waiting candidates looked at when a growth preemption stops admission
        self.iteration_target_s = None if iteration_target_s is None else float(iteration_target_s)
        self._target_us = None if iteration_target_s is None else int(round(iteration_target_s * 1e6))
        self.streak = 0
        self.protected: dict[str, bool] = {}
        self.isolated_ticks = 0
        self.trimmed_ticks = 0
        self.active_window_s = float(active_window_s)
        self._last_prefill_s: dict[str, float] = {}  # protected user -> last clock reading with a first-token prefill
        self._sat_out_run: dict[Any, int] = {}  # request -> iterations sat out in a row (with a target only)

    def refine(self, d: PlanDraft, sched: Any) -> None:
        """Apply protection, room-making, isolation and the iteration target to a draft plan
        (no state changes).

        Args:
            d: the draft, changed in place.
            sched: the ``Scheduler`` (read only): resident counts per user, weights, block
                arithmetic, the policy's victim choice.
        """
        self._protect(d, sched)
        if self._target_us is not None:
            if d.pending:
                now = sched.clock()
                for q in d.pending:
                    if d.protected_updates.get(q.user_id, self.protected.get(q.user_id, False)):
                        self._last_prefill_s[q.user_id] = now
            if not d.isolated:
                self._trim(d, sched)

    def _protect(self, d: PlanDraft, sched: Any) -> None:
        """Protection, room-making and isolation (steps 1-3 of the module docstring)."""
        if not d.pending and not d.blocked and d.stop != "preempted":
            return
        weight_of = sched._weight_of
        res = sched._resident_by_user
        delta: dict[str, int] = {}
        for q in d.preempted:
            delta[q.user_id] = delta.get(q.user_id, 0) - 1
        for q in d.admitted:
            delta[q.user_id] = delta.get(q.user_id, 0) + 1
        total_w = sched._resident_weight
        for u, dv in delta.items():
            before = res.get(u, 0)
            if before == 0 and before + dv > 0:
                total_w += weight_of(u)
            elif before > 0 and before + dv == 0:
                total_w -= weight_of(u)
        total = len(d.live) + len(d.admitted)
        num, den = self.enter_share.numerator, self.enter_share.denominator

        def count(u: str) -> int:
            return res.get(u, 0) + delta.get(u, 0)

        heads = d.blocked
        r = sched._reserved
        if r is not None and r.state not in WAITING_STATES:
            r = None
        if d.stop == "preempted" and not heads and len(sched.policy):
            # A growth preemption stopped admission: the next candidates still decide isolation.
            heads = [r] if r is not None else self._peek(d, sched, count, total, total_w)
        elif len(heads) == 1 and heads[0] is not r and d.stop == "kv":
            # Admission stopped at a request that does not fit (no backfill past it): a light
            # user's request further back still gets room.
            heads = heads + [q for q in self._peek(d, sched, count, total, total_w) if q is not heads[0]]
        if not d.pending and not heads:
            return
        waiting = sched._waiting_by_user
        updates = d.protected_updates
        for q in d.pending:
            u = q.user_id
            if u not in updates:
                demand = res.get(u, 0) + waiting.get(u, 0)  # admissions and preemptions move, not change, it
                updates[u] = fr.protected_next(self.protected.get(u, False), demand, weight_of(u), total, total_w,
                                               num, den)
        for q in heads:  # judged as if admitted
            u = q.user_id
            if u not in updates:
                c, w = count(u), weight_of(u)
                demand = res.get(u, 0) + waiting.get(u, 0)
                updates[u] = fr.protected_next(self.protected.get(u, False), demand, w, total + 1,
                                               total_w + (w if c == 0 else 0), num, den)
        protected = {u for u, on in updates.items() if on}
        if not protected:
            return
        # Shares as if the protected users' waiting heads joined the batch.
        joining = {q.user_id for q in heads if q.user_id in protected and count(q.user_id) == 0}
        total_j = total + len(joining)
        total_wj = total_w + sum(weight_of(u) for u in joining)
        over = {u for u in set(res) | set(delta)
                if count(u) > 0 and fr.over_served(count(u), weight_of(u), total_j, total_wj)}
        if not over:
            return
        targets = [q for q in heads if q.user_id in protected]
        if d.aging_due:  # the first blocked request's reservation comes first: room for it only
            targets = targets[:1] if targets and targets[0] is heads[0] else []
        if targets:
            if d.stop != "preempted":
                self._make_room(d, sched, targets, protected, over)
            elif not d.blocked:
                d.reserve = targets[0]  # admitted first next iteration; this one is isolated for it
        keep = {q for q in d.pending if q.user_id in protected and q in d.grants}
        if d.reserve is None and not keep:
            return
        if not fr.sit_out_allowed(self.streak, self.max_sit_out_ticks):
            return
        if r is not None and r in d.grants:  # the reservation holder's admission is never cut
            keep.add(r)
        cut = [q for q in d.order if q not in keep] + [q for q in d.admitted if q not in keep]
        if not cut:
            return
        n_full = len(d.order) + len(d.admitted)
        tok_full = sum(g[0] for g in d.grants.values())
        tok_cut = sum(d.grants[q][0] for q in cut)
        full_us = self.model.predict_us(n_full, tok_full)
        iso_us = self.model.predict_us(n_full - len(cut), tok_full - tok_cut)
        if not fr.isolation_pays(full_us, iso_us, self.min_speedup.numerator, self.min_speedup.denominator):
            return
        d.sat_out = [q for q in d.order if q not in keep]
        d.drop(cut)
        d.isolated = True

    def _peek(self, d: PlanDraft, sched: Any, count: Any, total: int, total_w: int) -> list[Any]:
        """Waiting candidates not admitted this iteration: the first ``peek_candidates`` in the
        policy's order, then, with at most 32 waiting users and a policy that has
        ``user_heads()``, the first waiting request of every other user (a light user behind
        more than ``peek_candidates`` requests of a heavy one, within its tolerance band, is
        still seen). None when no waiting user is below its fair share as if it joined the
        batch (a protected user always is: ``protected_next`` leaves at the fair share); that
        check is skipped with more than 32 waiting users."""
        waiting = sched._waiting_by_user
        few = len(waiting) <= 32
        if few:
            res, weight_of = sched._resident_by_user, sched._weight_of
            if not any((res.get(u, 0) + n) * (total_w + (weight_of(u) if count(u) == 0 else 0))
                       < weight_of(u) * (total + 1) for u, n in waiting.items()):
                return []
        out = []
        for q in sched.policy.admission_order():
            if q not in d.grants:
                out.append(q)
                if len(out) >= self.peek_candidates:
                    break
        user_heads = getattr(sched.policy, "user_heads", None)
        if few and user_heads is not None and len(out) >= self.peek_candidates:
            seen = {q.user_id for q in out}
            out += [q for q in user_heads() if q.user_id not in seen and q not in d.grants]
        return out

    def _make_room(self, d: PlanDraft, sched: Any, targets: list[Any], protected: set[str], over: set[str]) -> None:
        """Admit ``targets`` (protected users' requests that did not fit, in admission order).

        First by deferring this iteration's admissions of over-served users; if that does not
        fit them all, by preempting over-served requests (in the policy's victim order over
        them, never pinned ones, never one admitted this tick) for as many of them as
        possible, together with the protected requests admitted this iteration: then this
        iteration admits nothing, and the first of them holds the reservation for the next.
        """
        r = sched._reserved  # admitted this iteration: nothing goes before it (docs/fairness.md section 4)
        deferred = [q for q in d.admitted if q.user_id in over and q is not r]
        free = d.free_blocks + sum(d.grants[q][1] for q in deferred)
        budget = d.budget_tokens + sum(d.grants[q][0] for q in deferred)
        slots = sched.max_running - (len(d.live) + len(d.admitted) - len(deferred))
        fits, left = [], []
        for q in targets:
            need = sched._admission_blocks(q)
            if rules.can_allocate(free, need) and budget > 0 and slots > 0:
                n = rules.chunk_tokens(q.num_tokens, 0, sched.prefill_chunk_tokens, budget)
                fits.append((q, n, need))
                free, budget, slots = free - need, budget - n, slots - 1
            else:
                left.append(q)
        wanted = [q for q in d.admitted if q.user_id in protected] + targets
        if left and r not in d.grants and self._preempt_for(d, sched, wanted, over):  # it would drop r's admission
            return
        if not fits:
            return
        d.drop(deferred)
        for q, n, need in fits:
            d.grants[q] = [n, need]
            d.admitted.append(q)
            d.pending.append(q)
            d.free_blocks -= need
            d.budget_tokens -= n
            if q in d.blocked:
                d.blocked.remove(q)

    def _preempt_for(self, d: PlanDraft, sched: Any, wanted: list[Any], over: set[str]) -> bool:
        """Preempt over-served requests so that the longest possible prefix of ``wanted`` fits
        next iteration, which must reach past the requests admitted this one. Returns whether
        it did: then nothing is admitted this iteration and ``wanted[0]`` holds the reservation."""
        n_admitted = sum(1 for q in wanted if q in d.grants)
        free = d.free_blocks + sum(d.grants[q][1] for q in d.admitted)  # a preempting tick admits nothing
        needs = [sched._admission_blocks(q) for q in wanted]
        cands = [q for q in d.live if q.user_id in over and not q.pinned]
        victims: list[Any] = []
        covered, total = 0, 0  # the longest prefix of `wanted` that fits, and its blocks
        while True:
            while covered < len(wanted) and rules.can_allocate(free, total + needs[covered]):
                total += needs[covered]
                covered += 1
            if covered == len(wanted) or not cands:
                break
            v = sched.policy.choose_victim(cands)
            cands.remove(v)
            if fr.may_preempt(v.num_preemptions, sched.max_preemptions, v.admit_tick, sched.stats.ticks):
                victims.append(v)
                free += len(v.block_table) + (d.grants[v][1] if v in d.grants else 0)
        if covered <= n_admitted or not victims:
            return False  # no waiting target gains from preempting: they wait
        while len(victims) > 1:  # the last victims may not have been needed for the prefix
            v = victims[-1]
            if not rules.can_allocate(free - len(v.block_table) - (d.grants[v][1] if v in d.grants else 0), total):
                break
            free -= len(v.block_table) + (d.grants[v][1] if v in d.grants else 0)
            victims.pop()
        d.drop(list(d.admitted) + [v for v in victims if v in d.grants])
        gone = set(victims)
        d.live = [q for q in d.live if q not in gone]
        d.preempted.extend(victims)
        d.free_blocks += sum(len(v.block_table) for v in victims)
        d.stop = "preempted"
        d.reserve = wanted[0]
        return True

    def _trim(self, d: PlanDraft, sched: Any) -> None:
        """The iteration target (``iteration_target_s``): while a protected user is active, sit
        out over-served users' requests until the model predicts the iteration within the target.

        Candidates, cut first to last: this iteration's admissions of over-served users (they
        stay waiting), then their resident requests, fewest iterations sat out in a row first,
        then newest admission first, none that sat out K in a row (``may_trim``), so they take
        turns. Never the reservation holder, never a protected user's request; at least one
        request stays. Only with an identified latency model (``LatencyModel.ready``).
        """
        if not d.order or not self.model.ready:
            return
        res, waiting = sched._resident_by_user, sched._waiting_by_user
        last = self._last_prefill_s
        for u in [u for u in last if res.get(u, 0) + waiting.get(u, 0) == 0
                  or not d.protected_updates.get(u, self.protected.get(u, False))]:
            del last[u]  # left, or no longer protected
        if not last:
            return
        now = sched.clock()
        if not any(now - t <= self.active_window_s for t in last.values()):
            return
        n = len(d.order) + len(d.admitted)
        tokens = sum(g[0] for g in d.grants.values())
        target, predict = self._target_us, self.model.predict_us
        if not fr.over_target(predict(n, tokens), target):
            return
        counts: dict[str, int] = {}
        for q in itertools.chain(d.order, d.admitted):
            counts[q.user_id] = counts.get(q.user_id, 0) + 1
        weight_of = sched._weight_of
        total_w = sum(weight_of(u) for u in counts)
        over = {u for u, c in counts.items() if u not in last and fr.over_served(c, weight_of(u), n, total_w)}
        if not over:
            return
        r, run, K = sched._reserved, self._sat_out_run, self.max_sit_out_ticks
        residents = [(run.get(q, 0), -i, q) for i, q in enumerate(d.order)
                     if q.user_id in over and q is not r and fr.may_trim(run.get(q, 0), K)]
        residents.sort(key=lambda x: x[:2])
        cands = itertools.chain((q for q in reversed(d.admitted) if q.user_id in over and q is not r),
                                (q for _, _, q in residents))
        cut: list[Any] = []
        for q in cands:
            if n <= 1 or not fr.over_target(predict(n, tokens), target):
                break
            cut.append(q)
            n -= 1
            tokens -= d.grants[q][0]
        if not cut:
            return
        gone = set(cut)
        d.sat_out = [q for q in d.order if q in gone]
        d.drop(cut)
        d.trimmed = True

    def commit(self, isolated: bool, protected_updates: dict[str, bool], sat_out: Sequence[Any] = (),
               trimmed: bool = False) -> None:
        """After the iteration ran: advance the sit-out streak and the hysteresis states.

        Args:
            isolated: over-served requests sat out for a protected request's prefill.
            protected_updates: user -> protected, from the plan.
            sat_out: the requests that sat out (counted per request when a target is set).
            trimmed: they sat out to meet the iteration target (``streak_after``).
        """
        self.streak = fr.streak_after(self.streak, isolated, trimmed)
        if isolated:
            self.isolated_ticks += 1
        if trimmed:
            self.trimmed_ticks += 1
        if self._target_us is not None and (sat_out or self._sat_out_run):
            run = self._sat_out_run
            self._sat_out_run = {q: run.get(q, 0) + 1 for q in sat_out}
        if protected_updates:
            self.protected.update(protected_updates)
