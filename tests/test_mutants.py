"""tools/mutants.py: every planted bug still applies to the code as it is, and the tool catches one.

The fast tests keep the mutant list from rotting silently: each mutant's ``old`` text occurs in
its file the stated number of times, the file still compiles once the bug is planted, and the
names are unique. The slow test runs the tool end to end on one cheap mutant.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import mutants

ALL = mutants.MUTANTS + mutants.HELD_OUT  # the held-out ones must keep applying too
IDS = [m.name for m in ALL]


def test_names_are_unique() -> None:
    assert len(set(IDS)) == len(IDS)


def test_at_least_the_issues_mutants() -> None:
    assert len(mutants.MUTANTS) >= 23


@pytest.mark.parametrize("m", ALL, ids=IDS)
def test_old_text_occurs_the_stated_number_of_times(m: mutants.Mutant) -> None:
    text = (ROOT / m.path).read_text()
    assert text.count(m.old) == m.count, f"{m.name}: {m.old!r} in {m.path}"


@pytest.mark.parametrize("m", ALL, ids=IDS)
def test_mutated_file_compiles_and_differs(m: mutants.Mutant) -> None:
    text = (ROOT / m.path).read_text()
    mutated = m.apply(text)
    assert mutated != text
    compile(mutated, m.path, "exec")


def test_a_mutant_that_no_longer_applies_fails_loudly() -> None:
    stale = mutants.Mutant("stale", "gone", "scheduler.py", "no such text anywhere 1234", "x")
    with pytest.raises(mutants.MutantError, match="stale"):
        stale.apply((ROOT / "scheduler.py").read_text())


@pytest.mark.slow
def test_end_to_end_catches_a_cheap_mutant(tmp_path) -> None:
    """The script on one mutant, without proofs, at a small run: reported caught by the spec checks."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "mutants.py"), "--only", "grant_not_taken",
                        "--no-proofs", "--steps", "50", "--examples", "5"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "caught by the spec checks alone: 1 of 1" in p.stdout, p.stdout
    assert "clean tree: every check passes" in p.stdout


def test_docs_mutants_reports_each_held_out_round_apart_as_the_run_gives_it():
    """docs/mutants.md keeps each held-out round's rate before the checks were extended for it
    (``ROUNDS``) beside the rate of its run (docs/results/mutants.json), as tools/mutants.py writes it."""
    rows = json.loads((ROOT / "docs/results/mutants.json").read_text())["mutants"]
    section = "\n".join(mutants.rounds_section(rows))
    assert section in (ROOT / "docs/mutants.md").read_text()
    assert {p for p, *_ in mutants.ROUNDS} == {m.name.split("_")[0] + "_" for m in mutants.HELD_OUT}
