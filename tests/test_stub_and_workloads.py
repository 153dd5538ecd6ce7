"""The simulated GPU's added modes, the workload generators and the main job."""
import pytest
from conftest import ROOT, make_req

import inference_stub
import request_gen
from batch import cli
from batch.core.kv_cache import BlockPool, BlockPoolError
from batch.sim import simulate, traces
from inference_stub import Request, SimulatedGPU, VirtualClock


def test_virtual_clock_advances_by_latency_model_and_never_sleeps():
    clock = VirtualClock()
    gpu = SimulatedGPU(clock=clock, seed=1)
    batch = [make_req(f"r{i}") for i in range(7)]
    toks = gpu.forward(batch)
    assert len(toks) == 7 and clock.now() == pytest.approx(0.005 + 0.007)
    assert gpu.forward([]) == [] and clock.now() == pytest.approx(0.012)
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_seeded_tokens_do_not_depend_on_batch_mates():
    a1, a2 = make_req("a", max_tokens=50), make_req("a", max_tokens=50)
    g1, g2 = SimulatedGPU(seed=3, clock=VirtualClock()), SimulatedGPU(seed=3, clock=VirtualClock())
    for _ in range(20):
        a1.generated.append(g1.forward([a1])[0])
        others = [make_req(f"x{i}") for i in range(5)]
        a2.generated.append(g2.forward(others + [a2])[-1])
    assert a1.generated == a2.generated
    assert SimulatedGPU(seed=4, clock=VirtualClock()).forward([make_req("a", max_tokens=50)]) != []


def test_stub_rule_forces_eos_at_max_tokens_minus_one_and_probability_parameter():
    gpu = SimulatedGPU(seed=0, eos_probability=0.0, clock=VirtualClock())
    r = make_req("a", max_tokens=6)
    while not r.generated or r.generated[-1] != 0:
        r.generated.append(gpu.forward([r])[0])
    assert len(r.generated) == 6 and 0 not in r.generated[:-1]
    always = SimulatedGPU(seed=0, eos_probability=1.0, clock=VirtualClock())
    assert always.forward([make_req("b", max_tokens=50)]) == [0]
    with pytest.raises(ValueError):
        SimulatedGPU(eos_probability=1.5)


def test_stream_contract():
    rs = request_gen.stream()
    assert len(rs) == 50 and [r.request_id for r in rs[:2]] == ["r0", "r1"]
    assert all(5 <= len(r.prompt) <= 199 and 10 <= r.max_tokens <= 99 for r in rs)
    assert all(1 <= t <= 63 for r in rs for t in r.prompt)
    assert [r.submitted_at for r in rs] == sorted(r.submitted_at for r in rs)
    assert {r.user_id for r in rs} <= {"u1", "u2", "u3", "u4", "u5"}
    assert [r.prompt for r in request_gen.stream(n=5, seed=9)] == [r.prompt for r in request_gen.stream(n=5, seed=9)]


def test_load_trace_keeps_lengths_and_arrivals(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens,user_id\n0,10,5,\n0.5,4000,3,alice\n2.0,20,7,\n")
    rs = traces.load_trace(p, time_scale=2.0, users=3, seed=1)
    assert [len(r.prompt) for r in rs] == [10, 4000, 20]
    assert [r.max_tokens for r in rs] == [5, 3, 7]
    assert [r.submitted_at for r in rs] == [0.0, 1.0, 4.0]
    assert rs[1].user_id == "alice" and rs[0].user_id in {"u1", "u2", "u3"}
    assert len(traces.load_trace(p, limit=2)) == 2
    (tmp_path / "bad.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,x,5\n")
    with pytest.raises(ValueError, match="line 2"):
        traces.load_trace(tmp_path / "bad.csv")
    with pytest.raises(FileNotFoundError):
        traces.load_trace(tmp_path / "missing.csv")


def test_load_trace_reads_a_user_column(tmp_path):
    # The anchor traces (data/traces/anchors/) name the column ``user``, not ``user_id``.
    p = tmp_path / "anchor.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens,user\n0.1,10,5,A\n0.2,20,7,B\n0.3,30,9,\n")
    rs = traces.load_trace(p, users=3, seed=1)
    assert [r.user_id for r in rs[:2]] == ["A", "B"]
    assert rs[2].user_id in {"u1", "u2", "u3"}  # an empty one is drawn, as for user_id
    both = tmp_path / "both.csv"  # user_id wins where both columns have a value
    both.write_text("arrival_s,prompt_tokens,output_tokens,user_id,user\n0,10,5,alice,A\n0,10,5,,B\n")
    assert [r.user_id for r in traces.load_trace(both)] == ["alice", "B"]


def test_a_trace_of_the_repository_loads_by_name(monkeypatch):
    monkeypatch.delenv(traces.TRACES_ENV, raising=False)
    rs = traces.load_trace("norm_azure2023_code.csv", limit=50)
    assert len(rs) == 50 and rs[0].submitted_at == 0.0


def test_traces_folder_is_the_flag_then_the_setting_then_data_traces_in_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv(traces.TRACES_ENV, raising=False)
    monkeypatch.chdir(ROOT / "tests")  # anywhere inside the checkout: its root is found upward
    assert traces.project_root() == ROOT
    assert traces.traces_dir() == ROOT / "data" / "traces"
    monkeypatch.setenv(traces.TRACES_ENV, str(tmp_path))
    assert traces.traces_dir() == tmp_path
    assert traces.traces_dir(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv(traces.TRACES_ENV)
    monkeypatch.chdir(tmp_path)  # outside any checkout: the one holding the package (an editable install)
    assert traces.project_root() is None and traces.traces_dir() == ROOT / "data" / "traces"


def test_a_trace_name_is_looked_up_in_the_setting_or_the_given_folder(monkeypatch, tmp_path, capsys):
    header = "arrival_s,prompt_tokens,output_tokens,user_id\n"
    (tmp_path / "mine.csv").write_text(header + "0,10,5,\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.csv").write_text(header + "0,10,7,\n0,10,7,\n")
    monkeypatch.setenv(traces.TRACES_ENV, str(tmp_path))
    assert [r.max_tokens for r in traces.load_trace("mine.csv")] == [5]
    assert [r.max_tokens for r in request_gen.load_trace("mine.csv")] == [5]  # its old home still works
    assert [r.max_tokens for r in traces.load_trace("mine.csv", trace_dir=other)] == [7, 7]
    assert cli.main(["--trace", "mine.csv", "--trace-dir", str(other), "--no-progress"]) == 0
    assert "trace mine.csv (2 requests" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match=traces.TRACES_ENV):
        traces.load_trace("absent.csv")


def test_run_workload_virtual_completes_and_counts_refusals():
    reqs = request_gen.stream(n=60, lam=50.0, seed=5)
    reqs.append(Request(user_id="u9", prompt=[1] * 5000, max_tokens=3, request_id="huge", submitted_at=0.1))
    res = simulate.run_workload(reqs, virtual=True, gpu_seed=0)
    m = res.scheduler.metrics()
    assert len(res.finished) == 60 and [r.request_id for r, _ in res.refused] == ["huge"]
    assert m["refusals"] == 1 and m["refusals_by_reason"] == {"PromptTooLongError": 1}
    assert 0 < res.busy_s <= res.sim_s
    assert m["throughput_tokens_per_sec"] > 0


def test_virtual_run_is_reproducible():
    def once():
        res = simulate.run_workload(request_gen.stream(n=40, lam=30.0, seed=2), virtual=True, gpu_seed=7)
        return [(r.request_id, r.generated, r.completed_at) for r in res.finished]
    assert once() == once()


def test_main_job_prints_metrics(capsys, tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens,user_id\n0,10,5,\n0.01,5000,3,\n0.02,100,7,\n")
    assert cli.main(["--trace", str(p), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "requests finished" in out and "PromptTooLongError" in out
    assert cli.main(["--n", "5", "--rate", "100", "--clock", "virtual"]) == 0
    assert "throughput" in capsys.readouterr().out


def test_block_pool_check_then_act_and_integrity():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(a) == 3 and pool.num_free == 1 and pool.allocate(2) is None and pool.num_free == 1
    pool.check([a])
    with pytest.raises(BlockPoolError):
        pool.free([a[0], a[0]])
    pool.free(a)
    assert pool.num_free == 4 and pool.allocate(0) == []
    with pytest.raises(BlockPoolError):
        pool.free([0])
    b = pool.allocate(4)
    pool.free(b)
    pool.reclaim(b[:2])
    assert pool.num_used == 2
    with pytest.raises(BlockPoolError):
        pool.reclaim(b[:1])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_kv_blocks_for_matches_spec_rule():
    from spec.rules import blocks_for
    for n in range(1, 100):
        r = make_req("a", n_prompt=n)
        assert inference_stub.kv_blocks_for(r) == blocks_for(n, 16)
