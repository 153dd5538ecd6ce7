"""The lifecycle state diagram, generated from ``spec.lifecycle`` by the ``transitions``
diagrams extension (its Mermaid backend), and kept in ``docs/spec.md``.

``python -m spec.diagram`` prints the diagram; ``--write`` replaces the generated block in
``docs/spec.md``; ``--check`` exits 1 when the committed block is stale (a test does the same).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spec import lifecycle as lc

DOC = Path(__file__).resolve().parent.parent / "docs" / "spec.md"
BEGIN = "<!-- state diagram: generated from spec/lifecycle.py by `python -m spec.diagram --write`; do not edit -->"
END = "<!-- end of the generated state diagram -->"


class _Drawn:
    """A stand-in request for drawing (the diagram shows a request in its initial state)."""


def mermaid() -> str:
    """The Mermaid ``stateDiagram-v2`` source of ``spec.lifecycle.TRANSITIONS`` (trailing blanks stripped)."""
    from transitions.extensions.diagrams import GraphMachine

    drawn = _Drawn()
    lc.new_machine(machine_cls=GraphMachine, graph_engine="mermaid", model=drawn, title="Request lifecycle")
    src = drawn.get_graph().draw(None)
    return "\n".join(line.rstrip() for line in src.splitlines()).strip() + "\n"


def block() -> str:
    """The generated block as it appears in ``docs/spec.md``."""
    return f"{BEGIN}\n```mermaid\n{mermaid()}```\n{END}"


def committed(path: Path = DOC) -> str:
    """The block currently in ``path``.

    Raises:
        ValueError: the markers are missing.
    """
    text = path.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{path}: no generated state diagram block ({BEGIN!r} ... {END!r})")
    return text[i:j + len(END)]


def write(path: Path = DOC) -> bool:
    """Replace the block in ``path`` with a fresh one; returns whether it changed."""
    old = committed(path)
    new = block()
    if old != new:
        path.write_text(path.read_text().replace(old, new))
    return old != new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spec.diagram", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"update the block in {DOC.name}")
    g.add_argument("--check", action="store_true", help="exit 1 if the committed block is stale")
    a = p.parse_args(argv)
    if a.write:
        print("updated" if write() else "already up to date", DOC)
    elif a.check:
        stale = committed() != block()
        print(f"{DOC}: {'stale, run python -m spec.diagram --write' if stale else 'up to date'}")
        return int(stale)
    else:
        print(mermaid(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
