#!/usr/bin/env python3
"""Run a ``pip install`` and turn its resolver report on packages installed ``--no-deps`` into one note.

    python tools/pip_install.py --no-deps-file bench/requirements-vllm-nodeps.txt \\
        --log .venv-vllm/pip-unmet-requirements.txt -- .venv-vllm/bin/pip install -q -r bench/requirements-vllm.txt

``make test`` builds ``.venv-vllm`` in three pip runs (``Makefile``, ``$(VLLM_STAMP)``): torch, then
vllm and xgrammar with ``--no-deps`` (their declared dependencies would pull a CUDA torch and
triton, which the scheduler path never imports), then what the scheduler path does import. The
third run ends with pip's resolver report, a line ``ERROR: pip's dependency resolver ...`` and one
line per requirement of vllm or xgrammar left unmet (about 45 for vllm 0.33.0: ``requires
torch==2.14.0, but you have torch 2.13.0+cpu``, ``requires blake3, which is not installed``, ...).
Those are the intended result of ``--no-deps``, yet they read as a failure when nothing failed.

This runs the command, passes every other line of its output through unchanged, writes the
requirements of the ``--no-deps`` packages that pip reports unmet to ``--log``, and prints one
``note:`` line counting them in their place. A report line about any other package is printed as
pip wrote it, under pip's header: an unexpected conflict stays visible. The exit status is pip's.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

#: The first line of pip's resolver report (pip 20.3 to 26): the requirement lines follow it.
RESOLVER_HEADER = "ERROR: pip's dependency resolver does not currently take into account"
#: One line of that report: ``vllm 0.33.0 requires blake3, which is not installed.``
REQUIREMENT_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*) (?P<version>\S+) requires ")


def canonical(name: str) -> str:
    """A distribution name as pip compares it (PEP 503: case and runs of ``-_.`` do not matter)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def no_deps_names(path: str | Path) -> set[str]:
    """The distributions a requirements file names (``vllm==0.33.0`` -> ``vllm``), comments skipped."""
    names = set()
    for line in Path(path).read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if m:
            names.add(canonical(m.group(1)))
    return names


def filter_report(lines: Iterable[str], expected: set[str]) -> tuple[list[str], list[str]]:
    """``(lines to print, unmet requirements of expected packages)`` for pip's output ``lines``
    (without their newlines). The resolver header is printed only above a line it keeps."""
    shown: list[str] = []
    dropped: list[str] = []
    header: str | None = None  # pip's header, held until a line of its report is kept
    in_report = False
    for line in lines:
        if line.startswith(RESOLVER_HEADER):
            header, in_report = line, True
            continue
        m = REQUIREMENT_RE.match(line) if in_report else None
        if m is None:
            in_report = False
            shown.append(line)
        elif canonical(m["name"]) in expected:
            dropped.append(line)
        else:
            if header is not None:
                shown.append(header)
                header = None
            shown.append(line)
    return shown, dropped


def note(dropped: Sequence[str], log: str | None, no_deps_file: str) -> str:
    """The one line printed in place of the expected report."""
    packages = sorted({" ".join(REQUIREMENT_RE.match(x).group("name", "version")) for x in dropped})
    where = f"; the list: {log}" if log else ""
    return (f"note: pip lists {len(dropped)} requirements of {', '.join(packages)} as unmet: expected, those "
            f"packages are installed with --no-deps ({no_deps_file}) and the scheduler path needs none of them{where}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pip_install", description=__doc__.split("\n\n")[0])
    p.add_argument("--no-deps-file", required=True, help="the requirements file installed with --no-deps")
    p.add_argument("--log", default=None, help="write the unmet requirements pip lists for those packages here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the pip command")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the pip command after --")
    expected = no_deps_names(a.no_deps_file)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shown, dropped = filter_report(proc.stdout.splitlines(), expected)
    for line in shown:
        print(line)
    if dropped:
        if a.log:
            Path(a.log).write_text("".join(x + "\n" for x in dropped))
        print(note(dropped, a.log, a.no_deps_file))
    sys.stdout.flush()
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
