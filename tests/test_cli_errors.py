"""Bad input to the main job ends with one error line, never a traceback or a hang (issues 15, 26).

``python -m batch`` runs in a subprocess with a timeout, so an input that used to loop for ever
(a trace row with ``arrival_s=nan``) fails the test instead of hanging it. The trace loader and
``run_workload`` are also checked directly: a non-finite or negative arrival is a ``ValueError``
naming where it came from. A bad argument is one ``batch: error:`` line, no usage block; a
workload of no requests says there was nothing to run; the progress bar shows on a terminal once
a run lasts 2 s.
"""
from __future__ import annotations

import math
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

import request_gen
from batch.sim import simulate, traces
from conftest import NOT_APPLICABLE

ROOT = Path(__file__).resolve().parent.parent
HEADER = "arrival_s,prompt_tokens,output_tokens,user_id\n"
GOOD_ROWS = "0,10,5,\n0.5,20,8,\n"


def write_trace(tmp_path: Path, bad_row: str, name: str = "trace.csv") -> Path:
    """A trace in the normalised format: two valid rows, then ``bad_row`` on line 4."""
    path = tmp_path / name
    path.write_text(HEADER + GOOD_ROWS + bad_row + "\n")
    return path


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """``python -m batch ARGS`` from the repository root; the timeout turns a hang into a failure."""
    return subprocess.run([sys.executable, "-m", "batch", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str, prog: str = "batch") -> None:
    """Exit status 2, nothing on stdout; stderr is one ``batch: error:`` line naming ``words``
    and nothing else (no usage block)."""
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def run_cli_on_a_terminal(*args: str, timeout_s: float = 60) -> tuple[int, str, str]:
    """``python -m batch ARGS`` with stderr on a pseudo-terminal (as in a shell) and stdout piped:
    ``(exit status, stdout, what the terminal showed)``."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "batch", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=slave, text=True)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out = proc.stdout.read()
    return proc.wait(timeout=timeout_s), out, shown.decode(errors="replace")


# ---- the trace loader ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "NaN"])
def test_load_trace_refuses_non_finite_or_negative_arrival(tmp_path, value):
    path = write_trace(tmp_path, f"{value},10,5,")
    with pytest.raises(ValueError, match=r"line 4: arrival_s .*" + value):
        traces.load_trace(path)


def test_load_trace_error_names_the_file(tmp_path):
    path = write_trace(tmp_path, "nan,10,5,", name="with_nan.csv")
    with pytest.raises(ValueError, match="with_nan.csv"):
        traces.load_trace(path)


def test_load_trace_refuses_an_arrival_that_time_scale_makes_infinite(tmp_path):
    path = write_trace(tmp_path, "1e308,10,5,")
    with pytest.raises(ValueError, match="line 4"):
        traces.load_trace(path, time_scale=10.0)


@pytest.mark.parametrize("row, shown", [("1,0,5,", "prompt_tokens=0"), ("1,10,0,", "output_tokens=0"),
                                        ("1,0,0,", "prompt_tokens=0, output_tokens=0")])
def test_load_trace_refuses_a_row_no_request_could_have(tmp_path, row, shown):
    # An empty prompt or a request for no token loaded, and every such request was then refused
    # at submit: the run exited 0 with a table of zeros. Now the loader names the file and line.
    path = write_trace(tmp_path, row, name="zeros.csv")
    with pytest.raises(ValueError, match=rf"zeros.csv: line 4: no request can have this row.*{shown}"):
        traces.load_trace(path)


@pytest.mark.parametrize("field", ["input_length", "output_length"])
def test_load_mooncake_refuses_a_zero_length(tmp_path, field):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}'
    row = {"input_length": '{"timestamp": 5, "input_length": 0, "output_length": 5, "hash_ids": []}',
           "output_length": '{"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [0]}'}[field]
    path = tmp_path / "zeros.jsonl"
    path.write_text(good + "\n" + row + "\n")
    with pytest.raises(ValueError, match=rf"zeros.jsonl: line 2: .*lengths >= 1.*{field}=0"):
        traces.load_trace(path)


@pytest.mark.parametrize("time_scale", [math.nan, math.inf])
def test_load_trace_refuses_non_finite_time_scale(tmp_path, time_scale):
    path = write_trace(tmp_path, "1,10,5,")
    with pytest.raises(ValueError, match="time_scale"):
        traces.load_trace(path, time_scale=time_scale)


# ---- run_workload --------------------------------------------------------------------------


RUN_WORKLOAD_SCRIPT = """
from batch.sim.simulate import run_workload
from inference_stub import Request
reqs = [Request(user_id="u1", prompt=[1, 2, 3], max_tokens=2, request_id="ok", submitted_at=0.0),
        Request(user_id="u1", prompt=[1, 2, 3], max_tokens=2, request_id="bad", submitted_at=float({offset!r}))]
try:
    run_workload(reqs, virtual=True, max_ticks=1000)
except ValueError as e:
    print("ValueError:", e)
print("started_at of ok:", reqs[0].started_at)
"""


@pytest.mark.parametrize("offset", ["nan", "inf", "-1"])
def test_run_workload_refuses_non_finite_or_negative_offset_before_running(offset):
    # In a subprocess with a timeout: before the check, a nan offset looped for ever in-process.
    proc = subprocess.run([sys.executable, "-c", RUN_WORKLOAD_SCRIPT.format(offset=offset)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first.startswith("ValueError:") and "'bad'" in first, proc.stdout
    assert second == "started_at of ok: None"  # refused before anything ran


# ---- python -m batch from the command line -------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_cli_trace_with_bad_arrival_is_one_line_error(tmp_path, value):
    path = write_trace(tmp_path, f"{value},10,5,")
    assert_one_line_error(run_cli("--trace", str(path)), "arrival_s", "line 4", value)


def test_cli_trace_with_negative_token_count_is_one_line_error(tmp_path):
    path = write_trace(tmp_path, "1,-3,5,")  # was read as an empty prompt and run
    assert_one_line_error(run_cli("--trace", str(path)), "line 4", "prompt_tokens=-3")


def test_cli_trace_with_a_zero_token_count_is_one_line_error(tmp_path):
    path = write_trace(tmp_path, "1,0,5,")  # was run: every request refused, a table of zeros, exit 0
    assert_one_line_error(run_cli("--trace", str(path)), "line 4", "prompt_tokens=0")


def test_cli_trace_directory_is_one_line_error(tmp_path):
    assert_one_line_error(run_cli("--trace", str(tmp_path)), str(tmp_path), "directory")


@pytest.mark.slow
def test_cli_model_nowhere_is_one_line_error(tmp_path):
    pytest.importorskip("torch")
    nowhere = tmp_path / "no_such_checkpoint"
    assert_one_line_error(run_cli("--backend", "model", "--model", str(nowhere)), str(nowhere), "checkpoint")


@pytest.mark.slow
def test_cli_nonsense_device_is_one_line_error():
    pytest.importorskip("torch")
    assert_one_line_error(run_cli("--backend", "model", "--device", "foo"), "'foo'", "device")


@pytest.mark.slow
def test_cli_cuda_without_cuda_is_one_line_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip(NOT_APPLICABLE + "this machine has CUDA")
    assert_one_line_error(run_cli("--backend", "model", "--device", "cuda"), "'cuda'", "CUDA")


@pytest.mark.parametrize("device", ["foo", "cuda:x", "", "meta"])
def test_resolve_device_refuses_names_that_are_no_usable_device(device):
    pytest.importorskip("torch")
    from batch.backends import model_backend  # the optional 'model' extra

    with pytest.raises(model_backend.DeviceError, match=repr(device)):
        model_backend.resolve_device(device)
    assert issubclass(model_backend.DeviceError, ValueError)


@pytest.mark.parametrize("args,words", [
    (("--bogus",), ("unrecognized arguments: --bogus",)),
    (("--n", "x"), ("--n", "'x'")),
    (("--n", "-1"), ("--n", "'-1'")),
    (("--clock", "fast"), ("--clock", "'fast'")),
    (("--backend", "model", "--clock", "virtual"), ("--backend model", "real clock")),
])
def test_a_bad_argument_is_one_line_naming_batch_without_the_usage_block(args, words):
    assert_one_line_error(run_cli(*args), *words)


def test_the_batch_sim_subcommand_names_itself_in_its_one_error_line(capsys):
    from batch import commands

    with pytest.raises(SystemExit) as e:
        commands.main(["sim", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "batch-llm sim: error: unrecognized arguments: --bogus\n"


def test_help_still_prints_the_usage_under_the_name_batch():
    proc = run_cli("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: batch "), proc.stdout


@pytest.mark.parametrize("args,why", [
    (("--n", "0"), "--n 0 asks for no requests"),
    (("--n", "0", "--json"), "--n 0 asks for no requests"),
    (("--trace", "TRACE", "--limit", "0"), "--limit 0 asks for no trace rows"),
    (("--trace", "EMPTY"), "has no rows"),
])
def test_no_requests_says_there_was_nothing_to_run_and_exits_0(tmp_path, args, why):
    trace, empty = write_trace(tmp_path, "1,10,5,"), tmp_path / "empty.csv"
    empty.write_text(HEADER)
    args = [{"TRACE": str(trace), "EMPTY": str(empty)}.get(a, a) for a in args]
    proc = run_cli(*args)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout  # no table of zeros, no JSON of them
    assert proc.stderr.startswith("batch: nothing to run: ") and why in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


# ---- the progress bar --------------------------------------------------------------------------


def test_run_workload_shows_no_bar_for_a_run_shorter_than_the_delay(capsys):
    simulate.run_workload(request_gen.stream(n=5, lam=50.0, seed=1), virtual=True, progress=True)
    assert capsys.readouterr().err == ""


def test_run_workload_shows_the_bar_once_the_delay_has_passed(capsys, monkeypatch):
    monkeypatch.setattr(simulate, "PROGRESS_DELAY_S", 0.0)
    simulate.run_workload(request_gen.stream(n=5, lam=50.0, seed=1), virtual=True, progress=True)
    assert "5/5" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_of_more_than_2_s_shows_the_bar_on_a_terminal():
    """20 requests at 5 a second on the real-time stub: the last arrives 3.3 s in."""
    assert max(r.submitted_at for r in request_gen.stream(n=20, lam=5.0, seed=42)) > 3
    status, out, shown = run_cli_on_a_terminal("--n", "20", "--rate", "5")
    assert status == 0 and out.startswith("Batch on request_gen.stream(n=20"), out
    assert "20/20" in shown and "req/s" in shown, shown


def test_a_short_run_shows_no_bar_on_a_terminal():
    status, out, shown = run_cli_on_a_terminal("--clock", "virtual", "--n", "5")
    assert status == 0 and "requests finished                  5" in out
    assert shown == "", shown


@pytest.mark.slow
def test_a_run_of_more_than_2_s_shows_no_bar_when_stderr_is_not_a_terminal():
    proc = subprocess.run([sys.executable, "-m", "batch", "--n", "20", "--rate", "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_a_reader_closing_the_output_early_ends_the_run_quietly():
    """``python -m batch | head -1``: the rest of the output has nowhere to go; no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "batch", "--no-progress", "--clock", "virtual", "--n", "20"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = p.stdout.readline()
    p.stdout.close()  # as `head -1` does
    err = p.stderr.read()
    assert p.wait(timeout=60) == 0 and first.startswith("Batch on")
    assert "Traceback" not in err and "BrokenPipe" not in err, err
