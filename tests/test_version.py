"""``batch.__version__``, ``batch-llm --version`` and ``python -m batch --version`` (issue 37): one
source, ``[project] version`` in ``pyproject.toml``; and the console script is ``batch-llm``, not
``batch`` (at(1)'s command on many Linux systems)."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import batch
from batch import cli, commands
from batch import version as version_mod
from conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def test_the_package_version_is_pyprojects():
    assert batch.__version__ == VERSION == version_mod.version()
    with pytest.raises(AttributeError):
        batch.no_such_name  # noqa: B018 - the module's __getattr__ answers only __version__


def test_batch_llm_version_and_python_m_batch_version_print_it(capsys):
    assert commands.main(["--version"]) == 0 and capsys.readouterr().out == f"batch-llm {VERSION}\n"
    assert commands.main(["-V"]) == 0 and capsys.readouterr().out == f"batch-llm {VERSION}\n"
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"batch {VERSION}\n"
    assert "--version" in commands.USAGE


def test_without_an_installed_distribution_the_version_is_read_from_pyproject(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version_mod.metadata, "version", not_installed)
    version_mod.version.cache_clear()
    try:
        assert version_mod.version() == VERSION  # the checkout's pyproject.toml
    finally:
        version_mod.version.cache_clear()
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "someone-else"\nversion = "9.9"\n')
    assert version_mod.pyproject_version(other) == version_mod.UNKNOWN  # another project's
    other.write_text("not = [toml")
    assert version_mod.pyproject_version(other) == version_mod.UNKNOWN
    assert version_mod.pyproject_version(tmp_path / "absent.toml") == version_mod.UNKNOWN


def test_the_console_script_is_batch_llm_and_no_script_is_called_batch():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["batch-llm"] == "batch.commands:main" and "batch" not in scripts
    assert commands.PROG == "batch-llm"


def test_the_installed_batch_llm_prints_the_version():
    exe = Path(sys.executable).parent / "batch-llm"
    if not exe.exists():  # an environment installed before the rename, or none (make test installs it)
        pytest.skip(f"no batch-llm beside {sys.executable}: pip install -e . installs it")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == f"batch-llm {VERSION}\n", out.stderr


def test_no_doc_or_test_names_the_old_console_script():
    """``batch serve``, ``batch bench-serve``, ``batch sim``, ``.venv/bin/batch`` are
    ``batch-llm ...`` now (docs/CHANGELOG.md, history, aside); ``python -m batch`` stays."""
    old = re.compile(r"(?:bin|BIN\))/batch(?![-\w.])|(?<![\w.-])(?<!-m )batch (?:serve|bench-serve|sim|--[a-z])\b(?![-.\w])")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = []
    for f in out.splitlines():
        if f.startswith("data/") or f == "docs/CHANGELOG.md" or f == "tests/test_version.py" \
                or not f.endswith((".py", ".md", ".toml", ".txt", "Makefile", ".sh")) or not (ROOT / f).is_file():
            continue
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            if old.search(line):
                found.append(f"{f}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
