"""Review 9: defects found by an adversarial pass over the public API (each test failed before its fix).

1. A clock that raises when ``tick()`` reads it after ``forward`` left the tick half-applied:
   the plan's blocks granted (to requests still queued), the victims' blocks freed while they
   stayed resident, and the tick marked in flight for ever, so an ``abort`` from another
   thread waited for good.
2. One infinite iteration duration (a clock reading ``inf`` after ``forward``) turned the
   learned latency model's fit into NaN, clamped to zero for good: every prediction 0 us, so
   TTFT isolation was judged to pay (0 >= 1.5 x 0) whatever it costs on the backend.
3. ``ModelBackend`` for a model without an EOS id gave the scheduler ``eos_token_id=None``,
   which means the stub's EOS (token 0): the model's token 0 then ended every request.
4. A clock that raised when the aborts deferred to the end of a tick were retired left them
   unapplied and their ``abort`` calls waiting for good.
5. ``submit`` read every token id of a prompt before checking its length: refusing a
   10M-token prompt took about a second (and named a bad token id rather than the length).
"""
from __future__ import annotations

import math
import threading

import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req

from inference_stub import SimulatedGPU, VirtualClock
from isolation import LatencyModel
from policy import FCFSPolicy
from scheduler import Scheduler


class FailingClock(StepClock):
    """A ``StepClock`` whose next reading raises once ``fail_next`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False

    def __call__(self) -> float:
        if self.fail_next:
            self.fail_next = False
            raise OSError("clock read failed")
        return super().__call__()


class ArmsClock(ScriptedBackend):
    """Answers like ``ScriptedBackend`` and makes the clock's next reading (the tick's, right
    after ``forward``) raise, on the calls numbered in ``fail_on`` (1-based)."""

    def __init__(self, clock: FailingClock, fail_on: set[int]) -> None:
        super().__init__()
        self.clock = clock
        self.fail_on = fail_on

    def __call__(self, batch):
        out = super().__call__(batch)
        if len(self.batches) in self.fail_on:
            self.clock.fail_next = True
        return out


def _state(s: Scheduler) -> tuple:
    """What a rolled-back tick must leave as it was: tokens, blocks, counts, the KV ledger."""
    reqs = sorted(s._by_obj.values(), key=lambda q: q.arrival_no)
    return (tuple((q.request_id, q.state, q.num_computed_tokens, tuple(q.block_table), len(q.req.generated))
                  for q in reqs), s.pool.num_used, len(s.running), len(s.policy), s.metrics()["ticks"])


def _four_requests(clock: FailingClock, backend: ArmsClock) -> Scheduler:
    """Four requests on 8 blocks of 4 tokens under FCFS: tick 1 admits all four, tick 2 decodes,
    tick 3 preempts r3 and r2 to grow r0 and r1 by a block each."""
    s = Scheduler(backend=backend, clock=clock, kv_cap_blocks=8, block_tokens=4, policy=FCFSPolicy())
    for i in range(4):
        s.submit(make_req(f"r{i}", n_prompt=6, max_tokens=12))
    return s


@pytest.mark.parametrize("fail_on", [1, 2, 3])  # an admitting tick, a decode tick, a preempting tick
def test_a_clock_that_raises_after_forward_rolls_the_tick_back(fail_on):
    clock = FailingClock()
    backend = ArmsClock(clock, {fail_on})
    s = _four_requests(clock, backend)
    for _ in range(fail_on - 1):
        s.tick()
    before = _state(s)
    with pytest.raises(OSError, match="clock read failed"):
        s.tick()
    s.check_integrity()
    assert _state(s) == before, "the failed tick changed the scheduler"
    # Nothing is left in flight: an abort from another thread returns at once.
    out = []
    t = threading.Thread(target=lambda: out.append(s.abort("r3")), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive() and out and out[0].request_id == "r3", "abort waited on a tick that is over"
    done = drain(s)
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert s.pool.num_used == 0 and not s.has_active()


@pytest.mark.parametrize("clock", ["backwards", "nan"])
def test_a_clock_that_goes_back_or_reads_nan_loses_nothing(clock):
    """Admission, aging and preemption count ticks, not seconds: every request still finishes
    and no block leaks; only the latency figures are meaningless."""
    readings = iter(range(10**9))
    read = {"backwards": lambda: 1000.0 - next(readings) * 0.001, "nan": lambda: math.nan}[clock]
    s = Scheduler(backend=ScriptedBackend(), clock=read, kv_cap_blocks=16)
    for i in range(24):
        s.submit(make_req(f"r{i}", user=f"u{i % 3}", n_prompt=20 + 9 * i, max_tokens=30))
    assert len(drain(s)) == 24
    assert s.pool.num_used == 0 and not s.has_active()


def _fit(m: LatencyModel) -> None:
    """Observations of 5 ms + 1 ms per request + 10 us per token, varied enough to identify the fit."""
    for i in range(40):
        n, t = 1 + i % 7, 1 + (i * 13) % 50
        m.observe(n, t, 0.005 + 0.001 * n + 0.00001 * t)


@pytest.mark.parametrize("duration_s", [math.inf, -math.inf, math.nan, -1.0])
def test_a_non_finite_iteration_duration_does_not_poison_the_latency_model(duration_s):
    m = LatencyModel()
    _fit(m)
    want = m.predict_us(8, 40)
    assert want == pytest.approx(5000 + 8000 + 400, abs=5)
    m.observe(3, 3, duration_s)
    assert m.predict_us(8, 40) == want


def test_an_infinite_clock_reading_after_forward_leaves_the_learned_latency_model_intact():
    """On the simulated GPU (5 ms + 1 ms per request, virtual clock) the scheduler's model still
    predicts the stub's latency after one tick whose end reads ``inf``."""
    vc = VirtualClock()
    gpu = SimulatedGPU(clock=vc, seed=0, eos_probability=0.0)
    state = {"arm": False, "inf": False}

    def clock() -> float:
        if state["inf"]:
            state["inf"] = False
            return math.inf
        return vc.now()

    def forward(batch):
        out = gpu.forward(batch)
        state["inf"], state["arm"] = state["arm"], False  # the tick's reading right after forward
        return out

    s = Scheduler(backend=forward, clock=clock)
    for i in range(30):  # batches of varied size and tokens identify the fit
        s.submit(make_req(f"a{i}", user="A", n_prompt=10 + 7 * i, max_tokens=300))
        s.tick()
    for _ in range(30):
        s.tick()
    model = s.isolation.model
    assert model.ready and model.predict_us(8, 40) == pytest.approx(13_000, abs=5)
    state["arm"] = True
    s.tick()
    assert model.predict_us(8, 40) == pytest.approx(13_000, abs=5)


def test_a_model_without_an_eos_id_does_not_stop_on_token_zero():
    torch = pytest.importorskip("torch", reason="needs the 'model' extra")
    pytest.importorskip("transformers", reason="needs the 'model' extra")
    from model_backend import ModelBackend, tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(seed=0, eos_token_id=None)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit ties at 0: greedy answers token 0 every time
    backend = ModelBackend(model, num_blocks=8, block_tokens=4)
    assert backend.eos_token_id is None
    s = backend.make_scheduler(clock=StepClock())
    r = make_req("r0", n_prompt=5, max_tokens=6)
    s.submit(r)
    drain(s)
    assert r.generated == [0] * 6
    assert s.metrics()["finish_reasons"] == {"length": 1}


class _AbortDuringForward(ScriptedBackend):
    """Answers like ``ScriptedBackend``; on its ``at``-th call another thread aborts ``victim``
    while the batch is being computed (the abort is deferred to the end of the tick), and the
    clock is armed to raise on its second reading after ``forward``: the one that retires the
    deferred aborts (the first is the tick's own reading)."""

    def __init__(self, scheduler_box: list, clock: "CountdownClock", victim: str, at: int) -> None:
        super().__init__()
        self.box, self.clock, self.victim, self.at = scheduler_box, clock, victim, at
        self.aborted: list = []
        self.thread: threading.Thread | None = None

    def __call__(self, batch):
        out = super().__call__(batch)
        if len(self.batches) == self.at:
            s = self.box[0]
            self.thread = threading.Thread(target=lambda: self.aborted.append(s.abort(self.victim)), daemon=True)
            self.thread.start()
            for _ in range(500):  # until the abort is registered as deferred
                if s._pending_aborts:
                    break
                threading.Event().wait(0.01)
            assert s._pending_aborts, "the abort was not deferred"
            self.clock.fail_at = 2
        return out


class CountdownClock(StepClock):
    """A ``StepClock`` whose ``fail_at``-th reading from now raises (once)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at = 0

    def __call__(self) -> float:
        if self.fail_at:
            self.fail_at -= 1
            if self.fail_at == 0:
                raise OSError("clock read failed")
        return super().__call__()


class _InterruptClock(CountdownClock):
    """A ``CountdownClock`` that raises ``KeyboardInterrupt`` instead of ``OSError``."""

    def __call__(self) -> float:
        try:
            return super().__call__()
        except OSError:
            raise KeyboardInterrupt from None


@pytest.mark.parametrize("clock_cls, error", [(CountdownClock, OSError), (_InterruptClock, KeyboardInterrupt)])
def test_a_clock_that_raises_while_deferred_aborts_are_applied_still_applies_them(clock_cls, error):
    """Before: the tick's deferred aborts were never applied and the ``abort`` call waited for
    good (review 10: a ``KeyboardInterrupt`` from the clock too)."""
    clock = clock_cls()
    box: list = []
    backend = _AbortDuringForward(box, clock, victim="r1", at=2)
    s = Scheduler(backend=backend, clock=clock, kv_cap_blocks=16, block_tokens=4, policy=FCFSPolicy())
    box.append(s)
    for i in range(3):
        s.submit(make_req(f"r{i}", n_prompt=6, max_tokens=2 + 3 * i))  # r0 finishes on tick 2
    s.tick()
    with pytest.raises(error):
        s.tick()
    backend.thread.join(5)
    assert not backend.thread.is_alive(), "the abort call still waits on a tick that is over"
    assert [r.request_id for r in backend.aborted] == ["r1"]
    assert [(r.request_id, why) for r, why in s.last_finished] == [("r0", "length")]  # the tick was applied
    r1 = backend.aborted[0]
    assert r1.completed_at is not None and r1.completed_at >= r1.submitted_at
    s.check_integrity()
    assert [r.request_id for r in drain(s)] == ["r2"]
    assert s.pool.num_used == 0 and not s.has_active()


def test_a_prompt_over_the_cap_is_refused_for_its_length_before_its_tokens_are_read():
    """A 10M-token prompt took about a second to refuse: every token was checked first."""
    from scheduler import PromptTooLongError

    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=4, block_tokens=4)
    r = make_req("big", n_prompt=40, max_tokens=2)
    r.prompt[-1] = -1  # an invalid id at the end: the length check must come first
    with pytest.raises(PromptTooLongError):
        s.submit(r)
    assert not s.has_active()
