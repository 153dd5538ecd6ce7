"""The traces live in the repository, and nothing points outside it by default (issue 37).

* ``data/traces`` holds every trace the code and the docs name, each listed in its README with
  its sha256; the normalised copies are their originals converted as the README says, and the
  anchor traces are the seeded draws it describes.
* No default path in the code, the Makefile or ``pyproject.toml`` leaves the repository: no string
  literal (docstrings aside) holds ``../``, ``~/``, an absolute path under a data or home folder,
  or a ``shared/traces``-like path, no code climbs above the root (``ROOT.parent``), and the
  traces folders the main job and the bench scripts use when nothing is set are inside it. A clone
  with nothing beside it runs ``make run`` and ``make test`` (``tests/conftest.py``'s
  ``BATCH_REQUIRE_ALL`` turns a missing trace into a failure, not a skip).
"""
from __future__ import annotations

import ast
import csv
import datetime as dt
import hashlib
import json
import random
import re
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest
import vllm_compare as vc  # bench/vllm_compare.py (tests/conftest.py puts bench/ on sys.path)

from batch.sim import traces
from conftest import ROOT

TRACES = ROOT / "data" / "traces"
#: What a default path must not hold: a step up (``../``), a home (``~/``), an absolute path under a
#: folder of this or another machine, or the old traces folder beside the checkout (``shared/traces``).
OUTSIDE_RE = re.compile(r"(?:^|[\s\"'=:(,])(?:\.\./|~/)|^/(?:work|home|data|mnt|srv|opt|Users|root|var|usr|etc|tmp)\b"
                        r"|\bshared/(?:traces|guides|mission|checks)\b")
#: The names the code gives the repository's root: ``ROOT.parent`` climbs out of it.
ROOT_NAMES = {"ROOT", "root"}
#: String literals allowed to match, each with why it is no default path.
ALLOWED = {
    ("tests/test_docs.py", "../shared/"): "the docs cite the project's guides outside the repository; a link, no default",
}
#: This file plants such paths to show the checks see them.
SELF = "tests/test_traces_data.py"


def tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def readme_sha256() -> dict[str, str]:
    """File (relative to ``data/traces``) -> sha256, from the README's integrity block."""
    text = (TRACES / "README.md").read_text()
    return {name: digest for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", text, re.M)}


# ---------------------------------------------------------------- the data folder


def test_every_trace_file_is_listed_in_the_readme_with_its_sha256():
    listed = readme_sha256()
    present = {p.relative_to(TRACES).as_posix() for p in TRACES.rglob("*") if p.is_file() and p.name != "README.md"}
    assert listed and set(listed) == present
    for name, digest in listed.items():
        assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == digest, name


#: Data files named as another repository's sources, not traces: Vidur's operator profiles, from
#: which bench/data/ was derived (bench/data/README.md).
UPSTREAM_FILES = {"mlp.csv", "attention.csv"}


def test_every_trace_the_code_and_the_docs_name_is_in_the_repository():
    named = set()
    for f in tree_files():
        if f.split("/")[0] in {"batch", "bench", "tools", "scripts", "docs"} or f in {"README.md", "Makefile"}:
            for line in (ROOT / f).read_text(errors="replace").splitlines():
                if not re.search(r"BATCH_TRACES_DIR=|--trace-dir |--traces ", line):  # another folder's file
                    named |= set(re.findall(r"(?<![\w/.-])[\w.-]+\.(?:csv|jsonl)\b", line))  # a path's last part: another repo's
    named -= UPSTREAM_FILES
    assert {"norm_azure2023_conv.csv", "mooncake_conversation_trace.jsonl", "trace2k.csv"} <= named
    have = {p.name for p in TRACES.rglob("*") if p.is_file()} | {  # or data files kept elsewhere (bench/data)
        f.rsplit("/", 1)[-1] for f in tree_files() if f.endswith((".csv", ".jsonl"))}
    assert named <= have, sorted(named - have)


def _azure_seconds(stamp: str) -> Decimal:
    """``YYYY-MM-DD HH:MM:SS.fffffff`` as exact seconds."""
    day, clock = stamp.split(" ")
    h, m, s = clock.split(":")
    return Decimal(dt.date.fromisoformat(day).toordinal() * 86400 + int(h) * 3600 + int(m) * 60) + Decimal(s)


@pytest.mark.parametrize("kind", ["code", "conv"])
def test_a_normalised_azure_trace_is_its_original_in_seconds_since_the_first_row(kind):
    with open(TRACES / f"AzureLLMInferenceTrace_{kind}.csv", newline="") as f:
        raw = list(csv.DictReader(f))
    with open(TRACES / f"norm_azure2023_{kind}.csv", newline="") as f:
        norm = list(csv.DictReader(f))
    assert len(norm) == len(raw) > 8000
    t0 = _azure_seconds(raw[0]["TIMESTAMP"])
    for r, n in zip(raw, norm):
        assert (Decimal(n["arrival_s"]), int(n["prompt_tokens"]), int(n["output_tokens"]), n["user_id"]) == (
            _azure_seconds(r["TIMESTAMP"]) - t0, int(r["ContextTokens"]), int(r["GeneratedTokens"]), ""), r


def test_the_normalised_mooncake_trace_is_its_jsonl_in_seconds_since_the_first_row():
    raw = [json.loads(line) for line in open(TRACES / "mooncake_conversation_trace.jsonl")]
    with open(TRACES / "norm_mooncake_conversation.csv", newline="") as f:
        norm = list(csv.DictReader(f))
    assert len(norm) == len(raw) > 12000
    for r, n in zip(raw, norm):
        assert (Decimal(n["arrival_s"]), int(n["prompt_tokens"]), int(n["output_tokens"]), n["user_id"]) == (
            Decimal(r["timestamp"] - raw[0]["timestamp"]) / 1000, r["input_length"], r["output_length"], ""), r


def _poisson(n: int, rate: float, seed: int) -> list[tuple[float, int, int, str]]:
    rnd, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rnd.expovariate(rate)
        out.append((t, rnd.randint(5, 199), rnd.randint(10, 99), f"u{rnd.randint(1, 5)}"))
    return out


def _ab_burst(seed: int) -> list[tuple[float, int, int, str]]:
    rnd = random.Random(seed)
    rows = [(rnd.uniform(0.0, 1.0), rnd.randint(5, 199), rnd.randint(10, 99), user)
            for user, n in (("A", 100), ("B", 5)) for _ in range(n)]
    return sorted(rows, key=lambda r: r[0])


@pytest.mark.parametrize("name, rows", [
    ("poisson_n300_r30_seed0.csv", lambda: _poisson(300, 30.0, 0)),
    ("trace200_poisson20_seed0.csv", lambda: _poisson(200, 20.0, 0)),
    ("trace2k.csv", lambda: _poisson(2000, 20.0, 1)),
    ("ab_100A_5B_1s_seed0.csv", lambda: _ab_burst(0)),
])
def test_an_anchor_trace_is_the_seeded_draw_the_readme_describes(name, rows):
    with open(TRACES / "anchors" / name, newline="") as f:
        got = [(float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]), r["user"])
               for r in csv.DictReader(f)]
    want = rows()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g[0] - w[0]) <= 5e-7 and g[1:] == w[1:], (g, w)  # arrivals rounded to the microsecond


# ---------------------------------------------------------------- no default path outside the repository


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)}


def outside_paths_in_python(path: str, source: str) -> list[str]:
    """Where ``source`` holds a path outside the repository: a string literal (docstrings aside:
    they cite, they set nothing) matching ``OUTSIDE_RE``, or code climbing above the root."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = [f"{path}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
             and (path, node.value) not in ALLOWED and any(OUTSIDE_RE.search(line) for line in node.value.splitlines())]
    for node in ast.walk(tree):  # ROOT.parent, root.parent, Path.cwd().parent
        if isinstance(node, ast.Attribute) and node.attr in {"parent", "parents"} and (
                (isinstance(node.value, ast.Name) and node.value.id in ROOT_NAMES)
                or (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "Path.cwd")):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def outside_paths_in_make(path: str, text: str) -> list[str]:
    """A Makefile's (or TOML's) lines, comments aside, holding a path outside the repository."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if re.search(r"(?:^|[\s=:'\"(])(?:\.\./|~/|/(?:work|home|data|mnt|srv|Users|root)\b)|\bshared/traces\b", code):
            found.append(f"{path}:{lineno}: {code.strip()}")
    return found


def test_no_default_path_in_the_code_or_the_makefile_points_outside_the_repository():
    found = []
    for f in tree_files():
        if f == SELF:
            continue
        if f.endswith(".py"):
            found += outside_paths_in_python(f, (ROOT / f).read_text())
        elif f in {"Makefile", "pyproject.toml", "constraints.txt"} or f.startswith(("bench/requirements", ".ci/")):
            found += outside_paths_in_make(f, (ROOT / f).read_text())
    assert not found, "\n".join(found)


def test_the_checks_see_a_path_outside_the_repository():
    """Their teeth: each way the traces folder used to be found, or could be, is reported."""
    for planted in ('TRACES = "../shared/traces"', 'p.add_argument("--traces", default="/work/shared/traces")',
                    'folder = root.parent / "shared" / "traces"', 'home = "~/traces"',
                    'help="else ../shared/traces beside the checkout"'):
        assert outside_paths_in_python("planted.py", planted + "\n"), planted
    assert outside_paths_in_python("planted.py", 'base = Path.cwd().parent / "traces"\n')
    assert not outside_paths_in_python("ok.py", 'TRACES = ROOT / "data" / "traces"\nURL = "/v1/completions"\n'
                                                'HERE = Path(__file__).parent\n')
    assert not outside_paths_in_python("ok.py", '"""Cites ../shared/mission/contract.md."""\n')  # a docstring
    assert outside_paths_in_make("Makefile", "TRACES := ../shared/traces\n")
    assert outside_paths_in_make("Makefile", "run:\n\tpython -m batch --trace-dir /data/traces\n")
    assert not outside_paths_in_make("Makefile", "# see ../shared/guides (a comment)\nrun: $(VENV)/bin/python\n")


@pytest.mark.parametrize("where", ["root", "tests", "elsewhere"])
def test_with_nothing_set_every_traces_folder_is_inside_the_repository(monkeypatch, tmp_path, where):
    """The main job's folder and the bench scripts' (the anchors; the Mooncake traces), from the
    checkout's root, from inside it, and from outside any checkout (the package's own)."""
    monkeypatch.delenv(traces.TRACES_ENV, raising=False)
    monkeypatch.chdir({"root": ROOT, "tests": ROOT / "tests", "elsewhere": tmp_path}[where])
    for folder in (traces.default_traces_dir(), traces.traces_dir(), vc.traces_dir()):
        assert folder.resolve().is_relative_to(ROOT) and folder.is_dir(), folder
    assert traces.traces_dir() == TRACES and vc.traces_dir() == TRACES / "anchors"
    assert traces.resolve_trace("norm_azure2023_conv.csv") == TRACES / "norm_azure2023_conv.csv"


def test_the_setting_still_overrides_the_repository_folder(monkeypatch, tmp_path):
    (tmp_path / "mine.csv").write_text("arrival_s,prompt_tokens,output_tokens,user_id\n0,10,5,\n")
    monkeypatch.setenv(traces.TRACES_ENV, str(tmp_path))
    assert traces.traces_dir() == tmp_path and traces.resolve_trace("mine.csv") == tmp_path / "mine.csv"
    with pytest.raises(FileNotFoundError, match=traces.TRACES_ENV):
        traces.resolve_trace("norm_azure2023_conv.csv")  # not looked up in data/traces once the setting names a folder


def test_a_report_shows_the_traces_folder_relative_to_the_checkout(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert traces.shown_path(TRACES / "anchors") == str(Path("data") / "traces" / "anchors")
    assert traces.shown_path("/nowhere/else") == "/nowhere/else"
