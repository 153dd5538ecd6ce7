"""One iteration as functions of ``(State, Policy, Config)``: ``schedule`` decides (pure),
``commit`` / ``rollback`` move the blocks around ``forward``, ``apply`` applies its output.

Each step, the ``spec/`` rule it applies and the check that validates it on the code are
tabled in ``docs/design.md``. Rules are called in their compiled plain-int forms
(``spec.concrete.fast``); the same functions are what the z3 proofs reason about.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import Callable, Sequence

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
    B, chunk = cfg.block_tokens, cfg.prefill_chunk_tokens
    decode_ready, growth_blocks, chunk_tokens, can_allocate = fast(rules.decode_ready), \
        fast(rules.growth_blocks), fast(rules.chunk_tokens), fast(rules.can_allocate)
    free, budget = st.pool.num_free, cfg.token_budget_tokens
    seqs: list[Seq] = []
    ntok: list[int] = []
    nblk: list[int] = []
    preempted: list[Seq] = []
    cached: dict[Seq, list[int]] = {}  # admissions' prefix-cache hits (``batch.core.prefix_cache``)
    live = list(st.running)

    def gain(v: Seq) -> int:  # blocks preempting v frees: those it holds (alone) and any granted this plan
        held = freed_blocks(st.pool, v, preempted, cached) if cfg.prefix_caching else len(v.block_table)
        return held + (nblk[seqs.index(v)] if v in seqs else 0)

    def preempt(v: Seq) -> int:  # v leaves live (and this plan's batch); returns gain(v)
        nonlocal budget
        if not fr.may_preempt(v.num_preemptions, cfg.max_preemptions, v.admit_tick, st.tick_no):
            raise AssertionError(f"policy chose {v.request_id}, which may not be preempted")
        out = gain(v)
        live.remove(v)
        preempted.append(v)
        if v in seqs:
            k = seqs.index(v)
            budget += ntok.pop(k)
            del seqs[k], nblk[k]
        return out

    # 1. Running requests, in admission order: a decode, or a prefill chunk after growing the
    #    block table, preempting the policy's victim by recompute while the blocks do not fit.
    i = 0
    while i < len(live):
        s = live[i]
        n = s.num_prompt_tokens + len(s.req.generated)
        if budget <= 0:  # the budget is spent: it neither grows nor preempts
            i += 1
        elif decode_ready(len(s.block_table), n, s.num_computed_tokens, B):
            seqs.append(s), ntok.append(1), nblk.append(0)
            budget -= 1
            i += 1
        else:
            need = growth_blocks(len(s.block_table), n, B)
            while not can_allocate(free, need) and s in live:
                v = policy.victim([q for q in live if not q.pinned])
                j = live.index(v)
                free += preempt(v)
                i -= j < i
            if s in live:
                k = chunk_tokens(n, s.num_computed_tokens, chunk, budget)
                if k > 0:
                    seqs.append(s), ntok.append(k), nblk.append(need)
                    free -= need
                    budget -= k
                i += 1

    # 2. Admission, unless something was preempted: the reservation holder, preempted decodes
    #    that fit now (resume-first), then the policy's order, while a slot, the budget and the
    #    blocks with headroom fit. A light user's request that does not fit gets room by
    #    preemption; past a blocked head that is not light (nor the reservation), only the first
    #    request of each light user is tried, until every waiting user has been seen.
    blocked: Seq | None = None
    stop = "preempted" if preempted else "empty"
    reserved = st.reserved
    taken: list[Seq] = []
    passing = False
    seen: set[str] = set()
    if not preempted:
        trials = policy.resumable() if cfg.resume_first and reserved is None else ()
        first = ([(reserved, False)] if reserved is not None else []) + [(q, True) for q in trials]
        for s, trial in chain(first, ((q, False) for q in policy.order())):
            if s in taken:
                continue
            if passing:
                if len(seen) >= len(st.waiting_by_user):
                    break
                if s.user_id in seen:
                    continue
                seen.add(s.user_id)
                if not _joins_light(st, policy, s, live, taken):
                    continue
            resident = len(live) + len(taken)
            if resident >= cfg.max_running:
                stop = "max_running"
                break
            if budget <= 0:
                stop = "budget"
                break
            need = admission_blocks(s, cfg)
            hits, cost = planned_hits(st.pool, s, need, preempted, cached) if cfg.prefix_caching else ((), need)
            room = fr.growth_headroom_blocks(resident, B) if cfg.headroom and s is not reserved else 0
            if not fr.can_admit(free, cost, room):
                if trial:
                    continue
                if blocked is None:
                    stop, blocked = "kv", s
                victims = _room(st, policy, s, cost, free, live, taken, gain) if cfg.isolation else None
                if victims is None:
                    if cfg.isolation and not passing and s is not reserved:
                        passing = True
                        seen.add(s.user_id)
                        continue
                    break
                for v in victims:
                    free += preempt(v)
                if cfg.prefix_caching:  # the victims may hold blocks it hits
                    hits, cost = planned_hits(st.pool, s, need, preempted, cached)
                stop = "room"
                if blocked is s:
                    blocked = None
            k = chunk_tokens(s.num_tokens, len(hits) * B, chunk, budget)
            seqs.append(s), ntok.append(k), nblk.append(need - len(hits))
            taken.append(s)
            if hits:
                cached[s] = hits
            free -= cost
            budget -= k
            if stop == "room":
                break

    # 3. Isolation: while a light user's request prefills toward its first token, every other
    #    request sits out (keeping its blocks), at most max_sit_out_ticks iterations in a row.
    sat_out: tuple[Seq, ...] = ()
    isolated = False
    n_adm = len(taken)
    if cfg.isolation and fr.sit_out_allowed(st.streak, cfg.max_sit_out_ticks) and len(seqs) > 1:
        keep = _isolated(st, policy, seqs, live, taken, reserved)
        if keep is not None:
            k0 = len(seqs) - n_adm
            sat_out = tuple(s for s, kept in zip(seqs[:k0], keep) if not kept)
            n_adm = sum(keep[k0:])
            rows = [r for r, kept in zip(zip(seqs, ntok, nblk), keep) if kept]
            seqs, ntok, nblk = ([r[j] for r in rows] for j in range(3))
            isolated = True
    return Plan(tuple(seqs), tuple(ntok), tuple(nblk), n_adm, tuple(preempted), sat_out, blocked, stop, isolated,
                {s: h for s, h in cached.items() if s in seqs})


def _shares(policy: Policy, live: Sequence[Seq], admitted: Sequence[Seq]) -> tuple[Counter[str], int]:
    """Resident requests per user once the plan is applied, and the weights of those users."""
    count = Counter(s.user_id for s in chain(live, admitted))
    return count, sum(policy.weight(u) for u in count)


def _light(st: State, policy: Policy, user: str, total: int, total_w: int) -> bool:
    """A light user: its demand (resident + waiting requests) is at most half its weighted fair
    share of ``total`` resident requests (``fairness_rules.within_share`` at 1/2)."""
    demand = st.resident_by_user.get(user, 0) + st.waiting_by_user.get(user, 0)
    return bool(fr.within_share(demand, policy.weight(user), total, total_w, 1, 2))


def _joins_light(st: State, policy: Policy, s: Seq, live: Sequence[Seq], taken: Sequence[Seq]) -> bool:
    """``s``'s user is light with ``s`` admitted beside ``live`` and ``taken``."""
    total_w = _shares(policy, live, [*taken, s])[1]
    return _light(st, policy, s.user_id, len(live) + len(taken) + 1, total_w)


def _room(st: State, policy: Policy, head: Seq, need: int, free: int, live: list[Seq], taken: list[Seq],
          gain: Callable[[Seq], int]) -> list[Seq] | None:
    """Room for the head of the order when its user is light: no headroom, and if that is not
    enough, the victims to preempt among requests of users over their weighted fair share as
    if ``head`` joined (never pinned ones), in the policy's victim order. ``None``: the user is
    not light, or preempting all of them would not make room."""
    if not _joins_light(st, policy, head, live, taken):
        return None
    count, total_w = _shares(policy, live, taken + [head])
    total = len(live) + len(taken) + 1
    over = {u for u, c in count.items() if not fr.within_share(c, policy.weight(u), total, total_w, 1, 1)}
    cands = [q for q in live if q.user_id in over and not q.pinned]
    victims: list[Seq] = []
    while cands and not rules.can_allocate(free, need):
        v = policy.victim(cands)
        cands.remove(v)
        victims.append(v)
        free += gain(v)
    return victims if rules.can_allocate(free, need) else None


def _isolated(st: State, policy: Policy, seqs: list[Seq], live: list[Seq], taken: list[Seq],
              reserved: Seq | None) -> list[bool] | None:
    """Which of ``seqs`` an isolated iteration keeps: light users' requests prefilling toward
    their first token, and the reservation holder's admission; ``None`` when no request of a
    light user prefills toward its first token, or nothing would sit out."""
    total, total_w = len(live) + len(taken), _shares(policy, live, taken)[1]
    light: dict[str, bool] = {}
    keep = []
    for s in seqs:
        u = s.user_id
        if not s.req.generated and u not in light:
            light[u] = _light(st, policy, u, total, total_w)
        keep.append((not s.req.generated and light[u]) or s is reserved)
    return keep if any(keep) and not all(keep) else None


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
        fire(s, "preempt")
        _leave(st, s, st.resident_by_user)
        st.waiting_by_user[s.user_id] = st.waiting_by_user.get(s.user_id, 0) + 1
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
    st.by_obj.pop(id(s.req), None)
    same = st.by_id.get(s.rid, [])
    if s in same:
        same.remove(s)
        if not same:
            del st.by_id[s.rid]
