"""One iteration as functions of ``(State, Policy, Config)``: ``schedule`` decides (pure),
``commit`` / ``rollback`` move the blocks around ``forward``, ``apply`` applies its output.

Each step, the ``spec/`` rule it applies and the check that validates it on the code are
tabled in ``docs/design.md``. Rules are called in their compiled plain-int forms
(``spec.concrete.fast``); the same functions are what the z3 proofs reason about.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import Sequence

from batch.core.prefix_cache import freed_blocks, planned_hits
from batch.core.state import Config, Plan, Seq, State
from batch.policies.policy import Policy
from inference_stub import Request
from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import rules
from spec.concrete import fast

#: The lifecycle as ``(event, state) -> state``, read once off the shared ``transitions`` machine
#: (``spec.lifecycle.new_machine``): firing through the machine costs ~13 us an event.
MACHINE = lc.new_machine()
NEXT = {(name, src): t.dest for name, ev in MACHINE.events.items() for src, ts in ev.transitions.items()
        for t in ts}


def fire(seq: Seq, event: str) -> None:
    """Move ``seq`` along the lifecycle; ``KeyError`` for a transition the machine does not have."""
    seq.state = NEXT[event, seq.state]


def admission_blocks(seq: Seq, cfg: Config) -> int:
    """Blocks granted at admission: the tokens plus the lookahead slot, or the worst case for a
    request preempted ``max_preemptions`` times (``fairness_rules.pinned``)."""
    need = rules.blocks_needed(seq.num_tokens, cfg.block_tokens)
    if fr.pinned(seq.num_preemptions, cfg.max_preemptions):
        need = max(need, fr.worst_case_blocks(seq.num_prompt_tokens, seq.req.max_tokens,
                                              cfg.max_model_len_tokens, cfg.block_tokens))
    return need


def schedule(st: State, policy: Policy, cfg: Config) -> Plan:
    """Decide the next iteration without changing ``st``: running requests, admission, isolation.

    Raises:
        AssertionError: the policy chose a victim ``fairness_rules.may_preempt`` forbids.
    """
    d = _Draft(st, cfg)
    _run_residents(d, st, policy, cfg)
    blocked, stop = _admission(d, st, policy, cfg) if not d.preempted else (None, "preempted")
    return _isolate(d, st, policy, cfg, blocked, stop)


class _Draft:
    """The plan being built: rows ``seqs`` / ``ntok`` / ``nblk`` in forward order, the victims,
    the admissions' prefix-cache hits, the free blocks and token budget left, the resident
    requests not preempted (``live``) and those admitted (``taken``)."""

    def __init__(self, st: State, cfg: Config) -> None:
        self.st, self.cfg = st, cfg
        self.seqs: list[Seq] = []
        self.ntok: list[int] = []
        self.nblk: list[int] = []
        self.preempted: list[Seq] = []
        self.cached: dict[Seq, list[int]] = {}
        self.live = list(st.running)
        self.taken: list[Seq] = []
        self.free, self.budget = st.pool.num_free, cfg.token_budget_tokens
        prot = st.protected
        self.protected = prot if prot is not None and fr.protected(True, prot.admit_tick, st.tick_no,
                                                                   cfg.quantum_ticks) else None

    def add(self, s: Seq, k: int, blocks: int) -> None:
        self.seqs.append(s), self.ntok.append(k), self.nblk.append(blocks)
        self.budget -= k

    def gain(self, v: Seq) -> int:
        """Blocks preempting ``v`` frees: those it holds (alone) and any granted this plan."""
        st = self.st
        held = freed_blocks(st.pool, v, self.preempted, self.cached) if self.cfg.prefix_caching else len(v.block_table)
        return held + (self.nblk[self.seqs.index(v)] if v in self.seqs else 0)

    def preempt(self, v: Seq, last_resort: bool = False) -> None:
        """``v`` leaves ``live`` (and this plan's rows) by recompute; its blocks count free.
        ``last_resort``: growth found no other victim, so the protected request may be the one."""
        st, cfg = self.st, self.cfg
        if not fr.may_preempt(v.num_preemptions, cfg.max_preemptions, v.admit_tick, st.tick_no) or \
                (v is self.protected and not last_resort):
            raise AssertionError(f"policy chose {v.request_id}, which may not be preempted")
        self.free += self.gain(v)
        self.live.remove(v)
        self.preempted.append(v)
        if v in self.seqs:
            k = self.seqs.index(v)
            self.budget += self.ntok.pop(k)
            del self.seqs[k], self.nblk[k]

    def candidates(self) -> list[Seq]:
        """Resident requests that may be victims: not pinned, not protected."""
        return [q for q in self.live if not q.pinned and q is not self.protected]


def _run_residents(d: _Draft, st: State, policy: Policy, cfg: Config) -> None:
    """Step 1. Running requests, in admission order: a decode, or a prefill chunk after growing
    the block table, preempting the policy's victim by recompute while the blocks do not fit;
    with the budget spent a request neither grows nor preempts."""
    B, chunk = cfg.block_tokens, cfg.prefill_chunk_tokens
    decode_ready, growth_blocks, chunk_tokens, can_allocate = fast(rules.decode_ready), \
        fast(rules.growth_blocks), fast(rules.chunk_tokens), fast(rules.can_allocate)
    live = d.live
    i = 0
    while i < len(live):
        s = live[i]
        n = s.num_prompt_tokens + len(s.req.generated)
        if d.budget <= 0:
            i += 1
        elif decode_ready(len(s.block_table), n, s.num_computed_tokens, B):
            d.add(s, 1, 0)
            i += 1
        else:
            need = growth_blocks(len(s.block_table), n, B)
            while not can_allocate(d.free, need) and s in live:
                cands = d.candidates()
                last = not cands  # every other resident request pinned: the protected one yields
                v = policy.victim(cands or [q for q in live if not q.pinned])
                j = live.index(v)
                d.preempt(v, last)
                i -= j < i
            if s in live:
                k = chunk_tokens(n, s.num_computed_tokens, chunk, d.budget)
                if k > 0:
                    d.add(s, k, need)
                    d.free -= need
                i += 1


def _admission(d: _Draft, st: State, policy: Policy, cfg: Config) -> tuple[Seq | None, str]:
    """Step 2 (only in a tick that preempted nothing). Candidates: the reservation holder (none
    while a protected request is resident), the waiting preempted decodes that fit now
    (resume-first), then the policy's order (light users' requests first). A candidate is
    admitted while a slot, the budget and its blocks with headroom fit. One that does not fit
    gets room by preemption when the rules allow it (``_room``); otherwise the first such is the
    plan's ``blocked`` head (it ages), and the candidates after it wait while it has been blocked
    fewer than ``hold_ticks`` iterations, then pass it. Returns ``(blocked, stop)``."""
    B = cfg.block_tokens
    chunk_tokens = fast(rules.chunk_tokens)
    reserved = st.reserved
    holder = reserved if reserved is not None and d.protected is None else None
    light = _LightUsers(st, policy) if cfg.isolation else None
    trials = policy.resumable() if cfg.resume_first and holder is None else ()
    first = ([(holder, False)] if holder is not None else []) + [(q, True) for q in trials]
    order = policy.order(light) if light is not None else policy.order()
    blocked: Seq | None = None
    stop = "empty"
    for s, trial in chain(first, ((q, False) for q in order)):
        if s in d.taken:
            continue
        resident = len(d.live) + len(d.taken)
        if resident >= cfg.max_running:
            return blocked, "max_running"
        if d.budget <= 0:
            return blocked, "budget"
        need = admission_blocks(s, cfg)
        hits, cost = planned_hits(st.pool, s, need, d.preempted, d.cached) if cfg.prefix_caching else ((), need)
        room = fr.growth_headroom_blocks(resident, B) if cfg.headroom and s is not holder else 0
        if not fr.can_admit(d.free, cost, room):
            if trial:
                continue
            victims = _room(d, policy, cfg, s, need, light, s is holder)
            if victims is None:
                if s is holder:
                    continue
                if blocked is None:
                    stop, blocked = "kv", s
                if not fr.hold_elapsed(blocked.blocked_ticks, cfg.hold_ticks):
                    return blocked, stop
                continue
            for v in victims:
                d.preempt(v)
            if cfg.prefix_caching:  # the victims may hold blocks it hits
                hits, cost = planned_hits(st.pool, s, need, d.preempted, d.cached)
            stop = "room"
        k = chunk_tokens(s.num_tokens, len(hits) * B, cfg.prefill_chunk_tokens, d.budget)
        d.add(s, k, need - len(hits))
        d.taken.append(s)
        if hits:
            d.cached[s] = hits
        d.free -= cost
    return blocked, stop


class _LightUsers:
    """``fairness_rules.light_user`` for this tick: demand = requests resident and waiting."""

    def __init__(self, st: State, policy: Policy) -> None:
        self.st, self.policy = st, policy
        self.total = sum(st.resident_by_user.values()) + sum(st.waiting_by_user.values())
        users = st.resident_by_user.keys() | st.waiting_by_user.keys()
        self.total_w = sum(policy.weight(u) for u in users)
        self.memo: dict[str, bool] = {}

    def __call__(self, user: str) -> bool:
        got = self.memo.get(user)
        if got is None:
            st = self.st
            demand = st.resident_by_user.get(user, 0) + st.waiting_by_user.get(user, 0)
            got = self.memo[user] = bool(fr.light_user(demand, self.policy.weight(user), self.total, self.total_w))
        return got


def _room(d: _Draft, policy: Policy, cfg: Config, head: Seq, need: int, light: _LightUsers | None,
          holder: bool) -> list[Seq] | None:
    """Victims whose preemption lets ``head`` (``need`` blocks, no headroom) in, in the policy's
    victim order, or ``None``. The reservation holder: any resident request that may be preempted
    and was not admitted as a holder itself (``not_a_holder``).
    A light user's request: requests of other users over their weighted share of the resident
    requests as if ``head`` joined (taking its own user's request moves no share: two of one
    light user's requests took each other's room thousands of times on the Mooncake trace),
    past their prompt high-water mark (``past_high_water``).
    Another request, when the policy keeps shares (``Policy.pressure``): requests not admitted
    as a holder (``not_a_holder``), past their high-water mark ``quantum_ticks`` iterations
    (``quantum_elapsed`` from ``progress_tick``), of users it ``may_take`` from. With prefix caching the free blocks ``head`` takes are counted with the victims chosen so far: a cached
    block it hits that only a victim held is freed by the victim and taken again by the hit."""
    st = d.st

    def cost(victims: list[Seq]) -> int:
        if not cfg.prefix_caching:
            return need
        return planned_hits(st.pool, head, need, [*d.preempted, *victims], d.cached)[1]
    cands = [q for q in d.candidates() if q.admit_tick < st.tick_no]
    u = head.user_id
    if holder:
        cands = [q for q in cands if fr.not_a_holder(q.holder)]
    elif light is not None and light(u):
        count = Counter(q.user_id for q in chain(d.live, d.taken, (head,)))
        total, total_w = sum(count.values()), sum(policy.weight(v) for v in count)
        over = {v for v, c in count.items() if not fr.within_share(c, policy.weight(v), total, total_w, 1, 1)}
        cands = [q for q in cands if q.user_id in over and q.user_id != u  # never its own user's: churn
                 and fr.past_high_water(q.progress_tick, q.admit_tick)]
    else:
        if policy.pressure(u, 0) is None:
            return None
        count = Counter(q.user_id for q in chain(d.live, d.taken))
        mine = policy.pressure(u, count[u] + 1)
        cands = [q for q in cands if q.user_id != u and fr.not_a_holder(q.holder)
                 and fr.past_high_water(q.progress_tick, q.admit_tick)
                 and fr.quantum_elapsed(q.progress_tick, st.tick_no, cfg.quantum_ticks)]
        victims: list[Seq] = []
        free = d.free
        while not rules.can_allocate(free, cost(victims)):
            cands = [q for q in cands if fr.may_take(mine, policy.pressure(q.user_id, count[q.user_id] - 1))]
            if not cands:
                return None
            v = policy.victim(cands)
            cands.remove(v)
            victims.append(v)
            count[v.user_id] -= 1
            free += d.gain(v)
        return victims
    victims = []
    free = d.free
    while cands and not rules.can_allocate(free, cost(victims)):
        v = policy.victim(cands)
        cands.remove(v)
        victims.append(v)
        free += d.gain(v)
    return victims if rules.can_allocate(free, cost(victims)) else None


def _isolate(d: _Draft, st: State, policy: Policy, cfg: Config, blocked: Seq | None, stop: str) -> Plan:
    """Step 3. Isolation: while a light user's request prefills toward its first token, every
    other request sits out (keeping its blocks), at most ``max_sit_out_ticks`` in a row; the
    reservation holder's admission is kept. Builds the plan."""
    seqs, ntok, nblk, taken = d.seqs, d.ntok, d.nblk, d.taken
    sat_out: tuple[Seq, ...] = ()
    isolated = False
    n_adm = len(taken)
    if cfg.isolation and fr.sit_out_allowed(st.streak, cfg.max_sit_out_ticks) and len(seqs) > 1:
        light = _LightUsers(st, policy)
        reserved = st.reserved
        keep = [(not s.req.generated and light(s.user_id)) or s is reserved for s in seqs]
        if any(keep) and not all(keep):
            k0 = len(seqs) - n_adm
            sat_out = tuple(s for s, kept in zip(seqs[:k0], keep) if not kept)
            n_adm = sum(keep[k0:])
            rows = [r for r, kept in zip(zip(seqs, ntok, nblk), keep) if kept]
            seqs, ntok, nblk = ([r[j] for r in rows] for j in range(3))
            isolated = True
    return Plan(tuple(seqs), tuple(ntok), tuple(nblk), n_adm, tuple(d.preempted), sat_out, blocked, stop, isolated,
                {s: h for s, h in d.cached.items() if s in seqs})


# ---------------------------------------------------------------- around forward


def commit(st: State, plan: Plan) -> list[tuple[Seq, list[int], int]]:
    """Before ``forward``: free the victims' blocks, share the prefix-cache hits (their tokens are
    computed), grant the plan's blocks; returns the undo journal."""
    journal: list[tuple[Seq, list[int], int]] = []
    for s in plan.preempted:
        journal.append((s, s.block_table, s.num_computed_tokens))
        st.pool.free(s.block_table)
        s.block_table = []
    for s, hits in plan.hits.items():
        journal.append((s, s.block_table, s.num_computed_tokens))
        st.pool.share(hits)
        s.block_table, s.num_computed_tokens = list(hits), len(hits) * st.pool.block_tokens
    for s, n in zip(plan.seqs, plan.new_blocks):
        if n:
            blocks = st.pool.allocate(n)
            if blocks is None:  # schedule() counts free blocks exactly: a bug
                rollback(st, journal)
                raise AssertionError(f"plan granted {n} blocks, {st.pool.num_free} free")
            journal.append((s, s.block_table, s.num_computed_tokens))
            s.block_table = s.block_table + blocks
    return journal


def rollback(st: State, journal: list[tuple[Seq, list[int], int]]) -> None:
    """Undo ``commit``: grants and hits return their blocks, victims get their exact ids back."""
    for s, before, nc in reversed(journal):
        if len(s.block_table) > len(before):
            st.pool.free(s.block_table[len(before):])
        else:
            st.pool.reclaim(before)
        s.block_table, s.num_computed_tokens = before, nc


def apply(st: State, policy: Policy, cfg: Config, plan: Plan, tokens: Sequence[int], now_s: float,
          start_s: float) -> list[Request]:
    """Apply a committed plan's ``tokens``: preempt, admit, advance ``num_computed_tokens``, keep a
    token only at the last known token (``produces_token``), stamp times at ``now_s``, finish on EOS
    or length (blocks freed at once), charge, age. Returns the finished, in batch order."""
    stats = st.stats
    for s in plan.preempted:
        s.num_computed_tokens = 0
        s.num_preemptions += 1
        if st.protected is s:
            st.protected = None
        fire(s, "preempt")
        _leave(st, s, st.resident_by_user)
        st.waiting_by_user[s.user_id] = st.waiting_by_user.get(s.user_id, 0) + 1
        if policy.requeue_behind and s.req.generated:  # a preempted decode waits behind every arrival
            s.order_no, st.arrivals = st.arrivals, st.arrivals + 1
        policy.requeue(s)
        stats.preemptions += 1
    new_prompt, high_water = fast(fr.new_prompt_tokens), fast(fr.prompt_high_water)
    eos, max_len, k0 = cfg.eos_token_id, cfg.max_model_len_tokens, len(plan.seqs) - plan.num_admitted
    charges: dict[str, list[int]] = {}
    gone: set[Seq] = set(plan.preempted)
    finished: list[Request] = []
    idle: list[str] = []
    for i, (s, k, tok) in enumerate(zip(plan.seqs, plan.num_new_tokens, tokens)):
        if i >= k0:
            _admit(st, policy, cfg, s, start_s)
        nc, P, req = s.num_computed_tokens, s.num_prompt_tokens, s.req
        gen = req.generated
        n = P + len(gen)
        if s.progress_tick < s.admit_tick and nc + k > s.prompt_charged_tokens:  # past_high_water from now
            s.progress_tick = st.tick_no
        if nc < P:
            part = new_prompt(nc, k, P, s.prompt_charged_tokens)
            if part:
                charges.setdefault(s.user_id, [0, 0])[0] += part
            s.prompt_charged_tokens = high_water(s.prompt_charged_tokens, nc, k, P)
            if cfg.prefix_caching:
                st.pool.computed(s, nc, nc + k)
        s.num_computed_tokens = nc + k
        if nc + k != n:  # a prefill chunk short of the last known token: its token is discarded
            continue
        tok = tok if type(tok) is int else int(tok)
        gen.append(tok)
        charges.setdefault(s.user_id, [0, 0])[1] += 1
        if req.started_at is None:
            req.started_at = now_s
        elif stats.record_itl and s.last_token_s is not None:
            stats.itl_s.append(now_s - s.last_token_s)
        s.last_token_s = now_s
        if tok == eos:
            s.finish_reason = "stop"
        elif rules.reached_length(len(gen), req.max_tokens, n + 1, max_len):
            s.finish_reason = "length"
        else:
            if s.state == lc.PREFILLING:
                fire(s, "prefill_done")
            continue
        st.pool.free(s.block_table)
        s.block_table = []
        fire(s, "finish")
        req.completed_at = now_s
        gone.add(s)
        forget(st, s)
        if _leave(st, s, st.resident_by_user):
            idle.append(s.user_id)
        finished.append(req)
        stats.on_finish(reason=s.finish_reason, submitted_s=req.submitted_at,
                        first_token_s=req.started_at, admitted_s=s.admitted_s, completed_s=now_s,
                        prompt_tokens=P, output_tokens=len(gen))
    for user, (p, o) in charges.items():
        policy.charge(user, p, o)
    for user in idle:  # after its charges: forgetting must not lose them
        policy.on_idle(user)
    if gone:
        st.running = [s for s in st.running if s not in gone]
    b = plan.blocked
    if b is not None and b.state in lc.WAITING_STATES:
        b.blocked_ticks += 1
        if st.reserved is None and fr.reserved_after(b.blocked_ticks, cfg.aging_ticks):
            st.reserved = b
    st.streak = fr.next_streak(st.streak, plan.isolated)
    st.tick_no += 1
    stats.on_tick(len(plan.seqs), plan.num_batched_tokens, st.pool.num_used)
    return finished


def _admit(st: State, policy: Policy, cfg: Config, s: Seq, start_s: float) -> None:
    """``s`` leaves the waiting queue for the running list."""
    policy.remove(s)
    fire(s, "resume" if s.state == lc.PREEMPTED else "admit")
    s.admit_no, s.admit_tick = st.admissions, st.tick_no
    st.admissions += 1
    s.pinned = fr.pinned(s.num_preemptions, cfg.max_preemptions)
    prot = st.protected
    s.holder = st.reserved is s and (prot is None or not fr.protected(True, prot.admit_tick, st.tick_no,
                                                                      cfg.quantum_ticks))
    if s.holder:  # protected for the quantum: at most one at a time, so it can always grow
        st.protected = s
    if cfg.prefix_caching:  # its hits were shared at commit: num_computed_tokens holds them
        st.pool.query_tokens, st.pool.hit_tokens = st.pool.query_tokens + s.num_tokens, \
            st.pool.hit_tokens + s.num_computed_tokens
    s.blocked_ticks = 0
    if s.admitted_s is None:
        s.admitted_s = start_s
    st.running.append(s)
    st.resident_by_user[s.user_id] = st.resident_by_user.get(s.user_id, 0) + 1
    _leave(st, s, st.waiting_by_user)
    if st.reserved is s:
        st.reserved = None


def _leave(st: State, s: Seq, counts: dict[str, int]) -> bool:
    """Count ``s`` out of ``counts`` (resident or waiting per user); whether its user is now idle
    (nothing waiting or resident: the policy may forget it, ``Policy.on_idle``)."""
    u = s.user_id
    c = counts[u] - 1
    if c:
        counts[u] = c
        return False
    del counts[u]
    return u not in st.resident_by_user and u not in st.waiting_by_user


def retire(st: State, policy: Policy, s: Seq, reason: str, now_s: float) -> Request:
    """Take a live request out without completing it (``abort`` event; reason ``abort`` or ``error``)."""
    if s.state in lc.WAITING_STATES:
        policy.remove(s)
        idle = _leave(st, s, st.waiting_by_user)
        if st.reserved is s:
            st.reserved = None
    else:
        st.pool.free(s.block_table)
        s.block_table = []
        st.running.remove(s)
        idle = _leave(st, s, st.resident_by_user)
    if idle:
        policy.on_idle(s.user_id)
    s.finish_reason = reason
    fire(s, "abort")
    s.req.completed_at = now_s
    forget(st, s)
    st.stats.on_cancel(reason)
    return s.req


def forget(st: State, s: Seq) -> None:
    """Drop ``s`` from the lookups (it finished or was aborted)."""
    if st.protected is s:
        st.protected = None
    st.by_obj.pop(id(s.req), None)
    same = st.by_id.get(s.rid, [])
    if s in same:
        same.remove(s)
        if not same:
            del st.by_id[s.rid]
