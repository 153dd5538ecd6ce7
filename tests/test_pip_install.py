"""tools/pip_install.py: ``make test``'s build of ``.venv-vllm`` prints no line that reads as a
failure when nothing failed (issue 37). pip's resolver report on the packages installed
``--no-deps`` becomes one note line; a report line on any other package, and pip's exit status,
come through."""
from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import pip_install

HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
          "installed. This behaviour is the source of the following dependency conflicts.")
# What pip 24-26 printed for bench/requirements-vllm.txt (three of its 45 lines), and one more.
EXPECTED = ["xgrammar 0.2.8 requires triton; platform_system == \"Linux\" and platform_machine == \"x86_64\", "
            "which is not installed.",
            "vllm 0.33.0 requires blake3, which is not installed.",
            "vllm 0.33.0 requires torch==2.14.0, but you have torch 2.13.0+cpu which is incompatible."]
OTHER = "fastapi 0.136.0 requires starlette<0.50, but you have starlette 0.51.0 which is incompatible."


def fake_pip(tmp_path, lines, status=0):
    """A command printing ``lines`` (half on stderr) and exiting with ``status``."""
    script = tmp_path / "fake_pip.py"
    script.write_text("import sys\n" + "".join(
        f"print({line!r}, file=sys.{'stderr' if i % 2 else 'stdout'}, flush=True)\n" for i, line in enumerate(lines))
        + f"raise SystemExit({status})\n")
    return [sys.executable, str(script)]


def run_tool(tmp_path, lines, status=0):
    log = tmp_path / "unmet.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "pip_install.py"), "--no-deps-file",
                           str(ROOT / "bench" / "requirements-vllm-nodeps.txt"), "--log", str(log), "--",
                           *fake_pip(tmp_path, lines, status)], capture_output=True, text=True, timeout=60)
    return proc, log


def test_the_expected_report_becomes_one_note_line_and_the_list_goes_to_the_log(tmp_path):
    proc, log = run_tool(tmp_path, ["Collecting nothing", HEADER, *EXPECTED])
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout.splitlines()
    assert out[0] == "Collecting nothing" and len(out) == 2
    assert out[1].startswith("note: pip lists 3 requirements of vllm 0.33.0, xgrammar 0.2.8 as unmet: expected")
    assert not any(re.search(r"\b(ERROR|[Ee]rror|FAIL|[Ff]ail)", line) for line in out)
    assert log.read_text().splitlines() == EXPECTED


def test_a_conflict_of_another_package_is_printed_under_pips_header(tmp_path):
    proc, log = run_tool(tmp_path, [HEADER, EXPECTED[1], OTHER, EXPECTED[2], "Successfully installed x"])
    out = proc.stdout.splitlines()
    assert out[:3] == [HEADER, OTHER, "Successfully installed x"]
    assert out[3].startswith("note: pip lists 2 requirements of vllm 0.33.0")
    assert log.read_text().splitlines() == [EXPECTED[1], EXPECTED[2]]


def test_pips_exit_status_and_its_other_lines_come_through(tmp_path):
    proc, log = run_tool(tmp_path, ["ERROR: No matching distribution found for vllm==9"], status=1)
    assert proc.returncode == 1 and proc.stdout.splitlines() == ["ERROR: No matching distribution found for vllm==9"]
    assert not log.exists()


def test_the_names_are_read_from_the_no_deps_file_as_pip_compares_them(tmp_path):
    reqs = tmp_path / "r.txt"
    reqs.write_text("# a comment\nvllm==0.33.0\nApache_TVM.ffi>=0.1  # why\n\n")
    assert pip_install.no_deps_names(reqs) == {"vllm", "apache-tvm-ffi"}
    shown, dropped = pip_install.filter_report([HEADER, "apache-tvm-ffi 0.1.11 requires x, which is not installed."],
                                               pip_install.no_deps_names(reqs))
    assert shown == [] and len(dropped) == 1


def test_the_makefile_builds_the_vllm_venv_through_it():
    recipe = (ROOT / "Makefile").read_text().split("$(VLLM_STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "tools/pip_install.py --no-deps-file bench/requirements-vllm-nodeps.txt" in recipe
    assert "-- $(VLLM_PIP) -r bench/requirements-vllm.txt" in recipe
