"""Issue 6, fuzzing: random ``Request`` field values and call orders against a simple model.

A hypothesis state machine drives one scheduler with ``submit`` / ``tick`` / ``abort`` /
``metrics`` / ``has_active`` in any order, over small random knobs (a KV cache of a few
blocks, so preemption is common), a backend that emits EOS anywhere or never, and injected
backend faults (raise, wrong count, non-int tokens) with and without the retry policy.
Side by side runs a deliberately simple model: the set of live requests and the validation
rule. After every step: ``check_integrity()``; ``has_active()`` equals "the model has a live
request" and, when False, no block is in use. Only ``RequestError`` (from ``submit``) and
``BackendError`` (from ``tick``, when a fault was injected) may escape. At the end every
request accepted was returned exactly once, by ``tick()`` or by ``abort()``.
"""
import math
import os
import random

from conftest import StepClock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference_stub import Request
from scheduler import BackendError, RequestError, Scheduler

VOCAB = 64
EOS = 0

token_ids = st.integers(min_value=-2, max_value=VOCAB + 2)
odd_tokens = st.one_of(st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2))
prompts = st.one_of(
    st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=40),  # mostly valid
    st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=40).map(tuple),
    st.lists(st.one_of(token_ids, odd_tokens), max_size=6),
    st.none(), st.text(max_size=4), st.integers(),
)
max_tokens_values = st.one_of(st.integers(min_value=-1, max_value=12), st.booleans(), st.floats(), st.none(),
                              st.text(max_size=2))
user_ids = st.one_of(st.sampled_from(["a", "b", "c"]), st.just(""), st.none(), st.integers())
request_ids = st.one_of(st.sampled_from(["r0", "r1", "r2", "r3", ""]), st.none(), st.integers())


class FuzzBackend:
    """EOS with probability ``eos_p`` at any position (0: never, 1: always), from a seeded RNG;
    ``fault`` (set by the machine) makes the next call fail in the given way."""

    def __init__(self, eos_p: float, seed: int) -> None:
        self.eos_p = eos_p
        self.rng = random.Random(seed)
        self.fault: str | None = None

    def __call__(self, batch):
        fault, self.fault = self.fault, None
        if fault == "raise":
            raise RuntimeError("injected device fault")
        out = [EOS if self.rng.random() < self.eos_p else self.rng.randint(1, VOCAB - 1) for _ in batch]
        if fault == "short":
            return out[:-1]
        if fault == "long":
            return out + [1]
        if fault == "nonint":
            return [None] * len(batch)
        return out


def model_accepts(req, cap_blocks, block_tokens, live):
    """The validation rule, written plainly (issue 6's list)."""
    if not isinstance(req.user_id, str) or not req.user_id or not isinstance(req.request_id, str):
        return False
    mt = req.max_tokens
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        return False
    p = req.prompt
    if not isinstance(p, (list, tuple)) or not p:
        return False
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB for t in p):
        return False
    # a request not in flight starts afresh: any `generated` (a finished run's tokens, not a list)
    # is replaced by a new empty list at submit (issue 15), so it never makes a request invalid
    if math.ceil((len(p) + 1) / block_tokens) > cap_blocks:
        return False
    if any(r is req for r in live):  # the same object; a repeated request_id is accepted
        return False
    return True


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = None

    @initialize(cap=st.integers(2, 12), block_tokens=st.sampled_from([1, 2, 4, 16]),
                chunk=st.sampled_from([1, 3, 64]), max_running=st.sampled_from([1, 2, 4, 256]),
                budget=st.sampled_from([None, 1, 4, 64]), tries=st.sampled_from([None, 1, 2]),
                eos_p=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2 ** 16))
    def setup(self, cap, block_tokens, chunk, max_running, budget, tries, eos_p, seed):
        self.backend = FuzzBackend(eos_p, seed)
        self.s = Scheduler(kv_cap_blocks=cap, block_tokens=block_tokens, prefill_chunk_tokens=chunk,
                           max_running=max_running, token_budget_tokens=budget, max_backend_tries=tries,
                           backend=self.backend, clock=StepClock())
        self.live: list[Request] = []  # the model: accepted, not yet returned
        self.seen: list[Request] = []  # every object ever offered (for resubmit / abort targets)
        self.returned = 0
        self.accepted = 0

    # ------------------------------------------------------------ helpers

    def _submit(self, req):
        expect = model_accepts(req, self.s.config.kv_cap_blocks, self.s.config.block_tokens, self.live)
        try:
            self.s.submit(req)
        except RequestError:
            assert not expect, f"refused a valid request {req!r}"
            return
        assert expect, f"accepted an invalid request {req!r}"
        self.live.append(req)
        self.accepted += 1

    def _take(self, req, how):
        assert any(r is req for r in self.live), f"{how} returned a request that is not live: {req!r}"
        self.live = [r for r in self.live if r is not req]
        self.returned += 1
        assert req.completed_at is not None
        assert len(req.generated) <= req.max_tokens
        assert EOS not in req.generated[:-1], "a token followed EOS"

    # ------------------------------------------------------------ rules

    @rule(user_id=user_ids, prompt=prompts, max_tokens=max_tokens_values, request_id=request_ids)
    def submit_new(self, user_id, prompt, max_tokens, request_id):
        req = Request(user_id=user_id, prompt=prompt, max_tokens=max_tokens, request_id=request_id)
        self.seen.append(req)
        self._submit(req)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def resubmit_same_object(self, data):
        self._submit(data.draw(st.sampled_from(self.seen)))

    @rule(n=st.integers(1, 4))
    def tick(self, n):
        for _ in range(n):
            before = {id(r): len(r.generated) for r in self.live}
            faulty = self.backend.fault is not None
            try:
                done = self.s.tick()
            except BackendError:
                assert faulty, "BackendError without an injected fault"
                assert {id(r): len(r.generated) for r in self.live} == before, "a failed tick changed tokens"
                return
            reasons = dict((id(r), why) for r, why in self.s.last_finished)
            for r in done:
                assert reasons[id(r)] in (("error",) if faulty else ("stop", "length"))
                self._take(r, "tick")
            for r in self.live:
                assert r.completed_at is None
                assert len(r.generated) - before[id(r)] in (0, 1)
                assert EOS not in r.generated, "a live request holds EOS"

    @rule(kind=st.sampled_from(["raise", "short", "long", "nonint"]))
    def inject_fault(self, kind):
        self.backend.fault = kind

    @rule(data=st.data(), by_id=st.booleans())
    def abort(self, data, by_id):
        choices = self.seen + ["nope", "", None, 3]
        target = data.draw(st.sampled_from(choices)) if choices else "nope"
        key = target.request_id if by_id and isinstance(target, Request) else target
        if isinstance(key, str):
            expect = next((r for r in self.live if key and r.request_id == key), None)
        else:
            expect = next((r for r in self.live if r is key), None)
        got = self.s.abort(key)
        assert got is expect
        if got is not None:
            self._take(got, "abort")

    @rule()
    def metrics(self):
        m = self.s.metrics()
        for k in ("throughput_tokens_per_sec", "avg_latency_s", "p99_latency_s", "gpu_utilization"):
            assert isinstance(m[k], float) and math.isfinite(m[k])
        assert m["requests_finished"] + m["finish_reasons"].get("abort", 0) + m["finish_reasons"].get("error", 0) \
            == self.returned

    # ------------------------------------------------------------ after every step

    @invariant()
    def integrity_and_honest_has_active(self):
        if self.s is None:
            return
        self.s.check_integrity()
        active = self.s.has_active()
        assert active == bool(self.live)
        if not active:
            assert self.s.pool.num_used == 0
        m = self.s.metrics()
        assert m["waiting"] + m["running"] == len(self.live)

    def teardown(self):
        if self.s is None:
            return
        self.backend.fault = None
        for _ in range(20_000):
            if not self.s.has_active():
                break
            for r in self.s.tick():
                self._take(r, "tick")
        assert not self.live and not self.s.has_active() and self.s.pool.num_used == 0
        assert self.returned == self.accepted


TestSchedulerFuzz = SchedulerMachine.TestCase
#: Modest for CI; ``FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py`` for a long run.
TestSchedulerFuzz.settings = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")),
                                      stateful_step_count=40, deadline=None)
