"""Review of ``VTCPolicy(resume_decodes_first=True)``: findings as failing-first tests."""
from __future__ import annotations

from conftest import ScriptedBackend, StepClock, make_req

from policy import VTCPolicy
from scheduler import Scheduler


def _light_user_ttft_ticks(resume_decodes_first: bool) -> tuple[int, int]:
    """40 requests of user A (15-token prompts, 60 output tokens) grow into a second block in
    the same tick and preempt each other in a 48-block cache; user L's 10-token request arrives
    3 ticks in. Returns (preempted decodes waiting when L arrives, ticks to L's first token)."""
    s = Scheduler(backend=ScriptedBackend(), clock=StepClock(), kv_cap_blocks=48,
                  policy=VTCPolicy(resume_decodes_first=resume_decodes_first))
    for i in range(40):
        s.submit(make_req(f"a{i}", user="A", n_prompt=15, max_tokens=60))
    light = make_req("L", user="L", n_prompt=10, max_tokens=3)
    waiting_decodes = 0
    for t in range(500):
        if t == 3:
            s.submit(light)
            waiting_decodes = sum(1 for q in s.policy.admission_order() if q.req.generated)
        s.tick()
        if light.generated:
            return waiting_decodes, t - 3 + 1
    raise AssertionError("L got no token in 500 ticks")


def test_isolation_sees_a_light_user_behind_more_preempted_decodes_than_it_peeks_at():
    # Isolation looks at the first 16 waiting candidates; with resume_decodes_first those were
    # all of A's preempted decodes, so L was never protected and waited for A's backlog (69 ticks).
    waiting_decodes, ticks = _light_user_ttft_ticks(True)
    assert waiting_decodes >= 16  # more than isolation's peek window
    assert ticks <= 2
    assert _light_user_ttft_ticks(False)[1] <= 2
