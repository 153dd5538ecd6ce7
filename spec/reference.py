"""The reference tick: every rule of the default scheduler, written once more as plainly as
possible, to check the real one against on every tick (trace validation).

``Scheduler(check_invariants=True)`` (the test suite's default) takes a ``Snapshot`` of the
scheduler's state before each tick, asks ``reference_plan`` what the rules decide, and compares
it with the plan ``batch.core.step.schedule`` made; after ``forward`` it asks ``reference_apply``
what the tick must change (states, tokens, blocks, counters, the reservation, the isolation
streak, the timestamps and counts the metrics are computed from) and compares the scheduler's
state after the tick. Any difference is an ``InvariantViolation`` (``spec.invariants``).

What it covers: the running step (growth, preemption by the policy's victim rule, chunk size,
token budget), admission (the reservation, resume-first trials, the policy's order with VTC's
band, charges between picks and lift floor, the slot cap, headroom, pinned requests' worst
case, room made for a light user's head), isolation (light users, sit-outs, the streak bound),
and apply (admission records, prompt charged once, token kept only at the last known token,
EOS and length finishes, blocks freed, counters charged, lifts on requeue, forgetting, aging).

It is written from the rules in ``spec.rules`` and ``spec.fairness_rules`` and the prose in
``docs/design.md`` and ``docs/fairness.md``, not from the code: it iterates naively (O(n^2) is
fine), derives VTC's admission order from the counters and the requests' arrival numbers rather
than the policy's heaps, and derives the resume-first candidates from the requests' states. It
models ``FCFSPolicy``, ``RoundRobinPolicy`` and ``VTCPolicy`` exactly; for other policies the checker skips it.
A bug shared by the reference and the code (a wrong ``spec/`` rule) is for the z3 proofs.
"""
from __future__ import annotations

from collections import Counter
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

    @property
    def max_len(self) -> int:
        return self.cap * self.B


@dataclass
class Snapshot:
    """The state before a tick. ``policy`` is ``"fcfs"``, ``"rr"`` or ``"vtc"``; ``queue`` the FCFS
    waiting order; ``turns`` round robin's users in turn order; ``counters`` (counter units, every
    user with a counter) and ``floor`` VTC's."""

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

    def weight(self, user: str) -> int:
        return self.weights.get(user, 1) if self.policy == "vtc" else 1


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
               s.admit_tick, s.blocked_ticks, s.prompt_charged_tokens, s.req.started_at is not None)


def _victim(snap: Snapshot, cands: list[Req], blocks: dict[Any, int]) -> Req:
    """The policy's victim among ``cands``: FCFS and round robin the newest admission; VTC
    ``victim_before``."""
    if snap.policy != "vtc":
        return max(cands, key=lambda r: r.admit_no)
    held: dict[str, int] = {}
    for r in cands:
        held[r.user] = held.get(r.user, 0) + blocks[r.key]
    total, total_w = sum(held.values()), sum(snap.weight(u) for u in held)
    light = {u for u, b in held.items() if fr.within_share(b, snap.weight(u), total, total_w, 1, 4)}
    # victim_before is a strict order; the victim is the request no other goes before
    for r in cands:
        if not any(fr.victim_before(q.user in light, q.pre, q.nc, q.admit_no, r.user in light, r.pre, r.nc,
                                    r.admit_no) for q in cands if q is not r):
            return r
    raise AssertionError("victim_before is not a strict order on the candidates")


def vtc_order(snap: Snapshot) -> list[Req]:
    """VTC's admission order: repeatedly, among users with a waiting request whose local counter is
    within the tolerance of the least, the user whose oldest waiting request arrived first; that
    request goes next and its user's local counter is charged its uncharged prompt."""
    pp, _ = snap.prices
    queues: dict[str, list[Req]] = {}
    for r in sorted(snap.waiting, key=lambda r: r.arrival):
        queues.setdefault(r.user, []).append(r)
    local = {u: snap.counters.get(u, 0) for u in queues}
    out = []
    while queues:
        least = min(local[u] for u in queues)
        elig = [u for u in queues if fr.vtc_eligible(local[u], least, snap.tol)]
        u = min(elig, key=lambda u: queues[u][0].arrival)
        r = queues[u].pop(0)
        out.append(r)
        local[u] = fr.charged_counter(local[u], pp * (r.P - r.charged), snap.weight(u))
        if not queues[u]:
            del queues[u]
    return out


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


def _light(snap: Snapshot, user: str, total: int, total_w: int) -> bool:
    demand = sum(1 for r in snap.running if r.user == user) + sum(1 for r in snap.waiting if r.user == user)
    return bool(fr.within_share(demand, snap.weight(user), total, total_w, 1, 2))


def reference_plan(snap: Snapshot) -> RefPlan:
    """The plan the rules give for ``snap`` (see the module docstring)."""
    c = snap.cfg
    free, budget = snap.free, c.budget
    live = list(snap.running)
    grant: dict[Any, tuple[int, int]] = {}  # key -> (tokens, blocks), in grant order
    preempted: list[Req] = []
    blocks = {r.key: r.h for r in live}

    def preempt(v: Req) -> int:
        nonlocal budget
        assert fr.may_preempt(v.pre, c.max_pre, v.admit_tick, snap.tick), f"victim {v.key} may not be preempted"
        live.remove(v)
        preempted.append(v)
        k, b = grant.pop(v.key, (0, 0))
        budget += k
        return v.h + b

    for s in snap.running:  # 1. the running requests, in admission order
        if s not in live or budget <= 0:
            continue
        need = rules.growth_blocks(s.h, s.n, c.B)
        while not rules.can_allocate(free, need):
            free += preempt(_victim(snap, [q for q in live if not q.pinned], blocks))
            if s not in live:
                break
        if s in live:
            k = rules.chunk_tokens(s.n, s.nc, c.chunk, budget)
            if k > 0:
                grant[s.key] = (k, need)
                free -= need
                budget -= k
    stop, blocked, taken = ("preempted" if preempted else "empty"), None, []
    reserved = next((r for r in snap.waiting if r.key is snap.reserved), None)
    if not preempted:  # 2. admission
        order = vtc_order(snap) if snap.policy == "vtc" else rr_order(snap) if snap.policy == "rr" else [
            next(r for r in snap.waiting if r.key is k) for k in snap.queue]
        trials = ([r for r in sorted(snap.waiting, key=lambda r: r.arrival) if r.state == lc.PREEMPTED and r.g > 0]
                  if c.resume_first and snap.policy == "vtc" and reserved is None else [])
        cands = ([(reserved, False)] if reserved is not None else []) + [(r, True) for r in trials] + \
            [(r, False) for r in order]
        passing, seen, n_users = False, set(), len({r.user for r in snap.waiting})
        for q, trial in cands:
            if q in taken:
                continue
            if passing:  # past a blocked head that is not light: each light user's first request
                if len(seen) >= n_users:
                    break
                if q.user in seen:
                    continue
                seen.add(q.user)
                if not _joins_light(snap, q, live, taken):
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
            room = fr.growth_headroom_blocks(resident, c.B) if c.headroom and q is not reserved else 0
            if not fr.can_admit(free, need, room):
                if trial:
                    continue
                if blocked is None:
                    stop, blocked = "kv", q
                victims = _room_victims(snap, q, need, free, live, taken, grant) if c.isolation else None
                if victims is None:
                    if c.isolation and not passing and q is not reserved:
                        passing = True
                        seen.add(q.user)
                        continue
                    break
                for v in victims:
                    free += preempt(v)
                stop = "room"
                if blocked is q:
                    blocked = None
            k = rules.chunk_tokens(q.n, 0, c.chunk, budget)
            grant[q.key] = (k, need)
            taken.append(q)
            free -= need
            budget -= k
            if stop == "room":
                break
    rows = [(key, k, b, i >= len(grant) - len(taken)) for i, (key, (k, b)) in enumerate(grant.items())]
    sat_out: list[Any] = []
    isolated = False
    if c.isolation and fr.sit_out_allowed(snap.streak, c.K) and len(rows) > 1:  # 3. isolation
        users = [r.user for r in live] + [r.user for r in taken]
        total, total_w = len(users), sum(snap.weight(u) for u in set(users))
        by_key = {r.key: r for r in [*snap.running, *snap.waiting]}
        keep = [(by_key[key].g == 0 and _light(snap, by_key[key].user, total, total_w))
                or (adm and reserved is not None and key is reserved.key) for key, _, _, adm in rows]
        if any(keep) and not all(keep):
            sat_out = [key for (key, _, _, adm), kept in zip(rows, keep) if not kept and not adm]
            rows = [row for row, kept in zip(rows, keep) if kept]
            isolated = True
    return RefPlan(rows, [v.key for v in preempted], sat_out, None if blocked is None else blocked.key, stop,
                   isolated)


def _joins_light(snap: Snapshot, q: Req, live: list[Req], taken: list[Req]) -> bool:
    """``q``'s user is light with ``q`` admitted beside ``live`` and ``taken``."""
    users = [r.user for r in live] + [r.user for r in taken] + [q.user]
    return _light(snap, q.user, len(users), sum(snap.weight(u) for u in set(users)))


def _room_victims(snap: Snapshot, head: Req, need: int, free: int, live: list[Req], taken: list[Req],
                  grant: dict[Any, tuple[int, int]]) -> list[Req] | None:
    """Room for a light user's head: no headroom, then victims among users over their share."""
    users = [r.user for r in live] + [r.user for r in taken] + [head.user]
    total, total_w = len(users), sum(snap.weight(u) for u in set(users))
    if not _light(snap, head.user, total, total_w):
        return None
    over = {u for u in set(users) if not fr.within_share(users.count(u), snap.weight(u), total, total_w, 1, 1)}
    cands = [r for r in live if r.user in over and not r.pinned]
    blocks = {r.key: r.h for r in live}
    victims: list[Req] = []
    while cands and not rules.can_allocate(free, need):
        v = _victim(snap, cands, blocks)
        cands.remove(v)
        victims.append(v)
        free += v.h + grant.get(v.key, (0, 0))[1]
    return victims if rules.can_allocate(free, need) else None


@dataclass
class After:
    """The state a tick must leave: every request (by key), the FCFS queue, round robin's turns,
    VTC's counters and floor, the reservation, the streak, and per producing request its token's
    kind."""

    reqs: dict[Any, Req]
    queue: list[Any]
    turns: list[str]
    counters: dict[str, int]
    floor: int
    reserved: Any
    streak: int
    admissions: int
    first_token: list[Any]  # requests whose first token this tick gave
    produced: list[Any]  # requests whose token was kept
    finished: list[tuple[Any, str]]


def reference_apply(snap: Snapshot, plan: RefPlan, tokens: Sequence[int]) -> After:
    """The state after ``plan`` ran and ``forward`` returned ``tokens`` (one per batch row)."""
    c = snap.cfg
    reqs = {r.key: r for r in [*snap.running, *snap.waiting]}
    queue, turns = list(snap.queue), list(snap.turns)
    counters, floor = dict(snap.counters), snap.floor
    waiting_users = {r.user for r in snap.waiting}
    n_waiting = Counter(r.user for r in snap.waiting)  # requests waiting per user, as the tick goes
    active = {r.user for r in [*snap.running, *snap.waiting]}  # users with a live request
    for key in plan.preempted:  # requeued (lifted if its user had nothing waiting), before admissions leave
        r = reqs[key]
        reqs[key] = replace(r, nc=0, h=0, pre=r.pre + 1, state=lc.PREEMPTED)
        queue.insert(0, key)
        n_waiting[r.user] += 1
        if r.user not in turns:  # round robin: a user with nothing waiting joins at the back
            turns.append(r.user)
        if snap.policy == "vtc" and r.user not in waiting_users:
            others = [counters.get(u, 0) for u in waiting_users] or \
                [counters.get(u, 0) for u in active if u != r.user]
            floor = fr.lift_floor(floor, min(others, default=0), bool(others), snap.tol)
            counters[r.user] = fr.lifted_counter(counters.get(r.user, 0), floor)
        waiting_users.add(r.user)
    admissions, reserved = snap.admissions, snap.reserved
    charges: dict[str, list[int]] = {}
    first, produced, finished = [], [], []
    for (key, k, b, adm), tok in zip(plan.batch, tokens):
        r = reqs[key]
        if adm:
            r = replace(r, state=lc.PREFILLING, admit_no=admissions, admit_tick=snap.tick,
                        pinned=bool(fr.pinned(r.pre, c.max_pre)), blocked=0)
            admissions += 1
            if snap.policy == "fcfs":
                queue.remove(key)
            n_waiting[r.user] -= 1
            if snap.policy == "rr":  # the user moves behind the others, or leaves with nothing waiting
                turns.remove(r.user)
                if n_waiting[r.user]:
                    turns.append(r.user)
            reserved = None if reserved is key else reserved
        r = replace(r, h=r.h + b)
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
            elif r.state == lc.PREFILLING:
                r = replace(r, state=lc.DECODING)
        reqs[key] = r
    pp, op = snap.prices
    if snap.policy == "vtc":
        for u, (p, o) in charges.items():
            counters[u] = fr.charged_counter(counters.get(u, 0), fr.service_units(p, o, pp, op), snap.weight(u))
        live = lc.RESIDENT_STATES | lc.WAITING_STATES
        after = {r.user for r in reqs.values() if r.state in live}
        if active - after and not after:  # the last active user went idle: everyone starts level
            floor = fr.idle_floor(floor, max(counters.values(), default=0))
        for u in [u for u in counters if u not in after and fr.forgettable(counters[u], floor)]:
            del counters[u]  # an idle user at or below the floor is forgotten
    b = reqs.get(plan.blocked) if plan.blocked is not None else None
    if b is not None and b.state in lc.WAITING_STATES:
        b = reqs[plan.blocked] = replace(b, blocked=b.blocked + 1)
        if reserved is None and fr.reserved_after(b.blocked, c.aging):
            reserved = plan.blocked
    return After(reqs, queue, turns, counters, floor, reserved, fr.next_streak(snap.streak, plan.isolated), admissions,
                 first, produced, finished)
