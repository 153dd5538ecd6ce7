"""VTCPolicy: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), weighted, with a tolerance band, the lift of returning users, the drain
phase, preempted decodes resuming first and the light-user shield in victim choice
(``docs/fairness.md``)."""
from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, Iterator, Sequence

from batch.policies.queues import _Waiting, _arrival
from spec import fairness_rules as fr

#: Drain phase: VTC admits each user's longest waiting request first once the waiting requests
#: number at most this fraction of the resident ones (``VTCPolicy.before_admission``).
DRAIN_SHARE = (1, 2)
#: In the drain phase a waiting request is passed by later arrivals of its user at most this
#: many times; then it goes first again (no starvation).
MAX_DRAIN_PASSES = 8


def _uncharged_prompt_tokens(seq: Any) -> int:
    return seq.num_prompt_tokens - getattr(seq, "num_prompt_tokens_served", 0)


def remaining_iterations(seq: Any, chunk_tokens: int) -> int:
    """Iterations a waiting request still needs at most: its prefill (or recompute) chunks of
    ``chunk_tokens`` plus the decodes left to ``max_tokens`` (EOS may end it sooner)."""
    left = seq.req.max_tokens - len(seq.req.generated)
    return -(-seq.num_tokens // chunk_tokens) + max(0, left - 1)


class VTCPolicy:
    """Fair share across users: the Virtual Token Counter, weighted, with bounded backfill.

    Each user has a counter of the service it received: ``prompt_price`` (w_p = 1) per prompt
    token processed, charged once per request (a recompute after preemption is free), and
    ``output_price`` (w_q = 2) per output token, as produced; every charge is divided by the
    user's weight (``spec.fairness_rules.charged_counter``). Admission considers the backlogged
    users whose counter lies within ``tolerance_tokens`` of the smallest (``vtc_eligible``) and
    tries, among their waiting requests, the oldest arrival first: while no user's service runs
    ahead of the least-served one by more than the tolerance, admission is first come, first
    served; a user that does is passed over until the others catch up. Within one iteration it
    charges each admitted request's prompt in advance, so admissions interleave users. When a
    user goes from idle to backlogged its counter is lifted to ``tolerance_tokens`` (and one
    counter unit) below the smallest counter among the other backlogged users
    (``lifted_counter``): the others, at most the tolerance above it, may not run further
    ahead, so a returning user is served in turn at once instead of queueing behind the older
    requests of everyone in the band. A preempted
    request returns ahead of its user's later arrivals. The victim under KV pressure is chosen
    by ``choose_victim`` (by KV blocks, not by counter: see ``docs/fairness.md``).

    Args:
        weights: user id -> int weight >= 1 (weighted fair share); absent users weigh 1.
        tolerance_tokens: the fairness tolerance, weighted tokens (int >= 0; default
            ``spec.fairness_rules.TOLERANCE_TOKENS``, 0: the VTC paper's least-counter order).
            The counter-gap bound grows by it (``docs/fairness.md`` section 5).
        prompt_price: w_p, counter charge per prompt token (int >= 0).
        output_price: w_q, counter charge per output token (int >= 0).
        backfill: admission may pass a waiting request that does not fit (the scheduler
            bounds it: ``aging_ticks``, ``BACKFILL_WINDOW``). Off by default: on the bench's
            workloads it doubles preemptions for no throughput (``docs/fairness.md``).
        isolation: ask the scheduler for TTFT isolation (``isolation.Isolation``).
        admission_headroom: ask the scheduler to leave room for the next iteration's growth
            at admission (``spec.fairness_rules.growth_headroom_blocks``): fewer preemptions.
        easy_backfill: ask the scheduler to admit, past a first candidate that does not fit, the
            candidates that cannot delay it in the worst case (EASY backfilling, ``batch/core/backfill.py``).
        drain_longest_first: the drain phase (``before_admission``).
        resume_decodes_first: ask the scheduler to try each preempted request that already
            has output tokens (a decode preempted by recompute; ``resume_first``) before the
            counter order, oldest arrival first, and admit it if it fits now: vLLM and FCFS put
            a preempted request back at the head of the queue, since its token stream stalls
            for as long as it waits (TPOT, ITL). One that does not fit waits at its place in the
            counter order, so it never blocks the order or its aging. The aging reservation and
            a head of the counter order that is already blocked go before them, and EASY
            protects that head from them as from anything behind it. They are admissions out of
            counter order (``docs/fairness.md``, section 3).
        prefill_chunk_tokens: the chunk the drain phase counts prompt chunks in, tokens;
            ``None`` (default): the scheduler's (``min(prefill_chunk_tokens,
            token_budget_tokens)``, told by ``before_admission``).

    Raises:
        ValueError: a weight is not an int >= 1, or a price or ``tolerance_tokens`` is not an
            int >= 0, or both prices are 0,
            or ``prefill_chunk_tokens`` is not ``None`` or an int >= 1, or a flag is not a bool.

    Cost: ``add``/``requeue``/``remove`` O(log U) (U backlogged users) and O(1) in the number
    waiting; ``admission_order`` O(k log U) for the k users it looks at (``admission_order``);
    ``on_service`` O(1). In the drain phase (at most half as many waiting as resident)
    ``remove`` is O(position in its user's queue) and ``admission_order`` sorts each user's
    queue it reaches.

    Source: Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), the VTC algorithm;
    artifact ``Ying1123/VTC-artifact`` (``vtc_req_queue.py``).
    """

    def __init__(self, *, weights: dict[str, int] | None = None, tolerance_tokens: int = fr.TOLERANCE_TOKENS,
                 prompt_price: int = fr.PROMPT_PRICE,
                 output_price: int = fr.OUTPUT_PRICE, backfill: bool = False, isolation: bool = True,
                 admission_headroom: bool = True, easy_backfill: bool = True, drain_longest_first: bool = True,
                 resume_decodes_first: bool = True, prefill_chunk_tokens: int | None = None) -> None:
        weights = dict(weights or {})
        for user, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"weight of user {user!r} must be an int >= 1, got {w!r}")
        for name, p in (("prompt_price", prompt_price), ("output_price", output_price),
                        ("tolerance_tokens", tolerance_tokens)):
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise ValueError(f"{name} must be an int >= 0, got {p!r}")
        for name, flag in (("backfill", backfill), ("isolation", isolation), ("admission_headroom", admission_headroom),
                           ("easy_backfill", easy_backfill), ("drain_longest_first", drain_longest_first),
                           ("resume_decodes_first", resume_decodes_first)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if prompt_price == 0 and output_price == 0:
            raise ValueError("prompt_price and output_price cannot both be 0")
        if prefill_chunk_tokens is not None and (isinstance(prefill_chunk_tokens, bool) or not isinstance(
                prefill_chunk_tokens, int) or prefill_chunk_tokens < 1):
            raise ValueError(f"prefill_chunk_tokens must be an int >= 1 or None, got {prefill_chunk_tokens!r}")
        self.backfill = backfill
        self.isolation = isolation
        self.admission_headroom = admission_headroom
        self.easy_backfill = easy_backfill
        self.prompt_price = prompt_price
        self.output_price = output_price
        self._weights = weights
        self.tolerance_tokens = tolerance_tokens
        self._tolerance = tolerance_tokens * fr.COUNTER_SCALE  # counter units
        self._q = _Waiting()
        self._counter: dict[str, int] = {}
        self._unfolded: dict[str, list[int]] = {}  # [prompt, output] tokens not yet in the counter
        self._user_no: dict[str, int] = {}
        self._ver: dict[str, int] = {}
        self._heap: list[list[Any]] = []  # [counter, min waiting arrival, user_no, ver, user]; lazy
        self.drain_longest_first = drain_longest_first
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._chunk_tokens = prefill_chunk_tokens or 64  # the chunk the drain order counts in (tokens)
        self._drain = False  # set by before_admission: order each user's queue longest first
        self._passes: dict[Any, int] = {}  # waiting request -> later arrivals admitted before it (drain)
        self.resume_decodes_first = resume_decodes_first
        self._resumed: list[Any] = []  # waiting preempted decodes, by arrival_no (resume_decodes_first)

    # -------------------------------------------------------- counters

    def weight_of(self, user: str) -> int:
        """The user's share weight (1 unless given)."""
        return self._weights.get(user, 1)

    def counter(self, user: str) -> int:
        """The user's virtual token counter, in counter units (0 for an unknown user)."""
        c = self._counter.get(user, 0)
        acc = self._unfolded.pop(user, None)
        if acc is not None:
            units = fr.service_units(acc[0], acc[1], self.prompt_price, self.output_price)
            c = self._counter[user] = fr.charged_counter(c, units, self.weight_of(user))
        return c

    def counter_tokens(self, user: str) -> float:
        """The counter in weighted tokens (``counter / COUNTER_SCALE``), for reports."""
        return self.counter(user) / fr.COUNTER_SCALE

    def on_service(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """Charge ``user_id``: w_p per first-time prompt token, w_q per output token.

        O(1), once per user per iteration (the scheduler sums each user's tokens): the tokens
        are added up and folded into the counter (``service_units``, ``charged_counter``) when
        the counter is next read.
        """
        acc = self._unfolded.get(user_id)
        if acc is None:
            self._unfolded[user_id] = [prompt_tokens, output_tokens]
        else:
            acc[0] += prompt_tokens
            acc[1] += output_tokens

    # -------------------------------------------------------- the waiting queue

    def __len__(self) -> int:
        return self._q.n

    def add(self, seq: Any) -> None:
        if self._q.push(seq):
            self._activate(seq.user_id)

    def requeue(self, seq: Any) -> None:
        if self._q.push_front(seq):
            self._activate(seq.user_id)
        else:  # its user's oldest waiting arrival may go down: a fresh heap entry keeps keys lower bounds
            self._ver[seq.user_id] += 1
            self._push(seq.user_id)
        if self.resume_decodes_first and seq.num_tokens > seq.num_prompt_tokens:  # it has output tokens
            insort(self._resumed, seq, key=_arrival)

    def remove(self, seq: Any) -> None:
        if self._drain:  # an admission out of arrival order passes the user's older waiting requests
            for q in self._q.iter_user(seq.user_id):
                if q.arrival_no >= seq.arrival_no:
                    break
                self._passes[q] = self._passes.get(q, 0) + 1
        self.discard(seq)

    def discard(self, seq: Any) -> None:
        """``seq`` was aborted while waiting: it leaves the queue without passing anyone.

        ``remove`` counts a drain-phase admission as a pass of the user's older requests; an
        abort is not one (counting it would read the drain phase of whichever ``schedule()`` ran
        last).
        """
        self._passes.pop(seq, None)
        self._q.discard(seq)
        if self._resumed:
            r = self._resumed
            i = bisect_left(r, seq.arrival_no, key=_arrival)
            if i < len(r) and r[i] is seq:
                del r[i]

    def _activate(self, user: str) -> None:
        """The user went idle -> backlogged: lift its counter (``lifted_counter``) against the
        least counter among the other backlogged users, give it a fresh heap entry."""
        if user not in self._user_no:
            self._user_no[user] = len(self._user_no)
        self._ver[user] = self._ver.get(user, 0) + 1  # invalidates the user's old entries
        m = self._min_backlogged_counter()
        own = self.counter(user)
        lifted = fr.lifted_counter(own, 0 if m is None else m, m is not None, self._tolerance)
        # the lift is added to the stored counter, so that a subclass whose ``counter`` adds
        # service seen elsewhere (``batch.scaleout.counters.GlobalVTCPolicy``) lifts the sum;
        # here ``own`` is the stored counter, so this stores ``lifted``
        self._counter[user] = self._counter.get(user, 0) + (lifted - own)
        self._push(user)

    def _key(self, user: str) -> list[Any]:
        return [self.counter(user), self._q.min_arrival(user), self._user_no[user], self._ver[user], user]

    def _push(self, user: str) -> None:
        heappush(self._heap, self._key(user))
        if len(self._heap) > 2 * len(self._q.users) + 64:  # drop dead entries now and then
            self._heap = [self._key(u) for u in self._q.users]
            heapify(self._heap)

    def _valid(self, entry: list[Any]) -> bool:
        user = entry[4]
        return entry[3] == self._ver.get(user) and self._q.backlogged(user)

    def _min_backlogged_counter(self) -> int | None:
        """Smallest counter among backlogged users (other than one being activated), or None.

        Pops dead entries and re-keys stale ones at the top. A stored key is never above the
        true one: counters only grow, and so does a user's oldest waiting arrival, except when a
        preempted request is requeued, which pushes a fresh entry. So the first exact top is the
        minimum.
        """
        h = self._heap
        while h:
            top = h[0]
            if not self._valid(top):
                heappop(h)
                continue
            key = self._key(top[4])
            if key[:2] != top[:2]:
                heapreplace(h, key)
                continue
            return top[0]
        return None

    def before_admission(self, resident_requests: int, prefill_chunk_tokens: int | None = None) -> None:
        """Called by the scheduler in every ``schedule()``: enter or leave the drain phase.

        ``prefill_chunk_tokens`` is the scheduler's largest chunk per iteration (tokens), used
        to count prompt chunks unless the policy was given its own.

        In the drain phase (waiting requests <= ``DRAIN_SHARE`` of ``resident_requests``), each
        user's waiting requests are offered longest first (``remaining_iterations``: prompt
        chunks + ``max_tokens`` left), as LPT list scheduling does for makespan: the long
        requests start while the batch is still full instead of running alone at the end of a
        burst. Users are still ordered by counter, so the fair share is unchanged; a request
        passed ``MAX_DRAIN_PASSES`` times by later arrivals of its user goes first again.
        Outside the drain phase (a real backlog) each user's queue is first come, first served,
        so the TTFT tail is unchanged.
        """
        if self.prefill_chunk_tokens is None and prefill_chunk_tokens is not None:
            self._chunk_tokens = prefill_chunk_tokens
        num, den = DRAIN_SHARE
        self._drain = self.drain_longest_first and self._q.n * den <= num * resident_requests

    def _user_order(self, user: str) -> Iterator[Any]:
        """The user's waiting requests in admission order (arrival order, or drain order)."""
        it = self._q.iter_user(user)
        if not self._drain:
            return it
        chunk, passes = self._chunk_tokens, self._passes
        return iter(sorted(it, key=lambda q: (passes.get(q, 0) < MAX_DRAIN_PASSES,
                                              -remaining_iterations(q, chunk), q.arrival_no)))

    def user_heads(self) -> list[Any]:
        """Each backlogged user's first waiting request in its own order (arrival, or the drain
        order), oldest arrival first: O(U) for U backlogged users. Isolation's peek reads it to
        see every waiting user, not only the first in the admission order."""
        heads = [next(self._user_order(u)) for u in self._q.users]
        return sorted(heads, key=_arrival)

    def resume_first(self) -> Iterator[Any]:
        """The waiting preempted decodes (requests preempted after producing output tokens),
        oldest arrival first, when ``resume_decodes_first``; otherwise none.

        The scheduler tries each before ``admission_order`` (after the aging reservation, and
        after the order's first request when that one is blocked) and admits it if it fits now;
        one that does not fit is not blocked there and waits at its place in the counter order.
        O(1) to start; the list does not change until the plan is applied.
        """
        return iter(self._resumed if self.resume_decodes_first else ())

    def admission_order(self) -> Iterator[Any]:
        """Waiting requests in admission order, lazily: among the backlogged users within the
        tolerance of the least counter (``vtc_eligible``), the oldest waiting request first
        (arrival number; a preempted request keeps its own), each user's requests in its own
        order (arrival, or the drain order).

        Between yields the counter of the user just yielded is advanced by its request's
        uncharged prompt (as VTC charges at admission), on a local copy: the policy's state
        does not change (only its heap is tidied).

        Cost: O(k log U) for the k users it has to look at, of U backlogged. The policy's heap,
        keyed by (counter, oldest waiting arrival) with stored keys never above the true ones,
        is walked from its top only while a node's stored key is at most (least counter +
        tolerance, the best arrival in the band so far): nothing below a node beyond that can
        be picked next. Locally, heaps of the users reached: by counter (for the least one),
        outside the band by counter, inside it by their head's arrival. Local counters and the
        least one only grow, so a user leaves the band only by being charged; stale entries are
        dropped when they reach a top.
        """
        price, tol = self.prompt_price, self._tolerance
        self._min_backlogged_counter()  # tidy the top: its key is exact now
        heap = self._heap
        frontier = [(heap[0][0], heap[0][1], 0)] if heap else []  # heap nodes not walked yet
        reached: set[str] = set()
        live: dict[str, list[Any]] = {}  # user -> [local counter, head request, the rest]
        counters: list[tuple[int, str]] = []  # (counter, user) of live users: the least one
        outside: list[tuple[int, str]] = []  # (counter, user): live users not in the band yet
        band: list[tuple[int, str]] = []  # (head's arrival number, user)
        while True:
            if live:
                while live.get(counters[0][1], (None,))[0] != counters[0][0]:
                    heappop(counters)  # stale: charged since, or nothing left
                least = counters[0][0]
                while outside and fr.vtc_eligible(outside[0][0], least, tol):
                    c, u = heappop(outside)
                    v = live.get(u)
                    if v is not None and v[0] == c:
                        heappush(band, (v[1].arrival_no, u))
                while True:  # the least user is in the band, so it never empties here
                    arrival, user = band[0]
                    v = live.get(user)
                    if v is None or v[1].arrival_no != arrival:
                        heappop(band)  # stale: that head was yielded
                    elif not fr.vtc_eligible(v[0], least, tol):
                        heappop(band)  # charged past the band: back outside
                        heappush(outside, (v[0], user))
                    else:
                        break
            if frontier and (not live or frontier[0][:2] <= (least + tol, arrival)):
                _, _, i = heappop(frontier)
                for j in (2 * i + 1, 2 * i + 2):
                    if j < len(heap):
                        heappush(frontier, (heap[j][0], heap[j][1], j))
                u = heap[i][4]
                if u not in reached and self._valid(heap[i]):
                    reached.add(u)
                    rest = self._user_order(u)
                    head = next(rest, None)
                    if head is not None:
                        c = self.counter(u)
                        live[u] = [c, head, rest]
                        heappush(counters, (c, u))
                        heappush(outside, (c, u))
                continue
            if not live:
                return
            seq = v[1]
            yield seq
            heappop(band)
            v[0] = fr.charged_counter(v[0], price * _uncharged_prompt_tokens(seq), self.weight_of(user))
            heappush(counters, (v[0], user))
            v[1] = next(v[2], None)
            if v[1] is None:
                del live[user]
            else:
                heappush(band, (v[1].arrival_no, user))

    # -------------------------------------------------------- preemption

    def users_where(self, rule: Any, running: Sequence[Any]) -> set[str]:
        """The users of ``running`` for which ``rule(blocks, weight, total_blocks, total_weight)``
        holds, by the KV blocks their requests in ``running`` hold (``light_user``, ``over_served``)."""
        blocks: dict[str, int] = {}
        for s in running:
            blocks[s.user_id] = blocks.get(s.user_id, 0) + len(s.block_table)
        total = sum(blocks.values())
        total_w = sum(self.weight_of(u) for u in blocks)
        return {u for u, b in blocks.items() if rule(b, self.weight_of(u), total, total_w)}

    def choose_victim(self, running: Sequence[Any]) -> Any:
        """The request to preempt by recompute (``spec.fairness_rules.victim_before``).

        Requests of light users (``light_user`` by the KV blocks ``running`` holds: less than
        a quarter of the user's weighted fair share) go last; among the rest, the request
        preempted the fewest times, then the one with the fewest computed tokens (the least
        recompute lost), then the latest admitted.

        Why not "over-served users first", as this rule was: restricting victims to users above
        their share passes over cheaper victims of users near their share. Over 8 workload seeds
        (4 trace windows) that cost 0.013 of the throughput bound on ``azure-conv`` and 0.014 on
        ``mooncake-conv`` (``docs/fairness.md``, section 3).
        """
        light = self.users_where(fr.light_user, running)
        best = None
        for s in running:
            if best is None or fr.victim_before(s.user_id in light, s.num_preemptions, s.num_computed_tokens,
                                                s.admit_no, best.user_id in light, best.num_preemptions,
                                                best.num_computed_tokens, best.admit_no):
                best = s
        return best
