"""``block_holds_prefix`` (``spec.invariants.InvariantChecker``): with prefix caching, the block at
position i of a request's table holds the KV of exactly that request's tokens ``[i*B, (i+1)*B)``
after its own tokens ``[0, i*B)``, checked on every tick against the checker's own record of what
each physical block was written with. Bugs that reuse the wrong KV silently (a key that does not
chain, a block table shifted by one, an evicted block left in the cache's map) fail it; the
checks that only compare a hit's key with the block's key do not see them."""
from __future__ import annotations

import pytest

import scheduler
from batch.core import prefix_cache
from conftest import ScriptedBackend, StepClock
from inference_stub import Request
from scheduler import Scheduler
from spec.invariants import InvariantChecker, InvariantViolation

B = 4


@pytest.fixture
def contents_only(monkeypatch):
    """The bugs below are caught sooner by ``prefix_cache_reference`` (``tests/test_prefix_reference.py``
    plants them too); turned off here so that these tests keep showing what ``block_holds_prefix``
    catches on its own."""
    monkeypatch.setattr(InvariantChecker, "prefix_reference", False)


def _sched(**kw) -> Scheduler:
    return Scheduler(kv_cap_blocks=kw.pop("kv_cap_blocks", 16), block_tokens=B, prefix_caching=True,
                     check_invariants=True, backend=ScriptedBackend(block_tokens=B), clock=StepClock(), **kw)


def _run(s: Scheduler, prompts: list[list[int]], max_tokens: int = 2) -> None:
    """Each prompt in turn, drained before the next (so the later ones hit the earlier ones' blocks)."""
    for i, p in enumerate(prompts):
        s.submit(Request(user_id="u", prompt=p, max_tokens=max_tokens, request_id=f"r{i}"))
        while s.has_active():
            s.tick()


#: A, then B whose first block has the content of A's second block (same tokens, another
#: prefix), then C that shares A's first block, diverges, and meets A's third block again.
PROMPTS = [[1] * B + [2] * B + [3] * B + [9], [2] * B + [5] * B + [9], [1] * B + [7] * B + [3] * B + [9]]


def test_shared_prefixes_that_diverge_and_meet_again_hold_their_own_prefix():
    s = _sched()
    _run(s, PROMPTS)
    assert s.metrics()["prefix_cache_hits"] == B  # only C's first block hits (A's); B's and C's others do not


def _unchained(prompt, block_tokens):  # the planted bug: every block's parent hash is 0
    return tuple((0, key) for _, key in prefix_cache.block_keys(prompt, block_tokens))


def test_keys_that_do_not_chain_reuse_another_prefixs_block_and_fail_block_holds_prefix(monkeypatch, contents_only):
    monkeypatch.setattr(scheduler, "block_keys", _unchained)
    s = _sched()
    with pytest.raises(InvariantViolation) as e:
        _run(s, PROMPTS)
    assert e.value.property == "block_holds_prefix", e.value
    assert "r1: block 0" in e.value.detail and "another prefix's KV" in e.value.detail


def test_a_hit_one_block_off_fails_block_holds_prefix(monkeypatch, contents_only):
    real = prefix_cache.PrefixCachingPool.lookup

    def shifted(self, keys):  # the planted bug: a hit returns the blocks of the next positions
        hits = real(self, keys)
        return [*hits[1:], hits[0]] if len(hits) >= 2 else hits
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, "lookup", shifted)
    s = _sched()
    with pytest.raises(InvariantViolation) as e:
        _run(s, [[1] * B + [2] * B + [3] * B + [9], [1] * B + [2] * B + [3] * B + [8]])
    assert e.value.property == "block_holds_prefix", e.value


def test_an_evicted_block_left_in_the_cache_map_fails_block_holds_prefix(monkeypatch, contents_only):
    """Eviction in the middle of a chain: the pool forgets the block's key but keeps the map from
    its chained hash to the block (planted), so a later prompt with that prefix hits a block that
    was reused for another request's tokens."""
    real_alloc = prefix_cache.PrefixCachingPool.allocate

    def leaky_evict(self, n):
        kept = dict(self.block_of)
        out = real_alloc(self, n)
        if out is not None:
            for h, b in kept.items():
                if h not in self.block_of and b in out:  # evicted and reused: left mapped
                    self.block_of[h] = b
                    self.key_of[b] = next(k for k in _all_keys if hash(k) == h)
        return out
    _all_keys: list = []
    real_keys = prefix_cache.block_keys

    def recording_keys(prompt, block_tokens):
        ks = real_keys(prompt, block_tokens)
        _all_keys.extend(ks)
        return ks
    monkeypatch.setattr(scheduler, "block_keys", recording_keys)
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, "allocate", leaky_evict)
    monkeypatch.setattr(prefix_cache.PrefixCachingPool, "check", lambda self, held=None: None)  # its own ledger check off
    s = _sched(kv_cap_blocks=6)
    with pytest.raises(InvariantViolation) as e:
        # A fills 3 cached blocks; B (another prefix) needs 4 blocks: A's cached blocks are evicted
        # and reused; A again then hits blocks that hold B's KV
        _run(s, [[1] * B + [2] * B + [3] * B + [9], [4] * B + [5] * B + [6] * B + [7] * B + [9],
                 [1] * B + [2] * B + [3] * B + [9]], max_tokens=1)
    assert e.value.property == "block_holds_prefix", e.value


def test_without_prefix_caching_every_block_holds_its_own_prefix_too():
    s = Scheduler(kv_cap_blocks=8, block_tokens=B, check_invariants=True, backend=ScriptedBackend(block_tokens=B),
                  clock=StepClock())
    for i in range(4):  # the cache is small: requests are preempted, their blocks reused
        s.submit(Request(user_id=f"u{i % 2}", prompt=[i + 1] * 7, max_tokens=12, request_id=f"r{i}"))
    while s.has_active():
        s.tick()
    assert s.metrics()["preemptions"] > 0
