"""Block-level prefix caching: full prompt blocks shared read-only between requests.

Source: vLLM V1's ``KVCacheManager`` / ``BlockPool`` prefix caching (a block's key is a hash
chained with its parent's; a block nobody holds keeps its content and is evicted least recently
used only when a new block is needed). Rules: ``spec.rules`` (``kv_used_distinct``,
``may_evict``, ``hit_matches``, ``refcount_is_holders``), proved in ``spec.verify``
(``prefix_cache_*``) and checked on the pool every tick (``spec.invariants.check_state``).

Off by default (``Scheduler(prefix_caching=True)``): ``docs/design.md`` has the ablation.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Sequence

from batch.core.kv_cache import BlockPool, BlockPoolError
from spec import rules


def block_keys(prompt: Sequence[int], block_tokens: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The keys of a prompt's full blocks: ``(parent's chained hash, the block's token ids)``.

    Each block's chained hash is ``hash(key)``: equal keys mean equal content and equal parents'
    hashes (so, but for a 64-bit hash collision, an equal prefix; the content is compared on
    every hit: ``hit_matches``). The last prompt token is never in a key, so a hit always leaves
    at least one token to compute (the one whose logits give the first output token).
    """
    keys: list[tuple[int, tuple[int, ...]]] = []
    parent = 0
    for start in range(0, (len(prompt) - 1) // block_tokens * block_tokens, block_tokens):
        key = (parent, tuple(prompt[start:start + block_tokens]))
        keys.append(key)
        parent = hash(key)
    return tuple(keys)


class PrefixCachingPool(BlockPool):
    """A ``BlockPool`` whose blocks are reference counted and whose full prompt blocks are cached
    by content. ``num_free`` counts blocks nobody holds: free ones and cached ones (evictable).

    Invariant (``spec.rules``): ``refcount_is_holders`` (a block's count is the number of block
    tables holding it), ``kv_used_distinct`` (blocks in use are distinct blocks with a count),
    ``may_evict`` (only a block nobody holds is evicted or reused), ``hit_matches``.
    """

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        super().__init__(num_blocks)
        self.block_tokens = block_tokens
        self.refs = [0] * num_blocks  # block -> block tables holding it
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # cached block -> its key
        self.block_of: dict[int, int] = {}  # chained hash -> cached block
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.hit_tokens = self.query_tokens = 0  # prefix-cache hits and lookups, tokens

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def lookup(self, keys: Sequence[tuple[int, tuple[int, ...]]]) -> list[int]:
        """The cached blocks of the longest cached prefix of ``keys`` (pure: nothing changes)."""
        out: list[int] = []
        for key in keys:
            b = self.block_of.get(hash(key))
            if b is None or not rules.hit_matches(self.key_of[b], key):
                break
            out.append(b)
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """One more block table holds each of ``blocks`` (cached; a block nobody held leaves the LRU)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.lru[b]
                self._is_free[b] = 0
            self.refs[b] += 1

    def computed(self, seq: Any, start: int, end: int) -> None:
        """``seq``'s prompt tokens ``start .. end - 1`` were computed: the full blocks among them are
        cached under their keys (the first block cached for a key stays its block)."""
        for i in range(start // self.block_tokens, min(end // self.block_tokens, len(seq.keys))):
            key, b = seq.keys[i], seq.block_table[i]
            if hash(key) not in self.block_of and b not in self.key_of:
                self.block_of[hash(key)] = b
                self.key_of[b] = key

    def metrics(self) -> dict[str, float]:
        """vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens looked up at admission and
        found cached) and their ratio."""
        return {"prefix_cache_queries": self.query_tokens, "prefix_cache_hits": self.hit_tokens,
                "prefix_cache_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0}

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        while len(self._free) < n:  # evict the least recently used cached block nobody holds
            b, _ = self.lru.popitem(last=False)
            assert rules.may_evict(self.refs[b]), f"evicting block {b} held {self.refs[b]} times"
            del self.block_of[hash(self.key_of.pop(b))]
            self._free.append(b)
        out = super().allocate(n)
        for b in out:
            self.refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """One block table fewer holds each of ``blocks``; a block nobody holds any more stays
        cached (LRU, most recent last) when it has a key, else goes back to the free list."""
        for b in blocks:
            if not (0 <= b < self.num_blocks) or self.refs[b] <= 0:
                raise BlockPoolError(f"block {b} is not an allocated block of this pool")
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._is_free[b] = 1
                if b in self.key_of:
                    self.lru[b] = None
                else:
                    self._free.append(b)
        if self.on_free is not None:
            self.on_free(blocks)

    def reclaim(self, blocks: list[int]) -> None:
        """Undo a ``free`` of ``blocks`` (rollback): each is held once more."""
        for b in blocks:
            if self.refs[b] == 0 and b not in self.lru and b not in self._free:
                raise BlockPoolError(f"cannot reclaim block {b}: it was reused")
        for b in blocks:
            if self.refs[b] == 0:
                if b in self.lru:
                    del self.lru[b]
                else:
                    self._free.remove(b)
                self._is_free[b] = 0
            self.refs[b] += 1

    def check(self, held: list[list[int]] | None = None) -> None:
        """``refcount_is_holders`` and ``kv_used_distinct`` against ``held`` (every block table),
        and the free list, the LRU and the cached keys consistent; ``BlockPoolError`` if not."""
        counts = [0] * self.num_blocks
        for table in held or ():
            for b in table:
                counts[b] += 1
        if held is not None and not all(rules.refcount_is_holders(r, c) for r, c in zip(self.refs, counts)):
            raise BlockPoolError(f"reference counts {self.refs} are not the holders {counts}")
        if not rules.kv_used_distinct(self.num_used, self.refs, self.num_blocks):
            raise BlockPoolError(f"{self.num_used} blocks in use, {sum(r > 0 for r in self.refs)} held")
        if any(self.refs[b] for b in self.lru) or any(self.refs[b] for b in self._free) \
                or any(b in self.key_of for b in self._free) or set(self.lru) - set(self.key_of):
            raise BlockPoolError("a free or evictable block is held, or free with a key, or evictable without one")
        if len(set(self._free)) != len(self._free) or any(self.block_of[hash(k)] != b for b, k in self.key_of.items()):
            raise BlockPoolError("free list repeats a block, or the cache's two maps disagree")


def _planned_holds(preempted: Sequence[Any], planned: dict[Any, list[int]]) -> Counter[int]:
    """Per block, the holders this plan adds (hits) less those it removes (preemptions)."""
    held = Counter(b for hs in planned.values() for b in hs)
    held.subtract(b for v in preempted for b in v.block_table)
    return held


def planned_hits(pool: PrefixCachingPool, seq: Any, need: int, preempted: Sequence[Any],
                 planned: dict[Any, list[int]]) -> tuple[list[int], int]:
    """``seq``'s cached prefix and the free blocks its admission takes: the blocks it needs less
    the hits, plus the hits nobody will hold once this plan's preemptions and earlier hits are
    counted (a cached block nobody holds is counted free: taking it takes a free block)."""
    hits = pool.lookup(seq.keys)
    if not hits:
        return hits, need
    held = _planned_holds(preempted, planned)
    return hits, need - len(hits) + sum(1 for b in hits if pool.refs[b] + held[b] <= 0)


def freed_blocks(pool: PrefixCachingPool, victim: Any, preempted: Sequence[Any], planned: dict[Any, list[int]]) -> int:
    """The blocks preempting ``victim`` frees in this plan: those it is the last holder of, once
    the plan's earlier preemptions and hits are counted (a shared block stays held)."""
    held = _planned_holds(preempted, planned)
    return sum(1 for b in victim.block_table if pool.refs[b] + held[b] == 1)
