"""The reference tick: every rule of the default scheduler, written once more as plainly as
possible, to check the real one against on every tick (trace validation).

``Scheduler(check_invariants=True)`` (the test suite's default) takes a ``Snapshot`` of the
scheduler's state before each tick, asks ``reference_plan`` what the rules decide, and compares
it with the plan ``batch.core.step.schedule`` made; after ``forward`` it asks ``reference_apply``
what the tick must change (states, tokens, blocks, counters, admission order numbers, the
reservation and its protected holder, the isolation streak, the timestamps and counts the
metrics are computed from) and compares the scheduler's state after the tick. Any difference is
an ``InvariantViolation`` (``spec.invariants``).

What it covers (``docs/design.md``, "What the steps decide"): the running step (growth,
preemption by the policy's victim rule: VTC's pressure pre-selection then ``victim_before``;
neither pinned nor protected requests are victims; chunk size, token budget), admission (the
reservation holder unless a protected request is resident, resume-first trials, the policy's
order: VTC's light users first by ``order_no`` then the band; the slot cap, headroom, pinned
requests' worst case; room by preemption for the holder, for a light user's request and, under
pressure, after the quantum; the blocked head and the hold), isolation (light users by demand,
sit-outs, the streak bound), and apply (admission records, the protected holder, prompt charged
once, token kept only at the last known token, EOS and length finishes, blocks freed, counters
charged, requeue with a new ``order_no`` for VTC's preempted decodes, lifts on requeue,
forgetting, aging and the reservation).

It is written from the rules in ``spec.rules`` and ``spec.fairness_rules`` and the prose in
``docs/design.md``, not from the code: it iterates naively (O(n^2) is fine), derives VTC's
admission order from the counters and the requests' ``order_no`` rather than the policy's heaps,
derives the resume-first candidates from the requests' states, and recounts every share from
the request lists at each use. It models ``FCFSPolicy``, ``RoundRobinPolicy`` and ``VTCPolicy``
exactly, and the scale-out's ``GlobalVTCPolicy`` on its view of the counters (``Snapshot.forgets``
off); for other policies, and for prefix caching (hits, shared blocks), the checker skips it and
counts the tick (``InvariantChecker.skips``). A bug shared by the reference and the code (a
wrong ``spec/`` rule) is for the z3 proofs.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from itertools import chain
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import rules


@dataclass(frozen=True)
class Req:
    """A request as the rules see it. ``key`` is the scheduler's record (compared by identity)."""

    key: Any
    user: str
    arrival: int
    P: int  # prompt tokens
    M: int  # max_tokens
    g: int  # generated tokens
    nc: int  # num_computed_tokens
    h: int  # blocks held
    pre: int  # preemptions
    state: str
    pinned: bool = False
    admit_no: int = -1
    admit_tick: int = -1
    blocked: int = 0  # ticks as the blocked head
    charged: int = 0  # prompt tokens ever computed (charged once)
    started: bool = False  # has a first token
    order: int = -1  # order_no: the place in the admission order (arrival, or a new one once requeued behind)
    holder: bool = False  # admitted as the reservation holder while no request was protected
    progress: int = -1  # progress_tick: the tick it first computed past ``charged`` since its admission

    @property
    def n(self) -> int:
        return self.P + self.g


@dataclass(frozen=True)
class Cfg:
    cap: int
    B: int
    chunk: int
    budget: int
    max_running: int
    max_pre: int
    aging: int
    headroom: bool
    isolation: bool
    resume_first: bool
    K: int
    eos: int
    Q: int = fr.QUANTUM_TICKS  # quantum_ticks
    W: int = fr.HOLD_TICKS  # hold_ticks

    @property
    def max_len(self) -> int:
        return self.cap * self.B


@dataclass
class Snapshot:
    """The state before a tick. ``policy`` is ``"fcfs"``, ``"rr"`` or ``"vtc"``; ``queue`` the FCFS
    waiting order; ``turns`` round robin's users in turn order; ``counters`` (counter units, every
    user with a counter), ``floor``, ``weights``, ``tol`` (counter units) and ``prices`` VTC's;
    ``arrivals`` the arrival numbers handed out so far (VTC's requeued decodes take the next)."""

    cfg: Cfg
    free: int
    tick: int
    streak: int
    admissions: int
    reserved: Any
    running: list[Req]
    waiting: list[Req]
    policy: str
    queue: list[Any] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    floor: int = 0
    weights: dict[str, int] = field(default_factory=dict)
    tol: int = 0
    prices: tuple[int, int] = (1, 2)
    arrivals: int = 0
    protected: Any = None  # State.protected: the last request admitted as the protected holder, until it
    # is preempted or leaves (it is protected while ``fairness_rules.protected`` holds)
    forgets: bool = True  # VTC forgets idle users at the floor and levels at idle; the scale-out's
    # GlobalVTCPolicy does neither (its store says whom to forget): ``counters`` are then its view

    def weight(self, user: str) -> int:
        return self.weights.get(user, 1) if self.policy == "vtc" else 1

    def counter(self, user: str) -> int:
        return self.counters.get(user, 0)

    def pressure(self, user: str, resident: int) -> int:
        """``fairness_rules.pressure_units`` of ``user`` with ``resident`` requests resident (VTC only)."""
        return fr.pressure_units(resident, self.weight(user), self.counter(user))


@dataclass
class RefPlan:
    """What the rules decide: ``batch`` rows ``(key, num_new_tokens, new_blocks, admitted)``."""

    batch: list[tuple[Any, int, int, bool]]
    preempted: list[Any]
    sat_out: list[Any]
    blocked: Any
    stop: str
    isolated: bool


def req_of(s: Any) -> Req:
    """A scheduler record (``batch.core.state.Seq``) as a ``Req``."""
    return Req(s, s.user_id, s.arrival_no, s.num_prompt_tokens, s.req.max_tokens, len(s.req.generated),
               s.num_computed_tokens, len(s.block_table), s.num_preemptions, s.state, s.pinned, s.admit_no,
               s.admit_tick, s.blocked_ticks, s.prompt_charged_tokens, s.req.started_at is not None, s.order_no,
               s.holder, s.progress_tick)


def is_protected(snap: Snapshot, r: Req) -> bool:
    """``fairness_rules.protected`` at the snapshot's tick: the holder within the quantum of its admission."""
    return bool(fr.protected(r.holder, r.admit_tick, snap.tick, snap.cfg.Q))


def light_users(snap: Snapshot) -> set[str]:
    """The light users (``fairness_rules.light_user``): demand = the user's resident plus waiting
    requests, against all users' demand and the weights of the users with demand. A tick moves
    requests between resident and waiting only, so the demand before the tick is the demand
    throughout it."""
    demand = Counter(r.user for r in [*snap.running, *snap.waiting])
    total, total_w = sum(demand.values()), sum(snap.weight(u) for u in demand)
    return {u for u, d in demand.items() if fr.light_user(d, snap.weight(u), total, total_w)}


class NoVictim(AssertionError):
    """The rules ask for a victim and leave none: every resident request is pinned or protected
    (``docs/design.md`` step 1 says growth always finds one; with pinning it may not)."""


def victim(snap: Snapshot, cands: list[Req]) -> Req:
    """The policy's victim among ``cands`` (non-empty): FCFS and round robin the newest
    admission. VTC: count the candidates per user; when the highest and lowest pressure
    (``pressure_units(count, weight, counter)``) among their users differ by one resident
    request's worth (``victim_user_first``), keep only the highest-pressure user's candidates
    (every user at the highest, on a tie); among those the request no other goes before in
    ``victim_before``, light by ``within_share`` at 1/4 of the blocks those remaining candidates
    hold (before the tick)."""
    if not cands:
        raise NoVictim("the rules need a victim and every resident request is pinned or protected")
    if snap.policy != "vtc":
        return max(cands, key=lambda r: r.admit_no)
    count = Counter(r.user for r in cands)
    press = {u: snap.pressure(u, n) for u, n in count.items()}
    top = max(press.values())
    pool = [r for r in cands if press[r.user] == top] if fr.victim_user_first(top, min(press.values())) else cands
    held: dict[str, int] = {}
    for r in pool:
        held[r.user] = held.get(r.user, 0) + r.h
    total, total_w = sum(held.values()), sum(snap.weight(u) for u in held)
    light = {u for u, b in held.items() if fr.within_share(b, snap.weight(u), total, total_w, 1, 4)}
    for r in pool:  # victim_before is a strict order: the victim is the request none goes before
        if not any(fr.victim_before(q.user in light, q.pre, q.nc, q.admit_no, r.user in light, r.pre, r.nc,
                                    r.admit_no) for q in pool if q is not r):
            return r
    raise AssertionError("victim_before is not a strict order on the candidates")


def vtc_order(snap: Snapshot, light: set[str]) -> Iterator[Req]:
    """VTC's admission order, with the tolerance ``band_tolerance`` (the band only while every
    user with a waiting request has the same weight): the waiting requests of light users first,
    by ``order_no``, each while its user's local counter (charged its earlier picks' uncharged
    prompts) is within the tolerance of the least counter of the users not light (``light_first``;
    once not, that user's requests left join the others); then, repeatedly, among the users
    left whose local counter is within the tolerance of the least of theirs, the user whose
    earliest waiting request (by ``order_no``) comes first; that request goes next and its user's
    local counter is charged its uncharged prompt."""
    pp, _ = snap.prices
    by_order = sorted(snap.waiting, key=lambda r: r.order)
    tol = fr.band_tolerance(snap.tol, len({snap.weight(r.user) for r in snap.waiting}) <= 1)
    local = {r.user: snap.counter(r.user) for r in by_order}
    others = [local[u] for u in local if u not in light]
    cut: set[str] = set()  # light users past light_first
    out: list[Req] = []
    for r in by_order:
        if r.user in light and r.user not in cut:
            if others and not fr.light_first(local[r.user], min(others), tol):
                cut.add(r.user)
                continue
            out.append(r)
            local[r.user] = fr.charged_counter(local[r.user], pp * (r.P - r.charged), snap.weight(r.user))
    yield from out
    first = {id(r) for r in out}
    queues: dict[str, deque[Req]] = {}
    for r in by_order:
        if id(r) not in first:
            queues.setdefault(r.user, deque()).append(r)
    while queues:  # lazily: the plan consumes only the picks it reaches
        least = min(local[u] for u in queues)
        elig = [u for u in queues if fr.vtc_eligible(local[u], least, tol)]
        u = min(elig, key=lambda u: queues[u][0].order)
        r = queues[u].popleft()
        yield r
        local[u] = fr.charged_counter(local[u], pp * (r.P - r.charged), snap.weight(u))
        if not queues[u]:
            del queues[u]


def rr_queues(snap: Snapshot) -> list[list[Req]]:
    """Round robin's per-user queues in turn order: each user's waiting requests by arrival
    (first come first served; a preempted request returns ahead of its user's later arrivals)."""
    by_user: dict[str, list[Req]] = {}
    for r in sorted(snap.waiting, key=lambda r: r.arrival):
        by_user.setdefault(r.user, []).append(r)
    assert set(by_user) == set(snap.turns), f"round robin's turns {snap.turns} are not the waiting users"
    return [by_user[u] for u in snap.turns]


def rr_order(snap: Snapshot) -> list[Req]:
    """Round robin's admission order: rounds over the users in turn order, each user's next
    request per round."""
    qs = rr_queues(snap)
    return [q[i] for i in range(max(map(len, qs), default=0)) for q in qs if i < len(q)]


def reference_plan(snap: Snapshot) -> RefPlan:
    """The plan the rules give for ``snap`` (see the module docstring)."""
    c = snap.cfg
    free, budget = snap.free, c.budget
    live = list(snap.running)  # resident and not preempted in this plan, in admission order
    grant: dict[Any, tuple[int, int]] = {}  # key -> (tokens, blocks), in grant order
    preempted: list[Req] = []
    taken: list[Req] = []  # admitted in this plan

    def preemptible(r: Req) -> bool:
        return not r.pinned and not is_protected(snap, r)

    def preempt(v: Req, last_resort: bool = False) -> None:
        nonlocal budget, free
        assert fr.may_preempt(v.pre, c.max_pre, v.admit_tick, snap.tick), f"victim {v.key} may not be preempted"
        assert preemptible(v) or (last_resort and not v.pinned), f"victim {v.key} is pinned or protected"
        live.remove(v)
        preempted.append(v)
        k, b = grant.pop(v.key, (0, 0))
        budget += k
        free += v.h + b

    for s in snap.running:  # 1. the running requests, in admission order
        if s not in live or budget <= 0:
            continue
        need = rules.growth_blocks(s.h, s.n, c.B)
        while not rules.can_allocate(free, need):  # growth: the protected request only when no other is preemptible
            cands = [q for q in live if preemptible(q)]
            preempt(victim(snap, cands or [q for q in live if not q.pinned]), not cands)
            if s not in live:
                break
        if s in live:
            k = rules.chunk_tokens(s.n, s.nc, c.chunk, budget)
            if k > 0:
                grant[s.key] = (k, need)
                free -= need
                budget -= k
    light = light_users(snap) if c.isolation else set()  # without isolation no user is light (steps 2 and 3)
    stop, blocked = ("preempted" if preempted else "empty"), None
    reserved = next((r for r in snap.waiting if r.key is snap.reserved), None)
    holder = reserved if reserved is not None and not any(is_protected(snap, r) for r in snap.running) else None
    if not preempted:  # 2. admission
        order = vtc_order(snap, light) if snap.policy == "vtc" else rr_order(snap) if snap.policy == "rr" else [
            next(r for r in snap.waiting if r.key is k) for k in snap.queue]
        trials = sorted((r for r in snap.waiting if r.state == lc.PREEMPTED and r.g > 0), key=lambda r: r.order) \
            if c.resume_first and snap.policy == "vtc" and holder is None else []
        cands = chain([(holder, False)] if holder is not None else [], ((r, True) for r in trials),
                      ((r, False) for r in order))
        taken_ids: set[int] = set()
        for q, trial in cands:
            if id(q) in taken_ids:
                continue
            resident = len(live) + len(taken)
            if resident >= c.max_running:
                stop = "max_running"
                break
            if budget <= 0:
                stop = "budget"
                break
            need = rules.blocks_needed(q.n, c.B)
            if fr.pinned(q.pre, c.max_pre):
                need = max(need, fr.worst_case_blocks(q.P, q.M, c.max_len, c.B))
            room = fr.growth_headroom_blocks(resident, c.B) if c.headroom and q is not holder else 0
            if not fr.can_admit(free, need, room):
                if trial:
                    continue
                victims = room_victims(snap, q, q is holder, q.user in light, need, free, live, taken, grant)
                if victims is None:
                    if q is holder:
                        continue
                    if blocked is None:
                        stop, blocked = "kv", q
                    if not fr.hold_elapsed(blocked.blocked, c.W):
                        break
                    continue
                for v in victims:
                    preempt(v)
                stop = "room"
            k = rules.chunk_tokens(q.n, 0, c.chunk, budget)
            grant[q.key] = (k, need)
            taken.append(q)
            taken_ids.add(id(q))
            free -= need
            budget -= k
    rows = [(key, k, b, i >= len(grant) - len(taken)) for i, (key, (k, b)) in enumerate(grant.items())]
    sat_out: list[Any] = []
    isolated = False
    if c.isolation and fr.sit_out_allowed(snap.streak, c.K) and len(rows) > 1:  # 3. isolation
        by_key = {r.key: r for r in [*snap.running, *snap.waiting]}
        keep = [(by_key[key].g == 0 and by_key[key].user in light)
                or (adm and reserved is not None and key is reserved.key) for key, _, _, adm in rows]
        if any(keep) and not all(keep):
            sat_out = [key for (key, _, _, adm), kept in zip(rows, keep) if not kept and not adm]
            rows = [row for row, kept in zip(rows, keep) if kept]
            isolated = True
    return RefPlan(rows, [v.key for v in preempted], sat_out, None if blocked is None else blocked.key, stop,
                   isolated)


def room_victims(snap: Snapshot, q: Req, holder: bool, light: bool, need: int, free: int, live: list[Req],
                 taken: list[Req], grant: dict[Any, tuple[int, int]]) -> list[Req] | None:
    """Room for ``q``, a candidate whose blocks plus headroom do not fit: victims in the policy's
    victim order until its blocks fit without headroom, or ``None`` when even all the allowed
    ones would not do. Allowed: requests admitted before this tick (``may_preempt``), neither
    pinned nor protected, and of those, for the holder any not admitted as a holder
    (``not_a_holder``); for a light user's request those of other users over their weighted
    share of the resident requests (``within_share`` at 1/1, with ``q`` counted admitted) past
    their prompt high-water mark (``past_high_water``); for another request, when the policy
    keeps shares (VTC), those of other users, not admitted as a holder (``not_a_holder``), past
    their high-water mark ``quantum_ticks`` ticks (``quantum_elapsed`` from it) whose users it
    ``may_take`` from, with the resident counts as the victims are chosen (each pick is among those it may take from
    then). ``light`` is false for every user without isolation."""
    c = snap.cfg
    base = [r for r in live if not r.pinned and not is_protected(snap, r)
            and fr.may_preempt(r.pre, c.max_pre, r.admit_tick, snap.tick)]
    resident = Counter(r.user for r in [*live, *taken])

    def freed(v: Req) -> int:
        return v.h + grant.get(v.key, (0, 0))[1]

    if holder or light:
        if holder:
            cands = [r for r in base if fr.not_a_holder(r.holder)]
        else:
            users = resident + Counter([q.user])
            total, total_w = sum(users.values()), sum(snap.weight(u) for u in users)
            over = {u for u, n in users.items() if not fr.within_share(n, snap.weight(u), total, total_w, 1, 1)}
            cands = [r for r in base if r.user in over and r.user != q.user
                     and fr.past_high_water(r.progress, r.admit_tick)]
        if sum(freed(v) for v in cands) + free < need:
            return None
        victims: list[Req] = []
        while not rules.can_allocate(free, need):
            v = victim(snap, cands)
            cands.remove(v)
            victims.append(v)
            free += freed(v)
        return victims
    if snap.policy != "vtc":  # FCFS and round robin keep no shares among resident requests
        return None
    cands = [r for r in base if r.user != q.user and fr.not_a_holder(r.holder)
             and fr.past_high_water(r.progress, r.admit_tick) and fr.quantum_elapsed(r.progress, snap.tick, c.Q)]
    victims = []
    while not rules.can_allocate(free, need):
        mine = snap.pressure(q.user, resident[q.user] + 1)
        cands = [r for r in cands if fr.may_take(mine, snap.pressure(r.user, resident[r.user] - 1))]
        if not cands:
            return None
        v = victim(snap, cands)
        cands.remove(v)
        victims.append(v)
        resident[v.user] -= 1
        free += freed(v)
    return victims


@dataclass
class After:
    """The state a tick must leave: every request (by key), the FCFS queue, round robin's turns,
    VTC's counters and floor, the reservation, the protected holder, the streak, the admission
    and arrival numbers handed out, and per producing request its token's kind."""

    reqs: dict[Any, Req]
    queue: list[Any]
    turns: list[str]
    counters: dict[str, int]
    floor: int
    reserved: Any
    protected: Any  # State.protected: the last request admitted as the protected holder, until it leaves
    streak: int
    admissions: int
    arrivals: int
    first_token: list[Any]  # requests whose first token this tick gave
    produced: list[Any]  # requests whose token was kept
    finished: list[tuple[Any, str]]


def reference_apply(snap: Snapshot, plan: RefPlan, tokens: Sequence[int]) -> After:
    """The state after ``plan`` ran and ``forward`` returned ``tokens`` (one per batch row)."""
    c = snap.cfg
    reqs = {r.key: r for r in [*snap.running, *snap.waiting]}
    queue, turns = list(snap.queue), list(snap.turns)
    counters, floor, arrivals, protected = dict(snap.counters), snap.floor, snap.arrivals, snap.protected
    waiting_users = {r.user for r in snap.waiting}
    n_waiting = Counter(r.user for r in snap.waiting)  # requests waiting per user, as the tick goes
    active = {r.user for r in [*snap.running, *snap.waiting]}  # users with a live request
    lift_tol = fr.LIFT_TOLERANCE_TOKENS * fr.COUNTER_SCALE
    for key in plan.preempted:  # requeued (lifted if its user had nothing waiting), before admissions leave
        r = reqs[key]
        order = r.order
        if snap.policy == "vtc" and r.g > 0:  # a preempted decode takes the next arrival number
            order, arrivals = arrivals, arrivals + 1
        reqs[key] = replace(r, nc=0, h=0, pre=r.pre + 1, state=lc.PREEMPTED, order=order)
        protected = None if protected is key else protected
        queue.insert(0, key)
        n_waiting[r.user] += 1
        if r.user not in turns:  # round robin: a user with nothing waiting joins at the back
            turns.append(r.user)
        if snap.policy == "vtc" and r.user not in waiting_users:
            others = [counters.get(u, 0) for u in waiting_users] or \
                [counters.get(u, 0) for u in active if u != r.user]
            floor = fr.lift_floor(floor, min(others, default=0), bool(others), lift_tol)
            counters[r.user] = fr.lifted_counter(counters.get(r.user, 0), floor)
        waiting_users.add(r.user)
    admissions, reserved = snap.admissions, snap.reserved
    charges: dict[str, list[int]] = {}
    first, produced, finished = [], [], []
    for (key, k, b, adm), tok in zip(plan.batch, tokens):
        r = reqs[key]
        if adm:
            # the holder becomes the protected one when no request is protected at its admission
            # (in batch order: a protected request that finished earlier in this batch is gone)
            holder = key is snap.reserved and (protected is None or not is_protected(snap, reqs[protected]))
            r = replace(r, state=lc.PREFILLING, admit_no=admissions, admit_tick=snap.tick,
                        pinned=bool(fr.pinned(r.pre, c.max_pre)), blocked=0, holder=holder)
            admissions += 1
            if holder:
                protected = key
            if snap.policy == "fcfs":
                queue.remove(key)
            n_waiting[r.user] -= 1
            if snap.policy == "rr":  # the user moves behind the others, or leaves with nothing waiting
                turns.remove(r.user)
                if n_waiting[r.user]:
                    turns.append(r.user)
            reserved = None if reserved is key else reserved
        r = replace(r, h=r.h + b)
        if r.progress < r.admit_tick and r.nc + k > r.charged:
            r = replace(r, progress=snap.tick)
        if r.nc < r.P:
            charges.setdefault(r.user, [0, 0])[0] += fr.new_prompt_tokens(r.nc, k, r.P, r.charged)
            r = replace(r, charged=fr.prompt_high_water(r.charged, r.nc, k, r.P))
        r = replace(r, nc=r.nc + k)
        if rules.produces_token(r.nc - k, k, r.n):
            charges.setdefault(r.user, [0, 0])[1] += 1
            produced.append(key)
            if not r.started:
                first.append(key)
            r = replace(r, g=r.g + 1, started=True)
            why = "stop" if tok == c.eos else "length" if rules.reached_length(r.g, r.M, r.n, c.max_len) else None
            if why is not None:
                r = replace(r, state=lc.DONE, h=0)
                finished.append((key, why))
                protected = None if protected is key else protected
            elif r.state == lc.PREFILLING:
                r = replace(r, state=lc.DECODING)
        reqs[key] = r
    pp, op = snap.prices
    if snap.policy == "vtc":
        for u, (p, o) in charges.items():
            counters[u] = fr.charged_counter(counters.get(u, 0), fr.service_units(p, o, pp, op), snap.weight(u))
        live = lc.RESIDENT_STATES | lc.WAITING_STATES
        after = {r.user for r in reqs.values() if r.state in live}
        if not snap.forgets:
            pass
        elif active - after and not after:  # the last active user went idle: everyone starts level
            floor = fr.idle_floor(floor, max(counters.values(), default=0))
        for u in [u for u in counters if snap.forgets and u not in after and fr.forgettable(counters[u], floor)]:
            del counters[u]  # an idle user at or below the floor is forgotten
    b = reqs.get(plan.blocked) if plan.blocked is not None else None
    if b is not None and b.state in lc.WAITING_STATES:
        b = reqs[plan.blocked] = replace(b, blocked=b.blocked + 1)
        if reserved is None and fr.reserved_after(b.blocked, c.aging):
            reserved = plan.blocked
    return After(reqs, queue, turns, counters, floor, reserved, protected, fr.next_streak(snap.streak, plan.isolated),
                 admissions, arrivals, first, produced, finished)
