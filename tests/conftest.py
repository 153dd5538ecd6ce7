"""Shared factories for the tests: requests, a scripted backend, a drain loop."""
from __future__ import annotations

import math
import os
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The project root (the contract modules, batch/, spec/), then bench/ (the benchmark scripts some
# tests import: bench, bench_fairness, bench_load, bench_throughput, vllm_compare, ...).
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# Every Scheduler the tests build, in this process or in one it starts (``batch-llm serve``, a Ray
# replica: they inherit the environment), evaluates the spec checks around every tick
# (spec/invariants.py) and raises InvariantViolation naming the property.
os.environ["BATCH_CHECK_INVARIANTS"] = "1"

import inference_stub  # noqa: E402
import scheduler  # noqa: E402
from inference_stub import Request  # noqa: E402

scheduler.CHECK_INVARIANTS = True  # scheduler may have been imported before this file (a plugin)

#: ``make test`` (and so CI, ``.ci/run``) sets ``BATCH_REQUIRE_ALL=1``: every test runs, and one
#: that would be skipped (a missing extra such as ``scaleout`` or ``model``, vllm outside
#: ``.venv-vllm``) fails instead, naming what is missing. Without it, such a
#: test is skipped with that reason (``make test-fast``, a bare ``pytest``).
REQUIRE_ALL = os.environ.get("BATCH_REQUIRE_ALL") == "1"
#: A skip reason starting with this is allowed under ``BATCH_REQUIRE_ALL``: the test cannot apply
#: on this machine (a check that CUDA is absent, run where CUDA is present), nothing is missing.
NOT_APPLICABLE = "not applicable on this machine: "
#: Tests marked ``vllm`` need vllm, which is installed only in ``.venv-vllm``: ``make test`` runs
#: them there (``pytest -m vllm tests/test_vllm*.py``) and leaves them out of the ``.venv`` run
#: (``-m "not vllm"``), so they must live in files named like this.
VLLM_TEST_FILES = "test_vllm*.py"


def _required_skip_as_failure(rep) -> None:
    """Under ``BATCH_REQUIRE_ALL``, turn a skipped report (a test, or a whole module at collection)
    into a failure naming the skip's reason, unless the reason is ``NOT_APPLICABLE``."""
    if not (REQUIRE_ALL and rep.skipped) or hasattr(rep, "wasxfail"):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if reason.startswith(NOT_APPLICABLE):
        return
    rep.outcome = "failed"
    rep.longrepr = (f"skipped, but BATCH_REQUIRE_ALL=1 (make test, CI) requires every test to run: {reason}\n"
                    "make test installs every extra and .venv-vllm")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    _required_skip_as_failure((yield).get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    _required_skip_as_failure((yield).get_result())


@pytest.hookimpl(tryfirst=True)  # before -m deselects them
def pytest_collection_modifyitems(config, items):
    """A test marked ``vllm`` outside a ``VLLM_TEST_FILES`` file would never run in ``make test``."""
    stray = [item.nodeid for item in items
             if item.get_closest_marker("vllm") and not item.path.match(VLLM_TEST_FILES)]
    if stray:
        raise pytest.UsageError(f"tests marked vllm must be in tests/{VLLM_TEST_FILES} (make test runs them "
                                f"there in .venv-vllm): {', '.join(stray)}")


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
