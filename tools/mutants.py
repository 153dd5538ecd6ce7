"""Mutation check: plant known bugs one at a time and report which check catches each.

``make mutants`` (or ``.venv/bin/python tools/mutants.py``). For every ``Mutant`` in ``MUTANTS``
a fresh temporary copy of the tree is made (the files ``git ls-files`` lists; the working tree
is never modified), the mutant's ``old`` text is replaced by its ``new`` text there, and the
checks run in the copy, each in a subprocess that imports the copy's modules (cwd and
``PYTHONPATH`` are the copy; the child reports ``scheduler.__file__`` and friends, and the
run stops if they are not the copy's):

* **proofs**: ``python -m spec.verify`` (all z3 checks, default bounds); caught when it exits
  non-zero. Skipped (``n/a``) when the mutated file is not in the import closure of
  ``spec.verify`` with its plugins (computed once, from ``sys.modules`` in a child).
* **trace validation**, **runtime invariants**, **stateful invariants**: one derandomized run
  of ``tests/test_stateful.py``'s ``SchedulerMachine`` (as ``run_machine()``: no database, no
  shrinking; ``--steps`` x ``--examples``). To say which check catches a bug, not only which
  fired first, the child records rather than raises the first two: the first
  ``RefinementError`` of the trace validator (``spec/refinement.py``) and the first
  ``InvariantViolation`` of the runtime check (``InvariantChecker`` and the machine's
  ``check_state`` invariant) are noted and the run goes on; any other failure ends the run and
  counts as the stateful test's (an assertion of the machine, or a crash: an exception raised
  in the scheduler, labelled so). A check that fires after the run has ended cannot be seen.
* **scenarios** (``--scenarios``): ``pytest -m "not slow" -x -q`` without the spec test files
  (``SCENARIO_EXCLUDES``).

The same checks first run on the unmutated copy and must all pass. The table goes to stdout
and, for a run of the whole list, to ``docs/mutants.md`` and ``docs/results/mutants.json``.
Exit status: 0 when the run completed (whatever was caught), 1 on a broken mutant or a check
that fails on clean code.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JSON_OUT = Path("docs/results/mutants.json")
MD_OUT = Path("docs/mutants.md")
#: Test files left out of the scenario run: the spec checks themselves (and this tool's tests,
#: which look for each mutant's ``old`` text and so would fail in any mutated copy).
SCENARIO_EXCLUDES = ("tests/test_stateful.py", "tests/test_refinement.py", "tests/test_verify*.py",
                     "tests/test_spec.py", "tests/test_concrete_rules.py", "tests/test_mutants.py")
#: Seconds before a child is killed; ``timeout`` is then the check's result, counted as caught (a hang
#: fails a CI run too). The scenario run takes about 50 s on the clean tree (2 cores).
PROOFS_TIMEOUT_S = 900
STATEFUL_TIMEOUT_S = 300
SCENARIOS_TIMEOUT_S = 240
CHECKS = ("proofs", "trace validation", "runtime invariants", "stateful invariants", "scenarios")
SPEC_CHECKS = CHECKS[:4]


class MutantError(ValueError):
    """A mutant no longer applies: its ``old`` text does not occur the stated number of times."""


@dataclass(frozen=True)
class Mutant:
    """A planted bug: every occurrence of ``old`` in ``path`` becomes ``new``.

    Attributes:
        name: unique, short (``--only`` takes it). description: the bug in words.
        path: the file, relative to the repository root.
        old: text that must occur exactly ``count`` times in the file. new: its replacement.
        count: the occurrences of ``old`` (all are replaced).
    """

    name: str
    description: str
    path: str
    old: str
    new: str
    count: int = 1

    def apply(self, text: str) -> str:
        """The file's text with the bug planted.

        Raises:
            MutantError: ``old`` does not occur exactly ``count`` times (names the mutant).
        """
        found = text.count(self.old)
        if found != self.count:
            raise MutantError(f"mutant {self.name!r}: {self.old!r} occurs {found} times in {self.path}, "
                              f"expected {self.count}")
        return text.replace(self.old, self.new)

    def where(self, root: Path = ROOT) -> str:
        """``path:line`` of the first occurrence of ``old`` (1-based line)."""
        text = (root / self.path).read_text()
        i = text.find(self.old)
        return f"{self.path}:{text.count(chr(10), 0, i) + 1}" if i >= 0 else f"{self.path}:?"


M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    # ---- spec/: the rules both the scheduler and the z3 models call
    M("can_admit_true", "admission guard always true (fairness_rules.can_admit)", "spec/fairness_rules.py",
      "    return need_blocks + headroom_blocks <= free_blocks", "    return True"),
    M("growth_zero", "growth dropped: growth_blocks returns 0", "spec/rules.py",
      "    return Max(0, blocks_needed(num_tokens, block_tokens) - held_blocks)", "    return 0"),
    M("no_lookahead", "lookahead slot removed: blocks_needed = blocks for the tokens only", "spec/rules.py",
      "    return blocks_for(num_tokens + 1, block_tokens)", "    return blocks_for(num_tokens, block_tokens)"),
    M("chunk_uncapped", "chunk cap dropped: chunk_tokens ignores the prefill chunk size", "spec/rules.py",
      "    return Min(Min(chunk_tokens_max, num_tokens - num_computed_tokens), budget_left_tokens)",
      "    return Min(num_tokens - num_computed_tokens, budget_left_tokens)"),
    M("done_to_decoding", "lifecycle table allows done -> decoding (prefill_done from done)", "spec/lifecycle.py",
      '    ("prefill_done", (PREFILLING,), DECODING),', '    ("prefill_done", (PREFILLING, DONE), DECODING),'),
    # ---- the scheduler: scheduler.py, batch/core/
    M("admit_off_by_one", "admission's fit test off by one (one block more than is free)", "batch/core/admission.py",
      "            if not fr.can_admit(free, need, headroom):", "            if not fr.can_admit(free + 1, need, headroom):"),
    M("eos_keeps_blocks", "EOS finish does not free the request's blocks (length finish does)", "batch/core/output.py",
      "            pool.free(seq.block_table)\n            seq.block_table = []\n            seq.finish_reason = reason",
      "            if reason != \"stop\":\n                pool.free(seq.block_table)\n"
      "            seq.block_table = []\n            seq.finish_reason = reason"),
    M("preempted_keeps_blocks", "a preempted request keeps its block table (blocks freed in the pool)",
      "batch/core/output.py",
      "            self.pool.free(seq.block_table)\n            seq.block_table = []\n        for s in plan.batch:",
      "            self.pool.free(seq.block_table)\n        for s in plan.batch:"),
    M("max_tokens_ignored", "finishing ignores max_tokens (the cache length passed in its place)", "batch/core/output.py",
      "reached_length(num_tokens - num_prompt + 1, req.max_tokens, num_tokens + 1, max_len)",
      "reached_length(num_tokens - num_prompt + 1, max_len, num_tokens + 1, max_len)"),
    M("nc_not_reset", "num_computed_tokens not reset on preemption", "batch/core/output.py",
      "            seq.num_computed_tokens = 0\n            seq.num_preemptions += 1",
      "            seq.num_preemptions += 1"),
    M("abort_keeps_blocks", "abort of a resident request does not free its blocks", "batch/core/book.py",
      "            self.pool.free(seq.block_table)\n            seq.block_table = []\n            self.running.remove(seq)",
      "            seq.block_table = []\n            self.running.remove(seq)"),
    M("budget_ignored", "token budget ignored: the cache's capacity used in its place", "batch/core/running.py",
      "    budget = sched.token_budget_tokens", "    budget = sched.max_model_len_tokens"),
    M("victim_oldest", "FCFS (and round robin) victim = oldest admitted instead of newest",
      "batch/policies/policy.py",
      "        return max(running, key=lambda s: s.admit_no)", "        return min(running, key=lambda s: s.admit_no)",
      count=2),
    M("admit_after_preempt", "admission in a tick that preempted (`if preempted is None`)", "batch/core/admission.py",
      "    if preempted:\n        stop = \"preempted\"", "    if preempted is None:\n        stop = \"preempted\""),
    M("resident_dropped", "a resident request with a 1-token step on the slow path dropped from the batch",
      "batch/core/running.py", "        if n > 0:\n            grants[seq] = (n, need)",
      "        if n > 1:\n            grants[seq] = (n, need)"),
    # ---- the policies and their bookkeeping
    M("vtc_output_wrong_user", "VTC output charge goes to the batch's first user, not the token's", "batch/core/output.py",
      "            add_output(seq.user_id)", "            add_output(plan.batch[0].seq.user_id)"),
    M("vtc_prices_swapped", "VTC prompt and output prices swapped", "batch/policies/vtc.py",
      "fr.service_units(acc[0], acc[1], self.prompt_price, self.output_price)",
      "fr.service_units(acc[0], acc[1], self.output_price, self.prompt_price)"),
    M("preemption_cap_ignored", "preemption cap ignored: pinned requests are victims too", "batch/core/running.py",
      "victim = sched.policy.choose_victim([s for s in live if not s.pinned])",
      "victim = sched.policy.choose_victim(live)"),
    M("aging_never", "aging never triggers: blocked ticks counted only for resident requests (never)",
      "batch/core/output.py", "        if b is not None and b.state in lc.WAITING_STATES:",
      "        if b is not None and b.state in lc.RESIDENT_STATES:"),
    M("vtc_order_static", "VTC admission order does not advance a user's counter between picks in a tick",
      "batch/policies/vtc.py",
      "            v[0] = fr.charged_counter(v[0], price * _uncharged_prompt_tokens(seq), self.weight_of(user))\n",
      ""),
    M("no_light_shield", "light-user shield dropped from VTC's victim choice", "batch/policies/vtc.py",
      "        light = self.users_where(fr.light_user, running)", "        light = set()"),
    M("default_chunk_65", "default prefill chunk 65 instead of 64", "scheduler.py",
      "PREFILL_CHUNK_TOKENS = 64", "PREFILL_CHUNK_TOKENS = 65"),
    M("resident_count_stuck", "per-user resident count never decremented", "batch/core/book.py",
      "        c = self._resident_by_user[seq.user_id] - 1", "        c = self._resident_by_user[seq.user_id]"),
    M("fcfs_remove_noop", "FCFSPolicy.remove is a no-op", "batch/policies/policy.py",
      "    def remove(self, seq: Any) -> None:\n        if self._waiting and",
      "    def remove(self, seq: Any) -> None:\n        return\n        if self._waiting and"),
    # ---- batch/core/kv_cache.py
    M("free_not_returned", "freed blocks not returned to the free list", "batch/core/kv_cache.py",
      "        self._free.extend(reversed(blocks))\n", ""),
    M("grant_not_taken", "a grant is not taken from the free list", "batch/core/kv_cache.py",
      "        del self._free[-n:]\n", ""),
)


# ---------------------------------------------------------------- the copy and its children


def tracked_files(root: Path = ROOT) -> list[str]:
    """The files ``git ls-files`` lists under ``root`` (relative paths; ones missing on disk dropped)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and (root / p).is_file()]


def make_copy(dest: Path, files: list[str], mutant: Mutant | None = None, root: Path = ROOT) -> None:
    """Copy ``files`` from ``root`` into ``dest`` and plant ``mutant`` there (the source is not touched).

    Raises:
        MutantError: the mutant does not apply.
    """
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)
    if mutant is not None:
        target = dest / mutant.path
        target.write_text(mutant.apply(target.read_text()))


def child_env(copy: Path) -> dict[str, str]:
    """The environment of a child: ``PYTHONPATH`` is the copy only, no bytecode written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "BATCH_STATEFUL"))}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    return env


def run_child(copy: Path, args: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``python ARGS`` in ``copy``; returns (exit status or None on timeout, stdout + stderr)."""
    try:
        p = subprocess.run([sys.executable, *args], cwd=copy, env=child_env(copy), capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return p.returncode, p.stdout + p.stderr


_CLOSURE_SRC = r"""
import importlib, json, os, sys
import spec.verify
for name in spec.verify.PLUGINS:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
root = os.getcwd()
files = sorted({os.path.relpath(m.__file__, root) for m in list(sys.modules.values())
                if getattr(m, "__file__", None) and os.path.abspath(m.__file__).startswith(root + os.sep)})
print("CLOSURE " + json.dumps({"verify": os.path.abspath(spec.verify.__file__), "files": files}))
"""


def proofs_closure(copy: Path) -> set[str]:
    """Files of the copy that ``spec.verify`` and its plugins import (relative paths).

    Raises:
        RuntimeError: the child failed, or imported ``spec.verify`` from outside the copy.
    """
    rc, out = run_child(copy, ["-c", _CLOSURE_SRC], 120)
    line = next((x for x in out.splitlines() if x.startswith("CLOSURE ")), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"could not compute the proofs' import closure:\n{out[-2000:]}")
    got = json.loads(line[len("CLOSURE "):])
    if not got["verify"].startswith(str(copy) + os.sep):
        raise RuntimeError(f"spec.verify imported from {got['verify']}, not the copy {copy}")
    return set(got["files"])


def run_proofs(copy: Path) -> dict[str, Any]:
    """``python -m spec.verify`` in ``copy``: ``{"caught": bool, "detail": first failing check's line}``."""
    t0 = time.perf_counter()
    rc, out = run_child(copy, ["-m", "spec.verify"], PROOFS_TIMEOUT_S)
    wall = round(time.perf_counter() - t0, 1)
    if rc is None:
        return {"caught": True, "detail": f"timeout after {PROOFS_TIMEOUT_S} s", "wall_s": wall}
    if rc == 0:
        return {"caught": False, "detail": "", "wall_s": wall}
    bad = [x for x in out.splitlines() if x.startswith("[") and not x.startswith("[proved]")]
    first = bad[0] if bad else (out.strip().splitlines() or ["(no output)"])[-1]
    if bad:  # the check's violated goals are the next informative line
        lines = out.splitlines()
        i = lines.index(bad[0])
        more = next((x.strip() for x in lines[i + 1:i + 12] if x.strip().startswith(("violated:", "step:"))), "")
        first = f"{first} {more}".strip()
    return {"caught": True, "detail": first, "wall_s": wall}


_STATEFUL_SRC = r"""
import json, os, sys, traceback
root = os.getcwd()
sys.path[:0] = [root, os.path.join(root, "tests")]
steps, examples, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import batch, scheduler, spec
from spec import invariants as inv
import test_stateful

first = {}

def describe(e):
    tb = traceback.extract_tb(e.__traceback__)
    mine = [f for f in tb if os.path.abspath(f.filename).startswith(root + os.sep)]
    frame = mine[-1] if mine else (tb[-1] if tb else None)
    where = f"{os.path.relpath(frame.filename, root)}:{frame.lineno}" if frame else "?"
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else (f"`{frame.line}`" if frame is not None and frame.line else "")
    return {"type": type(e).__name__, "where": where, "line": f"{type(e).__name__}: {text}"[:300],
            "in_test": frame is not None and os.path.basename(frame.filename) == "test_stateful.py"}

def note(kind, e):
    if kind not in first:
        first[kind] = describe(e)

check_state = inv.check_state
def recording_check_state(*a, **kw):
    try:
        return check_state(*a, **kw)
    except inv.InvariantViolation as e:
        note("runtime", e)
inv.check_state = recording_check_state

class _Off:
    def after_tick(self, *a, **kw):
        return None

after_tick = inv.InvariantChecker.after_tick
def recording_after_tick(self, sched, plan, finished):
    validator, self.validator = self.validator, _Off()
    try:
        after_tick(self, sched, plan, finished)
    except inv.InvariantViolation as e:
        note("runtime", e)
    finally:
        self.validator = validator
    by_req = {id(s.seq.req): s.seq for s in plan.batch}
    reasons = {by_req[id(r)]: by_req[id(r)].finish_reason for r in finished if id(r) in by_req}
    try:
        validator.after_tick(sched, plan, reasons)
    except Exception as e:  # a RefinementError, or the validator failing on the trace
        note("trace", e)
inv.InvariantChecker.after_tick = recording_after_tick

before_commit = getattr(inv.InvariantChecker, "before_commit", None)
if before_commit is not None:  # plan_within_free: recorded, then raised (the plan must not be committed)
    def recording_before_commit(self, sched, plan):
        try:
            before_commit(self, sched, plan)
        except inv.InvariantViolation as e:
            note("runtime", e)
            raise
    inv.InvariantChecker.before_commit = recording_before_commit

end = None
try:
    test_stateful.run_machine(steps, examples)
except Exception as e:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    end = describe(e)
files = {m.__name__: os.path.abspath(m.__file__) for m in (scheduler, spec, batch, test_stateful)}
with open(out_path, "w") as f:
    json.dump({"first": first, "end": end, "files": files}, f)
"""


def run_stateful(copy: Path, steps: int, examples: int) -> dict[str, Any]:
    """The stateful machine in ``copy``: ``{"trace": ..., "runtime": ..., "stateful": ...}``,
    each ``{"caught": bool, "detail": first line}``.

    Raises:
        RuntimeError: the child did not report, or imported modules from outside the copy.
    """
    out_path = copy / ".mutants-stateful.json"
    t0 = time.perf_counter()
    rc, out = run_child(copy, ["-c", _STATEFUL_SRC, str(steps), str(examples), str(out_path)], STATEFUL_TIMEOUT_S)
    wall = round(time.perf_counter() - t0, 1)
    if rc is None:
        timeout = {"caught": True, "detail": f"timeout after {STATEFUL_TIMEOUT_S} s (a hang)"}
        return {"trace": {"caught": False, "detail": ""}, "runtime": {"caught": False, "detail": ""},
                "stateful": timeout, "wall_s": wall}
    if rc != 0 or not out_path.exists():
        raise RuntimeError(f"the stateful child failed (exit {rc}):\n{out[-3000:]}")
    got = json.loads(out_path.read_text())
    for name, f in got["files"].items():
        if not f.startswith(str(copy) + os.sep):
            raise RuntimeError(f"{name} imported from {f}, not the copy {copy}: the copy is shadowed")
    res: dict[str, Any] = {"wall_s": wall}
    for kind in ("trace", "runtime"):
        d = got["first"].get(kind)
        res[kind] = {"caught": d is not None, "detail": "" if d is None else f"{d['line']} ({d['where']})"}
    end = got["end"]
    if end is None:
        res["stateful"] = {"caught": False, "detail": ""}
    else:
        label = "" if end["in_test"] or end["type"] == "InvariantViolation" else "crash: "
        res["stateful"] = {"caught": True, "detail": f"{label}{end['line']} ({end['where']})",
                           "spec": not label}  # a crash in the scheduler is not a spec check's catch
    return res


def run_scenarios(copy: Path) -> dict[str, Any]:
    """``pytest -m "not slow" -x -q`` in ``copy`` without ``SCENARIO_EXCLUDES``: first failure's line."""
    ignores = []
    for pat in SCENARIO_EXCLUDES:
        ignores += ["--ignore-glob", pat]
    t0 = time.perf_counter()
    rc, out = run_child(copy, ["-m", "pytest", "-m", "not slow", "-x", "-q", "-p", "no:cacheprovider", *ignores,
                               "tests"], SCENARIOS_TIMEOUT_S)
    wall = round(time.perf_counter() - t0, 1)
    if rc is None:
        return {"caught": True, "detail": f"timeout after {SCENARIOS_TIMEOUT_S} s (a test hangs)", "wall_s": wall}
    if rc == 0:
        return {"caught": False, "detail": "", "wall_s": wall}
    failed = [x for x in out.splitlines() if x.startswith(("FAILED", "ERROR"))]
    return {"caught": True, "detail": (failed[0] if failed else out.strip().splitlines()[-1])[:300], "wall_s": wall}


@dataclass(frozen=True)
class Settings:
    """What a run checks: ``steps`` x ``examples`` of the stateful machine, proofs, scenarios."""

    steps: int
    examples: int
    proofs: bool
    scenarios: bool


def check_tree(files: list[str], mutant: Mutant | None, s: Settings, closure: set[str] | None) -> dict[str, Any]:
    """Run the checks on a fresh copy with ``mutant`` planted (None: the clean tree).

    Returns:
        ``{"name", "description", "where", "path", "results": {check: {"caught", "detail"}}}``;
        a check not run has ``"caught": None`` and says why in ``detail``.
    """
    with tempfile.TemporaryDirectory(prefix="batch-mutant-") as tmp:
        copy = Path(tmp).resolve()
        make_copy(copy, files, mutant)
        r: dict[str, Any] = {}
        if not s.proofs:
            r["proofs"] = {"caught": None, "detail": "not run (--no-proofs)"}
        elif mutant is not None and closure is not None and mutant.path not in closure:
            r["proofs"] = {"caught": None, "detail": f"n/a (proofs do not read {mutant.path})"}
        else:
            r["proofs"] = run_proofs(copy)
        st = run_stateful(copy, s.steps, s.examples)
        r["trace validation"], r["runtime invariants"], r["stateful invariants"] = \
            st["trace"], st["runtime"], st["stateful"]
        r["stateful invariants"]["wall_s"] = st["wall_s"]
        r["scenarios"] = run_scenarios(copy) if s.scenarios else {"caught": None, "detail": "not run (--scenarios)"}
    row = {"name": "(clean)", "description": "the unmutated tree", "where": "", "path": ""}
    if mutant is not None:
        row = {"name": mutant.name, "description": mutant.description, "where": mutant.where(), "path": mutant.path}
    row["results"] = r
    row["caught_by_spec"] = any(spec_catch(c, r[c]) for c in SPEC_CHECKS)
    return row


def spec_catch(check: str, res: dict[str, Any]) -> bool:
    """Whether ``res`` is a catch by the spec itself: a proof's counterexample (not an import error
    or a timeout of the mutated tree), a trace-validation or invariant failure, or an assertion of
    the stateful test; not a crash inside the scheduler (its own asserts) nor a hang."""
    if not res["caught"]:
        return False
    if check == "proofs":
        return "[counterexample]" in res["detail"]
    return res.get("spec", True) and "timeout" not in res["detail"]


# ---------------------------------------------------------------- output


def cell(res: dict[str, Any], width: int | None = None) -> str:
    """A table cell: ``caught: <first line>``, ``-`` (ran, not caught), or why it did not run."""
    if res["caught"] is None:
        return res["detail"]
    if not res["caught"]:
        return "-"
    text = "caught: " + res["detail"]
    return text if width is None or len(text) <= width else text[:width - 3] + "..."


def markdown_table(rows: list[dict[str, Any]], width: int | None = None) -> str:
    """The result table as markdown: mutant | where | one column per check."""
    head = "| mutant | where | " + " | ".join(CHECKS) + " |"
    lines = [head, "|" + "---|" * (2 + len(CHECKS))]
    for row in rows:
        cells = [cell(row["results"][c], width).replace("|", "\\|") for c in CHECKS]
        lines.append(f"| `{row['name']}` | `{row['where']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(rows: list[dict[str, Any]]) -> str:
    """``caught by the spec checks alone: X of N``."""
    return f"caught by the spec checks alone: {sum(r['caught_by_spec'] for r in rows)} of {len(rows)}"


def write_reports(rows: list[dict[str, Any]], meta: dict[str, Any], root: Path = ROOT) -> None:
    """Write ``docs/results/mutants.json`` and ``docs/mutants.md`` (generated files) under ``root``."""
    (root / JSON_OUT).parent.mkdir(parents=True, exist_ok=True)
    (root / JSON_OUT).write_text(json.dumps({**meta, "summary": summary_line(rows),
                                             "caught_by_spec": sum(r["caught_by_spec"] for r in rows),
                                             "total": len(rows), "mutants": rows}, indent=1) + "\n")
    missed = [r for r in rows if not r["caught_by_spec"]]
    scen = 'pytest -m "not slow" without the spec test files' if meta["scenarios"] else "not run"
    md = [
        "<!-- generated file: do not edit. Made by `" + meta["command"] + "` (tools/mutants.py); "
        "`make mutants` regenerates it. -->",
        "# Mutation check: which check catches which planted bug",
        "",
        f"Generated {meta['generated_at']} by `{meta['command']}` in {meta['wall_s']:.0f} s "
        f"(stateful machine: {meta['steps']} steps x {meta['examples']} examples, derandomized; "
        f"proofs: {'python -m spec.verify' if meta['proofs'] else 'not run'}; "
        f"scenarios: {scen}).",
        "",
        "Each mutant is planted alone in a fresh copy of the tracked files. `proofs`: `python -m spec.verify` "
        "exits non-zero (`n/a` when the mutated file is not in its import closure). `trace validation`, "
        "`runtime invariants`: the first `RefinementError` / `InvariantViolation` in the stateful run (recorded, "
        "not raised, so that each check is seen on its own). `stateful invariants`: the run's own failure, an "
        "assertion of `tests/test_stateful.py` or a `crash:` (an exception raised in the scheduler). `-`: ran, "
        "did not catch it. The run on the unmutated tree passed every check first. Counted as caught by the "
        "spec checks: a proof's counterexample, a trace-validation or invariant failure, an assertion of the "
        "stateful test; not a `crash:` (the scheduler's own asserts) or a timeout (`spec_catch`).",
        "",
        markdown_table(rows),
        "",
        f"**{summary_line(rows)}**",
        "",
        "Missed by the spec checks: " + (", ".join(f"`{r['name']}`" for r in missed) or "none") + ".",
        "",
        "## The mutants",
        "",
    ]
    md += [f"- `{r['name']}` (`{r['where']}`): {r['description']}" for r in rows]
    (root / MD_OUT).write_text("\n".join(md) + "\n")


# ---------------------------------------------------------------- main


def select(only: str | None) -> list[Mutant]:
    """The mutants named in ``only`` (comma-separated), or all.

    Raises:
        SystemExit: an unknown name.
    """
    if not only:
        return list(MUTANTS)
    by_name = {m.name: m for m in MUTANTS}
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(unknown)}; --list names them")
    return [by_name[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    """``tools/mutants.py``: plant each mutant, run the checks, print and write the table."""
    p = argparse.ArgumentParser(prog="tools/mutants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", metavar="NAME,...", help="run only these mutants (the reports are not written)")
    p.add_argument("--list", action="store_true", help="name the mutants and exit")
    p.add_argument("--jobs", type=int, default=1, help="mutants checked at once (default 1)")
    p.add_argument("--steps", type=int, default=200, help="stateful steps per example (default 200)")
    p.add_argument("--examples", type=int, default=30, help="stateful examples (default 30)")
    p.add_argument("--scenarios", action="store_true", help="also run the scenario tests (pytest -m 'not slow')")
    p.add_argument("--no-proofs", action="store_true", help="do not run python -m spec.verify")
    a = p.parse_args(argv)
    if len({m.name for m in MUTANTS}) != len(MUTANTS):
        raise SystemExit("mutant names are not unique")
    chosen = select(a.only)
    if a.list:
        for m in chosen:
            print(f"{m.name:24} {m.where():34} {m.description}")
        return 0
    for m in chosen:  # fail loudly, before anything runs, if a mutant no longer applies
        try:
            m.apply((ROOT / m.path).read_text())
        except (MutantError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    settings = Settings(a.steps, a.examples, not a.no_proofs, a.scenarios)
    files = tracked_files()
    t0 = time.perf_counter()
    closure = None
    if settings.proofs:
        with tempfile.TemporaryDirectory(prefix="batch-mutant-") as tmp:
            make_copy(Path(tmp).resolve(), files)
            closure = proofs_closure(Path(tmp).resolve())
        print(f"proofs read: {', '.join(sorted(closure))}", flush=True)
    clean = check_tree(files, None, settings, closure)
    failing = [c for c in CHECKS if clean["results"][c]["caught"]]
    if failing:
        for c in failing:
            print(f"error: {c} fails on the unmutated tree: {clean['results'][c]['detail']}", file=sys.stderr)
        return 1
    print(f"clean tree: every check passes ({time.perf_counter() - t0:.0f} s)", flush=True)

    def one(m: Mutant) -> dict[str, Any]:
        row = check_tree(files, m, settings, closure)
        verdict = "caught" if row["caught_by_spec"] else "MISSED by the spec checks"
        print(f"  {m.name}: {verdict} ({time.perf_counter() - t0:.0f} s)", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        rows = list(pool.map(one, chosen))
    wall = time.perf_counter() - t0
    print()
    print(markdown_table(rows, width=90))
    print()
    print(summary_line(rows))
    print(f"wall time: {wall:.0f} s")
    if not a.only:
        cmd = " ".join(["tools/mutants.py", *(argv if argv is not None else sys.argv[1:])]).strip()
        meta = {"command": cmd, "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "wall_s": round(wall, 1), "steps": a.steps, "examples": a.examples, "proofs": settings.proofs,
                "scenarios": settings.scenarios, "baseline": clean["results"]}
        write_reports(rows, meta)
        print(f"wrote {JSON_OUT} and {MD_OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
