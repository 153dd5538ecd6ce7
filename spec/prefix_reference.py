"""``prefix_cache_reference``: the prefix cache's bookkeeping against the checker's own model of it.

``check_state`` checks the pool's ledger (reference counts, distinct blocks, the cap) and
``block_holds_prefix`` checks that every block a request reads holds its own prefix's KV. Neither
says which blocks the cache *should* keep or which one it should evict: a cache that forgets a
block it should keep, or evicts the wrong one, loses hits and stays correct. This model follows
the rules of ``docs/prefix-caching.md`` from what the checker observes around each tick (the plan,
the block tables after ``commit``, the rows ``apply`` computed, the requests that finished or left),
never from ``batch/core/prefix_cache.py``'s methods or maps:

* **cacheable blocks** (``cacheable_blocks``): a request's prompt blocks ``0 .. (P - 1) // B - 1``,
  the full prompt blocks before the one holding the last prompt token (generated tokens never);
  block ``i`` is cached under its content (the checker's own chain over the prompt's tokens
  ``0 .. (i + 1) * B - 1``) in the tick whose batch row computes its last token, unless that content
  is already cached (the first block cached for a content stays its block) or the block already has
  a content; rows in batch order, each finish after its own row;
* **the free list** (``lru``): a cached block nobody holds is evictable; blocks go there in the
  order they are freed (victims at commit in plan order, finishes in batch order, each table front
  to back; the requests that left between two ticks together, in any order among them: the checker
  does not see the order of their aborts); a hit takes its block off the list;
* **eviction**: only when a grant needs more blocks than the free uncached ones (``N - free_plain``
  blocks for a tick's grants ``N``), the least recently freed first;
* **hits**: an admission's hits are the blocks of the longest run of its leading cacheable blocks
  whose contents are cached when the tick is planned.

After ``commit`` each eviction is compared (``(b) eviction``), before ``commit`` each admission's
hits (``(c) hits``), and at the end of the tick (and at the start of the next, after aborts and
rollbacks) the cached blocks, their contents, the free list and the reference counts of every block
the tick changed, with the numbers of cached and evictable blocks (``(a) cached``); every
``SWEEP_TICKS`` ticks the whole cache and the free list's order. Cost per tick: O(blocks changed +
batch + requests that left) and one sweep of O(cap) every ``SWEEP_TICKS`` ticks. A rolled-back tick
(``forward`` raised) is undone in the model as ``rollback`` undoes it (evictions stand).
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import takewhile
from typing import Any, Callable, Sequence

from spec import lifecycle as lc

PROPERTY = "prefix_cache_reference"
Fail = Callable[[str, str], None]


def cacheable_blocks(num_prompt_tokens: int, block_tokens: int) -> int:
    """How many of a prompt's leading blocks are cached once computed: the full blocks before
    the one that holds the last prompt token (so a hit always leaves a token to compute)."""
    return (num_prompt_tokens - 1) // block_tokens


class PrefixCacheModel:
    """The checker's model of a ``PrefixCachingPool`` of ``cap`` blocks of ``block_tokens``."""

    #: A full comparison of the cache and the free list's order every this many ticks.
    SWEEP_TICKS = 64

    def __init__(self, cap: int, block_tokens: int) -> None:
        self.cap, self.B = cap, block_tokens
        self.refs = [0] * cap  # block -> block tables that hold it
        self.held = 0  # blocks with refs > 0
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # cached block -> (content chain, tokens)
        self.block_of: dict[int, int] = {}  # content chain -> cached block
        self.lru: OrderedDict[int, int] = OrderedDict()  # evictable block -> its free group, oldest first
        self.ties: set[int] = set()  # free groups whose blocks were freed in an order not seen
        self.group = 0
        self.tables: dict[Any, list[int]] = {}  # resident record -> its block table, as the model has it
        self.chains: dict[Any, list[int]] = {}  # record -> chain of its prompt's leading blocks
        self.dirty: set[int] = set()
        self.journal: tuple | None = None  # the committed tick's changes, until it completes
        self.rows: list[tuple[Any, list[int], int, int]] = []  # (record, table, start, end) at forward
        self.ticks = 0
        self.sweeps = 0

    # ------------------------------------------------------------------ the model's steps

    def chain(self, seq: Any, n: int) -> list[int]:
        """Content keys of ``seq``'s prompt blocks ``0 .. n - 1``: ``c_i`` chains the tokens of
        blocks ``0 .. i`` (the checker's own hash, not ``prefix_cache.block_keys``)."""
        c = self.chains.get(seq)
        if c is None:
            c = self.chains[seq] = []
        if len(c) < n:
            prompt, B = seq.req.prompt, self.B
            parent = c[-1] if c else hash(("prefix_cache_reference", B))
            for i in range(len(c), n):
                parent = hash((parent, tuple(prompt[i * B:(i + 1) * B])))
                c.append(parent)
        return c

    def _free(self, table: Sequence[int], group: int) -> None:
        """One block table fewer holds each of ``table``; a cached block nobody holds goes to the
        free list's end (in ``group``), an uncached one to the free blocks."""
        refs, lru = self.refs, self.lru
        for b in table:
            refs[b] -= 1
            if refs[b] == 0:
                self.held -= 1
                if b in self.key_of:
                    lru[b] = group
        self.dirty.update(table)

    def _hold(self, blocks: Sequence[int]) -> None:
        """One more block table holds each of ``blocks`` (a hit takes its block off the free list)."""
        refs = self.refs
        for b in blocks:
            if refs[b] == 0:
                self.held += 1
                self.lru.pop(b, None)
            refs[b] += 1
        self.dirty.update(blocks)

    def _new_group(self, tie: bool = False) -> int:
        self.group += 1
        if tie:
            self.ties.add(self.group)
        return self.group

    def _uncache(self, b: int) -> None:
        chain, _ = self.key_of.pop(b)
        del self.block_of[chain]
        self.lru.pop(b, None)
        self.dirty.add(b)

    def _leave(self, seqs: Sequence[Any]) -> None:
        """Requests that left outside the model's sight free their tables, in an order not seen."""
        tie = self._new_group(tie=len(seqs) > 1)
        for s in seqs:
            self._free(self.tables.pop(s), tie)
            self.chains.pop(s, None)

    def _rollback(self) -> None:
        """Undo the committed tick's blocks as ``step.rollback`` does: grants freed (uncached),
        hits freed (to the free list's end), victims hold their blocks again. Evictions stand."""
        victims, hits, grants = self.journal
        self.journal = None
        for s, before, new in reversed(grants):
            self._free(new, self._new_group())
            self.tables[s] = before
        for s, h in reversed(hits):
            self._free(h, self._new_group())
            del self.tables[s]
        for s, table in reversed(victims):
            self._hold(table)
            self.tables[s] = table

    # ------------------------------------------------------------------ around the tick

    def before_tick(self, sched: Any, fail: Fail) -> None:
        """A tick that did not complete is undone; requests that left since the last tick (aborted,
        failed by the retry policy) free their blocks; then the changed blocks are compared."""
        if self.journal is not None:
            self._rollback()
        if len(self.tables) != len(sched.state.running) or any(s not in self.tables for s in sched.state.running):
            running = set(sched.state.running)
            gone = [s for s in self.tables if s not in running]
            if gone:
                self._leave(gone)
            if len(self.tables) != len(running):
                fail(PROPERTY, f"resident requests changed outside a tick: the model has {len(self.tables)}, "
                               f"the scheduler {len(running)}")
        self.compare(sched.state.pool, fail, "between ticks")

    def before_commit(self, sched: Any, plan: Any, fail: Fail) -> None:
        """``(c) hits``: each admission's hits are the blocks of the longest run of its leading
        cacheable blocks the model has cached now (the pool is as the last tick left it)."""
        B = self.B
        admitted = plan.seqs[len(plan.seqs) - plan.num_admitted:]
        if any(s not in admitted for s in plan.hits):
            fail(PROPERTY, f"(c) hits: hits planned for {[s.request_id for s in plan.hits if s not in admitted]}, "
                           f"not admitted in this tick")
        for s in admitted:
            k = cacheable_blocks(s.num_prompt_tokens, B)
            want: list[int] = []
            while len(want) < k:  # the chain is extended only as far as the run of cached blocks goes
                b = self.block_of.get(self.chain(s, len(want) + 1)[len(want)])
                if b is None:
                    break
                want.append(b)
            got = list(plan.hits.get(s, ()))
            if got != want:
                fail(PROPERTY, f"(c) hits: {s.request_id} hits blocks {got}, but the cache holds its first "
                               f"{len(want)} of {k} cacheable prompt blocks as {want}")

    def after_commit(self, sched: Any, plan: Any, fail: Fail) -> None:
        """The victims' tables freed, the hits held, then ``(b) eviction``: the grants take the free
        uncached blocks first, then evict the least recently freed cached blocks, exactly those;
        each granted block was free and uncached (after the evictions)."""
        pool = sched.state.pool
        unknown = [v.request_id for v in plan.preempted if v not in self.tables]
        if unknown:
            fail(PROPERTY, f"victims {unknown} were not resident when the tick began")
        victims = [(v, self.tables.pop(v)) for v in plan.preempted]
        for v, table in victims:
            self._free(table, self._new_group())
            self.chains.pop(v, None)
        hits = list(plan.hits.items())
        for s, h in hits:
            self._hold(h)
            self.tables[s] = list(h)
        need = sum(plan.new_blocks)
        evict = need - (self.cap - self.held - len(self.lru))
        if evict > 0:
            self._evict(evict, pool, fail)
        grants = []
        refs = self.refs
        for s, n in zip(plan.seqs, plan.new_blocks):
            before = self.tables.get(s, [])
            table = s.block_table
            if n:
                new = table[len(before):]
                if table[:len(before)] != before or len(new) != n or \
                        any(refs[b] or b in self.key_of for b in new):
                    fail(PROPERTY, f"(b) eviction: {s.request_id} was granted {n} blocks after {before}: its table "
                                   f"is {table}; a granted block must be one nobody holds and not cached")
                self._hold(new)
                grants.append((s, before, new))
            self.tables[s] = list(table)
        if len(pool.key_of) != len(self.key_of) or len(pool.lru) != len(self.lru):
            fail(PROPERTY, f"(b) eviction: after the grants the pool has {len(pool.key_of)} cached blocks, "
                           f"{len(pool.lru)} evictable; the rules leave {len(self.key_of)}, {len(self.lru)}")
        self.journal = (victims, hits, grants)
        self.rows = [(s, list(s.block_table), s.num_computed_tokens, s.num_computed_tokens + k)
                     for s, k in zip(plan.seqs, plan.num_new_tokens)]

    def _evict(self, n: int, pool: Any, fail: Fail) -> None:
        """The least recently freed ``n`` blocks lose their content; where the ``n``-th falls in a
        group freed in an order not seen, any of that group's blocks may go."""
        if n > len(self.lru):
            fail(PROPERTY, f"(b) eviction: the grants need {n} cached blocks evicted; {len(self.lru)} are evictable")
        front: list[int] = []
        it = iter(self.lru.items())
        for b, _ in it:
            front.append(b)
            if len(front) == n:
                break
        last = self.lru[front[-1]]
        tie: list[int] = []
        if last in self.ties:
            while front and self.lru[front[-1]] == last:
                tie.append(front.pop())
            tie.extend(b for b, _ in takewhile(lambda bg: bg[1] == last, it))  # groups are in order
        cached = pool.key_of
        kept = [b for b in front if b in cached]
        gone = [b for b in tie if b not in cached]
        if kept or len(gone) != n - len(front):
            lost = [b for b in self.lru if b not in cached and b not in front and b not in tie]
            fail(PROPERTY, f"(b) eviction: {n} cached blocks had to be evicted, the least recently freed first: "
                           f"{front}{' and ' + str(n - len(front)) + ' of ' + str(tie) if tie else ''}; the pool "
                           f"kept {kept}{' and evicted ' + str(gone) if tie else ''}, and evicted {lost} instead")
        for b in (*front, *gone):
            self._uncache(b)

    def after_tick(self, sched: Any, plan: Any, fail: Fail, outside: bool) -> None:
        """``apply``'s rows in batch order: the cacheable blocks each row completed are cached
        (unless the content is, or the block has one), a finished row frees its table; then
        ``(a) cached``. ``outside``: a request may have been aborted during ``forward``."""
        self.journal = None
        if outside:  # aborted during forward (sat out or resident, not in the batch): freed before apply
            rows = {s for s, *_ in self.rows}
            gone = [s for s in self.tables if s not in rows and s.state in lc.FINAL_STATES]
            if gone:
                self._leave(gone)
        B, key_of, block_of = self.B, self.key_of, self.block_of
        for s, table, start, end in self.rows:
            k = cacheable_blocks(s.num_prompt_tokens, B)
            hi = min(end // B, k)
            lo = start // B
            if lo < hi:
                chain = self.chain(s, hi)
                prompt = s.req.prompt
                for i in range(lo, hi):
                    c, b = chain[i], table[i]
                    if c not in block_of and b not in key_of:
                        block_of[c] = b
                        key_of[b] = (c, tuple(prompt[i * B:(i + 1) * B]))
                        self.dirty.add(b)
            if s.state in lc.FINAL_STATES:
                self._free(self.tables.pop(s), self._new_group())
                self.chains.pop(s, None)
        self.rows = []
        self.ticks += 1
        self.compare(sched.state.pool, fail, "after the tick")
        if self.ticks % self.SWEEP_TICKS == 0:
            self.sweep(sched.state.pool, fail)

    # ------------------------------------------------------------------ the comparisons

    def compare(self, pool: Any, fail: Fail, when: str) -> None:
        """``(a) cached``: every block changed since the last comparison is cached (with the same
        tokens), evictable and held as the model has it, and the pool has as many cached and
        evictable blocks as the model."""
        dirty, self.dirty = self.dirty, set()
        key_of, lru, refs = self.key_of, self.lru, self.refs
        for b in dirty:
            want, got = key_of.get(b), pool.key_of.get(b)
            if (want is None) != (got is None) or (want is not None and tuple(got[1]) != want[1]):
                fail(PROPERTY, f"(a) cached {when}: block {b} should "
                               f"{'not be cached' if want is None else 'be cached with tokens ' + str(list(want[1]))}"
                               f"; the pool {'does not cache it' if got is None else 'caches tokens ' + str(list(got[1]))}")
            if (b in lru) != (b in pool.lru) or refs[b] != pool.refs[b]:
                fail(PROPERTY, f"(a) cached {when}: block {b} should be held {refs[b]} times"
                               f"{', evictable' if b in lru else ''}; the pool holds it {pool.refs[b]} times"
                               f"{', evictable' if b in pool.lru else ''}")
        if len(pool.key_of) != len(key_of) or len(pool.lru) != len(lru):
            fail(PROPERTY, f"(a) cached {when}: the pool has {len(pool.key_of)} cached blocks, {len(pool.lru)} "
                           f"evictable; the rules give {len(key_of)}, {len(lru)}")

    def sweep(self, pool: Any, fail: Fail) -> None:
        """The whole cache: every cached block and its tokens, and the free list in the model's
        order (blocks of a group freed in an order not seen in any order among themselves)."""
        self.sweeps += 1
        want = {b: k[1] for b, k in self.key_of.items()}
        got = {b: tuple(k[1]) for b, k in pool.key_of.items()}
        if want != got:
            fail(PROPERTY, f"(a) cached: blocks {sorted(got.keys() - want.keys())} are cached and should not be, "
                           f"{sorted(want.keys() - got.keys())} should be cached and are not, "
                           f"{sorted(b for b in want.keys() & got.keys() if want[b] != got[b])} hold other tokens")
        lru, ties = self.lru, self.ties
        order = [(g, None if g in ties else b) for b, g in lru.items()]
        seen = [(lru.get(b), None if lru.get(b) in ties else b) for b in pool.lru]
        if order != seen or set(pool.lru) != set(lru):
            fail(PROPERTY, f"(b) the free list's order: the rules give {list(lru)}, the pool {list(pool.lru)}")
        live = set(lru.values())
        self.ties &= live
