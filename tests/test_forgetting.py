"""Per-user state is bounded: VTC forgets an idle user whose counter is at or below the lift
floor, and forgetting changes no scheduling decision (``docs/fairness.md``, the lift floor).

The same workload runs twice, with ``VTCPolicy`` as it ships and with a ``VTCPolicy`` that
never forgets; every tick's plan (who runs, how many tokens, which blocks, who is admitted,
preempted, sits out) must be identical, and the forgetting run must hold counters only for the
users still in flight (or idle above the floor).
"""
from __future__ import annotations

import random

import pytest

from batch.policies.vtc import VTCPolicy
from conftest import ScriptedBackend, StepClock
from inference_stub import Request
from scheduler import Scheduler


class NeverForget(VTCPolicy):
    """VTC that keeps every user's counter for ever (the control): the same rules, no deletion."""

    def forget(self, user: str) -> None:
        return None


class PlanRecorder(Scheduler):
    """A scheduler that records each tick's plan as plain data (request ids and numbers)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.plans: list[tuple] = []

    def schedule(self):
        p = super().schedule()
        self.plans.append((tuple(s.rid for s in p.seqs), p.num_new_tokens, p.new_blocks, p.num_admitted,
                           tuple(s.rid for s in p.preempted), tuple(s.rid for s in p.sat_out),
                           p.blocked.rid if p.blocked is not None else None, p.admission_stop, p.isolated))
        return p


def churn_workload(seed: int, n_light: int = 300) -> list[tuple[int, Request, int]]:
    """``(tick, request, eos_at)``: two heavy users backlogged throughout and many light users
    (some returning later) arriving over the run: users go idle, are forgotten, and come back."""
    rnd = random.Random(seed)
    out = []
    for i in range(60):
        for u in ("heavy1", "heavy2"):
            out.append((i * 3, Request(user_id=u, prompt=[1] * rnd.randint(5, 120), max_tokens=rnd.randint(5, 40),
                                       request_id=f"{u}-{i}"), rnd.randint(0, 45)))
    for j in range(n_light):
        user = f"light{rnd.randint(0, n_light // 3)}"  # about three requests per light user, spread out
        out.append((rnd.randint(0, 400), Request(user_id=user, prompt=[2] * rnd.randint(3, 60),
                                                 max_tokens=rnd.randint(2, 12), request_id=f"l{j}"),
                    rnd.randint(0, 14)))
    return sorted(out, key=lambda x: x[0])


def run(policy: VTCPolicy, seed: int, cap_blocks: int) -> PlanRecorder:
    work = churn_workload(seed)
    backend = ScriptedBackend({r.request_id: e for _, r, e in work if e})
    s = PlanRecorder(policy=policy, backend=backend, clock=StepClock(), kv_cap_blocks=cap_blocks)
    i = tick = 0
    while i < len(work) or s.has_active():
        while i < len(work) and work[i][0] <= tick:
            s.submit(work[i][1])
            i += 1
        s.tick()
        tick += 1
        assert tick < 20_000
    return s


@pytest.mark.parametrize("seed,cap_blocks", [(0, 64), (1, 256), (2, 40)])
def test_forgetting_idle_users_changes_no_plan(seed: int, cap_blocks: int) -> None:
    forgetting, control = run(VTCPolicy(), seed, cap_blocks), run(NeverForget(), seed, cap_blocks)
    assert len(forgetting.plans) == len(control.plans)
    for k, (a, b) in enumerate(zip(forgetting.plans, control.plans)):
        assert a == b, f"tick {k}: forgetting planned {a}, the control {b}"
    assert forgetting.metrics()["output_tokens"] == control.metrics()["output_tokens"]


def test_forgetting_keeps_per_user_state_bounded() -> None:
    """After the churn every light user is idle: the forgetting run holds at most the counters of
    users idle above the floor (the heavy users, served last), the control holds one per user."""
    forgetting, control = run(VTCPolicy(), 0, 64), run(NeverForget(), 0, 64)
    users = {r.user_id for _, r, _ in churn_workload(0)}
    assert len(control.policy._counter) == len(users)  # the state whose size is the point
    kept = forgetting.policy._counter
    assert len(kept) <= 3, f"kept {len(kept)} of {len(users)} users' counters: {sorted(kept)[:10]}"
    assert all(c > forgetting.policy.floor for c in kept.values())
