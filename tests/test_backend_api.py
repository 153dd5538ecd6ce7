"""The richer backend interface (``backend_api.BatchItem``), checked without torch.

A pure-Python paged cache stands in for the model: it keeps one token id per slot, checks
that every position an item claims as computed holds that request's token at the slot its
block table gives, and clears blocks as the pool frees them. Under preemption by recompute,
chunked prefill and a small token budget, every item must be consistent with it.
"""
from __future__ import annotations

import zlib

from conftest import StepClock, drain, make_req

import scheduler as sched_mod
from batch.core.backend_api import BatchItem
from scheduler import Scheduler


class SlotCheckingExecutor:
    """A fake paged model runner: slot -> token id, checked on every read."""

    def __init__(self, block_tokens: int = 16, eos_at: dict[str, int] | None = None) -> None:
        self.block_tokens = block_tokens
        self.eos_at = eos_at or {}
        self.slots: dict[int, int] = {}
        self.calls: list[list[BatchItem]] = []

    def on_free(self, blocks: list[int]) -> None:
        B = self.block_tokens
        for b in blocks:
            for s in range(b * B, (b + 1) * B):
                self.slots.pop(s, None)

    def execute_model(self, items: list[BatchItem]) -> list[int]:
        self.calls.append(items)
        B = self.block_tokens
        out = []
        for it in items:
            r = it.request
            seq = list(r.prompt) + r.generated
            c, n = it.num_computed_tokens, len(it.token_ids)
            assert n >= 1 and list(it.token_ids) == seq[c:c + n], f"{r.request_id}: wrong token ids"
            assert it.sample == (c + n == len(seq))
            assert len(it.block_table) * B >= c + n
            for p in range(c):  # the KV the scheduler says is computed is there, at the table's slots
                slot = it.block_table[p // B] * B + p % B
                assert self.slots.get(slot) == seq[p], f"{r.request_id}: position {p} not in the cache"
            for p in range(c, c + n):
                self.slots[it.block_table[p // B] * B + p % B] = seq[p]
            k = len(r.generated) + 1
            out.append(0 if self.eos_at.get(r.request_id) == k else
                       1 + zlib.crc32(f"{r.request_id}:{k}".encode()) % 63)
        return out


def test_items_match_a_paged_cache_through_chunking_budget_and_preemption():
    ex = SlotCheckingExecutor(eos_at={"r3": 4})
    sched = Scheduler(backend=ex, kv_cap_blocks=14, token_budget_tokens=50, clock=StepClock())
    sched.pool.on_free = ex.on_free
    reqs = [make_req(f"r{i}", n_prompt=10 + 37 * i % 150, max_tokens=30) for i in range(6)]
    for r in reqs:
        sched.submit(r)
    done = drain(sched)
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    assert sched.metrics()["preemptions"] > 0 and not ex.slots  # every block freed and cleared
    items = [it for call in ex.calls for it in call]
    assert any(not it.sample and len(it.token_ids) < 64 for it in items)  # a chunk cut by the budget
    assert len(reqs[3].generated) == 4 and reqs[3].generated[-1] == 0
    assert all(len(r.generated) == 30 for r in reqs if r.request_id != "r3")


def test_a_plain_callable_backend_still_gets_requests():
    seen = []

    def forward(batch):
        seen.append(list(batch))
        return [0] * len(batch)

    sched = Scheduler(backend=forward, clock=StepClock())
    r = make_req("a")
    sched.submit(r)
    drain(sched)
    assert seen == [[r]] and r.generated == [0]


def test_the_default_backend_is_the_module_forward_looked_up_at_call_time(monkeypatch):
    calls = []
    monkeypatch.setattr(sched_mod, "forward", lambda batch: calls.append(batch) or [0] * len(batch))
    sched = Scheduler(clock=StepClock())
    sched.submit(make_req("a"))
    drain(sched)
    assert len(calls) == 1 and isinstance(calls[0], list)
