"""batch.integrations.vllm against vLLM's real AsyncScheduler (and its Scheduler) on CPU, driven as
vLLM's engine core drives them: ``schedule()`` runs ahead of ``update_from_output()`` with up to
``max_concurrent_batches`` steps in flight (2 with async scheduling, 3 with pipeline parallelism
of 2), aborts are processed just before an output (``EngineCore._process_aborts_queue``), and a
fake model runner samples tokens when a step is scheduled. Checked: the charges stay exact one
step ahead (a prompt chunk charged by the output of the step that computed it, never a
placeholder or a token vLLM drops, requests finishing or aborted with a step in flight, a
preemption with a step in flight), users told idle only after their last charge, speculative
decoding's several tokens a step (trimmed at a stop), one user as vLLM's own scheduler step by
step, isolation, the A/B burst, and the start-up checks. Marked vllm: ``make test`` runs them in
.venv-vllm."""
from __future__ import annotations

import logging
import random
import sys
from collections import Counter, deque
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import vllm_compare as vc  # noqa: E402
from batch.policies.vtc import VTCPolicy  # noqa: E402

try:
    from batch.integrations import vllm as bv
    from vllm.v1.request import RequestStatus
except ImportError:  # .venv: collected, deselected (-m "not vllm"); these run in .venv-vllm
    bv = RequestStatus = None

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _needs_vllm():
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")


T = vc.TraceRequest


def build(cls, *, policy=None, blocks=vc.KV_BLOCKS, spec_tokens=0, pp=1, async_scheduling=None):
    """``cls`` (a vLLM scheduler class, fair or not) on the comparison's tiny-Llama set-up with
    ``blocks`` KV blocks of 16 tokens, ngram speculative decoding of ``spec_tokens`` drafts and
    pipeline parallelism of ``pp`` (vLLM's own config checks apply: it resolves the batch queue)."""
    v = vc._vllm()
    from vllm.config import ParallelConfig, SpeculativeConfig
    if async_scheduling is None:
        async_scheduling = issubclass(cls, v.VAsyncScheduler)
    base = vc._vllm_config(vc.CHUNK_TOKENS)
    sched_cfg = v.SchedulerConfig(max_model_len=vc.VLLM_MAX_MODEL_LEN, is_encoder_decoder=False,
                                  max_num_batched_tokens=vc.VLLM_MAX_BATCHED_TOKENS, max_num_seqs=vc.VLLM_MAX_SEQS,
                                  long_prefill_token_threshold=vc.CHUNK_TOKENS, enable_chunked_prefill=True,
                                  async_scheduling=async_scheduling)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens, prompt_lookup_max=3,
                             prompt_lookup_min=1) if spec_tokens else None
    cfg = v.VllmConfig(model_config=base.model_config, scheduler_config=sched_cfg,
                       cache_config=v.CacheConfig(block_size=vc.BLOCK_TOKENS, enable_prefix_caching=False),
                       device_config=v.DeviceConfig(device="cpu"), speculative_config=spec,
                       parallel_config=ParallelConfig(pipeline_parallel_size=pp))
    cfg.cache_config.num_gpu_blocks = blocks
    kv = v.KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        v.KVCacheGroupSpec(["layer.0"], v.FullAttentionSpec(block_size=vc.BLOCK_TOKENS, num_kv_heads=2, head_size=32,
                                                            dtype=v.torch.float32))])
    kwargs = {} if not issubclass(cls, bv._FairMixin) else {"fair_policy": policy if policy is not None
                                                                         else VTCPolicy()}
    return cls(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=v.StructuredOutputManager(cfg),
               block_size=vc.BLOCK_TOKENS, log_stats=False, **kwargs)


class Spy(VTCPolicy):
    """VTCPolicy recording every charge and idle call with the engine's update number."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.update_no = 0
        self.events: list[tuple] = []

    def charge(self, user_id, prompt_tokens, output_tokens):
        self.events.append(("charge", self.update_no, user_id, prompt_tokens, output_tokens))
        super().charge(user_id, prompt_tokens, output_tokens)

    def on_idle(self, user_id):
        self.events.append(("idle", self.update_no, user_id))
        super().on_idle(user_id)


class Engine:
    """vLLM's engine-core loop over ``sched`` with a fake model runner.

    ``step()`` is ``EngineCore.step_with_batch_queue`` (``step`` when one step is in flight at
    most): schedule a step if there is work; unless the queue of steps in flight is then full
    (``vllm_config.max_concurrent_batches``) or nothing was scheduled, return; else process the
    queued aborts and the oldest step's output. The runner samples, for each request that is not
    mid-(re)prefill, ``1 + accepted drafts`` tokens (``accept(rid, drafts)``), the EOS token at
    the request's output length counted by the runner (``out_len``); tokens after it in flight
    are vLLM's to drop. With speculative decoding and async scheduling off, it proposes
    ``spec_tokens`` drafts after each output as the engine's ``post_step`` does.

    Records, independently of the scheduler under test: the prompt tokens each request had
    computed for the first time (from the scheduler outputs' ``num_computed_tokens`` and
    ``num_scheduled_tokens``, what the model runner computes) and the tokens vLLM delivered.
    """

    def __init__(self, sched, *, accept=None, record=None):
        self.sched = sched
        self.depth = sched.vllm_config.max_concurrent_batches
        self.inflight: deque = deque()
        self.accept = accept or (lambda rid, drafts: 0)
        self.record = record
        self.spec_tokens = sched.num_spec_tokens
        self.prompt_len: dict[str, int] = {}
        self.out_len: dict[str, int] = {}
        self.user: dict[str, str] = {}
        self.sampled: Counter = Counter()  # tokens the runner sampled, by request
        self.computed_prompt: dict[str, int] = {}  # most prompt tokens the runner computed
        self.delivered: Counter = Counter()  # tokens vLLM delivered, by request
        self.scheduled_after_stop: Counter = Counter()  # steps scheduled for a request after its EOS was sampled
        self.to_abort: list[str] = []
        self.updates = 0
        self.multi_token_outputs = 0

    def add(self, rid, user, prompt, out, max_tokens=None):
        v = vc._vllm()
        sp = v.SamplingParams(max_tokens=max_tokens or out, ignore_eos=False, extra_args={"user": user})
        sp.update_from_generation_config({}, eos_token_id=vc.VLLM_EOS)
        self.prompt_len[rid], self.out_len[rid], self.user[rid] = prompt, out, user
        self.sched.add_request(v.VRequest(request_id=rid, prompt_token_ids=[1] * prompt, sampling_params=sp,
                                          pooling_params=None, arrival_time=0.0))

    def _forward(self, out):
        reqs, sampled = self.sched.requests, []
        pos = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        c = out.scheduled_cached_reqs
        pos.update(zip(c.req_ids, c.num_computed_tokens))
        for rid, k in out.num_scheduled_tokens.items():
            P = self.prompt_len[rid]
            self.computed_prompt[rid] = max(self.computed_prompt.get(rid, 0), min(pos[rid] + k, P))
            r = reqs[rid]
            if r.is_prefill_chunk:
                sampled.append([])
                continue
            if self.sampled[rid] >= self.out_len[rid]:
                self.scheduled_after_stop[rid] += 1
            n = 1 + self.accept(rid, len(out.scheduled_spec_decode_tokens.get(rid, ())))
            toks = []
            for _ in range(n):
                self.sampled[rid] += 1
                toks.append(vc.VLLM_EOS if self.sampled[rid] >= self.out_len[rid] else vc.VLLM_TOKEN)
            sampled.append(toks)
        ids = list(out.num_scheduled_tokens)
        return vc._vllm().ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                                            sampled_token_ids=sampled)

    def schedule(self):
        out = self.sched.schedule()
        if self.record is not None:
            self.record.append(summary(out))
        self.inflight.append((out, self._forward(out)))
        return out

    def update(self):
        if self.to_abort:
            self.sched.finish_requests(self.to_abort, RequestStatus.FINISHED_ABORTED)
            self.to_abort = []
        out, mro = self.inflight.popleft()
        self.updates += 1
        policy = getattr(self.sched, "fair_policy", None)
        if isinstance(policy, Spy):
            policy.update_no = self.updates
        res = self.sched.update_from_output(out, mro)
        for eco in res.values():
            for o in eco.outputs:
                self.delivered[o.request_id] += len(o.new_token_ids)
                self.multi_token_outputs += len(o.new_token_ids) > 1
        if self.spec_tokens and not self.sched.scheduler_config.async_scheduling:
            ids = [r.request_id for r in self.sched.running if not r.is_prefill_chunk]
            self.sched.update_draft_token_ids(_draft_ids(ids, self.spec_tokens))
        return res

    def step(self):
        if self.sched.has_unfinished_requests():
            out = self.schedule()
            if out.num_scheduled_tokens and len(self.inflight) < self.depth:
                return
        if self.inflight:
            self.update()

    def run(self, steps=100_000, between=None):
        for i in range(steps):
            if not (self.sched.has_unfinished_requests() or self.inflight):
                return
            if between is not None:
                between(self, i)
            self.step()
        raise AssertionError("the engine did not finish")


def _draft_ids(ids, n):
    """``n`` drafts for each of ``ids``, as the engine's ``post_step`` hands a synchronous scheduler."""
    from vllm.v1.outputs import DraftTokenIds
    return DraftTokenIds(req_ids=ids, draft_token_ids=[[vc.VLLM_TOKEN] * n for _ in ids])


def summary(out):
    """What a step hands the model runner, comparably across schedulers."""
    return (dict(out.num_scheduled_tokens), [d.req_id for d in out.scheduled_new_reqs],
            sorted(out.preempted_req_ids or ()), sorted(out.finished_req_ids),
            {k: len(v) for k, v in out.scheduled_spec_decode_tokens.items()})


def check_exact(eng: Engine, spy: Spy):
    """Every user was charged exactly the prompt tokens its requests had computed for the first
    time and the tokens vLLM delivered to them, once per user per output, and told idle only
    after its last charge (and again only after a new request)."""
    want_p, want_o = Counter(), Counter()
    for rid, u in eng.user.items():
        want_p[u] += eng.computed_prompt.get(rid, 0)
        want_o[u] += eng.delivered[rid]
    got_p, got_o, seen = Counter(), Counter(), set()
    for ev in spy.events:
        if ev[0] == "charge":
            _, no, u, p, o = ev
            assert (no, u) not in seen, f"user {u} charged twice by output {no}"
            seen.add((no, u))
            got_p[u] += p
            got_o[u] += o
    assert got_p == +want_p and got_o == +want_o
    last = {}
    for ev in spy.events:
        last[ev[2]] = ev[0]
    assert all(kind == "idle" for kind in last.values()), last  # everyone ends idle, after its charges
    s = eng.sched
    assert s._live == {} and s._entries == {} and s._user == {} and s._inflight == {} and not s._idle_due
    assert s._due == {} and len(s.waiting) == 0 and not s._prefilling and s._first_pending == {}


CLASSES = pytest.mark.parametrize("cls_name", ["AsyncFairScheduler", "FairScheduler"])


# ------------------------------------------------------------------------- one step ahead

def test_async_scheduling_runs_one_step_ahead_with_the_async_class():
    s = build(bv.AsyncFairScheduler, policy=VTCPolicy(isolation=False))
    assert isinstance(s, vc._vllm().VAsyncScheduler) and s.vllm_config.max_concurrent_batches == 2
    eng = Engine(s)
    eng.add("a", "A", 10, 5)
    eng.schedule()
    out2 = eng.schedule()  # before the first step's output: the decode runs on a placeholder
    assert out2.num_scheduled_tokens == {"a": 1} and s.requests["a"].num_output_placeholders == 2


def test_a_prompt_chunk_is_charged_by_the_output_of_the_step_that_computed_it():
    s = build(bv.AsyncFairScheduler, policy=VTCPolicy(isolation=False))
    eng = Engine(s)
    eng.add("a", "A", 200, 3)
    eng.add("b", "B", 10, 3)
    eng.schedule()  # a: 64 of 200, b: all 10 and its first token
    eng.schedule()  # a: the next 64, b: a decode on a placeholder, both before the first output
    eng.update()
    assert s.last_charges == {"A": [64, 0], "B": [10, 1]}
    eng.schedule()
    eng.update()
    assert s.last_charges == {"A": [64, 0], "B": [0, 1]}


def test_tokens_vllm_drops_after_a_stop_are_not_charged():
    """The EOS comes at the 3rd token of 10 allowed: async scheduling has already scheduled a 4th
    step on a placeholder; vLLM drops its token, and so does the charge."""
    spy = Spy(isolation=False)
    eng = Engine(build(bv.AsyncFairScheduler, policy=spy))
    eng.add("a", "A", 20, 3, max_tokens=10)
    eng.run()
    assert eng.scheduled_after_stop["a"] == 1 and eng.delivered["a"] == 3
    assert sum(ev[4] for ev in spy.events if ev[0] == "charge") == 3
    check_exact(eng, spy)


@CLASSES
def test_a_request_aborted_with_two_steps_in_flight_is_charged_its_computed_prompt_then_idle(cls_name):
    spy = Spy(isolation=False)
    s = build(getattr(bv, cls_name), policy=spy)
    eng = Engine(s)
    eng.add("a", "A", 300, 5)
    eng.add("b", "B", 20, 40)
    eng.schedule()
    eng.schedule()  # a's second chunk is scheduled while the first is in flight (sync: nothing new for b)
    eng.to_abort = ["a"]  # the client left: processed before the first output
    eng.update()
    assert "a" not in s.requests and eng.computed_prompt["a"] == 128
    assert not any(ev[0] == "idle" and ev[2] == "A" for ev in spy.events)  # a step with A's prompt is in flight
    eng.update()
    assert spy.events[-1] == ("idle", 2, "A")  # told idle once its last step returned, after its charge
    eng.run()
    check_exact(eng, spy)
    assert eng.delivered["a"] == 0


def test_a_user_back_before_its_steps_in_flight_returned_is_never_told_idle():
    spy = Spy(isolation=False)
    s = build(bv.AsyncFairScheduler, policy=spy)
    eng = Engine(s)
    eng.add("a", "A", 300, 5)
    eng.add("b", "B", 20, 40)
    eng.schedule()
    eng.schedule()
    eng.to_abort = ["a"]
    eng.update()
    eng.add("a2", "A", 10, 3)  # A returns while its second chunk is still in flight
    eng.run()
    idles = [ev for ev in spy.events if ev[0] == "idle" and ev[2] == "A"]
    assert len(idles) == 1 and idles[0][1] > 2  # only after a2 finished
    check_exact(eng, spy)


def random_load(eng: Engine, seed: int, users=4, n=40, abort_p=0.04):
    rnd = random.Random(seed)
    for i in range(n):
        u = f"u{rnd.randrange(users)}"
        eng.add(f"r{i}", u, rnd.randint(5, 300), rnd.randint(1, 60), max_tokens=rnd.choice([None, 200]))
    live = [f"r{i}" for i in range(n)]

    def between(e, i):
        if rnd.random() < abort_p and e.inflight:
            rid = rnd.choice(live)
            if rid in e.sched.requests:
                e.to_abort.append(rid)
    return between


@pytest.mark.parametrize("cls_name,pp", [("AsyncFairScheduler", 1), ("FairScheduler", 1),
                                         ("AsyncFairScheduler", 2), ("FairScheduler", 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_charges_stay_exact_with_steps_in_flight_preemptions_and_aborts(cls_name, pp, seed):
    spy = Spy()
    s = build(getattr(bv, cls_name), policy=spy, blocks=96, pp=pp)
    eng = Engine(s)
    eng.run(between=random_load(eng, seed))
    assert eng.depth == {("AsyncFairScheduler", 1): 2, ("FairScheduler", 1): 1,
                         ("AsyncFairScheduler", 2): 3, ("FairScheduler", 2): 2}[cls_name, pp]
    check_exact(eng, spy)
    finished = [rid for rid in eng.user if eng.delivered[rid] == eng.out_len[rid]]
    assert len(finished) >= 20


def test_the_stress_load_preempts_and_aborts_with_steps_in_flight():
    """The load of the test above exercises what it claims to (seed 0, async)."""
    s = build(bv.AsyncFairScheduler, policy=Spy(), blocks=96)
    eng = Engine(s)
    preempted = []
    orig = s._preempt_request

    def spy_preempt(request, *a, **k):
        preempted.append(request.num_in_flight_tokens > 0)
        return orig(request, *a, **k)
    s._preempt_request = spy_preempt
    between = random_load(eng, 0)
    aborted_in_flight = []

    def watch(e, i):
        before = list(e.to_abort)
        between(e, i)
        aborted_in_flight.extend(rid for rid in e.to_abort if rid not in before
                                 and rid in e.sched.requests and e.sched.requests[rid].num_in_flight_tokens > 0)
    eng.run(between=watch)
    assert any(preempted) and aborted_in_flight  # preempted and aborted with a step in flight


@pytest.mark.parametrize("cls_name", ["AsyncFairScheduler", "FairScheduler"])
def test_speculative_decoding_charges_the_tokens_delivered_trimmed_at_a_stop(cls_name):
    spy = Spy()
    s = build(getattr(bv, cls_name), policy=spy, spec_tokens=2)
    assert s.num_spec_tokens == 2
    eng = Engine(s, accept=lambda rid, drafts: min(drafts, (len(rid) + eng.updates) % 3))
    for i in range(12):
        eng.add(f"r{i}", f"u{i % 3}", 20 + 17 * i, 3 + 5 * i)
    eng.run()
    assert eng.multi_token_outputs > 0
    assert sum(eng.sampled.values()) > sum(eng.delivered.values())  # tokens past a stop were trimmed
    assert all(eng.delivered[rid] == eng.out_len[rid] for rid in eng.user)
    check_exact(eng, spy)


# ------------------------------------------------------------------------- one user: vLLM's own

@pytest.mark.parametrize("ours,theirs", [("AsyncFairScheduler", "VAsyncScheduler"), ("FairScheduler", "VScheduler")])
def test_one_user_gets_vllms_own_schedule_step_by_step(ours, theirs):
    reqs = [T(f"A{i}", "u", 0.001 * i, 150, 200) for i in range(20)]
    reqs += [T(f"C{i}", "u", 0.5 + 0.01 * i, 60 + 7 * i, 40) for i in range(30)]
    mine, vllms = [], []
    run_mine = vc.run_vllm(reqs, make=lambda thr: build(getattr(bv, ours)), on_schedule=lambda o: mine.append(summary(o)))
    run_vllm = vc.run_vllm(reqs, make=lambda thr: build(getattr(vc._vllm(), theirs)),
                           on_schedule=lambda o: vllms.append(summary(o)))
    assert run_mine.preemptions == run_vllm.preemptions > 0
    assert mine == vllms


# ------------------------------------------------------------------------- isolation and the A/B burst

def test_isolation_under_async_scheduling_stops_once_the_first_token_is_in_flight():
    s = build(bv.AsyncFairScheduler)
    eng = Engine(s)
    for i in range(8):
        eng.add(f"A{i}", "A", 30, 40)
    eng.step()
    eng.step()  # A's requests decode, a step in flight
    eng.add("B0", "B", 30, 20)
    out = eng.schedule()
    assert list(out.num_scheduled_tokens) == ["B0"] and s.num_isolated_steps == 1
    out = eng.schedule()  # B0's first token is in flight: nothing left to isolate for
    assert len(out.num_scheduled_tokens) == 9 and s.num_isolated_steps == 1


def test_an_isolated_step_leaves_out_a_request_whose_first_token_is_in_flight():
    """B1 arrives while B0's first token is in flight: the next step isolates B1's prefill; B0's
    decode sits out with A's, as it would with its token back."""
    s = build(bv.AsyncFairScheduler)
    eng = Engine(s)
    for i in range(8):
        eng.add(f"A{i}", "A", 30, 40)
    eng.step()
    eng.step()
    eng.add("B0", "B", 30, 20)
    assert list(eng.schedule().num_scheduled_tokens) == ["B0"]
    eng.add("B1", "B", 30, 20)
    assert list(eng.schedule().num_scheduled_tokens) == ["B1"] and s.num_isolated_steps == 2


def test_seed_ab_burst_under_async_scheduling_ratio_at_once_and_throughput():
    reqs = vc.ab_trace(0)
    f = vc.ab_ratios(partial(vc.run_vllm, make=vc.make_async_fair_scheduler), reqs, name="fair")
    v = vc.ab_ratios(partial(vc.run_vllm, make=vc.make_async_vllm_scheduler), reqs, name="vllm")
    assert f.ratio("at once") <= 1.2 < 1.5 < v.ratio("at once")
    tf = vc.summarize(vc.run_vllm(reqs, make=vc.make_async_fair_scheduler)).throughput_tok_s
    tv = vc.summarize(vc.run_vllm(reqs, make=vc.make_async_vllm_scheduler)).throughput_tok_s
    assert tf >= 0.99 * tv


# ------------------------------------------------------------------------- start-up

def test_the_async_class_loads_by_qualified_name_and_needs_no_other_flag():
    """As ``vllm serve --scheduler-cls batch.integrations.vllm.AsyncFairScheduler`` with no
    scheduling flag: vLLM resolves async scheduling on, loads the class by name and builds it
    (``EngineCore.__init__``'s call)."""
    v = vc._vllm()
    base = vc._vllm_config(vc.CHUNK_TOKENS)
    sc = v.SchedulerConfig(max_model_len=vc.VLLM_MAX_MODEL_LEN, is_encoder_decoder=False,
                           scheduler_cls="batch.integrations.vllm.AsyncFairScheduler")
    assert sc.async_scheduling is None  # not given
    cfg = v.VllmConfig(model_config=base.model_config, scheduler_config=sc, device_config=base.device_config,
                       cache_config=v.CacheConfig(block_size=16, enable_prefix_caching=True))
    assert cfg.scheduler_config.async_scheduling is True and cfg.max_concurrent_batches == 2
    cfg.cache_config.num_gpu_blocks = 64  # what EngineCore sets from the profiled KV cache
    cls = cfg.scheduler_config.get_scheduler_cls()
    assert cls is bv.AsyncFairScheduler and issubclass(cls, v.VAsyncScheduler)
    kv = v.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[v.KVCacheGroupSpec(
        ["layer.0"], v.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=v.torch.float32))])
    s = cls(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=v.StructuredOutputManager(cfg),
            include_finished_set=False, log_stats=True, block_size=16, hash_block_size=16)
    assert isinstance(s.fair_policy, VTCPolicy) and isinstance(s.waiting, bv.PolicyQueue)


def test_the_async_class_refuses_to_start_with_async_scheduling_off():
    with pytest.raises(ValueError, match="async scheduling is off.*FairScheduler"):
        build(bv.AsyncFairScheduler, async_scheduling=False)


def test_the_sync_class_under_async_scheduling_warns_and_keeps_exact_charges(caplog):
    with caplog.at_level(logging.WARNING, logger=bv.__name__):
        s = build(bv.FairScheduler, policy=Spy(isolation=False), async_scheduling=True)
    assert "AsyncFairScheduler" in caplog.text
    eng = Engine(s)
    assert eng.depth == 2
    eng.run(between=random_load(eng, 3, abort_p=0.0))
    check_exact(eng, s.fair_policy)
