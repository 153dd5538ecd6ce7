"""``bench/vllm_prefix_compare.py``: Batch's prefix caching beside vLLM's on Mooncake rows (issue 30,
part 5). Batch's side runs anywhere; the tests marked ``vllm`` run in ``.venv-vllm`` (``make test``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import vllm_prefix_compare as vpc  # noqa: E402

B = 512  # tokens per Mooncake hash id


def write_trace(folder: Path, rows, name: str = vpc.TRACES[0]) -> Path:
    p = folder / name
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + "\n"
                         for t, n, o, ids in rows))
    return p


#: Three rows on one 1,024-token prefix, each arriving after the previous finished, and one that
#: does not fit the 32,768-token cache.
ROWS = [(0, 3 * B, 4, [0, 1, 2]), (2000, 3 * B, 4, [0, 1, 3]), (4000, 2 * B + 5, 3, [0, 1, 4]),
        (4000, 64 * B + 1, 2, list(range(100, 165)))]


def test_rows_that_do_not_fit_the_cache_are_left_out_and_counted(tmp_path):
    reqs, left_out = vpc.load_requests(write_trace(tmp_path, ROWS), limit=None)
    assert [r.rid for r in reqs] == ["t0", "t1", "t2"] and left_out == 1
    assert reqs[0].prompt[:2 * B] == reqs[1].prompt[:2 * B] != reqs[0].prompt[2 * B:3 * B]
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 4.0]


def test_batch_hits_the_shared_prefix_of_each_later_row(tmp_path):
    reqs, _ = vpc.load_requests(write_trace(tmp_path, ROWS), limit=None)
    run = vpc.run_batch(reqs)
    assert run.queries == run.new_queries == 3 * B + 3 * B + 2 * B + 5
    assert run.hits == run.new_hits == 2 * (2 * B)  # rows 2 and 3 find the 1,024 shared tokens
    cold = vpc.run_batch(reqs, prefix_caching=False, name="cold")
    assert cold.hits == 0 and cold.hit_rate == 0
    ttft = {t.rid: t.first_s - t.arrival_s for t in run.run.timings}
    ttft_cold = {t.rid: t.first_s - t.arrival_s for t in cold.run.timings}
    assert ttft["t0"] == pytest.approx(ttft_cold["t0"]) and ttft["t1"] < ttft_cold["t1"]  # 16 chunks skipped


def test_batch_only_command_line(tmp_path):
    write_trace(tmp_path, ROWS)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_prefix_compare.py"), "--batch-only", "--cold",
                        "--only", "conversation", "--traces", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith(f"| `{vpc.TRACES[0]}` |")]
    assert [r.split("|")[2].strip() for r in rows] == ["Batch", "Batch (no prefix caching)"]
    assert "| 49.94% / 49.94% |" in rows[0] and "3 rows run, 1 left out" in p.stdout
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_prefix_compare.py"), "--batch-only",
                        "--traces", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "no Mooncake trace" in p.stderr


@pytest.mark.vllm
def test_vllm_hits_the_same_tokens_as_batch_on_sequential_rows(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    reqs, _ = vpc.load_requests(write_trace(tmp_path, ROWS), limit=None)
    v, b = vpc.run_vllm(reqs), vpc.run_batch(reqs)
    assert (v.new_queries, v.new_hits) == (b.new_queries, b.new_hits) == (8 * B + 5, 4 * B)
    off = vpc.run_vllm(reqs, prefix_caching=False)
    assert off.hits == off.queries == 0  # vLLM counts nothing with caching off


@pytest.mark.vllm
def test_side_by_side_command_line_on_a_small_shared_prefix_trace(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    # a row every 0.3 s: each finds the shared prefix computed (twins admitted in one step differ:
    # vLLM shares a block from the step that computes it, Batch from the step after; docs/prefix-caching.md)
    rows = [(300 * i, 4 * B, 6, [0, 1, 10 + i, 50 + i]) for i in range(9)]
    write_trace(tmp_path, rows)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_prefix_compare.py"), "--only", "conversation",
                        "--traces", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    got = {line.split("|")[2].strip(): line.split("|")[3] for line in p.stdout.splitlines()
           if line.startswith(f"| `{vpc.TRACES[0]}` |")}
    assert set(got) == {"Batch", "vLLM (thr 64, prefix caching)"}, p.stdout
    rates = {k: [float(x.strip(" %")) for x in v.split("/")] for k, v in got.items()}
    assert all(r[1] > 0 for r in rates.values())  # both found the shared 1,024 tokens
    assert abs(rates["Batch"][1] - rates["vLLM (thr 64, prefix caching)"][1]) <= 1.0 + 1e-9, rates


def test_batch_only_command_line_on_the_gpu_clock(tmp_path):
    """``--gpu h100-llama3-8b``: the realistic cache fits every row (the 33k-token one too), and
    Batch runs at both chunkings with the instrumented step counts."""
    write_trace(tmp_path, ROWS)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_prefix_compare.py"), "--batch-only", "--gpu",
                        "h100-llama3-8b", "--only", "conversation", "--traces", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith(f"| `{vpc.TRACES[0]}` |")]
    assert [r.split("|")[2].strip() for r in rows] == ["thr 0 / chunk 8192", "thr 64 / chunk 64"]
    assert all(r.split("|")[4].strip() == "Batch" for r in rows) and "4 rows run, 0 left out" in p.stdout
    assert "28,094 blocks" in p.stdout


def test_a_prefix_hit_shortens_the_first_token_on_the_gpu_clock(tmp_path):
    reqs, _ = vpc.load_requests(write_trace(tmp_path, ROWS[:2]), limit=None)
    h100 = vpc.vc.clock_for("h100-llama3-8b")
    warm = {t.rid: t for t in vpc.run_batch(reqs, clock=h100).run.timings}
    cold = {t.rid: t for t in vpc.run_batch(reqs, clock=h100, prefix_caching=False, name="cold").run.timings}
    assert warm["t0"].first_s == pytest.approx(cold["t0"].first_s)
    assert warm["t1"].first_s - warm["t1"].arrival_s < 0.5 * (cold["t1"].first_s - cold["t1"].arrival_s)


def test_the_unbounded_hit_rate_counts_leading_blocks_seen_before(tmp_path):
    reqs, _ = vpc.load_requests(write_trace(tmp_path, ROWS[:3]), limit=None)
    # rows 2 and 3 share the first 1,024 tokens of row 1; nothing else repeats
    assert vpc.unbounded_hit_rate(reqs) == pytest.approx(2 * (2 * B) / (3 * B + 3 * B + 2 * B + 5))
