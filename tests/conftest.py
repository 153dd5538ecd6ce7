"""Shared factories for the tests: requests, a scripted backend, a drain loop."""
from __future__ import annotations

import math
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The project root (the contract modules, batch/, spec/), then bench/ (the benchmark scripts some
# tests import: bench, bench_fairness, bench_load, bench_throughput, vllm_compare, ...).
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import inference_stub  # noqa: E402
import scheduler  # noqa: E402
from inference_stub import Request  # noqa: E402

# Every Scheduler the tests build evaluates the spec invariants after every tick
# (spec/invariants.py) and raises InvariantViolation naming the property.
scheduler.CHECK_INVARIANTS = True


def make_req(rid: str, user: str = "u1", n_prompt: int = 10, max_tokens: int = 5) -> Request:
    """A request with a deterministic prompt of ``n_prompt`` ids in 1..63."""
    return Request(user_id=user, prompt=[1 + i % 63 for i in range(n_prompt)], max_tokens=max_tokens,
                   request_id=rid)


class ScriptedBackend:
    """A fast deterministic model: EOS only where told (``eos_at[rid] = k``: the k-th output
    token is EOS), otherwise a token derived from (rid, position). Records every batch as
    ``[(request_id, kv_blocks_for(request), len(generated))]``."""

    def __init__(self, eos_at: dict[str, int] | None = None, block_tokens: int = 16) -> None:
        self.eos_at = eos_at or {}
        self.block_tokens = block_tokens
        self.batches: list[list[tuple[str, int, int]]] = []

    def __call__(self, batch):
        self.batches.append([(r.request_id, math.ceil((len(r.prompt) + len(r.generated)) / self.block_tokens),
                              len(r.generated)) for r in batch])
        out = []
        for r in batch:
            k = len(r.generated) + 1
            out.append(0 if self.eos_at.get(r.request_id) == k else 1 + zlib.crc32(f"{r.request_id}:{k}".encode()) % 63)
        return out

    def max_blocks_in_a_batch(self) -> int:
        return max((sum(b for _, b, _ in batch) for batch in self.batches), default=0)

    def iterations_with(self, rid: str) -> int:
        return sum(1 for batch in self.batches if any(x[0] == rid for x in batch))


class StepClock:
    """A clock that advances by ``dt_s`` each time it is read (a deterministic fake)."""

    def __init__(self, dt_s: float = 0.001) -> None:
        self.t = 0.0
        self.dt_s = dt_s

    def __call__(self) -> float:
        self.t += self.dt_s
        return self.t


def drain(sched, limit: int = 100_000, check: bool = True) -> list[Request]:
    """Tick until idle; returns finished requests; checks the KV ledger after every tick."""
    done: list[Request] = []
    ticks = 0
    while sched.has_active():
        done += sched.tick()
        if check:
            sched.check_integrity()
        ticks += 1
        assert ticks < limit, f"did not drain within {limit} ticks"
    return done


@pytest.fixture
def backend():
    return ScriptedBackend()


@pytest.fixture
def stub_module():
    return inference_stub
