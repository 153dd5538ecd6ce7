"""FairScheduler's edges that tests/test_vllm_plugin.py did not reach: a reviewer who had not read
that file planted 20 bugs in batch/integrations/vllm.py and it caught 11 (2026-12-04); each test
here fails on one of the other 9 (named in its docstring) and passes on the code. Helpers and the
vLLM set-up are tests/test_vllm_plugin.py's."""
from test_vllm_plugin import RequestStatus, VTCPolicy, admitted, bv, fair, pytestmark, step, vc, vreq  # noqa: F401

def test_a_prompt_recomputed_after_a_mid_prefill_preemption_is_charged_once():
    """Planted: the high-water mark set to min(nc + k, P) instead of the running max."""
    pol = VTCPolicy(isolation=False); s = fair(pol); produced = {}
    s.kv_cache_manager.enable_caching = False  # the resume recomputes: no prefix-cache hit
    s.add_request(vreq("a", "A", 200, 3)); s.add_request(vreq("b", "B", 10, 30))
    total = 0
    for _ in range(2):  # a: 64-token chunks (b keeps the threshold on)
        _, c = step(s, produced); total += c.get("A", [0, 0])[0]
    r = s.requests["a"]; assert r.num_computed_tokens == 128
    s.running.remove(r); s._preempt_request(r, 0.0)
    while not produced.get("a"):
        _, c = step(s, produced); total += c.get("A", [0, 0])[0]
    assert total == 200

def test_making_room_preempts_only_users_over_their_share():
    """Planted: _make_room drawing victims from every running request."""
    s = fair(VTCPolicy(isolation=False)); produced = {}
    for i in range(4):
        s.add_request(vreq(f"A{i}", "A", 30, 50))
    s.add_request(vreq("B0", "B", 10, 50)); s.add_request(vreq("B1", "B", 10, 50))
    step(s, produced)  # B: 2 of 6 running, within its share; not light by blocks
    s.add_request(vreq("C0", "C", 30, 5))
    assert s._make_room(s.requests["C0"], 1)
    running = [r.request_id for r in s.running]
    assert {"B0", "B1"} <= set(running) and len(running) == 5

def test_the_body_user_is_trusted_only_with_the_flag_set_to_1(monkeypatch):
    """Planted: the flag read as bool(env), so =0 trusts the body."""
    for val, want in (("1", True), ("0", False), ("", False), ("true", False)):
        monkeypatch.setenv(bv.TRUST_USER_FIELD_ENV, val)
        assert bv.UserMiddleware(lambda *a: None, api_keys={}).trust_user_field is want

def test_a_normal_step_resets_the_isolation_streak():
    """Planted: the streak not reset on a step that is not isolated."""
    s = fair(); produced = {}
    for i in range(4):
        s.add_request(vreq(f"A{i}", "A", 30, 20))
    s._streak = 5
    step(s, produced)  # one user: not isolated
    assert s._streak == 0

def test_aborts_before_the_first_token_leave_no_per_user_state():
    """Planted: _free_request leaving _first_pending counts behind."""
    s = fair(VTCPolicy(isolation=False)); produced = {}
    for i in range(3):
        s.add_request(vreq(f"a{i}", "A", 200, 5))
    s.add_request(vreq("b0", "B", 30, 5))
    step(s, produced)
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert s._first_pending == {} and not s._prefilling and s._user == {}

def test_a_user_above_half_its_share_is_not_light():
    """Planted: light at the full share instead of half."""
    s = fair()
    for i in range(8):
        s.add_request(vreq(f"A{i}", "A", 30, 20))
    for i in range(3):
        s.add_request(vreq(f"B{i}", "B", 30, 20))  # 3 of 11: above half of B's share (2.75)
    out = s.schedule()
    assert s.num_isolated_steps == 0 and len(admitted(out)) == 11

def test_no_isolated_step_after_k_in_a_row():
    """Planted: MAX_SIT_OUT_TICKS + 1 isolated steps in a row."""
    from scheduler import MAX_SIT_OUT_TICKS as K
    s = fair(); produced = {}
    for i in range(8):
        s.add_request(vreq(f"A{i}", "A", 30, 20))
    step(s, produced)
    s.add_request(vreq("B0", "B", 30, 20))
    s._streak = K
    out, _ = step(s, produced)
    assert len(out.num_scheduled_tokens) == 9 and s.num_isolated_steps == 0

def test_an_empty_user_string_is_the_shared_identity():
    """Planted: an empty user its own identity (vreq passes no extra_args for a falsy user, so this builds the request itself)."""
    v = vc._vllm()
    sp = v.SamplingParams(max_tokens=2, extra_args={"user": ""})
    sp.update_from_generation_config({}, eos_token_id=vc.VLLM_EOS)
    r = v.VRequest(request_id="y", prompt_token_ids=[1] * 5, sampling_params=sp, pooling_params=None, arrival_time=0.0)
    assert bv.user_of(r) == bv.DEFAULT_USER

def test_an_isolated_step_never_runs_more_than_max_num_seqs():
    """Planted: max_num_active_reqs not lowered by the requests that sit out."""
    s = fair(); produced = {}
    for i in range(vc.VLLM_MAX_SEQS - 2):
        s.add_request(vreq(f"A{i}", "A", 10, 50))
    step(s, produced); step(s, produced)
    for i in range(6):
        s.add_request(vreq(f"B{i}", "B", 10, 50))
    for _ in range(4):
        step(s, produced)
        assert len(s.running) <= vc.VLLM_MAX_SEQS
