"""``prefix_cache_reference`` (``spec.prefix_reference``): the prefix cache's bookkeeping against the
checker's own model of the rules, on every tick. Two bugs that keep every result correct but lose
hits (``tools/mutants.py``'s ``h4_prefix_last_block_never_cached`` and
``h4_prefix_lru_evicts_newest``, missed by every other spec check) and an evicted block left in the
cache's map fail it; the clean scheduler passes under shared prefixes that diverge and meet again,
with evictions in the middle of chains, preemptions, aborts and a rolled-back tick."""
from __future__ import annotations

import pytest

from batch.core import prefix_cache
from batch.core.errors import BackendError
from batch.core.kv_cache import BlockPool
from conftest import ScriptedBackend, StepClock
from inference_stub import Request
from scheduler import Scheduler
from spec import rules
from spec.invariants import InvariantViolation
from spec.prefix_reference import PROPERTY, PrefixCacheModel, cacheable_blocks

B = 4
A, C, D, E, F = ([t] * B for t in (11, 12, 13, 14, 15))


def _sched(cap: int = 12, backend=None, **kw) -> Scheduler:
    return Scheduler(kv_cap_blocks=cap, block_tokens=B, prefix_caching=True, check_invariants=True,
                     backend=backend or ScriptedBackend(block_tokens=B), clock=StepClock(), **kw)


#: Shared prefixes that diverge and meet again (``ACD`` / ``AED`` / ``ECD``: the same content at
#: the same position after another prefix, or at another position), a prompt whose last full block
#: holds its last token (``ACDE``: 16 tokens, only ``ACD`` cacheable), and another user's long
#: prompt that makes the small cache evict chains from the middle.
WAVES = [
    [("a1", A + C + D + [1]), ("a2", A + E + D + [2])],
    [("a3", A + C + D + E), ("b1", F + F + F + F + F + [3])],
    [("a4", E + C + D + [4]), ("a5", A + C + [5]), ("b2", F + F + F + E + E + [6])],
    [("a6", A + C + D + [7]), ("a7", A + E + D + [8])],
]


def _drive(s: Scheduler, waves=WAVES, max_tokens: int = 3, ticks_between: int = 2) -> None:
    """Each wave submitted a few ticks after the last one, then everything drained."""
    for wave in waves:
        for rid, prompt in wave:
            s.submit(Request(user_id=rid[0], prompt=list(prompt), max_tokens=max_tokens, request_id=rid))
        for _ in range(ticks_between):
            s.tick()
    while s.has_active():
        s.tick()


def _computed_one_key_short(self, seq, start, end):
    """The planted bug ``h4_prefix_last_block_never_cached``: ``computed`` stops one key short."""
    for i in range(start // self.block_tokens, min(end // self.block_tokens, len(seq.keys) - 1)):
        key, b = seq.keys[i], seq.block_table[i]
        if hash(key) not in self.block_of and b not in self.key_of:
            self.block_of[hash(key)] = b
            self.key_of[b] = key


def _allocate_evicting_newest(self, n):
    """The planted bug ``h4_prefix_lru_evicts_newest``: eviction pops the most recently freed block."""
    if n < 0:
        raise ValueError(f"cannot allocate {n} blocks")
    if n > self.num_free:
        return None
    while len(self._free) < n:
        b, _ = self.lru.popitem(last=True)
        assert rules.may_evict(self.refs[b])
        del self.block_of[hash(self.key_of.pop(b))]
        self._free.append(b)
    out = BlockPool.allocate(self, n)
    for b in out:
        self.refs[b] = 1
    return out


def test_cacheable_blocks_are_the_full_prompt_blocks_before_the_last_prompt_token():
    assert [cacheable_blocks(p, 4) for p in (1, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 1, 2, 3, 4]
    for p in range(1, 40):  # the same count as the scheduler's keys (an independent statement of it)
        assert cacheable_blocks(p, 4) == len(prefix_cache.block_keys(list(range(p)), 4))


def test_clean_scheduler_passes_with_shared_prefixes_diverging_and_meeting_again_and_evictions(monkeypatch):
    monkeypatch.setattr(PrefixCacheModel, "SWEEP_TICKS", 1)  # the whole cache and its order, every tick
    evictions = []
    real = prefix_cache.PrefixCachingPool.allocate

    def counting(self, n):
        before = len(self.key_of)
        out = real(self, n)
        evictions.append(before - len(self.key_of))
        return out
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, "allocate", counting)
    s = _sched()
    _drive(s)
    st = s.check_stats()
    m = s.metrics()
    assert st["prefix_cache_checked"] == st["ticks"] > 0, st
    assert s._checker._prefix.sweeps == st["ticks"]
    assert m["prefix_cache_hits"] >= 6 * B, m  # later prompts hit their shared prefixes
    assert sum(evictions) >= 3 and m["preemptions"] > 0, (evictions, m)


def test_clean_scheduler_passes_with_aborts_and_a_rolled_back_tick():
    down = []
    be = ScriptedBackend(block_tokens=B)

    def backend(batch):
        if down:
            down.pop()
            raise RuntimeError("device lost")
        return be(batch)
    s = _sched(cap=10, backend=backend)
    for rid, prompt in WAVES[0] + WAVES[1]:
        s.submit(Request(user_id=rid[0], prompt=list(prompt), max_tokens=4, request_id=rid))
    for _ in range(4):
        s.tick()
    down.append(1)
    with pytest.raises(BackendError):
        s.tick()  # undone: the hits it shared go back to the free list, its evictions stand
    s.abort("a3")
    s.abort("b1")  # two aborts between ticks: their blocks are freed in an order the check does not see
    for rid, prompt in WAVES[2] + WAVES[3]:
        s.submit(Request(user_id=rid[0], prompt=list(prompt), max_tokens=4, request_id=rid))
    while s.has_active():
        s.tick()
    assert s.check_stats()["prefix_cache_checked"] > 0 and s.metrics()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("method, planted, why", [
    ("computed", _computed_one_key_short, ("(a) cached", "should be cached")),  # the last cacheable block never cached
    ("allocate", _allocate_evicting_newest, ("(b) eviction", "least recently freed")),  # the newest cached block evicted
], ids=["last_cacheable_block_never_cached", "eviction_of_the_newest_cached_block"])
def test_each_planted_prefix_cache_bug_fails_prefix_cache_reference(monkeypatch, method, planted, why):
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, method, planted)
    s = _sched()
    with pytest.raises(InvariantViolation) as e:
        _drive(s)
    assert e.value.property == PROPERTY, e.value
    assert all(w in e.value.detail for w in why), e.value.detail


def test_both_planted_bugs_keep_the_results_and_only_lose_hits(monkeypatch):
    """Why no other check sees them: with the new check off, both run clean and produce the same
    tokens, with fewer hits."""
    from spec.invariants import InvariantChecker

    def run():
        s = _sched()
        reqs = []
        for wave in WAVES:
            for rid, prompt in wave:
                r = Request(user_id=rid[0], prompt=list(prompt), max_tokens=3, request_id=rid)
                reqs.append(r)
                s.submit(r)
            s.tick(), s.tick()
        while s.has_active():
            s.tick()
        return {r.request_id: list(r.generated) for r in reqs}, s.metrics()["prefix_cache_hits"]
    tokens, hits = run()
    monkeypatch.setattr(InvariantChecker, "prefix_reference", False)
    for name, bug in (("computed", _computed_one_key_short), ("allocate", _allocate_evicting_newest)):
        with monkeypatch.context() as m:
            m.setattr(prefix_cache.PrefixCachingPool, name, bug)
            got, got_hits = run()
        assert got == tokens and got_hits < hits, (name, got_hits, hits)


def test_an_evicted_block_left_in_the_cache_map_fails_prefix_cache_reference(monkeypatch):
    """The pool evicts and reuses a block but keeps its content in the cache (planted): the model
    has dropped it, so the counts of cached blocks differ at once."""
    real = prefix_cache.PrefixCachingPool.allocate

    def leaky(self, n):
        kept = dict(self.key_of)
        out = real(self, n)
        for b in out or ():
            if b in kept:
                self.key_of[b] = kept[b]
                self.block_of[hash(kept[b])] = b
        return out
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, "allocate", leaky)
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, "check", lambda self, held=None: None)
    s = _sched()
    with pytest.raises(InvariantViolation) as e:
        _drive(s)
    assert e.value.property == PROPERTY and "(b) eviction" in e.value.detail, e.value


def test_blocks_freed_by_aborts_between_two_ticks_may_be_evicted_in_any_order_among_them():
    """Two aborts between ticks: the check does not see which came first, so their blocks form one
    group of the free list, and an eviction that takes part of it may take any of its blocks."""
    s = _sched(cap=8)
    for rid, prompt in (("a1", A + C + [1]), ("a2", D + E + [2])):
        s.submit(Request(user_id=rid[0], prompt=prompt, max_tokens=20, request_id=rid))
    for _ in range(3):
        s.tick()
    s.abort("a2")
    s.abort("a1")
    model = s._checker._prefix
    s.submit(Request(user_id="b", prompt=F * 5 + [3], max_tokens=2, request_id="b1"))
    s.tick()  # b1 takes the four free blocks, the two tail blocks and two of the four cached ones
    assert not s.check_stats()["reference_skipped"].keys() - {"prefix_caching"}
    old = [b for b, (_, toks) in model.key_of.items() if toks[0] != F[0]]  # the aborted prompts' blocks left
    assert len(model.ties) == 1 and len(old) == 2 and set(old) <= s.pool.key_of.keys(), (model.ties, old)
    while s.has_active():
        s.tick()
