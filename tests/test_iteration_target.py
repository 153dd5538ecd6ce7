"""The iteration target (``Isolation(iteration_target_s=...)``): while a light user is active,
iterations are trimmed to the target by sitting out over-served users' requests, in turns, never
more than ``spec.fairness_rules.target_sit_out_bound(K)`` iterations in a row for one request."""
import math
import random
import statistics

import pytest
from conftest import make_req

from batch.core.isolation import Isolation
from scheduler import Scheduler
from spec import fairness_rules as fr


class CostClock(Scheduler):
    """A scheduler on a virtual clock advanced by the stub's cost of each iteration (5 ms + 1 ms
    per request), recording every plan; ``arrive(t, req)`` queues a request for submission once
    the clock passes ``t``."""

    def __init__(self, **kw):
        self.t = 0.0
        self.plans = []
        self.arrivals = []
        super().__init__(clock=lambda: self.t, backend=self._forward, **kw)

    def schedule(self):
        plan = super().schedule()
        self.plans.append(plan)
        return plan

    def _forward(self, batch):
        self.t += 0.005 + 0.001 * len(batch)
        return [1 + len(r.generated) % 50 for r in batch]

    def run(self, limit=100_000):
        """Tick until every request arrived and finished; submit each at its arrival."""
        pending = sorted(self.arrivals, key=lambda x: x[0])
        for _ in range(limit):
            while pending and pending[0][0] <= self.t:
                self.submit(pending.pop(0)[1])
            if self.has_active():
                self.tick()
            elif pending:
                self.t = pending[0][0]
            else:
                return
        raise AssertionError("did not finish")


def _ab(seed, target_s, *, k=8):
    """100 requests of A and 5 of B arriving in one second (the seed problem's burst); returns
    the scheduler after the run and B's requests with their nominal arrivals."""
    rnd = random.Random(1000 + seed)
    s = CostClock(isolation=Isolation(iteration_target_s=target_s, max_sit_out_ticks=k))
    b = []
    for user, n in (("A", 100), ("B", 5)):
        for i in range(n):
            r = make_req(f"{user}{i}", user=user, n_prompt=rnd.randint(5, 199), max_tokens=rnd.randint(10, 99))
            at = rnd.uniform(0.0, 1.0)
            s.arrivals.append((at, r))
            if user == "B":
                b.append((at, r))
    s.run()
    return s, b


def _runs_of_sit_outs(plans):
    """The longest run of consecutive iterations each request sat out, per request id."""
    run, worst = {}, {}
    for p in plans:
        sat = {q.request_id for q in p.sat_out}
        for rid in sat:
            run[rid] = run.get(rid, 0) + 1
            worst[rid] = max(worst.get(rid, 0), run[rid])
        for e in p.batch:
            run[e.seq.request_id] = 0
    return worst


def test_target_trims_only_the_heavy_users_requests_while_a_light_user_is_active():
    s, b = _ab(0, 0.015)
    trimmed = [p for p in s.plans if p.trimmed]
    assert s.isolation.trimmed_ticks == len(trimmed) > 20
    assert all(not p.isolated for p in trimmed)
    assert {q.user_id for p in trimmed for q in p.sat_out} == {"A"}
    assert all(r.started_at is not None and r.completed_at is not None for _, r in b)
    # every trimmed iteration is within the target as the model predicts it, or down to one request
    model = s.isolation.model
    for p in trimmed:
        assert len(p.batch) == 1 or model.predict_s(len(p.batch), p.num_batched_tokens) <= 0.015 + 1e-6


def test_target_is_off_by_default_and_idle_without_a_light_user():
    assert Isolation().iteration_target_s is None
    s = CostClock(isolation=Isolation(iteration_target_s=0.010))
    for i in range(60):
        s.arrivals.append((i * 0.01, make_req(f"a{i}", user="A", n_prompt=100, max_tokens=40)))
    s.run()
    assert s.isolation.trimmed_ticks == 0  # one user: nobody is light, nothing to protect


@pytest.mark.parametrize("k", [1, 2, 8])
def test_a_request_sits_out_at_most_2k_iterations_in_a_row(k):
    s, _ = _ab(3, 0.008, k=k)
    assert s.isolation.trimmed_ticks > 0
    worst = max(_runs_of_sit_outs(s.plans).values())
    assert worst <= fr.target_sit_out_bound(k) == 2 * k


def test_trimmed_requests_take_turns():
    """A target near half an iteration: in back-to-back trimmed iterations the second cuts the
    requests that ran in the first (fewest sit-outs in a row first), not the same ones again."""
    s, _ = _ab(1, 0.02, k=8)
    both = again = 0
    for p, q in zip(s.plans, s.plans[1:]):
        if p.trimmed and q.trimmed:
            first, second = {x.request_id for x in p.sat_out}, {x.request_id for x in q.sat_out}
            both += 1
            again += len(first & second) > len(second) // 4
    assert both > 10 and again <= both // 10


def _b_ratio_from_arrival(seed, target_s):
    with_a = statistics.median(r.started_at - at for at, r in _ab(seed, target_s)[1])
    s = CostClock(isolation=Isolation(iteration_target_s=target_s))
    _, b = _ab(seed, target_s)
    s.arrivals = [(at, make_req(r.request_id, user="B", n_prompt=len(r.prompt), max_tokens=r.max_tokens))
                  for at, r in b]
    s.run()
    alone = statistics.median(r.started_at - at for at, r in s.arrivals)
    return with_a / alone


@pytest.mark.slow
def test_target_shortens_the_light_users_wait_timed_from_arrival():
    seeds = range(6)
    off = [_b_ratio_from_arrival(seed, None) for seed in seeds]
    on = [_b_ratio_from_arrival(seed, 0.015) for seed in seeds]
    assert statistics.median(on) < 0.85 * statistics.median(off)
    assert max(on) < max(off)


@pytest.mark.parametrize("kw", [{"iteration_target_s": 0}, {"iteration_target_s": -0.01},
                                {"iteration_target_s": math.nan}, {"iteration_target_s": math.inf},
                                {"iteration_target_s": True}, {"iteration_target_s": "15ms"},
                                {"active_window_s": -1.0}, {"active_window_s": math.nan}])
def test_bad_target_settings_raise(kw):
    with pytest.raises(ValueError):
        Isolation(**kw)


# ---------------------------------------------------------------- bench/target_sweep.py


def _target_sweep():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import target_sweep
    return target_sweep


def test_the_sweep_draws_the_cold_harness_workload():
    """``bench/target_sweep.py``'s A/B burst is the one ``bench/cold_fairness.py`` draws for the
    same seed (lengths, users, arrival order), so the two benchmarks' ratios are comparable."""
    ts = _target_sweep()
    rnd = random.Random(1000 + 4)
    want = []
    for user, n in (("A", 100), ("B", 5)):
        for i in range(n):
            prompt = [rnd.randint(1, 63) for _ in range(rnd.randint(5, 199))]
            want.append((f"{user}{i}", user, len(prompt), rnd.randint(10, 99)))
    arrivals = [rnd.uniform(0.0, 1.0) for _ in want]
    want = [w for _, w in sorted(zip(arrivals, want), key=lambda x: x[0])]
    got = [(r.rid, r.user, r.prompt_tokens, r.output_tokens) for r in ts.ab_trace(4)]
    assert got == want


def test_the_sweep_prints_a_row_per_setting_and_refuses_bad_flags(tmp_path, capsys):
    ts = _target_sweep()
    assert ts.main(["--seeds", "1", "--targets-ms", "15", "--traces", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " | " in line and "ms" in line.split("|")[0]
            or line.strip().startswith("off")]
    assert len(rows) == 2  # off and 15 ms
    for bad in (["--targets-ms", "0"], ["--targets-ms", "x"], ["--seeds", "0"], ["--window-s", "-1"]):
        with pytest.raises(SystemExit) as e:
            ts.main(bad)
        assert e.value.code == 2
