"""The Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024;
artifact ``Ying1123/VTC-artifact``, ``vtc_req_queue.py``), weighted, with a tolerance band.

Rules (``spec.fairness_rules``, which the z3 proofs check; ``docs/fairness.md``): a counter grows
by ``w_p`` per prompt token computed for the first time and ``w_q`` per output token over the
weight (``charged_counter``); admission takes light users' requests first, then the earliest
``order_no`` among users within the tolerance of the least counter (``vtc_eligible``), charging its
prompt before the next pick; a returning user is lifted to the floor (``lift_floor``,
``lifted_counter``, at ``LIFT_TOLERANCE_TOKENS``); an idle user at or below it is forgotten
(``forgettable``: the lift restores the same counter).
"""
from __future__ import annotations

from bisect import insort
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from batch.policies.policy import Policy
from spec import fairness_rules as fr
from spec.concrete import fast

if TYPE_CHECKING:
    from batch.core.state import Seq


class VTCPolicy(Policy):
    """Weighted VTC. ``weights``: user -> int >= 1 (absent: 1); ``tolerance_tokens``: the band,
    weighted tokens (0: the paper's least-counter order; the counter-gap bound grows by it);
    ``prompt_price``, ``output_price``: ``w_p``, ``w_q`` (ints >= 0, not both 0); ``isolation``,
    ``headroom``, ``resume_first``: the mechanisms asked of the scheduler. ``ValueError`` if not."""

    name = "vtc"
    requeue_behind = True

    def __init__(self, *, weights: dict[str, int] | None = None, tolerance_tokens: int = fr.TOLERANCE_TOKENS,
                 prompt_price: int = fr.PROMPT_PRICE, output_price: int = fr.OUTPUT_PRICE,
                 isolation: bool = True, headroom: bool = True, resume_first: bool = True) -> None:
        super().__init__()
        weights = dict(weights or {})
        for name, v, low in (("tolerance_tokens", tolerance_tokens, 0), ("prompt_price", prompt_price, 0),
                             ("output_price", output_price, 0), *((f"weight of user {u!r}", w, 1)
                                                                  for u, w in weights.items())):
            if type(v) is not int or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if prompt_price == output_price == 0:
            raise ValueError("prompt_price and output_price cannot both be 0")
        for name, flag in (("isolation", isolation), ("headroom", headroom), ("resume_first", resume_first)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.isolation, self.headroom, self.resume_first = isolation, headroom, resume_first
        self.weights = weights
        self.tolerance_tokens, self.prompt_price, self.output_price = tolerance_tokens, prompt_price, output_price
        self._tol = tolerance_tokens * fr.COUNTER_SCALE  # counter units
        self._lift_tol = fr.LIFT_TOLERANCE_TOKENS * fr.COUNTER_SCALE
        self._queues: dict[str, list[Seq]] = {}  # backlogged user -> waiting requests by arrival
        self._n = 0
        self._counter: dict[str, int] = {}  # counter units; a missing (forgotten) user reads 0
        self.floor = 0  # the lift floor, counter units (only grows)
        self._active: set[str] = set()  # users with a request waiting or resident (told by on_idle)
        self._idle: list[tuple[int, str]] = []  # idle users above the floor, by counter (a heap)
        self._resumable: list[Seq] = []  # waiting preempted decodes by arrival (resume_first)

    def counter(self, user: str) -> int:
        """The user's counter, counter units (``COUNTER_SCALE`` a weighted token); a subclass may add
        service seen elsewhere (``GlobalVTCPolicy``), charges and lifts change the stored part."""
        return self._counter.get(user, 0)

    def weight(self, user_id: str) -> int:
        return self.weights.get(user_id, 1)

    def charge(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        units = fr.service_units(prompt_tokens, output_tokens, self.prompt_price, self.output_price)
        self._counter[user_id] = fr.charged_counter(self._counter.get(user_id, 0), units, self.weight(user_id))

    def __len__(self) -> int:
        return self._n

    def add(self, seq: Seq) -> None:
        self._enqueue(seq).append(seq)

    def requeue(self, seq: Seq) -> None:
        insort(self._enqueue(seq), seq, key=_order)
        if seq.req.generated:
            insort(self._resumable, seq, key=_order)

    def _enqueue(self, seq: Seq) -> list[Seq]:  # the user's queue, lifting a user becoming backlogged
        self._n += 1
        q = self._queues.get(seq.user_id)
        if q is None:
            self.lift(seq.user_id)
            q = self._queues[seq.user_id] = []
        return q

    def lift(self, user: str) -> None:
        """``user`` goes from idle to backlogged: raise the floor against the least counter of the
        other backlogged users, else of the other active ones (``lift_floor``), and the user's
        counter to it (``lifted_counter``)."""
        others = [self.counter(u) for u in self._queues if u != user] or \
            [self.counter(u) for u in self._active if u != user]
        self._raise_floor(fr.lift_floor(self.floor, min(others, default=0), bool(others), self._lift_tol))
        view = self.counter(user)
        self._counter[user] = self._counter.get(user, 0) + fr.lifted_counter(view, self.floor) - view
        self._active.add(user)

    def _raise_floor(self, floor: int) -> None:
        """Set the floor; idle users it reaches are forgotten (``forgettable``)."""
        self.floor = floor
        while self._idle and fr.forgettable(self._idle[0][0], floor):
            c, u = heappop(self._idle)
            if u not in self._active and self._counter.get(u) == c:
                self.forget(u)

    def forget(self, user: str) -> None:
        """Drop an idle user's counter (it reads 0 from then on; the floor is above it)."""
        self._counter.pop(user, None)

    def remove(self, seq: Seq) -> None:
        q = self._queues[seq.user_id]
        if q[0] is seq:
            del q[0]
        else:
            q.remove(seq)
        self._n -= 1
        if not q:
            del self._queues[seq.user_id]
        if self._resumable and seq in self._resumable:
            self._resumable.remove(seq)

    def resumable(self) -> list[Seq]:
        return self._resumable

    def on_idle(self, user_id: str) -> None:
        self._active.discard(user_id)
        if not self._active:  # nothing waiting or resident: everyone starts level (``idle_floor``)
            self._raise_floor(fr.idle_floor(self.floor, max(self._counter.values(), default=0)))
        if fr.forgettable(self.counter(user_id), self.floor):
            self.forget(user_id)
        else:
            heappush(self._idle, (self.counter(user_id), user_id))

    def pressure(self, user_id: str, resident_requests: int) -> int:
        return fr.pressure_units(resident_requests, self.weight(user_id), self.counter(user_id))

    def victim(self, candidates: Sequence[Seq]) -> Seq:
        """The user of highest ``pressure_units`` among the candidates' (counted among them) gives
        the victim when ``victim_user_first``; then ``spec.fairness_rules.victim_before``: light
        users' requests last (by the blocks ``candidates`` hold, ``within_share`` at 1/4), then
        fewest preemptions, fewest computed tokens, newest admission."""
        count: dict[str, int] = {}
        for s in candidates:
            count[s.user_id] = count.get(s.user_id, 0) + 1
        if len(count) > 1:
            p = {u: self.pressure(u, n) for u, n in count.items()}
            hi = max(p.values())
            if fr.victim_user_first(hi, min(p.values())):
                candidates = [s for s in candidates if p[s.user_id] == hi]
        blocks: dict[str, int] = {}
        for s in candidates:
            blocks[s.user_id] = blocks.get(s.user_id, 0) + len(s.block_table)
        total, total_w = sum(blocks.values()), sum(self.weight(u) for u in blocks)
        within, before = fast(fr.within_share), fast(fr.victim_before)  # plain-int forms (16x faster)
        light = {u for u, b in blocks.items() if within(b, self.weight(u), total, total_w, 1, 4)}
        best = candidates[0]
        for s in candidates[1:]:
            if before(s.user_id in light, s.num_preemptions, s.num_computed_tokens, s.admit_no,
                                best.user_id in light, best.num_preemptions, best.num_computed_tokens, best.admit_no):
                best = s
        return best

    def order(self, light: Callable[[str], bool] | None = None) -> Iterator[Seq]:
        """Waiting requests in admission order, lazily: first the requests of ``light`` users, by
        ``order_no``, each while its user's local counter is within the tolerance of the least
        counter of the users not light (``light_first``); then, among the users left within the
        tolerance of their least counter, the head first in ``order_no``; the pick's user is
        charged its uncharged prompt on a local copy between picks. The tolerance is
        ``band_tolerance``: 0 unless every backlogged user has the same weight. O(U) to start for
        U backlogged users, O(log U) a pick."""
        price = self.prompt_price
        tol = fr.band_tolerance(self._tol, len({self.weight(u) for u in self._queues}) <= 1)
        local = {u: self.counter(u) for u in self._queues}
        pos = dict.fromkeys(self._queues, 0)
        if light is not None:
            heads = [(q[0].order_no, u) for u, q in self._queues.items() if light(u)]
            others = [local[u] for u in self._queues if not light(u)]
            cap = min(others) if others else None
            heapify(heads)
            while heads:
                _, u = heappop(heads)
                if cap is not None and not fr.light_first(local[u], cap, tol):
                    continue  # its other requests wait in the band
                q = self._queues[u]
                seq = q[pos[u]]
                yield seq
                local[u] = fr.charged_counter(local[u], price * (seq.num_prompt_tokens - seq.prompt_charged_tokens),
                                              self.weight(u))
                pos[u] += 1
                if pos[u] < len(q):
                    heappush(heads, (q[pos[u]].order_no, u))
                else:
                    del pos[u]
        least = [(local[u], u) for u in pos]  # the users left, lazily re-keyed: the least counter
        outside = least[:]  # users not yet in the band, by counter
        heapify(least)
        heapify(outside)
        band: list[tuple[int, str]] = []  # eligible users by their head's order_no
        while pos:
            while least[0][1] not in pos or least[0][0] != local[least[0][1]]:
                heappop(least)
            top = least[0][0]
            while outside and fr.vtc_eligible(outside[0][0], top, tol):
                c, u = heappop(outside)
                if u in pos and c == local[u]:
                    heappush(band, (self._queues[u][pos[u]].order_no, u))
            while True:
                order_no, u = band[0]
                if u not in pos or self._queues[u][pos[u]].order_no != order_no:
                    heappop(band)  # stale: that head was yielded
                elif not fr.vtc_eligible(local[u], top, tol):
                    heappop(band)  # charged past the band since
                    heappush(outside, (local[u], u))
                else:
                    break
            heappop(band)
            seq = self._queues[u][pos[u]]
            yield seq
            local[u] = fr.charged_counter(local[u], price * (seq.num_prompt_tokens - seq.prompt_charged_tokens),
                                          self.weight(u))
            heappush(least, (local[u], u))
            pos[u] += 1
            if pos[u] < len(self._queues[u]):
                heappush(band, (self._queues[u][pos[u]].order_no, u))
            else:
                del pos[u]


def _order(seq: Seq) -> int:
    return seq.order_no
