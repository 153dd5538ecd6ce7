"""batch.integrations.vllm against vLLM's real V1 Scheduler on CPU, driven by the fake model runner
of bench/vllm_compare.py: the admission order, the charges, a returning user's lift, abort and
preemption, one user as vLLM's FCFS, isolation, the A/B burst, and how the user reaches the
scheduler (extra_args, the ASGI middleware, the users file). Marked vllm: ``make test`` runs them
in .venv-vllm."""
from __future__ import annotations

import asyncio
import json
import sys
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import vllm_compare as vc  # noqa: E402
from batch.policies.vtc import VTCPolicy  # noqa: E402
from spec import fairness_rules as fr  # noqa: E402

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


def fair(policy=None):
    """A FairScheduler on the comparison's set-up (256 blocks x 16, chunks of 64)."""
    return vc.make_vllm_scheduler(vc.CHUNK_TOKENS, bv.FairScheduler,
                                  fair_policy=policy if policy is not None else VTCPolicy())


def vreq(rid, user, prompt, out):
    v = vc._vllm()
    sp = v.SamplingParams(max_tokens=out, ignore_eos=False, extra_args={"user": user} if user else None)
    sp.update_from_generation_config({}, eos_token_id=vc.VLLM_EOS)
    return v.VRequest(request_id=rid, prompt_token_ids=[1] * prompt, sampling_params=sp, pooling_params=None,
                      arrival_time=0.0)


def step(sched, produced):
    """One schedule / fake forward / update_from_output; returns (SchedulerOutput, charges)."""
    v = vc._vllm()
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests[rid]
        if r.num_computed_tokens >= r.num_tokens:
            k = produced[rid] = produced.get(rid, 0) + 1
            sampled.append([vc.VLLM_EOS if k >= r.sampling_params.max_tokens else vc.VLLM_TOKEN])
        else:
            sampled.append([])
    mro = v.ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                              sampled_token_ids=sampled)
    sched.update_from_output(out, mro)
    return out, sched.last_charges


def admitted(out):
    return [r.req_id for r in out.scheduled_new_reqs]


def units(prompt, output):
    return fr.service_units(prompt, output, fr.PROMPT_PRICE, fr.OUTPUT_PRICE) * fr.COUNTER_SCALE


# ------------------------------------------------------------------------- order and charges

def test_admission_alternates_users_by_counter_where_vllm_takes_arrival_order():
    reqs = [("A0", "A", 30), ("A1", "A", 30), ("A2", "A", 30), ("A3", "A", 30), ("B0", "B", 30), ("B1", "B", 30)]
    s = fair(VTCPolicy(isolation=False, tolerance_tokens=0))  # the band (default 8192) would keep arrival order
    plain = vc.make_vllm_scheduler()
    for sched in (s, plain):
        for rid, u, p in reqs:
            sched.add_request(vreq(rid, u, p, 5))
    assert admitted(s.schedule()) == ["A0", "B0", "A1", "B1", "A2", "A3"]
    assert admitted(plain.schedule()) == ["A0", "A1", "A2", "A3", "B0", "B1"]


def test_weights_give_a_heavier_user_more_admissions_first():
    s = fair(VTCPolicy(weights={"A": 3}, isolation=False, tolerance_tokens=0))
    for i in range(4):
        s.add_request(vreq(f"A{i}", "A", 30, 5))
    for i in range(4):
        s.add_request(vreq(f"B{i}", "B", 30, 5))
    # A's counter grows a third as fast: three A prompts per B prompt.
    assert admitted(s.schedule())[:6] == ["A0", "B0", "A1", "A2", "A3", "B1"]


def test_charges_are_prompt_tokens_computed_once_and_output_tokens_sampled():
    pol = VTCPolicy(isolation=False)
    s = fair(pol)
    s.add_request(vreq("a", "A", 100, 3))
    s.add_request(vreq("b", "B", 10, 3))
    produced = {}
    _, c1 = step(s, produced)  # a: a 64-token chunk (two requests: the threshold holds); b: all 10 + a token
    assert c1 == {"A": [64, 0], "B": [10, 1]}
    _, c2 = step(s, produced)  # a: the last 36 and its first token; b: a decode
    assert c2 == {"A": [36, 1], "B": [0, 1]}
    assert pol.counter("A") == units(100, 1) and pol.counter("B") == units(10, 2)


def test_update_from_output_charges_once_per_user_per_step_before_the_user_goes_idle():
    calls, idle, steps = [], [], [0]

    class Spy(VTCPolicy):
        def charge(self, user_id, prompt_tokens, output_tokens):
            calls.append((steps[0], user_id, prompt_tokens, output_tokens))
            super().charge(user_id, prompt_tokens, output_tokens)

        def on_idle(self, user_id):
            idle.append((steps[0], user_id, len(calls)))
            super().on_idle(user_id)

    def make(thr):
        s = fair(Spy(isolation=False))
        upd = s.update_from_output

        def counted(*a):
            steps[0] += 1
            return upd(*a)
        s.update_from_output = counted
        return s

    reqs = [T("a", "A", 0.0, 100, 4), T("a2", "A", 0.0, 10, 2), T("b", "B", 0.0, 20, 3)]
    vc.run_vllm(reqs, make=make)
    totals = {u: [sum(c[2] for c in calls if c[1] == u), sum(c[3] for c in calls if c[1] == u)] for u in "AB"}
    assert totals == {"A": [110, 6], "B": [20, 3]}
    keys = [(step, u) for step, u, _, _ in calls]
    assert len(keys) == len(set(keys))  # once per user per step
    assert sorted(u for _, u, _ in idle) == ["A", "B"]
    for step, user, seen in idle:  # idle after that step's charges, and none after
        assert any(c[0] == step and c[1] == user for c in calls[:seen])
        assert not any(c[1] == user for c in calls[seen:])


def test_a_returning_user_is_lifted_to_the_backlogged_users_counter():
    pol = VTCPolicy(isolation=False)
    s = fair(pol)
    produced = {}
    s.add_request(vreq("b0", "B", 10, 2))
    for i in range(6):
        s.add_request(vreq(f"a{i}", "A", 40, 30))
    while "b0" in s.requests:  # B's one request finishes; B goes idle
        step(s, produced)
    b_before = pol.counter("B")
    for _ in range(5):
        step(s, produced)
    a_now = pol.counter("A")
    assert a_now > b_before
    floor = pol.floor
    s.add_request(vreq("b1", "B", 10, 2))
    # lifted to one unit below A's counter (spec.fairness_rules.lift_floor): no credit for idle time
    assert pol.floor == fr.lift_floor(floor, a_now, True, 0) == a_now - 1
    assert pol.counter("B") == fr.lifted_counter(b_before, pol.floor) == a_now - 1
    out, _ = step(s, produced)
    assert "b1" in admitted(out)  # the newcomer wins the tie, and only that


# ------------------------------------------------------------------------- abort and preemption

def test_abort_of_waiting_and_running_requests_leaves_nothing_behind():
    pol = VTCPolicy(isolation=False)
    s = fair(pol)
    for i in range(3):
        s.add_request(vreq(f"a{i}", "A", 30, 50))
    s.add_request(vreq("b0", "B", 30, 50))
    produced = {}
    step(s, produced)
    for i in range(3, 6):
        s.add_request(vreq(f"a{i}", "A", 30, 50))  # waiting
    s.finish_requests(["a4", "a0"], RequestStatus.FINISHED_ABORTED)
    assert "a4" not in [r.request_id for r in s.waiting] and len(s.waiting) == 2
    assert "a0" not in [r.request_id for r in s.running]
    out, _ = step(s, produced)
    assert {"a0", "a4"}.isdisjoint(out.num_scheduled_tokens)
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and len(s.waiting) == 0 and len(pol) == 0
    assert s._live == {} and s._entries == {}


def heavy_and_light():
    """20 A requests whose decodes outgrow the 256 blocks, and one B request among them."""
    reqs = [T(f"A{i}", "A", 0.001 * i, 150, 200) for i in range(20)]
    return reqs + [T("B0", "B", 0.0105, 20, 200)]


def test_preemption_takes_the_marked_victim_the_policys_while_two_users_run():
    picked, marked, preempted = [], [], []

    class Spy(VTCPolicy):
        def victim(self, candidates):
            v = super().victim(candidates)
            picked.append(v.vreq.request_id)
            return v

    def make(thr):
        s = vc.make_vllm_scheduler(thr, bv.FairScheduler, fair_policy=Spy(isolation=False))
        pre, choose = s._preempt_request, s._choose_victim

        def spy_preempt(request, *a, **k):
            preempted.append(request.request_id)
            return pre(request, *a, **k)

        def spy_choose(running):
            v = choose(running)
            marked.append(v.request_id)
            return v
        s._preempt_request, s._choose_victim = spy_preempt, spy_choose
        return s

    run = vc.run_vllm(heavy_and_light(), make=make)
    assert run.preemptions > 0 and preempted == marked  # vLLM preempted exactly the victims it read
    assert picked and set(picked) <= set(preempted)  # the policy chose while B ran
    assert "B0" not in preempted  # the light user's request is preempted last
    assert vc.run_vllm(heavy_and_light()).preemptions > 0


def _waiting_after_preempting_a_decode(users):
    """A0 (user A) admitted and decoding; then one request per entry of ``users`` arrives; A0 is
    preempted before the next step. Returns the waiting queue's order and A0's order_no."""
    import time
    s = fair(VTCPolicy(isolation=False))
    s.add_request(vreq("A0", "A", 30, 50))
    produced = {}
    step(s, produced)
    step(s, produced)
    assert s.requests["A0"].output_token_ids  # a decode
    for i, u in enumerate(users):
        s.add_request(vreq(f"{u}{i + 1}", u, 30, 5))
    r = s.requests["A0"]
    s.running.remove(r)
    s._preempt_request(r, time.monotonic())
    return [q.request_id for q in s.waiting], s._entries["A0"].order_no


def test_a_preempted_decode_keeps_its_arrival_place_in_its_users_queue():
    order, order_no = _waiting_after_preempting_a_decode(["B", "A"])
    assert order == ["A0", "B1", "A2"] and order_no == 0  # no requeue_behind in the plugin (no resume-first)
    order, order_no = _waiting_after_preempting_a_decode(["A"])
    assert order == ["A0", "A1"] and order_no == 0


def test_one_user_behaves_as_vllms_fcfs():
    reqs = [T(r.rid, "u", r.arrival_s, r.prompt_tokens, r.output_tokens) for r in heavy_and_light()]
    reqs += [T(f"C{i}", "u", 0.5 + 0.01 * i, 60 + 7 * i, 40) for i in range(30)]
    ours = vc.run_vllm(reqs, make=lambda thr: fair())
    theirs = vc.run_vllm(reqs)
    assert ours.preemptions == theirs.preemptions > 0
    key = lambda run: sorted((t.rid, t.first_s, t.done_s) for t in run.timings)  # noqa: E731
    assert key(ours) == key(theirs) and ours.steps == theirs.steps


def test_requests_without_a_user_share_one_identity():
    s = fair()
    s.add_request(vreq("x", None, 10, 2))
    s.add_request(vreq("y", "", 10, 2))
    assert s._live == {bv.DEFAULT_USER: 2}


# ------------------------------------------------------------------------- isolation and the A/B burst

def test_isolation_admits_the_light_users_first_prefill_alone():
    s = fair()
    for i in range(8):
        s.add_request(vreq(f"A{i}", "A", 30, 20))
    s.add_request(vreq("B0", "B", 30, 20))
    out = s.schedule()
    assert admitted(out) == ["B0"] and s.num_isolated_steps == 1


def test_isolation_lets_running_decodes_sit_out_and_keeps_them():
    s = fair()
    produced = {}
    for i in range(8):
        s.add_request(vreq(f"A{i}", "A", 30, 20))
    step(s, produced)  # A alone: no light user
    s.add_request(vreq("B0", "B", 30, 20))
    out, _ = step(s, produced)
    assert list(out.num_scheduled_tokens) == ["B0"]
    assert [r.request_id for r in s.running] == [f"A{i}" for i in range(8)] + ["B0"]
    out, _ = step(s, produced)  # B0 has its token: everyone runs again
    assert len(out.num_scheduled_tokens) == 9


def test_seed_ab_burst_ratio_at_once_and_throughput():
    reqs = vc.ab_trace(0)
    f = vc.ab_ratios(partial(vc.run_vllm, make=vc.make_fair_scheduler), reqs, name="fair")
    v = vc.ab_ratios(vc.run_vllm, reqs, name="vllm")
    assert f.ratio("at once") <= 1.5 < v.ratio("at once")
    assert f.ratio("from submit") <= 1.5
    tf = vc.summarize(vc.run_vllm(reqs, make=vc.make_fair_scheduler)).throughput_tok_s
    tv = vc.summarize(vc.run_vllm(reqs)).throughput_tok_s
    assert tf >= 0.99 * tv


# ------------------------------------------------------------------------- where the user comes from

def test_user_of_reads_extra_args():
    assert bv.user_of(vreq("r", "alice", 5, 1)) == "alice"
    assert bv.user_of(vreq("r", None, 5, 1)) == bv.DEFAULT_USER


def test_with_user_takes_the_key_and_the_body_only_when_trusted():
    body = json.dumps({"prompt": "hi", "user": "mallory", "vllm_xargs": {"x": 1, "user": "alice"}}).encode()
    assert json.loads(bv.with_user(body, None, {}))["vllm_xargs"] == {"x": 1, "user": bv.DEFAULT_USER}
    assert json.loads(bv.with_user(body, None, {}, trust_user_field=True))["vllm_xargs"] == {"x": 1, "user": "mallory"}
    keys = {"sk-a": "alice"}
    assert json.loads(bv.with_user(body, "sk-a", keys))["vllm_xargs"]["user"] == "alice"
    assert json.loads(bv.with_user(body, "sk-zzz", keys))["vllm_xargs"]["user"] == bv.DEFAULT_USER
    spoof = json.dumps({"prompt": "hi", "vllm_xargs": {"user": "alice"}}).encode()
    assert json.loads(bv.with_user(spoof, None, keys))["vllm_xargs"]["user"] == bv.DEFAULT_USER
    assert json.loads(bv.with_user(b'{"prompt": "x"}', None, {}))["vllm_xargs"]["user"] == bv.DEFAULT_USER
    assert bv.with_user(b"not json", None, {}) == b"not json"


def test_middleware_rewrites_the_body_and_its_length():
    seen = {}

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"], seen["headers"] = msg["body"], dict(scope["headers"])

    body = json.dumps({"prompt": "hi"}).encode()
    chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
              {"type": "http.request", "body": body[5:], "more_body": False}]

    async def receive():
        return chunks.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"authorization", b"Bearer sk-b"), (b"content-length", str(len(body)).encode())]}
    asyncio.run(bv.UserMiddleware(app, api_keys={"sk-b": "bob"})(scope, receive, None))
    assert json.loads(seen["body"])["vllm_xargs"] == {"user": "bob"}
    assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()


def test_policy_from_env_reads_weights_and_tolerance(tmp_path):
    cfg = tmp_path / "users.json"
    cfg.write_text(json.dumps({"weights": {"alice": 3}, "api_keys": {"sk-a": "alice"}}))
    pol = bv.policy_from_env({bv.CONFIG_ENV: str(cfg), bv.TOLERANCE_ENV: "512"})
    assert pol.weight("alice") == 3 and pol.weight("bob") == 1 and pol.tolerance_tokens == 512
    assert bv.policy_from_env({}).weights == {}
    with pytest.raises(ValueError):
        bv.policy_from_env({bv.TOLERANCE_ENV: "lots"})


def test_the_class_loads_by_qualified_name_as_vllm_serve_does():
    v = vc._vllm()
    cfg = v.SchedulerConfig(max_model_len=512, is_encoder_decoder=False,
                            scheduler_cls="batch.integrations.vllm.FairScheduler")
    assert cfg.get_scheduler_cls() is bv.FairScheduler
