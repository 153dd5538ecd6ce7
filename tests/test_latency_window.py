"""``Scheduler(max_latency_samples=N)`` (``MetricsRecorder``'s ``max_samples``): a long-running
server keeps only a window of per-request latencies, so its memory does not grow with the
requests it served (issue 28: 100,000 one-request users), while the counts stay exact and the
runtime invariants (which compare the recorder with the rules every tick) still hold."""
from __future__ import annotations

import pytest

from batch.core.metrics import MetricsRecorder
from inference_stub import Request
from scheduler import Scheduler


def finish(m: MetricsRecorder, i: int) -> None:
    m.on_finish(reason="stop", submitted_s=0.0, first_token_s=i * 0.1, admitted_s=i * 0.01,
                completed_s=i * 1.0 + 1.0, prompt_tokens=3, output_tokens=2)


def test_the_window_keeps_the_latest_samples_and_counts_every_request():
    m = MetricsRecorder(max_samples=10)
    for i in range(1000):
        finish(m, i)
    assert 10 <= len(m.e2e_s) <= 20 and len(m.queue_s) == len(m.ttft_s) == len(m.tpot_s) == len(m.e2e_s)
    assert list(m.e2e_s)[-1] == 1000.0  # the newest is kept
    assert m.queue_dropped + len(m.queue_s) == 1000  # what the server's queue histogram reads past
    s = m.summary(kv_blocks_in_use=0, kv_cap_blocks=1, waiting=0, running=0)
    assert s["requests_finished"] == 1000 and s["output_tokens"] == 2000
    assert s["e2e_p50_s"] > 900  # over the window: the latest requests


def test_without_a_window_every_sample_is_kept():
    m = MetricsRecorder()
    for i in range(300):
        finish(m, i)
    assert len(m.e2e_s) == 300 and m.queue_dropped == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, "10"])
def test_a_bad_window_is_refused(bad):
    with pytest.raises(ValueError, match="max_samples"):
        MetricsRecorder(max_samples=bad)


def test_a_scheduler_with_a_window_passes_its_invariants_every_tick():
    s = Scheduler(max_latency_samples=3, check_invariants=True, clock=iter(range(10**6)).__next__)
    for i in range(40):
        s.submit(Request(user_id=f"u{i % 7}", prompt=[1, 2, 3], max_tokens=2 + i % 3, request_id=f"r{i}"))
        s.tick()
    while s.has_active():
        s.tick()
    m = s.metrics()
    assert m["requests_finished"] == 40 and len(s.state.stats.e2e_s) <= 6
