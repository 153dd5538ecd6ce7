"""Executable models of the scheduler's steps, over Python ints or z3 terms.

The proofs in ``spec/verify.py`` reason about these models; the models do the scheduler's
arithmetic by calling the very rule functions the tick calls (``batch/core/step.py``; ``spec.rules``:
``growth_blocks``, ``can_allocate``, ``blocks_needed``, ``chunk_tokens``, ``produces_token``,
``reached_length``; ``fairness_rules.can_admit``). Their control flow is a relation, not a copy
of ``step.schedule`` / ``step.apply``: the policy's choices (victims, admission order, sit-outs,
extra blocks, admissions taken back) are left free where asked, and the code is tied to it by
checks, not by construction: trace validation (``spec/refinement.py``) replays every tick the
scheduler takes on ``tick``, and, because the models are written with ``spec.logic`` only, they
also run on Python ints, so ``tests/test_verify.py`` runs ``tick`` under FCFS side by side with
the real ``Scheduler`` on random workloads and requires identical states after every tick.

Two granularities:

* ``TRANSITIONS``: one request's lifecycle event (or internal step: a prefill chunk, a decode),
  with the other requests summarised by the blocks they hold. Used for the per-transition
  inductive proof.
* ``tick``: the whole iteration for a list of request slots (growth and preemption of the
  running requests, admission of the waiting ones, chunk progress, one token per producing
  request, EOS and length finishes), with the policy's choices left symbolic when asked.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from spec import fairness_rules as fr
from spec import lifecycle as lc
from spec import rules
from spec.invariants import (ABSENT, STATE_CODE, batch_kv_within_cap, batch_within_budget, chunk_within_limit,
                             is_final, is_resident, is_waiting, kv_used_is_sum_held, kv_within_cap,
                             ledger_consistent, one_token_per_tick, request_invariants)
from spec.logic import And, If, Not, Or, Sum, cdiv, lift

Int = Any
Bool = Any

Q, PF, DEC, PRE, DONE, AB = (STATE_CODE[s] for s in lc.STATES)


@dataclass(frozen=True)
class Cfg:
    """The scheduler's knobs. ``block_tokens`` must be a Python int (keeps z3 arithmetic linear).

    Attributes:
        cap_blocks: KV cap ``C``, blocks. block_tokens: ``B``, tokens per block.
        chunk_tokens: prefill chunk, tokens. budget_tokens: token budget per iteration.
        max_running: most resident requests.
    """

    cap_blocks: Int
    block_tokens: int
    chunk_tokens: Int
    budget_tokens: Int
    max_running: Int

    @property
    def max_model_len_tokens(self) -> Int:
        return rules.max_model_len_tokens(self.cap_blocks, self.block_tokens)

    def ok(self) -> Bool:
        """The knobs are valid (what ``Scheduler.__init__`` accepts)."""
        return And(self.cap_blocks >= 1, self.chunk_tokens >= 1, self.budget_tokens >= 1, self.max_running >= 1)


@dataclass(frozen=True)
class Req:
    """One request slot: the scheduler's record of it, as integers.

    Attributes:
        st: state code (``spec.invariants.STATE_CODE``; ``ABSENT`` = not submitted yet).
        P: prompt tokens. M: ``max_tokens``. E: the output position (1-based) at which the
            backend returns EOS, 0 for never (the backend's choice, fixed per request).
        g: tokens generated. nc: ``num_computed_tokens``. h: KV blocks held.
        pre: times preempted. arrival: tick before which it is submitted (BMC only).
    """

    st: Int
    P: Int
    M: Int
    E: Int
    g: Int = 0
    nc: Int = 0
    h: Int = 0
    pre: Int = 0
    arrival: Int = 0

    @property
    def n(self) -> Int:
        """``num_tokens``: prompt plus generated, tokens."""
        return self.P + self.g

    @property
    def eos_position(self) -> Int:
        """1-based position of the first EOS in ``generated`` (0: none)."""
        return If(And(self.E > 0, self.g >= self.E), self.E, 0)


def request_named(r: Req, cfg: Cfg, tag: str = "") -> list[tuple[str, Bool]]:
    """The per-request invariants of slot ``r`` as ``(name, predicate)`` (an absent slot holds nothing)."""
    absent = And(r.st == ABSENT, r.g == 0, r.nc == 0, r.h == 0, r.pre == 0)
    known = Or(is_waiting(r.st), is_resident(r.st), is_final(r.st))
    named = [("state_known", And(r.E >= 0, Or(absent, known)))]
    for name, p in request_invariants(r.st, r.P, r.g, r.nc, r.h, r.M, r.eos_position, cfg.block_tokens,
                                      cfg.max_model_len_tokens):
        named.append((name + tag, Or(absent, p)))
    return named


def system_named(reqs: Sequence[Req], free_blocks: Int, cfg: Cfg, other_held_blocks: Int = 0) -> list[tuple[str, Bool]]:
    """The inductive invariant as named conjuncts: the KV ledger is exact and within the cap, and
    every request is valid.

    Args:
        other_held_blocks: blocks held by requests not modelled as slots (``>= 0``).
    """
    held = [r.h for r in reqs] + [other_held_blocks]
    used = cfg.cap_blocks - free_blocks
    named = [("free_nonnegative", And(free_blocks >= 0, other_held_blocks >= 0)),
             ("ledger_consistent", ledger_consistent(free_blocks, held, cfg.cap_blocks)),
             ("kv_within_cap", kv_within_cap(used, cfg.cap_blocks)),
             ("kv_used_is_sum_held", kv_used_is_sum_held(used, held))]
    for j, r in enumerate(reqs):
        named += request_named(r, cfg, f"[{j}]" if len(reqs) > 1 else "")
    return named


def system_valid(reqs: Sequence[Req], free_blocks: Int, cfg: Cfg, other_held_blocks: Int = 0) -> Bool:
    """The conjunction of ``system_named``: the inductive invariant that implies ``kv_within_cap``."""
    return And(*(p for _, p in system_named(reqs, free_blocks, cfg, other_held_blocks)))


def is_eos(eos_position: Int, num_generated: Int) -> Bool:
    """The token just appended (the ``num_generated``-th) is EOS: the backend returns EOS at
    output position ``eos_position``. Mirrors ``tok == eos`` in
    ``batch.core.step.apply`` (which is not a ``spec.rules`` function)."""
    return eos_position == num_generated


# ---------------------------------------------------------------- per-transition models


@dataclass(frozen=True)
class Step:
    """One event's model: ``guard`` (when it may fire), the request and free blocks after, and
    ``facts`` (named per-iteration properties that must hold whenever it fires)."""

    guard: Bool
    req: Req
    free_blocks: Int
    facts: tuple[tuple[str, Bool], ...] = ()


def _grant(r: Req, free: Int, cfg: Cfg) -> Step:
    """``admit`` / ``resume``: the whole prompt (plus generated tokens) and the lookahead slot."""
    need = rules.blocks_needed(r.n, cfg.block_tokens)
    return Step(fr.can_admit(free, need, 0), replace(r, st=PF, h=need, nc=0), free - need)


def _release(r: Req, free: Int, st: Int) -> Step:
    return Step(True, replace(r, st=st, h=0, nc=0, pre=r.pre + If(st == PRE, 1, 0)), free + r.h)


def _iterate(r: Req, free: Int, cfg: Cfg, budget: Int, produce: bool, finish: bool) -> Step:
    """A resident request's share of one iteration: grow, compute a chunk, maybe keep a token."""
    need = rules.growth_blocks(r.h, r.n, cfg.block_tokens)
    k = rules.chunk_tokens(r.n, r.nc, cfg.chunk_tokens, budget)
    produced = rules.produces_token(r.nc, k, r.n)
    g1 = If(produced, r.g + 1, r.g)
    fin = And(produced, Or(is_eos(r.E, g1), rules.reached_length(g1, r.M, r.P + g1, cfg.max_model_len_tokens)))
    guard = And(rules.can_allocate(free, need), k > 0, produced if produce else Not(produced),
                fin if finish else Not(fin))
    st = DONE if finish else (DEC if produce else PF)
    after = replace(r, st=st, g=g1, nc=r.nc + k, h=0 if finish else r.h + need)
    facts = (("chunk_within_limit", chunk_within_limit(k, cfg.chunk_tokens)),
             ("batch_within_budget", batch_within_budget([k], budget)),
             ("one_token_per_tick", one_token_per_tick(g1 - r.g, True)))
    return Step(guard, after, free - need + (r.h + need if finish else 0), facts)


#: The per-request steps: ``(name, sources, destination, model)``. Every event of
#: ``spec.lifecycle.TRANSITIONS`` appears with the same sources and destination (a test and
#: the proof check that), plus the internal steps ``chunk`` and ``decode`` (self-loops).
#: ``model(r, free, cfg, budget) -> Step``.
TRANSITIONS: tuple[tuple[str, tuple[str, ...], str, Callable[..., Step]], ...] = (
    ("admit", (lc.QUEUED,), lc.PREFILLING, lambda r, f, c, b: _grant(r, f, c)),
    ("resume", (lc.PREEMPTED,), lc.PREFILLING, lambda r, f, c, b: _grant(r, f, c)),
    ("prefill_done", (lc.PREFILLING,), lc.DECODING, lambda r, f, c, b: _iterate(r, f, c, b, True, False)),
    ("preempt", (lc.PREFILLING, lc.DECODING), lc.PREEMPTED, lambda r, f, c, b: _release(r, f, PRE)),
    ("finish", (lc.PREFILLING, lc.DECODING), lc.DONE, lambda r, f, c, b: _iterate(r, f, c, b, True, True)),
    ("abort", (lc.QUEUED, lc.PREFILLING, lc.DECODING, lc.PREEMPTED), lc.ABORTED,
     lambda r, f, c, b: _release(r, f, AB)),
    ("chunk", (lc.PREFILLING,), lc.PREFILLING, lambda r, f, c, b: _iterate(r, f, c, b, False, False)),
    ("decode", (lc.DECODING,), lc.DECODING, lambda r, f, c, b: _iterate(r, f, c, b, True, False)),
)
#: The internal steps (not lifecycle events: no state change, no trigger fired).
INTERNAL_STEPS = ("chunk", "decode")


# ---------------------------------------------------------------- the whole tick


@dataclass
class Choices:
    """The policy's freedom in one tick. ``None`` everywhere = ``FCFSPolicy`` exactly.

    Attributes:
        victim: ``victim(i, attempt, alive) -> index`` of the request to preempt while slot
            ``i`` cannot grow; ``None``: the most recently admitted alive request (the last
            alive slot), as ``Policy.victim`` (FCFS).
        skip: per slot, the policy leaves this running request out of the batch this tick.
        backfill: admission passes a waiting request that does not fit and tries later ones (the
            light users' pass of ``batch.core.step.schedule``'s step 2 is one such choice).
        admit_after_preempt: admission runs even in a tick that preempted.
        extra_blocks: per slot, blocks granted at admission beyond ``blocks_needed`` (``>= 0``;
            a pinned request's worst case, ``batch.core.step.admission_blocks``).
        headroom: per slot, blocks admission must leave free (``>= 0``;
            ``fairness_rules.growth_headroom_blocks``).
        late_preempt: per slot, a running request preempted after admission (isolation
            making room; its grant of this plan is undone).
        revoke: per slot, an admission of this plan taken back (isolation).
        room: running slots preempted to make room for admissions (``batch.core.step``'s
            ``_room``), in the order they are preempted: right before a waiting slot's admission
            check, while its blocks do not fit, the next of them (still alive) is preempted.
        assumptions: constraints on the choice variables (filled in by ``tick``).
    """

    victim: Callable[[int, int, list], Int] | None = None
    skip: Sequence[Bool] | None = None
    backfill: Bool = False
    admit_after_preempt: Bool = False
    extra_blocks: Sequence[Int] | None = None
    headroom: Sequence[Int] | None = None
    late_preempt: Sequence[Bool] | None = None
    revoke: Sequence[Bool] | None = None
    room: Sequence[int] | None = None
    assumptions: list = field(default_factory=list)


@dataclass(frozen=True)
class TickResult:
    """A tick's outcome: requests and free blocks after, the batch, named facts of the iteration."""

    reqs: tuple[Req, ...]
    free_blocks: Int
    in_batch: tuple[Bool, ...]
    num_new_tokens: tuple[Int, ...]
    admitted: tuple[Bool, ...]
    preempted: tuple[Bool, ...]
    facts: tuple[tuple[str, Bool], ...]


def _last_alive(alive: list, like: Int) -> Int:
    v: Int = lift(-1, like)
    for j in range(len(alive)):
        v = If(alive[j], lift(j, like), v)
    return v


def tick(reqs: Sequence[Req], free_blocks: Int, cfg: Cfg, choices: Choices | None = None) -> TickResult:
    """One ``Scheduler.tick()`` over request slots.

    Slots are in the scheduler's orders: running requests are processed in slot order and
    waiting requests are admitted in slot order (for ``FCFSPolicy`` both are arrival order:
    the running list followed by the waiting queue is always sorted by arrival, which the
    stateful test checks).

    Args:
        reqs: the slots. free_blocks: free KV blocks before the tick. cfg: the knobs.
        choices: the policy's choices; ``None`` is FCFS.

    Returns:
        The ``TickResult``; its ``facts`` are the per-iteration invariants (chunk size,
        budget, batch KV as ``forward`` sees it, one token per request).
    """
    ch = choices or Choices()
    R, B = len(reqs), cfg.block_tokens
    free, budget = free_blocks, cfg.budget_tokens
    one, zero = lift(1, free_blocks), lift(0, free_blocks)
    alive = [is_resident(r.st) for r in reqs]  # resident and not preempted in this plan
    skip = list(ch.skip) if ch.skip is not None else [False] * R
    preempted: list = [False] * R
    granted: list = [False] * R
    k: list = [0] * R
    got: list = [0] * R  # blocks granted this tick
    # 1. running requests, in order: grow (preempting victims until it fits), then a chunk
    for i, r in enumerate(reqs):
        need = rules.growth_blocks(r.h, r.n, B)
        has_budget = budget > 0  # a request the spent budget cannot run neither grows nor preempts
        for a in range(R):  # `while not can_allocate`: each round removes one alive request
            cond = And(alive[i], Not(skip[i]), has_budget, Not(rules.can_allocate(free, need)))
            if cond is False:  # decided (plain ints): no hit, so free and alive stay and every later round is False too
                break
            v = _last_alive(alive, free_blocks) if ch.victim is None else ch.victim(i, a, alive)
            if ch.victim is not None:
                ch.assumptions.append(Or(Not(cond), *(And(v == j, alive[j]) for j in range(R))))
            for j in range(R):
                hit = And(cond, v == j)
                free = free + If(hit, reqs[j].h + If(granted[j], got[j], 0), 0)
                budget = budget + If(And(hit, granted[j]), k[j], 0)
                k[j] = If(hit, 0, k[j])  # an earlier grant of this plan is undone
                got[j] = If(hit, 0, got[j])
                alive[j] = And(alive[j], Not(hit))
                granted[j] = And(granted[j], Not(hit))
                preempted[j] = Or(preempted[j], hit)
        n_new = rules.chunk_tokens(r.n, r.nc, cfg.chunk_tokens, budget)
        granted[i] = And(alive[i], Not(skip[i]), n_new > 0)
        k[i] = If(granted[i], n_new, 0)
        got[i] = If(granted[i], need, 0)
        free = free - got[i]
        budget = budget - k[i]
    # 2. waiting requests, in order, unless something was preempted
    any_preempted = Or(*preempted)
    stop = And(any_preempted, Not(ch.admit_after_preempt))
    resident = Sum([If(x, one, zero) for x in alive])
    n_admitted: Int = zero
    admitted: list = [False] * R
    room = list(ch.room) if ch.room is not None else []
    used = [False] * len(room)  # room victims preempted so far
    for j, r in enumerate(reqs):
        consider = And(is_waiting(r.st), Not(stop))
        need = rules.blocks_needed(r.n, B) + (ch.extra_blocks[j] if ch.extra_blocks is not None else 0)
        for a, v in enumerate(room):  # room for slot j: the next victims while its blocks do not fit
            hit = And(consider, Not(used[a]), alive[v], Not(rules.can_allocate(free, need)))
            free = free + If(hit, reqs[v].h + If(granted[v], got[v], 0), 0)
            budget = budget + If(And(hit, granted[v]), k[v], 0)
            k[v] = If(hit, 0, k[v])
            got[v] = If(hit, 0, got[v])
            alive[v] = And(alive[v], Not(hit))
            granted[v] = And(granted[v], Not(hit))
            preempted[v] = Or(preempted[v], hit)
            used[a] = Or(used[a], hit)
            resident = resident - If(hit, one, zero)
        full = resident + n_admitted >= cfg.max_running
        no_budget = budget <= 0
        fits = fr.can_admit(free, need, ch.headroom[j] if ch.headroom is not None else 0)
        admitted[j] = And(consider, Not(full), Not(no_budget), fits)
        stop = Or(stop, And(consider, Or(full, no_budget, And(Not(fits), Not(ch.backfill)))))
        n_new = rules.chunk_tokens(r.n, 0, cfg.chunk_tokens, budget)
        k[j] = If(admitted[j], n_new, k[j])
        got[j] = If(admitted[j], need, got[j])
        free = free - If(admitted[j], need, 0)
        budget = budget - If(admitted[j], n_new, 0)
        n_admitted = n_admitted + If(admitted[j], one, zero)
    # 2b. the policy may still preempt running requests or take admissions back (isolation)
    for j, r in enumerate(reqs):
        late = And(alive[j], ch.late_preempt[j]) if ch.late_preempt is not None else False
        back = And(admitted[j], ch.revoke[j]) if ch.revoke is not None else False
        free = free + If(late, r.h + If(granted[j], got[j], 0), 0) + If(back, got[j], 0)
        budget = budget + If(Or(And(late, granted[j]), back), k[j], 0)
        k[j] = If(Or(late, back), 0, k[j])
        got[j] = If(Or(late, back), 0, got[j])
        alive[j] = And(alive[j], Not(late))
        granted[j] = And(granted[j], Not(late))
        preempted[j] = Or(preempted[j], late)
        admitted[j] = And(admitted[j], Not(back))
    # 3. forward, then update_from_output
    in_batch = [Or(granted[j], admitted[j]) for j in range(R)]
    out: list[Req] = []
    facts: list[tuple[str, Bool]] = []
    for j, r in enumerate(reqs):
        inb = in_batch[j]
        nc0 = If(admitted[j], 0, r.nc)
        held = If(preempted[j], 0, r.h + got[j])
        produced = And(inb, rules.produces_token(nc0, k[j], r.n))
        g1 = If(produced, r.g + 1, r.g)
        fin = And(produced, Or(is_eos(r.E, g1), rules.reached_length(g1, r.M, r.P + g1, cfg.max_model_len_tokens)))
        free = free + If(fin, held, 0)
        st = If(preempted[j], PRE, If(fin, DONE, If(produced, DEC, If(inb, PF, r.st))))
        out.append(replace(r, st=st, g=g1, nc=If(preempted[j], 0, If(inb, nc0 + k[j], r.nc)),
                           h=If(fin, 0, held), pre=If(preempted[j], r.pre + 1, r.pre)))
        facts.append(("chunk_within_limit", Or(Not(inb), chunk_within_limit(k[j], cfg.chunk_tokens))))
        facts.append(("one_token_per_tick", one_token_per_tick(g1 - r.g, inb)))
    facts.append(("batch_within_budget", batch_within_budget(k, cfg.budget_tokens)))
    facts.append(("batch_kv_within_cap", batch_kv_within_cap(
        [If(in_batch[j], rules.blocks_for(r.n, B), 0) for j, r in enumerate(reqs)], cfg.cap_blocks)))
    return TickResult(tuple(out), free, tuple(in_batch), tuple(k), tuple(admitted), tuple(preempted), tuple(facts))


def arrive(reqs: Sequence[Req], t: int) -> tuple[Req, ...]:
    """Submit, before tick ``t``, every absent slot whose ``arrival == t`` (it becomes queued)."""
    return tuple(replace(r, st=If(And(r.st == ABSENT, r.arrival == t), Q, r.st)) for r in reqs)


def remaining_ticks(r: Req, chunk_tokens: Int) -> Int:
    """Ticks ``r`` needs to finish if it gets a full chunk (``chunk_tokens``) every tick and is
    never preempted: ``ceil((n - nc) / chunk)`` to produce its next token, then one per token
    up to ``max_tokens`` (EOS or the length limit can only end it sooner)."""
    return cdiv(r.n - r.nc, chunk_tokens) + r.M - r.g - 1


def fcfs_service_ticks(num_prompt_tokens: Int, max_tokens: Int, chunk_tokens: Int) -> Int:
    """Ticks the oldest live request needs, at most, to finish under ``FCFSPolicy``.

    ``ceil((P + M - 1) / chunk) + M - 1``: in the worst case it was preempted after ``M - 1``
    tokens and recomputes ``P + M - 1`` tokens in chunks, the last of which yields token ``M``.
    ``chunk`` is ``min(prefill_chunk_tokens, token_budget_tokens)``: the oldest resident is
    processed first in every tick, so it always gets its chunk. See ``docs/spec.md``.
    """
    return cdiv(num_prompt_tokens + max_tokens - 1, chunk_tokens) + max_tokens - 1
