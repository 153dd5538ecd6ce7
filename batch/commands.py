"""The ``batch-llm`` console script: subcommands.

    batch-llm serve [...]          # the HTTP server (batch.server.serve; needs the 'serve' extra)
    batch-llm bench-serve [...]    # the HTTP load generator (batch.server.bench_serve)
    batch-llm sim [...]            # the main job, as batch-sim and python -m batch (batch.cli)
    batch-llm --trace T [...]      # the same: options with no command are the main job's
    batch-llm --version            # the version (pyproject.toml's, through the installed package)

It is not called ``batch``: on many Linux systems ``batch`` is the command of ``at`` that queues a
job (installed in ``/usr/bin``), and whichever came first on ``PATH`` would shadow the other.
"""
from __future__ import annotations

import sys
from typing import Sequence

#: The console script's name (``[project.scripts]`` in ``pyproject.toml``).
PROG = "batch-llm"
USAGE = (f"usage: {PROG} {{serve,bench-serve,sim}} [options]   ({PROG} COMMAND --help for each; "
         f"{PROG} --OPTION ... is {PROG} sim --OPTION ...; {PROG} --version)")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns its exit status (2 with a usage line for an unknown one).
    Arguments that start with an option (``--trace ...``) are the main job's (``sim``), except
    ``--version`` / ``-V`` alone, which prints ``batch-llm VERSION``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args in (["--version"], ["-V"]):
        from batch.version import version

        print(f"{PROG} {version()}")
        return 0
    if args[0].startswith("-"):
        args = ["sim", *args]
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        from batch.server.serve import main as run  # imported only when asked for
    elif cmd == "bench-serve":
        from batch.server.bench_serve import main as run
    elif cmd == "sim":
        from batch.cli import main as sim

        def run(argv):
            return sim(argv, prog=f"{PROG} sim")
    else:
        print(f"{USAGE}\n{PROG}: error: unknown command {cmd!r}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
