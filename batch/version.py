"""The package's version: ``[project] version`` of ``pyproject.toml``, its one source.

``version()`` asks the installed distribution (``importlib.metadata``; ``pip install -e .``, as
``make`` does, records it). A checkout on ``sys.path`` without an install (an outside harness's
``PYTHONPATH``) has no distribution: then ``pyproject.toml`` beside the package is read. Neither:
``0+unknown`` (PEP 440's local label, so it still sorts as a version).
"""
from __future__ import annotations

import functools
import tomllib
from importlib import metadata
from pathlib import Path

#: The distribution name (``[project] name`` in ``pyproject.toml``).
DISTRIBUTION = "batch-scheduler"
#: What ``version()`` answers when neither source has a version.
UNKNOWN = "0+unknown"


@functools.cache
def version() -> str:
    """The version string, e.g. ``0.1.0``."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return pyproject_version(Path(__file__).resolve().parent.parent / "pyproject.toml")


def pyproject_version(path: Path) -> str:
    """``[project] version`` of the ``pyproject.toml`` at ``path`` when it is this project's, else
    ``UNKNOWN`` (no file, not TOML, another project)."""
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return UNKNOWN
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return UNKNOWN
    return project["version"]
