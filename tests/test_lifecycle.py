"""Issue 2's behaviours: chunked prefill, EOS, max_tokens, the KV cap, preemption, refusal."""
import pytest
from conftest import ScriptedBackend, StepClock, drain, make_req

import inference_stub
import scheduler as sched_mod
from batch.policies.policy import FCFSPolicy
from scheduler import (BackendError, DuplicateRequestError, InvalidRequestError, PromptTooLongError,
                       Scheduler)


def new(backend=None, **kw):
    return Scheduler(backend=backend or ScriptedBackend(), clock=StepClock(), check_invariants=True, **kw)


@pytest.mark.parametrize("n_prompt, chunks", [(1, 1), (63, 1), (64, 1), (65, 2), (128, 2), (192, 3), (200, 4)])
def test_prompt_takes_ceil_p_over_64_iterations_then_first_token(n_prompt, chunks):
    be = ScriptedBackend()
    s = new(be)
    r = make_req("p", n_prompt=n_prompt, max_tokens=3)
    s.submit(r)
    first = None
    t = 0
    while s.has_active():
        s.tick()
        if first is None and r.generated:
            first = t
        t += 1
    assert first == chunks - 1
    assert be.iterations_with("p") == chunks + 2  # prefill chunks, then 2 decodes
    assert len(r.generated) == 3


def test_non_final_chunk_tokens_are_discarded_and_started_at_set_at_first_token():
    be = ScriptedBackend(eos_at={"p": 1})  # EOS would be the first output token
    s = new(be)
    r = make_req("p", n_prompt=130, max_tokens=5)
    s.submit(r)
    s.tick()
    s.tick()
    assert r.generated == [] and r.started_at is None  # two chunks of 64: no token kept
    done = s.tick()  # last chunk (2 tokens): its token is the first output, and it is EOS
    assert done == [r] and r.generated == [0]
    assert r.started_at == r.completed_at is not None


def test_eos_on_first_token_finishes_same_tick_others_continue():
    be = ScriptedBackend(eos_at={"a": 1})
    s = new(be)
    a, b = make_req("a", max_tokens=5), make_req("b", user="u2", max_tokens=5)
    s.submit(a)
    s.submit(b)
    assert s.tick() == [a]
    assert a.generated == [0] and len(b.generated) == 1 and s.has_active()
    assert drain(s) == [b] and len(b.generated) == 5 and 0 not in b.generated


def test_eos_and_max_tokens_on_the_same_tick():
    be = ScriptedBackend(eos_at={"a": 3})
    s = new(be)
    a = make_req("a", max_tokens=3)
    s.submit(a)
    assert drain(s) == [a]
    assert a.generated[-1] == 0 and len(a.generated) == 3
    assert s.metrics()["finish_reasons"] == {"stop": 1}


def test_max_tokens_without_eos_finishes_with_length_and_no_token_follows_eos():
    be = ScriptedBackend(eos_at={"b": 2})
    s = new(be)
    a, b = make_req("a", max_tokens=7), make_req("b", max_tokens=9)
    s.submit(a)
    s.submit(b)
    drain(s)
    assert len(a.generated) == 7 and 0 not in a.generated
    assert b.generated[-1] == 0 and len(b.generated) == 2
    assert s.metrics()["finish_reasons"] == {"length": 1, "stop": 1}
    assert be.iterations_with("b") == 2  # never scheduled after its EOS


def test_model_that_never_emits_eos_still_drains():
    be = ScriptedBackend()
    s = new(be)
    for i in range(40):
        s.submit(make_req(f"r{i}", user=f"u{i % 4}", n_prompt=5 + 7 * i, max_tokens=30 + i))
    done = drain(s)
    assert len(done) == 40 and all(len(r.generated) == r.max_tokens for r in done)


def test_a_negative_eos_token_id_never_matches():
    """``eos_token_id=-1`` (worked before the knob checks): no token ends a request early."""
    b = ScriptedBackend()
    s = Scheduler(backend=b, eos_token_id=-1)
    r = make_req("r", max_tokens=6)
    b.eos_at["r"] = 2  # the backend's EOS (0) at the 2nd token is an ordinary token here
    s.submit(r)
    assert drain(s) == [r] and len(r.generated) == 6


def test_kv_cap_under_pressure_never_exceeded_in_any_batch():
    be = ScriptedBackend()
    s = new(be)
    for i in range(30):
        s.submit(make_req(f"L{i}", user=f"u{i % 3}", n_prompt=150 + i, max_tokens=99))
    done = drain(s)
    assert len(done) == 30
    assert 0 < be.max_blocks_in_a_batch() <= inference_stub.MAX_KV_BLOCKS
    assert s.pool.num_used == 0 and s.pool.num_free == inference_stub.MAX_KV_BLOCKS


def test_preemption_when_every_running_request_needs_a_block_in_the_same_tick():
    # cap 8 blocks: four 31-token prompts hold 2 blocks each (31 tokens + 1 slot). After the
    # first token each has 32 tokens and needs a 3rd block, all in the same tick.
    be = ScriptedBackend()
    s = new(be, kv_cap_blocks=8, policy=FCFSPolicy())  # FCFS packs the cache (no admission headroom)
    reqs = [make_req(f"r{i}", user=f"u{i}", n_prompt=31, max_tokens=20) for i in range(4)]
    for r in reqs:
        s.submit(r)
    s.tick()
    assert s.pool.num_free == 0 and all(len(r.generated) == 1 for r in reqs)
    s.tick()
    m = s.metrics()
    assert m["preemptions"] >= 1
    assert sum(len(q.block_table) for q in s.running) <= 8
    done = drain(s)
    assert sorted(r.request_id for r in done) == [f"r{i}" for i in range(4)]
    assert all(len(r.generated) == 20 for r in reqs)
    assert be.max_blocks_in_a_batch() <= 8


def test_preempted_request_keeps_tokens_and_recomputes_prompt_plus_generated():
    be = ScriptedBackend()
    s = new(be, kv_cap_blocks=6)
    a = make_req("a", n_prompt=31, max_tokens=40)  # 2 blocks at admission, 5 at the end: both cannot fit
    b = make_req("b", user="u2", n_prompt=31, max_tokens=40)
    s.submit(a)
    s.submit(b)
    drain(s)
    assert len(a.generated) == 40 and len(b.generated) == 40
    assert s.metrics()["preemptions"] >= 1
    # tokens are a pure function of (rid, position): recompute changed nothing
    import zlib
    assert a.generated == [1 + zlib.crc32(f"a:{k}".encode()) % 63 for k in range(1, 41)]


def test_prompt_larger_than_cache_refused_small_request_still_served():
    s = new()
    with pytest.raises(PromptTooLongError) as e:
        s.submit(make_req("big", n_prompt=5000))
    assert "5000 tokens" in str(e.value) and "256 blocks" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert not s.has_active()
    ok = make_req("ok", user="u2", max_tokens=3)
    s.submit(ok)
    assert drain(s, limit=50) == [ok]
    assert s.metrics()["refusals"] == 1


def test_largest_admissible_prompt_runs_and_stops_at_cache_length():
    s = new(kv_cap_blocks=4)  # 64 tokens of KV
    with pytest.raises(PromptTooLongError):
        s.submit(make_req("full", n_prompt=64))
    r = make_req("edge", n_prompt=60, max_tokens=50)
    s.submit(r)
    drain(s)
    assert len(r.generated) == 4  # 60 + 4 = 64 tokens: the cache is full, finish with "length"
    assert s.metrics()["finish_reasons"] == {"length": 1}


def test_a_prompt_over_the_cap_is_refused_for_its_length_before_its_tokens_are_read():
    """A 10M-token prompt took about a second to refuse: every token was checked first."""
    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=4, block_tokens=4)
    r = make_req("big", n_prompt=40, max_tokens=2)
    r.prompt[-1] = -1  # an invalid id at the end: the length check must come first
    with pytest.raises(PromptTooLongError):
        s.submit(r)
    assert not s.has_active()


@pytest.mark.parametrize("bad, field", [
    (dict(prompt=[]), "prompt"), (dict(prompt=[1, "x"]), "prompt"), (dict(prompt=[1, -64]), "prompt"),
    (dict(prompt=[-1]), "prompt"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(user_id=""), "user_id"), (dict(user_id=7), "user_id"),
])
def test_bad_input_is_refused_with_a_typed_error_and_changes_nothing(bad, field):
    s = new()
    kw = dict(user_id="u1", prompt=[1, 2, 3], max_tokens=4, request_id="x")
    kw.update(bad)
    with pytest.raises(InvalidRequestError, match=field):
        s.submit(inference_stub.Request(**kw))
    assert not s.has_active() and s.metrics()["refusals"] == 1


def test_duplicate_object_in_flight_refused_but_a_repeated_id_accepted():
    s = new()
    r = make_req("x")
    s.submit(r)
    with pytest.raises(DuplicateRequestError):
        s.submit(r)
    s.tick()
    assert r.generated  # in flight with tokens: still a duplicate, not a malformed request
    with pytest.raises(DuplicateRequestError):
        s.submit(r)
    twin, third = make_req("x"), make_req("x")  # another object, same id: the contract allows it
    s.submit(twin)
    s.submit(third)
    assert s.abort("x") is r and s.abort("x") is twin  # by id: the oldest in flight
    assert s.abort(third) is third and s.abort("x") is None
    s.submit(make_req(""))
    s.submit(make_req(""))  # empty ids never clash
    assert len(drain(s)) == 2 and s.metrics()["refusals_by_reason"] == {"DuplicateRequestError": 2}
    s.submit(make_req("x"))  # finished ids may be reused
    assert len(drain(s)) == 1


def test_backend_failure_leaves_state_as_before_and_tick_can_be_retried():
    calls = {"n": 0}
    inner = ScriptedBackend()

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise RuntimeError("device lost")
        return inner(batch)

    s = Scheduler(backend=flaky, clock=StepClock(), kv_cap_blocks=8)
    reqs = [make_req(f"r{i}", user=f"u{i}", n_prompt=31, max_tokens=6) for i in range(4)]
    for r in reqs:
        s.submit(r)
    s.tick()  # all admitted; pool full; next tick must preempt
    before = ([list(q.block_table) for q in s.running], [list(r.generated) for r in reqs], s.pool.num_free)
    with pytest.raises(BackendError, match="device lost"):
        s.tick()
    s.check_integrity()
    assert ([list(q.block_table) for q in s.running], [list(r.generated) for r in reqs], s.pool.num_free) == before
    with pytest.raises(BackendError):
        s.tick()
    assert len(drain(s)) == 4


@pytest.mark.parametrize("out", [[], [1, 2, 3, 4, 5, 6], ["a"], None, [1.5]])
def test_malformed_backend_output_raises_and_changes_nothing(out):
    s = Scheduler(backend=lambda batch: out if not isinstance(out, list) or len(out) != 1 else out,
                  clock=StepClock())
    r = make_req("a")
    s.submit(r)
    with pytest.raises(BackendError):
        s.tick()
    assert r.generated == [] and s.pool.num_used == 0 and s.has_active()


def test_wrapping_inference_stub_forward_sees_every_batch(monkeypatch):
    seen = []
    be = ScriptedBackend()

    def wrapped(batch):
        seen.append(len(batch))
        return be(batch)

    monkeypatch.setattr(inference_stub, "forward", wrapped)
    s = Scheduler()
    s.submit(make_req("a", n_prompt=70, max_tokens=3))
    drain(s)
    assert seen == [1, 1, 1, 1]


def test_wrapping_scheduler_forward_sees_every_batch(monkeypatch):
    be = ScriptedBackend()
    monkeypatch.setattr(sched_mod, "forward", be)
    s = Scheduler()
    s.submit(make_req("a", max_tokens=4))
    drain(s)
    assert be.iterations_with("a") == 4


def test_empty_ticks_count_against_gpu_utilization():
    s = new()
    assert s.tick() == []
    s.submit(make_req("a", max_tokens=2))
    drain(s)
    m = s.metrics()
    assert m["ticks"] == 3 and m["gpu_utilization"] == pytest.approx(2 / 3)


def test_metrics_before_anything_are_finite_zeros():
    m = new().metrics()
    assert all(m[k] == 0.0 for k in ("throughput_tokens_per_sec", "avg_latency_s", "p99_latency_s",
                                     "gpu_utilization"))


def test_timestamps_use_the_injected_clock_and_are_ordered():
    clock = StepClock(0.5)
    s = Scheduler(backend=ScriptedBackend(), clock=clock)
    r = make_req("a", n_prompt=100, max_tokens=3)
    s.submit(r)
    drain(s)
    assert r.submitted_at == 0.5 and r.submitted_at < r.started_at < r.completed_at <= clock.t


def test_token_budget_splits_chunks_below_64():
    be = ScriptedBackend()
    s = new(be, token_budget_tokens=40)
    r = make_req("a", n_prompt=100, max_tokens=2)
    s.submit(r)
    drain(s)
    assert be.iterations_with("a") == 3 + 1  # 40 + 40 + 20, then one decode


def test_max_running_bounds_the_batch():
    be = ScriptedBackend()
    s = new(be, max_running=3)
    for i in range(10):
        s.submit(make_req(f"r{i}", max_tokens=4))
    drain(s)
    assert max(len(b) for b in be.batches) == 3


@pytest.mark.parametrize("knob", ["kv_cap_blocks", "block_tokens", "prefill_chunk_tokens", "max_running",
                                  "token_budget_tokens"])
@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_bad_knobs_raise(knob, value):
    with pytest.raises(ValueError, match=knob):
        Scheduler(**{knob: value})


def test_lifecycle_states_follow_the_spec():
    from spec import lifecycle as lc
    be = ScriptedBackend()
    s = new(be, kv_cap_blocks=16)
    a = make_req("a", n_prompt=100, max_tokens=3)
    s.submit(a)
    seq = s.state.by_obj[id(a)]
    assert seq.state == lc.QUEUED
    s.tick()
    assert seq.state == lc.PREFILLING
    s.tick()
    assert seq.state == lc.DECODING
    drain(s)
    assert seq.state == lc.DONE and seq.finish_reason == "length"


def test_preempted_state_then_resume():
    from spec import lifecycle as lc
    s = new(kv_cap_blocks=6)
    a, b = make_req("a", n_prompt=31, max_tokens=40), make_req("b", user="u2", n_prompt=31, max_tokens=40)
    s.submit(a)
    s.submit(b)
    seen = set()
    while s.has_active():
        s.tick()
        for r in (a, b):
            q = s.state.by_obj.get(id(r))
            if q is not None:
                seen.add(q.state)
    assert {lc.PREEMPTED, lc.DECODING} <= seen  # 31-token prompts re-prefill within one tick
