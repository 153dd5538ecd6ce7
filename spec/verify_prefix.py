"""z3 check of prefix caching's shared-block rules (``batch/core/prefix_cache.py``).

A plugin of ``spec.verify``: ``prefix_cache_blocks``. The pool is abstracted to ``N`` blocks and
``R`` requests: a block's reference count, whether it is cached (holds a key) and its key; per
request, which blocks it holds and the content it expects in each. Each operation is an
inductive step from any state satisfying the invariant, with the guard the code evaluates,
written with the rules of ``spec.rules`` (``hit_matches``, ``may_evict``, ``refcount_is_holders``,
``kv_used_distinct``), so a bug planted in a rule shows as a counterexample here. Contents are
ints: a key's equality is content equality (the code compares the stored key, tokens included,
on every hit: no hash-collision assumption).
"""
from __future__ import annotations

from typing import Any

from spec import rules
from spec.logic import And, If, Implies, Not, Sum
from spec.verify import Options, Outcome, StateCounterexample, _outcome, _prove, _val, _z3, register

#: Blocks and requests of the abstraction (every block and request symbolic).
BLOCKS, REQUESTS = 3, 2


class _Pool:
    """One state of the abstraction: ``ref[b]``, ``cached[b]``, ``key[b]``, ``held[r][b]``, ``want[r][b]``."""

    def __init__(self, tag: str) -> None:
        z3 = _z3()
        self.ref = [z3.Int(f"ref_{b}_{tag}") for b in range(BLOCKS)]
        self.cached = [z3.Bool(f"cached_{b}_{tag}") for b in range(BLOCKS)]
        self.key = [z3.Int(f"key_{b}_{tag}") for b in range(BLOCKS)]
        self.held = [[z3.Bool(f"holds_{r}_{b}_{tag}") for b in range(BLOCKS)] for r in range(REQUESTS)]
        self.want = [[z3.Int(f"wants_{r}_{b}_{tag}") for b in range(BLOCKS)] for r in range(REQUESTS)]
        self.used = z3.Int(f"used_{tag}")

    def invariant(self) -> list[tuple[str, Any]]:
        out = [("kv_used_distinct", rules.kv_used_distinct(self.used, self.ref, BLOCKS))]
        for b in range(BLOCKS):
            holders = Sum([If(self.held[r][b], 1, 0) for r in range(REQUESTS)])
            out.append((f"refcount_is_holders[{b}]", rules.refcount_is_holders(self.ref[b], holders)))
            out.append((f"an uncached block has at most one holder[{b}]", Implies(Not(self.cached[b]), self.ref[b] <= 1)))
            for r in range(REQUESTS):
                out.append((f"a holder sees the content it expects[{r}][{b}]",
                            Implies(And(self.held[r][b], self.cached[b]), self.key[b] == self.want[r][b])))
        return out


def _steps(p: _Pool, q: _Pool) -> list[tuple[str, list]]:
    """``(name, the transition from p to q)`` for each operation on block ``b`` by request ``r``."""
    z3 = _z3()
    w = z3.Int("content")  # the content the request wants in the block (its prompt's block)
    steps = []

    def same(b: int, **changed: Any) -> list:
        out = []
        for field in ("ref", "cached", "key"):
            if field not in changed:
                out.append(getattr(q, field)[b] == getattr(p, field)[b])
            else:
                out.append(getattr(q, field)[b] == changed[field])
        return out

    for b in range(BLOCKS):
        for r in range(REQUESTS):
            others = [c for c in range(BLOCKS) if c != b]
            frame = [x for c in others for x in same(c)]
            frame += [q.held[s][c] == p.held[s][c] for s in range(REQUESTS) for c in range(BLOCKS) if (s, c) != (r, b)]
            frame += [q.want[s][c] == p.want[s][c] for s in range(REQUESTS) for c in range(BLOCKS) if (s, c) != (r, b)]
            used = q.used == Sum([If(x > 0, 1, 0) for x in q.ref])
            steps.append((f"hit: request {r} shares cached block {b}", [
                p.cached[b], Not(p.held[r][b]), rules.hit_matches(p.key[b], w),
                *same(b, ref=p.ref[b] + 1), q.held[r][b], q.want[r][b] == w, *frame, used]))
            steps.append((f"allocate: request {r} takes block {b} (evicting its key)", [
                rules.may_evict(p.ref[b]), Not(p.held[r][b]),
                *same(b, ref=1, cached=False, key=p.key[b]), q.held[r][b], q.want[r][b] == w, *frame, used]))
            steps.append((f"free: request {r} lets go of block {b}", [
                p.held[r][b], *same(b, ref=p.ref[b] - 1), Not(q.held[r][b]), q.want[r][b] == p.want[r][b],
                *frame, used]))
            steps.append((f"register: request {r}'s computed block {b} is cached under its content", [
                p.held[r][b], Not(p.cached[b]), *same(b, cached=True, key=p.want[r][b]), q.held[r][b],
                q.want[r][b] == p.want[r][b], *frame, used]))
    return steps


@register("prefix_cache_blocks",
          "prefix caching's shared blocks: every block's reference count is the number of block tables "
          "holding it (refcount_is_holders), the blocks in use are the distinct held blocks and at most the "
          "cap (kv_used_distinct), no block is evicted or reused while held (may_evict), and a holder always "
          "finds in a cached block the content it expects (hits only where hit_matches): inductive under "
          "hit, allocate (with eviction), free and register")
def check_prefix_cache_blocks(opts: Options) -> Outcome:
    """Inductive step per operation, on every block and request of the abstraction."""
    z3 = _z3()
    p, q = _Pool("0"), _Pool("1")
    bound = f"inductive step, {BLOCKS} blocks x {REQUESTS} requests, any counts, keys and contents"
    pre = [g for _, g in p.invariant()] + [x >= 0 for x in p.ref]
    for name, step in _steps(p, q):
        status, info = _prove([*pre, *step], q.invariant(), opts.timeout_s)
        if status != "proved":
            def cex(m: Any, bad: list[str], name: str = name) -> StateCounterexample:
                values = {f"block {b} before (ref, cached, key)": (_val(m, p.ref[b]), _val(m, p.cached[b]),
                                                                   _val(m, p.key[b])) for b in range(BLOCKS)}
                values["holds before"] = [[_val(m, x) for x in row] for row in p.held]
                return StateCounterexample(name, bad, values)
            return _outcome(status, info, bound, cex)
    del z3
    return Outcome("proved", bound, "unsat for every step; assumptions sat")
