"""EASY backfilling for admission: pass a waiting request that does not fit, without delaying it.

When the first candidate of the admission order (the *head*) does not fit the free KV blocks,
a scheduler without backfill admits nothing more this tick (head-of-line blocking) and the free
blocks stay idle until enough resident requests finish. Plain backfill admits whatever fits
past the head, which can keep the head waiting for ever (hence aging). EASY backfilling (Lifka,
"The ANL/IBM SP scheduling system", JSSPP 1995; Mu'alem and Feitelson, IEEE TPDS 12(6), 2001)
keeps the head's place in time instead:

1. From every resident request's *worst case* (it runs to ``max_tokens`` or the cache length,
   growing one block every ``block_tokens`` tokens) compute the head's *shadow iteration*: the
   first coming iteration at which the blocks still held leave room for the head.
2. A later candidate may be admitted now only if, in the same worst case, it never needs a
   block the others would need before the shadow iteration, and it has either finished by the
   shadow iteration or still leaves room for the head there.

Requests that stop early (EOS) only free blocks sooner, so the head is admitted no later than
its shadow iteration unless a growth preemption, a later change of the admission order, or
isolation intervenes (``batch/core/isolation.py``: room made for a protected user's request, or
iterations in which resident requests sit out, at most ``max_sit_out_ticks`` in a row,
which delays the requests the shadow waits for). The worst case also needs
every resident request to run each iteration, so the scheduler backfills this way only when
the token budget cannot bind (``budget_never_binds``). Past the aging reservation the
scheduler further requires ``spec.fairness_rules.may_pass_reservation`` (the starvation
bound's guard).

Iterations are counted from the coming one (0). Blocks follow ``spec.rules.blocks_needed``:
before an iteration a request holds its tokens plus one lookahead slot.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

from spec import rules


def worst_case_iterations(num_tokens: int, num_computed_tokens: int, num_prompt_tokens: int, num_output_tokens: int,
                          max_tokens: int, max_model_len_tokens: int, chunk_tokens: int) -> tuple[int, int]:
    """The most iterations a request still needs, and how many of them are prefill chunks.

    Args:
        num_tokens: prompt + generated tokens known now.
        num_computed_tokens: of them, tokens with KV in the cache (0 for a waiting request).
        num_prompt_tokens, num_output_tokens: the prompt's length and the tokens generated so far.
        max_tokens: the request's output cap, tokens.
        max_model_len_tokens: the cache length (``spec.rules.max_model_len_tokens``), tokens.
        chunk_tokens: the prefill chunk, tokens (>= 1).

    Returns:
        ``(prefill_iters, iters)``: ``prefill_iters = ceil((num_tokens - num_computed_tokens) /
        chunk)`` (a decode is a one-token chunk), the last of which produces a token; then one
        token per iteration up to ``min(max_tokens, max_model_len - prompt)`` output tokens.
        ``iters >= prefill_iters >= 1``.
    """
    prefill_iters = max(1, -(-(num_tokens - num_computed_tokens) // chunk_tokens))
    outputs_left = min(max_tokens, max_model_len_tokens - num_prompt_tokens) - num_output_tokens
    return prefill_iters, prefill_iters + max(0, outputs_left - 1)


def budget_never_binds(token_budget_tokens: int, cap_blocks: int, block_tokens: int, max_running: int,
                       prefill_chunk_tokens: int) -> bool:
    """Whether the token budget can never cut a request's chunk, so that the worst case holds.

    ``worst_case_iterations`` assumes every resident request runs a full chunk (or its decode)
    every iteration. A request's chunk is at most ``prefill_chunk_tokens`` and at most its
    ``num_tokens``, which is below ``held_blocks * block_tokens``; so all chunks of an
    iteration together are at most ``min(max_running * prefill_chunk_tokens, cap_blocks *
    block_tokens)`` tokens. With a smaller budget, requests late in the running order get
    fewer tokens than that (none at all once it is spent) and finish later than their worst
    case; EASY's shadow iteration is then no bound, and a candidate that "finishes by it"
    on paper may still hold its blocks when the head should fit, so the scheduler does not
    backfill past the head at all.
    """
    return token_budget_tokens >= min(max_running * prefill_chunk_tokens, cap_blocks * block_tokens)


@dataclass(frozen=True)
class Shadow:
    """The head's place in time.

    Attributes:
        iteration: the first coming iteration (0 = the next) at which the worst-case resident
            blocks leave ``need_blocks`` free.
        extra_blocks: blocks still free at that iteration once the head has its ``need_blocks``,
            counting the rows present when the shadow was computed (for diagnostics and tests;
            ``admits`` recounts with the rows added since).
        need_blocks: the head's admission blocks (with any headroom).
    """

    iteration: int
    extra_blocks: int
    need_blocks: int


class WorstCaseProfile:
    """Worst-case KV blocks of a set of resident requests over the coming iterations.

    Each row is one request: ``tokens`` known now, ``prefill_iters`` and ``iters`` from
    ``worst_case_iterations``, and ``held_blocks`` it holds now (a floor: a pinned request holds
    its worst case from admission). At iteration ``k < iters`` it holds
    ``max(held, blocks_needed(tokens + max(0, k - prefill_iters + 1)))``; from ``iters`` on, none.

    Args:
        cap_blocks: the KV cache, blocks. block_tokens: tokens per block.

    Cost: plain Python with no first-call set-up (it runs on the first tick under KV pressure).
    ``shadow`` sweeps the rows once, O(R log R + E * block_tokens) for R rows and E distinct
    finishing iterations, cached until the next ``add``; ``admits`` adds O(R). Computed only in
    a tick whose head does not fit.
    """

    def __init__(self, cap_blocks: int, block_tokens: int) -> None:
        self.cap_blocks = cap_blocks
        self.block_tokens = block_tokens
        self._rows: list[tuple[int, int, int, int]] = []
        self._steps: tuple[list[int], list[int], list[int]] | None = None

    def add(self, tokens: int, prefill_iters: int, iters: int, held_blocks: int) -> None:
        """Add a resident request (or one admitted this tick).

        Args:
            tokens: its prompt + generated tokens now. prefill_iters, iters: its
                ``worst_case_iterations`` (iterations). held_blocks: blocks it holds after this
                tick's grant (its admission blocks, for one admitted this tick).
        """
        self._rows.append((tokens, prefill_iters, iters, held_blocks))
        self._steps = None

    @property
    def max_iters(self) -> int:
        """The largest worst-case remaining iterations among the rows (0 when empty)."""
        return max((r[2] for r in self._rows), default=0)

    def rows_after(self, iteration: int) -> int:
        """Rows still resident at ``iteration`` in the worst case (``iters > iteration``): the
        resident count the head's admission headroom is computed from there."""
        return sum(1 for r in self._rows if r[2] > iteration)

    def _own_blocks(self, tokens: int, prefill_iters: int, held_blocks: int, k: int) -> int:
        """Blocks a row that has not finished holds at iteration ``k``."""
        known = tokens + (k - prefill_iters + 1 if k >= prefill_iters else 0)
        need = rules.blocks_needed(known, self.block_tokens)
        return held_blocks if held_blocks >= need else need

    def _usage_at(self, k: int) -> int:
        """Worst-case blocks held by all rows at iteration ``k``, O(R)."""
        return sum(self._own_blocks(t, pre, held, k) for t, pre, iters, held in self._rows if k < iters)

    def usage_blocks(self, iterations: Sequence[int]) -> list[int]:
        """Worst-case blocks held by all rows at each of ``iterations`` (ints >= 0), in their order.

        One sweep over the iterations in ascending order. A row holds ``c0 = max(held,
        blocks_needed(tokens))`` until its switch iteration ``s``, the first ``k >= prefill_iters``
        at which ``blocks_needed`` reaches ``held``; from there it holds ``(k + a) //
        block_tokens`` with ``a = tokens - prefill_iters + 1 + block_tokens``, until ``iters``.
        Writing ``a = q * block_tokens + m`` and ``k = K * block_tokens + r``, the growing rows
        hold ``sum(q) + n * K + #{rows with m >= block_tokens - r}`` together, so a histogram of
        ``m`` gives each point in O(block_tokens) however many rows grow.
        """
        bt = self.block_tokens
        const_sum = 0
        # (iteration, change to the constant rows' sum, +1 a row starts growing / -1 stops, its a)
        changes: list[tuple[int, int, int, int]] = []
        for tokens, pre, iters, held in self._rows:
            if iters <= 0:
                continue
            c0 = max(held, rules.blocks_needed(tokens, bt))
            a = tokens - pre + 1 + bt
            switch = max(pre, held * bt - a)
            const_sum += c0
            if switch < iters:
                changes += ((switch, -c0, 1, a), (iters, 0, -1, a))
            else:
                changes.append((iters, -c0, 0, 0))
        changes.sort()
        hist = [0] * bt
        grow_n = grow_q = 0
        ks = list(iterations)
        out = [0] * len(ks)
        j = 0
        for i in sorted(range(len(ks)), key=ks.__getitem__):
            k = ks[i]
            while j < len(changes) and changes[j][0] <= k:
                _, dc, sign, a = changes[j]
                j += 1
                const_sum += dc
                if sign:
                    q, m = divmod(a, bt)
                    grow_q += sign * q
                    grow_n += sign
                    hist[m] += sign
            whole, r = divmod(k, bt)
            out[i] = const_sum + grow_q + grow_n * whole + (sum(hist[bt - r:]) if r else 0)
        return out

    def _usage_steps(self) -> tuple[list[int], list[int], list[int]]:
        """``(events, usage at each event, usage just before each event)``: the events are
        iteration 0 and every row's finishing iteration, ascending. Usage only drops at an event
        and never drops between two, so these are where it can start to fit and where it peaks.
        Cached until the next ``add``."""
        if self._steps is None:
            events = sorted({0, *(r[2] for r in self._rows if r[2] > 0)})
            usage = self.usage_blocks(events + [max(e - 1, 0) for e in events])
            self._steps = (events, usage[:len(events)], usage[len(events):])
        return self._steps

    def shadow(self, need_blocks: int) -> Shadow | None:
        """The head's shadow iteration for ``need_blocks``; ``None`` if it never fits.

        Usage only drops when a row finishes, so the first fitting iteration is 0 or a
        finishing iteration.
        """
        events, usage, _ = self._usage_steps()
        for e, u in zip(events, usage):
            free = self.cap_blocks - u
            if free >= need_blocks:
                return Shadow(iteration=e, extra_blocks=free - need_blocks, need_blocks=need_blocks)
        return None

    def admits(self, tokens: int, prefill_iters: int, iters: int, held_blocks: int, shadow: Shadow) -> bool:
        """EASY's test for a candidate row against the head's ``shadow``.

        True iff, in the worst case, the rows plus the candidate fit the cache at every
        iteration before ``min(iters, shadow.iteration)`` (usage peaks just before a row
        finishes), and the candidate has finished by the shadow iteration or its blocks there
        fit in what the rows (including candidates added since the shadow was computed) leave
        beside the head's ``need_blocks``. A shadow at iteration 0 admits nothing (the head fits).
        """
        s = shadow.iteration
        if s <= 0:
            return False
        end = min(iters, s)
        events, _, before = self._usage_steps()
        inside = range(bisect_right(events, 0), bisect_right(events, end))
        peaks = [(events[i] - 1, before[i]) for i in inside]
        if not peaks or events[inside[-1]] != end:  # the candidate's own last iteration
            peaks.append((end - 1, self._usage_at(end - 1)))
        cap = self.cap_blocks
        if any(u + self._own_blocks(tokens, prefill_iters, held_blocks, k) > cap for k, u in peaks):
            return False
        if iters <= s:
            return True
        left_blocks = cap - shadow.need_blocks - self._usage_at(s)
        return self._own_blocks(tokens, prefill_iters, held_blocks, s) <= left_blocks
