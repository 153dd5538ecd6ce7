"""Machine-checked properties of the scheduler: z3 proofs over ``spec/model.py``.

Run ``python -m spec.verify`` (``make verify``); ``--list`` names the checks, ``--only NAME``
runs some, ``--help`` shows the bounds. Each check prints its property, its bound or depth,
its result (``proved``, or ``counterexample`` with a replayable program) and its time; the
exit status is 1 when any check did not prove its property.

The checks are a registry (``CHECKS``): add one by decorating a function
``f(opts: Options) -> Outcome`` with ``@register(name, property)``, in this module or in a
module listed in ``PLUGINS`` (imported when present), as the fairness proofs
(``spec/verify_fairness.py``), the lifecycle table's (``spec/verify_lifecycle.py``) and prefix
caching's (``spec/verify_prefix.py``) are.

Every check but ``lifecycle_table`` (exhaustive over a finite table, ``spec/verify_lifecycle.py``)
asks z3 for a counterexample to ``assumptions -> property`` and expects
``unsat``; each also checks that the assumptions alone are satisfiable (``sat``), so a proof
cannot hold vacuously.

The proofs must not depend on one z3 version's luck (they prove with z3-solver 4.15 and 5.4):
every solver gets ``SOLVER_PARAMS`` (what 5.x changed by default), bounded runs are bit-blasted
by a fixed tactic (``BV_TACTIC``) one query per depth (``Run.stages``, ``_prove_stages``), each
query has a timeout (``Options.timeout_s``) and each check a time budget (``Options.budget_s``),
and ``--queries`` prints every query's result and time.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Sequence

from spec import lifecycle as lc
from spec import fairness_rules as fr
from spec import model, rules
from spec.invariants import (ABSENT, STATE_CODE, chunk_within_limit, fcfs_order, is_final, is_resident, is_waiting,
                             kv_within_cap)
from spec.logic import And, If, Implies, Not, Or, Sum
from spec.model import Cfg, Choices, Req

#: Modules that register more checks when imported (skipped when absent).
PLUGINS: tuple[str, ...] = ("spec.verify_fairness", "spec.verify_lifecycle", "spec.verify_prefix")

CODE_STATE = {v: k for k, v in STATE_CODE.items()} | {ABSENT: "absent"}


def _z3():
    import z3  # the runtime scheduler never needs z3

    return z3


# ---------------------------------------------------------------- options and results


@dataclass(frozen=True)
class Options:
    """Bounds of the checks (all sizes are small on purpose: every check runs in seconds).

    Attributes:
        block_tokens: ``B`` in the inductive proofs (the cap, chunk, budget and max_running
            are symbolic there: any positive integers).
        tick_slots: requests in flight (running or waiting) in the whole-tick proof.
        bmc_requests: requests submitted over a bounded run. bmc_depth: ticks in a bounded run.
        bmc_cap_blocks, bmc_block_tokens, bmc_chunk_tokens, bmc_budget_tokens, bmc_max_running:
            the knobs of bounded runs (concrete, small, so memory pressure is frequent).
        bmc_max_tokens: largest ``max_tokens`` in bounded runs (prompts: any admissible length).
        progress_chunks: ``(prefill_chunk_tokens, token_budget_tokens)`` pairs for the
            unbounded no-starvation proof (concrete, so ``ceil(x / chunk)`` stays linear).
        timeout_s: per z3 query; ``unknown`` after it.
        budget_s: per check, all its queries together (``run_checks``): a query gets what is
            left of it when that is less than ``timeout_s``, and the check is ``unknown`` once it
            is spent. The longest check is ``kv_cap_tick`` (times per check: ``docs/spec.md``).
    """

    block_tokens: int = 16
    tick_slots: int = 4
    bmc_requests: int = 3
    bmc_depth: int = 5
    bmc_cap_blocks: int = 3
    bmc_block_tokens: int = 2
    bmc_chunk_tokens: int = 2
    bmc_budget_tokens: int = 4
    bmc_max_running: int = 256
    bmc_max_tokens: int = 3
    progress_chunks: tuple[tuple[int, int], ...] = ((64, 4096), (4, 3), (3, 5))
    timeout_s: float = 60.0
    budget_s: float = 100.0

    def bmc_cfg(self) -> Cfg:
        return Cfg(self.bmc_cap_blocks, self.bmc_block_tokens, self.bmc_chunk_tokens, self.bmc_budget_tokens,
                   self.bmc_max_running)


@dataclass
class Trace:
    """A replayable bounded run: requests submitted before given ticks, then ``ticks`` ticks.

    Attributes:
        cfg: ``Scheduler`` keyword arguments. requests: ``(tick, request_id, prompt_tokens,
            max_tokens, eos_at)`` (``eos_at``: the backend returns EOS as that output token,
            0 never). ticks: ticks to run. violated: names of the violated properties.
        expect: what the replay should show (for example ``"r2 not finished after tick 7"``).
        target: ``(request_id, "admitted" or "finished")`` that the run shows late, if any.
        states: per tick, the model's view ``request_id: state g/nc/h``, for reading.
    """

    cfg: dict[str, int]
    requests: list[tuple[int, str, int, int, int]]
    ticks: int
    violated: list[str]
    expect: str = ""
    states: list[str] = field(default_factory=list)
    target: tuple[str, str] | None = None

    def program(self) -> str:
        """Python source that replays the run on the real ``Scheduler`` (runtime checks on)."""
        arrivals: dict[int, list] = {}
        for t, rid, p, m, _ in self.requests:
            arrivals.setdefault(t, []).append((rid, p, m))
        eos = {rid: e for _, rid, _, _, e in self.requests if e}
        knobs = ", ".join(f"{k}={v}" for k, v in self.cfg.items())
        return "\n".join([
            "from inference_stub import Request",
            "from batch.policies.policy import FCFSPolicy",
            "from scheduler import Scheduler",
            "from spec.verify import EosBackend",
            f"sched = Scheduler({knobs}, {FCFS_SOURCE},",
            f"                  backend=EosBackend({eos!r}), check_invariants=True)",
            f"arrivals = {arrivals!r}  # tick -> [(request_id, prompt_tokens, max_tokens)]",
            f"for t in range({self.ticks}):",
            "    for rid, p, m in arrivals.get(t, []):",
            "        sched.submit(Request(user_id='u-' + rid, prompt=[1] * p, max_tokens=m, request_id=rid))",
            "    for r in sched.tick():",
            "        print('tick', t, 'finished', r.request_id, len(r.generated))",
        ])

    def replay(self, **scheduler_kwargs: Any) -> dict[str, Any]:
        """Run the trace on the real ``Scheduler`` (FCFS as modelled, ``check_invariants=True``).

        Returns:
            ``{"finished": {request_id: tick}, "states": {request_id: lifecycle state at the
            end}, "error": exception or None}``; an exception (``InvariantViolation``, a failed
            assertion) stops the run.
        """
        from inference_stub import Request
        from scheduler import Scheduler

        eos = {rid: e for _, rid, _, _, e in self.requests if e}
        kw = dict(self.cfg, backend=EosBackend(eos), check_invariants=True) | fcfs_kwargs() | scheduler_kwargs
        sched = Scheduler(**kw)
        finished: dict[str, int] = {}
        error = None
        try:
            for t in range(self.ticks):
                for ta, rid, p, m, _ in self.requests:
                    if ta == t:
                        sched.submit(Request(user_id="u-" + rid, prompt=[1] * p, max_tokens=m, request_id=rid))
                for r in sched.tick():
                    finished[r.request_id] = t
        except Exception as e:  # noqa: BLE001 - reported to the caller
            error = e
        states = {s.request_id: s.state for s in sched.state.by_obj.values()} | {rid: "done" for rid in finished}
        return {"finished": finished, "states": states, "error": error}

    def __str__(self) -> str:
        lines = [f"violated: {', '.join(self.violated)}"]
        if self.expect:
            lines.append(f"expect: {self.expect}")
        lines += ["trace (model view per tick, request: state generated/computed/blocks):"]
        lines += [f"  {s}" for s in self.states]
        lines += ["replay:"] + [f"  {x}" for x in self.program().splitlines()]
        return "\n".join(lines)


@dataclass
class StateCounterexample:
    """A state satisfying the invariant from which one step breaks it (it may be unreachable:
    the bounded checks search reachable states)."""

    step: str
    violated: list[str]
    values: dict[str, Any]

    def __str__(self) -> str:
        body = "\n".join(f"  {k} = {v}" for k, v in self.values.items())
        return f"step: {self.step}\nviolated: {', '.join(self.violated)}\nstate before the step:\n{body}"


@dataclass
class Outcome:
    """What a check function returns. ``status``: ``proved``, ``counterexample`` or ``unknown``."""

    status: str
    bound: str
    detail: str = ""
    counterexample: Trace | StateCounterexample | None = None


@dataclass
class Result:
    """One check's printed record."""

    name: str
    property: str
    outcome: Outcome
    time_s: float

    @property
    def proved(self) -> bool:
        return self.outcome.status == "proved"

    def __str__(self) -> str:
        o = self.outcome
        head = (f"[{o.status}] {self.name} ({self.time_s:.2f} s)\n  property: {self.property}\n"
                f"  bound: {o.bound}")
        if o.detail:
            head += f"\n  {o.detail}"
        if o.counterexample is not None:
            head += "\n" + "\n".join("  " + x for x in str(o.counterexample).splitlines())
        return head


@dataclass(frozen=True)
class Check:
    name: str
    property: str
    run: Callable[[Options], Outcome]


#: The registry, in registration order.
CHECKS: dict[str, Check] = {}


def register(name: str, prop: str) -> Callable[[Callable[[Options], Outcome]], Callable[[Options], Outcome]]:
    """Decorator: add ``f(opts) -> Outcome`` to ``CHECKS`` under ``name`` with its property."""
    def deco(f: Callable[[Options], Outcome]) -> Callable[[Options], Outcome]:
        CHECKS[name] = Check(name, prop, f)
        return f
    return deco


#: ``Scheduler`` keyword arguments (beyond the knobs) of the FCFS scheduler the bounded models
#: describe: vLLM V1's rule exactly, without the defaults' aging reservation and hold (a head that
#: does not fit holds back every later request, as in vLLM V1: no admission past it; the
#: reservation's and the hold's bounds are ``spec/verify_fairness.py``'s).
FCFS_SOURCE = "policy=FCFSPolicy(), max_preemptions=None, aging_ticks=10**9, hold_ticks=10**9"


def fcfs_kwargs() -> dict[str, Any]:
    """``FCFS_SOURCE`` as keyword arguments (a fresh policy each call)."""
    from batch.policies.policy import FCFSPolicy

    return {"policy": FCFSPolicy(), "max_preemptions": None, "aging_ticks": 10**9, "hold_ticks": 10**9}


class EosBackend:
    """A deterministic backend for replays: EOS as the ``eos_at[request_id]``-th output token,
    token 1 otherwise (the same behaviour the models give the backend)."""

    def __init__(self, eos_at: dict[str, int]) -> None:
        self.eos_at = dict(eos_at)

    def __call__(self, batch: list) -> list[int]:
        return [0 if self.eos_at.get(r.request_id) == len(r.generated) + 1 else 1 for r in batch]


# ---------------------------------------------------------------- z3 plumbing


#: Parameters set on every solver, whatever the installed z3's defaults. z3 5.x sorts the
#: arguments of bit-vector sums (``rewriter.bv_sort_ac``, off up to 4.15): the unrolled runs' sums
#: of held blocks then lose their sharing, and ``kv_cap_bmc`` / ``no_starvation_fcfs`` went from
#: seconds to minutes (``unknown`` at the 120 s timeout). Stated here, both versions pose the same query.
SOLVER_PARAMS: dict[str, Any] = {"rewriter.bv_sort_ac": False}

#: The tactic for queries over bit-vectors and booleans only (the bounded runs): simplify,
#: eliminate the ``x_t == term`` definitions, bit-blast, and a SAT solver. Fixed here rather than
#: left to z3's choice for the logic, which changes between versions.
BV_TACTIC: tuple[str, ...] = ("simplify", "propagate-values", "solve-eqs", "bit-blast", "sat")

#: When the running check's time budget ends (``time.perf_counter()``); set by ``run_checks``.
_deadline: float | None = None
#: Where each query's result and time go (``--queries``), or nowhere.
_query_log: Callable[[str], None] | None = None


def _log_query(label: str, result: Any, t0: float) -> None:
    if _query_log is not None:
        _query_log(f"    query {label}: {result} ({time.perf_counter() - t0:.2f} s)")


class BudgetSpent(Exception):
    """The running check's time budget (``Options.budget_s``) ran out before a query."""


def _query_ms(timeout_s: float) -> int:
    """The timeout of the next query, ms: ``timeout_s``, or what is left of the check's budget.

    Raises:
        BudgetSpent: nothing is left.
    """
    if _deadline is not None:
        left = _deadline - time.perf_counter()
        if left <= 0:
            raise BudgetSpent
        timeout_s = min(timeout_s, left)
    return max(1, int(timeout_s * 1000))


def _is_bv(constraints: Sequence[Any]) -> bool:
    """Every constraint is over bit-vectors and booleans (z3's ``is-qfbv`` probe)."""
    z3 = _z3()
    g = z3.Goal()
    g.add(*constraints)
    return z3.Probe("is-qfbv")(g) == 1.0


_known_params: dict[tuple[str, Any], bool] = {}


def _param_known(key: str, value: Any) -> bool:
    """z3 accepts the solver parameter (it checks at the first assertion, not at ``set``): a
    later z3 without one of ``SOLVER_PARAMS`` runs the checks with its default instead of failing."""
    if (key, value) not in _known_params:
        z3 = _z3()
        s = z3.Solver()
        s.set(key, value)
        try:
            s.add(z3.BoolVal(True))
            _known_params[key, value] = True
        except z3.Z3Exception:
            _known_params[key, value] = False
    return _known_params[key, value]


def _solver(timeout_s: float, bit_blast: bool = False) -> Any:
    """A fresh solver with ``SOLVER_PARAMS`` and the query timeout; ``bit_blast``: ``BV_TACTIC``."""
    z3 = _z3()
    s = z3.Then(*BV_TACTIC).solver() if bit_blast else z3.Solver()
    s.set("timeout", _query_ms(timeout_s))
    for k, v in SOLVER_PARAMS.items():
        if _param_known(k, v):
            s.set(k, v)
    return s


def _solve(constraints: Sequence[Any], timeout_s: float) -> tuple[str, Any]:
    """``("sat", model)``, ``("unsat", None)`` or ``("unknown", reason)``; one fresh solver,
    ``BV_TACTIC`` when the constraints are bit-vector only."""
    z3 = _z3()
    s = _solver(timeout_s, _is_bv(constraints))
    s.add(*constraints)
    r = s.check()
    if r == z3.sat:
        return "sat", s.model()
    if r == z3.unsat:
        return "unsat", None
    return "unknown", s.reason_unknown()


def _outcome(status: str, info: Any, bound: str, counterexample: Callable[[Any, list[str]], Any],
             proved: str = "unsat; assumptions sat") -> Outcome:
    """Map a ``_prove`` answer to an ``Outcome``; ``counterexample(model, violated)`` builds the
    counterexample when z3 found one."""
    if status == "counterexample":
        return Outcome("counterexample", bound, counterexample=counterexample(*info))
    if status != "proved":
        return Outcome("unknown", bound, f"{status} {info or ''}")
    return Outcome("proved", bound, proved)


def _val(m: Any, t: Any) -> Any:
    z3 = _z3()
    if isinstance(t, (bool, int)):
        return t
    v = m.eval(t, model_completion=True)
    return z3.is_true(v) if z3.is_bool(v) else v.as_long()


def _sym_req(tag: str) -> Req:
    z3 = _z3()
    return Req(*(z3.Int(f"{f.name}_{tag}") for f in fields(Req)))


def _sym_cfg(block_tokens: int) -> Cfg:
    z3 = _z3()
    return Cfg(z3.Int("cap_blocks"), block_tokens, z3.Int("chunk_tokens"), z3.Int("budget_tokens"),
               z3.Int("max_running"))


def _req_values(m: Any, r: Req) -> str:
    st = CODE_STATE.get(_val(m, r.st), _val(m, r.st))
    return (f"{st}: prompt {_val(m, r.P)}, generated {_val(m, r.g)}, computed {_val(m, r.nc)}, "
            f"blocks {_val(m, r.h)}, max_tokens {_val(m, r.M)}, eos_at {_val(m, r.E)}")


def _cfg_values(m: Any, cfg: Cfg) -> dict[str, Any]:
    return {"cap_blocks": _val(m, cfg.cap_blocks), "block_tokens": cfg.block_tokens,
            "prefill_chunk_tokens": _val(m, cfg.chunk_tokens), "token_budget_tokens": _val(m, cfg.budget_tokens),
            "max_running": _val(m, cfg.max_running)}


def _prove(assumptions: Sequence[Any], goals: Sequence[tuple[str, Any]], timeout_s: float,
           split: bool = True, lemmas: bool = False) -> tuple[str, Any]:
    """Check ``assumptions`` are satisfiable, then that they imply every goal.

    With ``split``, one goal at a time on one incremental solver (much faster for a single
    step with many goals); with ``lemmas`` too, each proved goal is then kept as a lemma for
    the next ones (sound: the assumptions imply it; for goals that restate each other, such as
    a whole tick's ledger goals, one linear equation written twice; unrelated lemmas can slow
    a query down, so it is asked for per group). Without ``split``, one query for the
    disjunction of the negated goals on a fresh solver (``_prove_stages`` with one stage:
    bounded runs, whose goals share the unrolling).

    Returns:
        ``("proved", None)``, ``("vacuous", None)``, ``("unknown", reason)`` or
        ``("counterexample", (model, [names of the goals false in it]))``.
    """
    if not split:
        return _prove_stages([("", assumptions, goals)], timeout_s)
    z3 = _z3()
    try:
        s = _solver(timeout_s)
        s.add(*assumptions)
        t0 = time.perf_counter()
        r = s.check()
        _log_query("assumptions", r, t0)
        if r == z3.unsat:
            return "vacuous", None
        if r != z3.sat:
            return "unknown", s.reason_unknown()
        for name, g in goals:
            if isinstance(g, bool):
                if g:
                    continue
                s.check()
                return "counterexample", (s.model(), [name])
            s.set("timeout", _query_ms(timeout_s))
            s.push()
            s.add(Not(g))
            t0 = time.perf_counter()
            r = s.check()
            _log_query(name, r, t0)
            if r == z3.sat:
                m = s.model()
                return "counterexample", (m, [n for n, h in goals if not _val(m, h)])
            s.pop()
            if r != z3.unsat:
                return "unknown", f"{name}: {s.reason_unknown()}"
            if lemmas:
                s.add(g)  # proved: a lemma for the goals after it
    except BudgetSpent:
        return "unknown", "the check's time budget is spent"
    return "proved", None


def _prove_stages(stages: Sequence[tuple[str, Sequence[Any], Sequence[tuple[str, Any]]]],
                  timeout_s: float) -> tuple[str, Any]:
    """A bounded run, one query per stage: stage ``k``'s goals under the assumptions of stages
    ``0..k`` (``(label, assumptions, goals)``; a run's goals at tick ``t`` need its unrolling up
    to ``t`` only, so one stage per depth). Each query is a fresh solver (``BV_TACTIC`` when the
    query is bit-vector only), for the disjunction of the stage's negated goals, so every
    query gets the whole time limit and the first depth with a counterexample is the one
    reported. The conjunction of every stage's assumptions is checked satisfiable first.

    Returns:
        As ``_prove``; ``unknown``'s reason names the stage.
    """
    everything = [a for _, asm, _ in stages for a in asm]
    try:
        t0 = time.perf_counter()
        r, info = _solve(everything, timeout_s)
        _log_query("assumptions", r, t0)
        if r != "sat":
            return ("vacuous", None) if r == "unsat" else ("unknown", info)
        upto: list[Any] = []
        for label, asm, goals in stages:
            upto += asm
            if not goals:
                continue
            t0 = time.perf_counter()
            r, m = _solve([*upto, Or(*(Not(g) for _, g in goals))], timeout_s)
            _log_query(label or "the goals at once", r, t0)
            if r == "sat":
                return "counterexample", (m, [n for n, g in goals if not _val(m, g)])
            if r != "unsat":
                return "unknown", f"{label}: {m}".lstrip(": ")
    except BudgetSpent:
        return "unknown", "the check's time budget is spent"
    return "proved", None


# ---------------------------------------------------------------- (a) KV cap, per transition


@register("kv_cap_per_transition",
          "kv_within_cap, by the inductive invariant Inv (exact ledger, every request valid): for every "
          "transition of the lifecycle table and every internal step (chunk, decode), "
          "Inv and guard and effect imply Inv' and the step's facts (chunk <= 64, budget, one token)")
def check_kv_cap_per_transition(opts: Options) -> Outcome:
    """One request steps; every other request is summarised by the blocks it holds (``rest``)."""
    z3 = _z3()
    cfg = _sym_cfg(opts.block_tokens)
    table = {e: (tuple(src), dst) for e, src, dst in lc.TRANSITIONS}
    modelled = {name: (tuple(src), dst) for name, src, dst, _ in model.TRANSITIONS}
    mismatch = [e for e in table if modelled.get(e) != table[e]]
    mismatch += [e for e in modelled if e not in table and e not in model.INTERNAL_STEPS]
    bound = f"unbounded (any cap, chunk, budget; B = {opts.block_tokens} tokens per block; any number of requests)"
    if mismatch:
        return Outcome("counterexample", bound, f"the model and spec.lifecycle.TRANSITIONS disagree on {mismatch}")
    steps = 0
    for name, sources, dest, fn in model.TRANSITIONS:
        for src in sources:
            r = _sym_req("r")
            free, rest, budget = z3.Ints("free_blocks rest_held_blocks budget_left_tokens")
            step = fn(r, free, cfg, budget)
            pre = [cfg.ok(), budget >= 1, r.st == STATE_CODE[src], model.system_valid([r], free, cfg, rest),
                   step.guard]
            goals = (model.system_named([step.req], step.free_blocks, cfg, rest) + list(step.facts)
                     + [("destination", step.req.st == STATE_CODE[dest])])
            status, info = _prove(pre, goals, opts.timeout_s)
            steps += 1
            if status == "counterexample":
                m, bad = info
                values = _cfg_values(m, cfg) | {"request": _req_values(m, r), "free_blocks": _val(m, free),
                                                "blocks held by the others": _val(m, rest),
                                                "budget_left_tokens": _val(m, budget),
                                                "after": _req_values(m, step.req)}
                return Outcome("counterexample", bound, counterexample=StateCounterexample(
                    f"{name} from {src}", bad, values))
            if status != "proved":
                return Outcome("unknown", bound, f"{name} from {src}: {status} {info or ''}")
    return Outcome("proved", bound, f"{steps} (step, source state) pairs, each unsat; assumptions sat")


# ---------------------------------------------------------------- (b) KV cap, the whole tick


#: The KV ledger's goals of ``model.system_named`` (proved as one group in ``kv_cap_tick``).
LEDGER_GOALS = ("free_nonnegative", "ledger_consistent", "kv_within_cap", "kv_used_is_sum_held")


def _any_policy(R: int, tag: str = "") -> Choices:
    """Every choice a policy (or the isolation layer) can make, as free variables."""
    z3 = _z3()
    extra = [z3.Int(f"extra_blocks_{tag}{j}") for j in range(R)]
    headroom = [z3.Int(f"headroom_{tag}{j}") for j in range(R)]
    ch = Choices(victim=lambda i, a, alive: z3.Int(f"victim_{tag}{i}_{a}"),
                 skip=[z3.Bool(f"skip_{tag}{j}") for j in range(R)],
                 backfill=z3.Bool(f"backfill{tag}"), admit_after_preempt=z3.Bool(f"admit_after_preempt{tag}"),
                 extra_blocks=extra, headroom=headroom,
                 late_preempt=[z3.Bool(f"late_preempt_{tag}{j}") for j in range(R)],
                 revoke=[z3.Bool(f"revoke_{tag}{j}") for j in range(R)])
    ch.assumptions += [x >= 0 for x in extra + headroom]
    return ch


@register("kv_cap_tick",
          "Inv is preserved by a whole tick (growth and preemption of running requests, admissions, chunk "
          "progress, one token per producing request, EOS and length finishes), and every batch passed "
          "to forward satisfies sum(kv_blocks_for) <= cap, chunk <= 64, budget, one token per request")
def check_kv_cap_tick(opts: Options) -> Outcome:
    """Slots hold any mix of absent, queued, running, preempted and finished requests."""
    z3 = _z3()
    R = opts.tick_slots
    cfg = _sym_cfg(opts.block_tokens)
    reqs = [_sym_req(f"r{j}") for j in range(R)]
    free = z3.Int("free_blocks")
    ch = _any_policy(R)
    res = model.tick(reqs, free, cfg, ch)
    pre = [cfg.ok(), model.system_valid(reqs, free, cfg), *ch.assumptions]
    goals = model.system_named(res.reqs, res.free_blocks, cfg) + list(res.facts)
    bound = (f"up to {R} requests in flight, any cap, chunk, budget, max_running; B = {opts.block_tokens}; "
             f"any policy choice (victim, skipped running requests, admission order, backfill, admission "
             f"after preemption)")
    # Two groups: the KV ledger's goals (free >= 0, the ledger, within the cap, used = sum held:
    # one equation and its consequences, each proved goal a lemma for the next, which halves
    # the time), then every other goal on its own (the ledger lemmas slow z3 5.4 down there).
    ledger = [g for g in goals if g[0] in LEDGER_GOALS]
    status, info = _prove(pre, ledger, opts.timeout_s, lemmas=True)
    if status == "proved":
        status, info = _prove(pre, [g for g in goals if g[0] not in LEDGER_GOALS], opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> StateCounterexample:
        values = _cfg_values(m, cfg) | {"free_blocks": _val(m, free)}
        for j, r in enumerate(reqs):
            values[f"slot {j}"] = _req_values(m, r)
            values[f"slot {j} this tick"] = (
                f"in batch {_val(m, res.in_batch[j])}, tokens {_val(m, res.num_new_tokens[j])}, "
                f"admitted {_val(m, res.admitted[j])}, preempted {_val(m, res.preempted[j])}, skipped "
                f"{_val(m, ch.skip[j])} -> {_req_values(m, res.reqs[j])}")
        values["backfill"] = _val(m, ch.backfill)
        values["admit_after_preempt"] = _val(m, ch.admit_after_preempt)
        return StateCounterexample("tick", bad, values)
    return _outcome(status, info, bound, cex)


class _Loop:
    """The state of ``model.tick``'s loops between two steps, summarised over any number of
    requests: ``free`` blocks, ``held_in`` (blocks held, with this plan's grants, by the requests
    in the batch so far), ``held_out`` (by resident requests not in it), ``kv_in`` (their
    ``blocks_for(num_tokens)``, what ``forward`` counts), ``spent`` (their tokens) and the
    ``budget`` left."""

    def __init__(self, tag: str) -> None:
        z3 = _z3()
        self.free, self.held_in, self.held_out, self.kv_in, self.spent, self.budget = z3.Ints(
            " ".join(f"{x}_{tag}" for x in ("free", "held_in", "held_out", "kv_in", "spent", "budget_left")))

    def inv(self, cap: Any, budget: Any, sub: dict | None = None) -> list[tuple[str, Any]]:
        """The loop invariant, after the substitution ``sub`` (field -> value) when given."""
        v = {k: getattr(self, k) for k in ("free", "held_in", "held_out", "kv_in", "spent", "budget")} | (sub or {})
        return [("free >= 0", v["free"] >= 0),
                ("ledger: free + held_in + held_out = cap", v["free"] + v["held_in"] + v["held_out"] == cap),
                ("held_out >= 0", v["held_out"] >= 0),
                ("0 <= kv_in <= held_in (the batch is covered)", And(0 <= v["kv_in"], v["kv_in"] <= v["held_in"])),
                ("spent + budget_left = budget, budget_left >= 0",
                 And(v["spent"] >= 0, v["budget"] >= 0, v["spent"] + v["budget"] == budget))]


def _loop_steps(lp: _Loop, cfg: Cfg) -> list[tuple[str, list, dict, list]]:
    """The steps ``model.tick``'s loops are made of, each on one request with the others summarised:
    ``(name, guard, after (field -> value), element goals)``."""
    z3 = _z3()
    B = cfg.block_tokens
    steps = []
    # a request of the batch leaves it: a growth or room victim granted this plan, a late
    # preemption, an admission taken back, or a finish in update_from_output (its blocks come
    # back); its share of the sums is an element of sums of non-negative terms
    held, kv, k = z3.Ints("victim_held victim_kv victim_tokens")
    guard = [0 <= kv, kv <= held, held <= lp.held_in, kv <= lp.kv_in, held - kv <= lp.held_in - lp.kv_in,
             0 <= k, k <= lp.spent]
    steps.append(("a request leaves the batch (victim granted this plan, late preemption, admission taken back, "
                  "finish)", guard, {"free": lp.free + held, "held_in": lp.held_in - held, "kv_in": lp.kv_in - kv,
                                     "spent": lp.spent - k, "budget": lp.budget + k}, []))
    h = z3.Int("victim_held_out")
    steps.append(("a resident request not in the batch is preempted (growth, room, late preemption)",
                  [0 <= h, h <= lp.held_out], {"free": lp.free + h, "held_out": lp.held_out - h}, []))
    r = _sym_req("r")
    need = rules.growth_blocks(r.h, r.n, B)
    n_new = rules.chunk_tokens(r.n, r.nc, cfg.chunk_tokens, lp.budget)
    guard = [And(*(p for _, p in model.request_named(r, cfg))),
             is_resident(r.st), 0 <= r.h, r.h <= lp.held_out, lp.budget > 0, rules.can_allocate(lp.free, need),
             n_new > 0]
    steps.append(("a running request grows and joins the batch (its while loop ended: its blocks fit)", guard,
                  {"free": lp.free - need, "held_out": lp.held_out - r.h, "held_in": lp.held_in + r.h + need,
                   "kv_in": lp.kv_in + rules.blocks_for(r.n, B), "spent": lp.spent + n_new,
                   "budget": lp.budget - n_new},
                  [("its blocks cover it", And(0 <= rules.blocks_for(r.n, B), rules.blocks_for(r.n, B) <= r.h + need)),
                   ("chunk_within_limit", chunk_within_limit(n_new, cfg.chunk_tokens))]))
    w = _sym_req("w")
    extra, headroom = z3.Ints("extra_blocks headroom_blocks")
    need_w = rules.blocks_needed(w.n, B) + extra
    n_w = rules.chunk_tokens(w.n, 0, cfg.chunk_tokens, lp.budget)
    guard = [And(*(p for _, p in model.request_named(w, cfg))), is_waiting(w.st), extra >= 0, headroom >= 0,
             lp.budget > 0, fr.can_admit(lp.free, need_w, headroom)]
    steps.append(("a waiting request is admitted (any extra blocks and headroom)", guard,
                  {"free": lp.free - need_w, "held_in": lp.held_in + need_w,
                   "kv_in": lp.kv_in + rules.blocks_for(w.n, B), "spent": lp.spent + n_w, "budget": lp.budget - n_w},
                  [("its blocks cover it", And(0 <= rules.blocks_for(w.n, B), rules.blocks_for(w.n, B) <= need_w)),
                   ("chunk_within_limit", chunk_within_limit(n_w, cfg.chunk_tokens))]))
    return steps


@register("kv_cap_tick_loop",
          "kv_cap_tick for any number of requests in flight: a loop invariant (free >= 0; free + blocks held by "
          "the batch + blocks held by the other residents = cap; the batch's kv_blocks_for <= its blocks; tokens "
          "spent + budget left = budget) holds at the tick's start under Inv and is kept by every step "
          "model.tick's loops are made of (a request leaves the batch, a resident outside it is preempted, a "
          "running request grows and joins it, a waiting request is admitted), so forward's batch is within the "
          "cap and the budget and the ledger is exact after the tick; each request's own path through a tick "
          "(model.tick on its slot with any policy choice and any free blocks and budget left at its turn) keeps "
          "its invariants")
def check_kv_cap_tick_loop(opts: Options) -> Outcome:
    """Inductive steps over the loop state ``_Loop``; the per-request part is ``model.tick`` on one slot."""
    z3 = _z3()
    cfg = _sym_cfg(opts.block_tokens)
    bound = (f"any number of requests in flight, any cap, chunk, budget, max_running; B = {opts.block_tokens}; any "
             f"policy choice; the composition of the steps is model.tick's loops (read from its code)")
    lp = _Loop("0")
    base = [cfg.ok()]
    pre = [g for _, g in lp.inv(cfg.cap_blocks, cfg.budget_tokens)]
    # the start: Inv (the ledger) gives the invariant with an empty batch
    free0, held0 = z3.Ints("free_blocks_at_start held_by_residents")
    start = lp.inv(cfg.cap_blocks, cfg.budget_tokens, {"free": free0, "held_in": 0, "held_out": held0, "kv_in": 0,
                                                       "spent": 0, "budget": cfg.budget_tokens})
    status, info = _prove([*base, free0 >= 0, held0 >= 0, free0 + held0 == cfg.cap_blocks], start, opts.timeout_s)
    if status != "proved":
        return Outcome(status if status != "counterexample" else "counterexample", bound, f"start: {status}")
    for name, guard, after, elem in _loop_steps(lp, cfg):
        goals = lp.inv(cfg.cap_blocks, cfg.budget_tokens, after) + elem
        status, info = _prove([*base, *pre, *guard], goals, opts.timeout_s)
        if status == "counterexample":
            m, bad = info
            values = _cfg_values(m, cfg) | {d.name(): m[d] for d in m.decls() if not d.name().startswith(
                ("cap_", "chunk_", "budget_tokens", "max_running"))}
            return Outcome("counterexample", bound, counterexample=StateCounterexample(name, bad, values))
        if status != "proved":
            return Outcome("unknown", bound, f"{name}: {status} {info or ''}")
    # what the invariant gives: forward's facts, and the ledger after the tick (the batch's blocks
    # stay held or come back at a finish, a step above)
    facts = [("batch_kv_within_cap: kv_in <= cap", lp.kv_in <= cfg.cap_blocks),
             ("batch_within_budget: spent <= budget", lp.spent <= cfg.budget_tokens),
             ("kv_within_cap after the tick", kv_within_cap(cfg.cap_blocks - lp.free, cfg.cap_blocks)),
             ("kv_used_is_sum_held after the tick", cfg.cap_blocks - lp.free == lp.held_in + lp.held_out)]
    status, info = _prove([*base, *pre], facts, opts.timeout_s)
    if status != "proved":
        return Outcome("counterexample" if status == "counterexample" else "unknown", bound, f"facts: {status}")
    # each request's own path, the others as the free blocks and budget left at its turn
    r = _sym_req("r")
    free_env, budget_env = z3.Ints("free_at_its_turn budget_at_its_turn")
    env = Cfg(cfg.cap_blocks, cfg.block_tokens, cfg.chunk_tokens, budget_env, cfg.max_running)
    ch = _any_policy(1)
    res = model.tick([r], free_env, env, ch)
    pre1 = [cfg.ok(), budget_env >= 1, budget_env <= cfg.budget_tokens, free_env >= 0,
            And(*(p for _, p in model.request_named(r, cfg))), *ch.assumptions]
    goals1 = model.request_named(res.reqs[0], cfg) + [(n, g) for n, g in res.facts
                                                       if n in ("chunk_within_limit", "one_token_per_tick")]
    status, info = _prove(pre1, goals1, opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> StateCounterexample:
        return StateCounterexample("one request's path through a tick", bad, _cfg_values(m, cfg) | {
            "request": _req_values(m, r), "after": _req_values(m, res.reqs[0]),
            "free at its turn": _val(m, free_env), "budget at its turn": _val(m, budget_env)})
    return _outcome(status, info, bound, cex, "unsat for the start, every step, the facts and a request's path; "
                                              "assumptions sat")


@register("decode_fast_path",
          "the scheduler's decode fast path is the rule: when rules.decode_ready holds (budget and chunk "
          ">= 1), growth_blocks is 0, chunk_tokens is 1 and can_allocate(free, 0) holds, so skipping them "
          "changes no plan")
def check_decode_fast_path(opts: Options) -> Outcome:
    """One resident request in any state of the inductive invariant's ranges."""
    z3 = _z3()
    held, n, nc, chunk, budget, free = z3.Ints("held_blocks num_tokens num_computed_tokens chunk_tokens "
                                              "budget_left_tokens free_blocks")
    B = opts.block_tokens
    pre = [held >= 0, n >= 1, nc >= 0, nc <= n, chunk >= 1, budget >= 1, free >= 0,
           rules.decode_ready(held, n, nc, B)]
    goals = [("growth_is_zero", rules.growth_blocks(held, n, B) == 0),
             ("one_token", rules.chunk_tokens(n, nc, chunk, budget) == 1),
             ("growth_guard_passes", rules.can_allocate(free, 0))]
    status, info = _prove(pre, goals, opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> StateCounterexample:
        return StateCounterexample("decode fast path", bad, {
            "held_blocks": _val(m, held), "num_tokens": _val(m, n), "num_computed_tokens": _val(m, nc),
            "prefill_chunk_tokens": _val(m, chunk), "budget_left_tokens": _val(m, budget),
            "free_blocks": _val(m, free), "block_tokens": B})
    return _outcome(status, info, f"unbounded (any tokens, blocks, chunk, budget; B = {B})", cex)


# ---------------------------------------------------------------- bounded runs from the empty state


@dataclass
class Run:
    """A symbolic bounded run: ``before[t]`` is the state fed to tick ``t`` (after the
    submits before it), ``after[t]`` the state that tick leaves (before the next submits);
    ``free_before`` / ``free_after`` the free blocks then; ``marks[t]``: how many of
    ``assumptions`` (the requests', then each tick's definitions) unroll ticks ``0..t``."""

    cfg: Cfg
    reqs0: list[Req]
    before: list[tuple[Req, ...]]
    free_before: list[Any]
    after: list[tuple[Req, ...]]
    free_after: list[Any]
    results: list[model.TickResult]
    assumptions: list[Any]
    marks: list[int] = field(default_factory=list)

    def stages(self, goals: Sequence[Sequence[tuple[str, Any]]]) -> list[tuple[str, list, list]]:
        """``_prove_stages``' stages for ``goals[t]``, goals about ticks ``0..t``: one per depth."""
        cut = [0, *self.marks]
        return [(f"depth {t + 1}", self.assumptions[cut[t]:cut[t + 1]], list(g)) for t, g in enumerate(goals)]


def unroll(opts: Options, *, fcfs: bool = True) -> Run:
    """Unroll ``opts.bmc_depth`` ticks of the FCFS model from the empty scheduler.

    Requests (``opts.bmc_requests`` slots, in arrival order) have symbolic arrival ticks,
    admissible prompt lengths (``prompt_fits``), ``max_tokens`` in ``1..bmc_max_tokens`` and
    an EOS position in ``0..bmc_max_tokens`` (0: the backend never returns EOS).
    """
    z3 = _z3()
    from spec import rules

    R, K = opts.bmc_requests, opts.bmc_depth
    cfg = opts.bmc_cfg()
    # With R requests, max_running >= R and a budget >= R * chunk never bind: clamp them so the
    # numbers stay small (same behaviour).
    cfg = replace(cfg, max_running=min(cfg.max_running, R),
                  budget_tokens=min(cfg.budget_tokens, R * cfg.chunk_tokens))
    # Bit-vectors: every quantity of a bounded run is small, and z3 decides them by bit-blasting
    # far faster than integer arithmetic full of if-then-else. The width leaves room for
    # sign and sums (comparisons are signed, so a negative free count stays visible).
    longest = cfg.cap_blocks * cfg.block_tokens + opts.bmc_max_tokens  # tokens of one request
    service = longest + opts.bmc_max_tokens  # >= fcfs_service_ticks of one request
    top = max(longest, cfg.chunk_tokens, cfg.budget_tokens, cfg.cap_blocks, cfg.max_running, K + R * service) + longest
    width = (2 * top).bit_length() + 1

    def var(name: str) -> Any:
        return z3.BitVec(name, width)

    zero = z3.BitVecVal(0, width)
    reqs = [Req(zero + ABSENT, var(f"P{j}"), var(f"M{j}"), var(f"E{j}"), zero, zero, zero, zero, var(f"a{j}"))
            for j in range(R)]
    asm = []
    for j, r in enumerate(reqs):
        asm += [r.P <= cfg.max_model_len_tokens, rules.prompt_fits(r.P, cfg.cap_blocks, cfg.block_tokens),
                r.M >= 1, r.M <= opts.bmc_max_tokens,
                r.E >= 0, r.E <= opts.bmc_max_tokens, r.arrival >= 0, r.arrival < K]
        if j:
            asm.append(reqs[j - 1].arrival <= r.arrival)
    cur: tuple[Req, ...] = tuple(reqs)
    free: Any = zero + cfg.cap_blocks
    run = Run(cfg, reqs, [], [], [], [], [], asm)
    for t in range(K):
        cur = model.arrive(cur, t)
        run.before.append(cur)
        run.free_before.append(free)
        res = model.tick(cur, free, cfg, None if fcfs else _any_policy(R, f"t{t}_"))
        run.results.append(res)
        cur, free = _fresh(res.reqs, res.free_blocks, f"t{t + 1}", asm, var)
        run.after.append(cur)
        run.free_after.append(free)
        run.marks.append(len(asm))
    return run


def _fresh(reqs: Sequence[Req], free: Any, tag: str, asm: list, var: Callable[[str], Any]) -> tuple[tuple[Req, ...], Any]:
    """Name a tick's outcome with fresh variables (``x_t == term``): keeps z3's terms flat."""
    out = []
    for j, r in enumerate(reqs):
        vals = {}
        for f in ("st", "g", "nc", "h", "pre"):
            v = var(f"{f}{j}_{tag}")
            asm.append(v == getattr(r, f))
            vals[f] = v
        out.append(replace(r, **vals))
    fv = var(f"free_{tag}")
    asm.append(fv == free)
    return tuple(out), fv


def _trace(m: Any, run: Run, opts: Options, violated: list[str], ticks: int, expect: str = "") -> Trace:
    reqs = [(_val(m, r.arrival), f"r{j}", _val(m, r.P), _val(m, r.M), _val(m, r.E))
            for j, r in enumerate(run.reqs0)]
    states = []
    for t in range(1, ticks + 1):
        parts = []
        for j, r in enumerate(run.after[t - 1]):
            st = _val(m, r.st)
            if st != ABSENT:
                parts.append(f"r{j}: {CODE_STATE[st]} {_val(m, r.g)}/{_val(m, r.nc)}/{_val(m, r.h)}")
        states.append(f"after tick {t - 1}: free {_val(m, run.free_after[t - 1])}; " + "; ".join(parts))
    cfg = {"kv_cap_blocks": opts.bmc_cap_blocks, "block_tokens": opts.bmc_block_tokens,
           "prefill_chunk_tokens": opts.bmc_chunk_tokens, "token_budget_tokens": opts.bmc_budget_tokens,
           "max_running": opts.bmc_max_running}
    return Trace(cfg, reqs, ticks, violated, expect, states)


def _bmc_bound(opts: Options) -> str:
    return (f"depth {opts.bmc_depth} ticks, {opts.bmc_requests} requests (any arrival ticks, admissible prompts, "
            f"max_tokens <= {opts.bmc_max_tokens}, any EOS position), cap {opts.bmc_cap_blocks} blocks of "
            f"{opts.bmc_block_tokens} tokens, chunk {opts.bmc_chunk_tokens}, budget {opts.bmc_budget_tokens}")


@register("kv_cap_bmc",
          "every state reachable from the empty scheduler within the depth satisfies Inv (hence kv_within_cap) "
          "and every tick's facts hold (batch kv_blocks_for <= cap, chunk, budget, one token per request); "
          "FCFS, replayable counterexamples")
def check_kv_cap_bmc(opts: Options) -> Outcome:
    """One query per depth (``Run.stages``): tick ``t``'s state and facts under the unrolling of
    ticks ``0..t``."""
    run = unroll(opts)
    bound = _bmc_bound(opts)
    goals: list[list[tuple[str, Any]]] = []
    for t in range(1, opts.bmc_depth + 1):
        goals.append([(f"{n} (after tick {t - 1})", g)
                      for n, g in model.system_named(run.after[t - 1], run.free_after[t - 1], run.cfg)]
                     + [(f"{n} (tick {t - 1})", g) for n, g in run.results[t - 1].facts])
    status, info = _prove_stages(run.stages(goals), opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> Trace:
        tick_of = {b: int(b.rsplit("tick ", 1)[1].rstrip(")")) for b in bad}
        first = min(tick_of.values())
        return _trace(m, run, opts, [b for b in bad if tick_of[b] == first], first + 1)
    return _outcome(status, info, bound, cex)


# ---------------------------------------------------------------- (c) no starvation under FCFS


@register("no_starvation_fcfs",
          "under FCFSPolicy every admissible request r, submitted before tick a_r, is admitted within "
          "A_r = sum_{older live q} T_q + 1 ticks and finishes within D_r = sum_{older live q} T_q + T_r ticks, "
          "T_q = ceil((P_q + M_q - 1) / min(chunk, budget)) + M_q - 1 (fairness assumption: tick() keeps "
          "being called; a request finishes by its max_tokens)")
def check_no_starvation_fcfs(opts: Options) -> Outcome:
    """Bounded model checking: only deadlines that fall within the depth are checked; one query
    per depth (``Run.stages``): the deadlines that fall at the end of tick ``t``."""
    run = unroll(opts)
    K = opts.bmc_depth
    chunk = min(opts.bmc_chunk_tokens, opts.bmc_budget_tokens)
    T = [model.fcfs_service_ticks(r.P, r.M, chunk) for r in run.reqs0]
    goals: list[list[tuple[str, Any]]] = [[] for _ in range(K)]
    targets = {}
    for j, r in enumerate(run.reqs0):
        for t0 in range(K):
            live_older = [Or(is_waiting(run.before[t0][q].st), is_resident(run.before[t0][q].st)) for q in range(j)]
            older = Sum([If(live_older[q], T[q], 0) for q in range(j)])
            adm_by, fin_by = t0 + older + 1, t0 + older + T[j]
            for t1 in range(t0 + 1, K + 1):
                s = run.after[t1 - 1][j]
                ever = Or(is_resident(s.st), is_final(s.st), s.pre >= 1)
                name_a = f"r{j} submitted before tick {t0} admitted by tick {t1 - 1}"
                name_f = f"r{j} submitted before tick {t0} finished by tick {t1 - 1}"
                goals[t1 - 1].append((name_a, Or(r.arrival != t0, adm_by != t1, ever)))
                goals[t1 - 1].append((name_f, Or(r.arrival != t0, fin_by != t1, is_final(s.st))))
                targets[name_a] = (t1, f"r{j} not yet admitted after tick {t1 - 1}", (f"r{j}", "admitted"))
                targets[name_f] = (t1, f"r{j} not finished after tick {t1 - 1}", (f"r{j}", "finished"))
    bound = _bmc_bound(opts) + "; deadlines beyond the depth are not checked"
    status, info = _prove_stages(run.stages(goals), opts.timeout_s)

    def cex(m: Any, bad: list[str]) -> Trace:
        ticks, expect, target = targets[bad[0]]
        trace = _trace(m, run, opts, [bad[0]], ticks, expect)
        trace.target = target
        return trace
    return _outcome(status, info, bound, cex)


# ---------------------------------------------------------------- (c') no starvation, unbounded


@register("no_starvation_fcfs_inductive",
          "under FCFSPolicy, from every state satisfying Inv and fcfs_order, one tick keeps fcfs_order, "
          "the oldest live request is never preempted, a waiting oldest request is admitted, and the "
          "oldest live request finishes or its remaining_ticks drops by >= 1, with remaining_ticks <= T_q "
          "(so it finishes within T_q ticks; by induction over the older requests, r within D_r)")
def check_no_starvation_fcfs_inductive(opts: Options) -> Outcome:
    """Slot 0 is the oldest live request; earlier requests are finished and play no part."""
    z3 = _z3()
    R = opts.tick_slots
    bound = (f"up to {R} requests in flight, any cap and max_running, B = {opts.block_tokens}, "
             f"(chunk, budget) in {list(opts.progress_chunks)}; unbounded depth")
    for chunk, budget in opts.progress_chunks:
        cap, max_running = z3.Ints("cap_blocks max_running")
        cfg = Cfg(cap, opts.block_tokens, chunk, budget, max_running)
        reqs = [_sym_req(f"r{j}") for j in range(R)]
        free = z3.Int("free_blocks")
        res = model.tick(reqs, free, cfg)
        q, q1 = reqs[0], res.reqs[0]
        eff = min(chunk, budget)
        rem, rem1 = model.remaining_ticks(q, eff), model.remaining_ticks(q1, eff)
        pre = [cfg.ok(), model.system_valid(reqs, free, cfg), fcfs_order([r.st for r in reqs]),
               Or(is_waiting(q.st), is_resident(q.st))]
        goals = [("fcfs_order", fcfs_order([r.st for r in res.reqs])),
                 ("oldest_never_preempted", Not(res.preempted[0])),
                 ("oldest_admitted", Implies(is_waiting(q.st), Not(is_waiting(q1.st)))),
                 ("oldest_progress", Or(is_final(q1.st), rem1 <= rem - 1)),
                 ("remaining_positive", rem >= 1),
                 ("remaining_within_service", rem <= model.fcfs_service_ticks(q.P, q.M, eff))]
        status, info = _prove(pre, goals, opts.timeout_s)
        if status == "counterexample":
            m, bad = info
            values = _cfg_values(m, cfg) | {"free_blocks": _val(m, free)}
            for j, r in enumerate(reqs):
                values[f"slot {j}"] = _req_values(m, r) + f" -> {_req_values(m, res.reqs[j])}"
            return Outcome("counterexample", bound, counterexample=StateCounterexample(
                f"tick (chunk {chunk}, budget {budget})", bad, values))
        if status != "proved":
            return Outcome("unknown", bound, f"(chunk {chunk}, budget {budget}): {status} {info or ''}")
    return Outcome("proved", bound, "unsat for every (chunk, budget); assumptions sat")


# ---------------------------------------------------------------- running


def _load_plugins() -> None:
    for name in PLUGINS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def run_checks(names: Iterable[str] | None = None, opts: Options | None = None,
               out: Callable[[str], None] | None = print) -> list[Result]:
    """Run the named checks (all by default) and print each result as it finishes.

    Raises:
        KeyError: an unknown check name.
    """
    global _deadline
    _load_plugins()
    opts = opts or Options()
    chosen = [CHECKS[n] for n in names] if names else list(CHECKS.values())
    results = []
    for c in chosen:
        t0 = time.perf_counter()
        _deadline = t0 + opts.budget_s
        try:
            outcome = c.run(opts)
        except BudgetSpent:
            outcome = Outcome("unknown", "", f"the time budget of {opts.budget_s} s is spent")
        finally:
            _deadline = None
        r = Result(c.name, c.property, outcome, time.perf_counter() - t0)
        results.append(r)
        if out is not None:
            out(str(r))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spec.verify``: run the checks; exit status 0 iff every one is proved."""
    _load_plugins()
    p = argparse.ArgumentParser(prog="python -m spec.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="name the checks and exit")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these checks")
    p.add_argument("--queries", action="store_true", help="print every z3 query's result and time as it ends")
    defaults = Options()
    scalars = [f.name for f in fields(Options) if isinstance(getattr(defaults, f.name), (int, float))]
    for name in scalars:
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)),
                       default=getattr(defaults, name), help=f"(default {getattr(defaults, name)})")
    a = p.parse_args(argv)
    if a.list:
        for c in CHECKS.values():
            print(f"{c.name}: {c.property}")
        return 0
    opts = replace(defaults, **{name: getattr(a, name) for name in scalars})
    global _query_log
    _query_log = (lambda line: print(line, flush=True)) if a.queries else None
    try:
        results = run_checks(a.only, opts)
    except KeyError as e:
        p.error(f"unknown check {e}; --list names them")
    finally:
        _query_log = None
    total = sum(r.time_s for r in results)
    ok = sum(r.proved for r in results)
    print(f"{ok} of {len(results)} checks proved in {total:.1f} s")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    # Run the imported ``spec.verify``, not this ``__main__`` copy: plugins register into the former.
    from spec.verify import main as _main

    sys.exit(_main())
