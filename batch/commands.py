"""The ``batch`` console script: subcommands.

    batch serve [...]          # the HTTP server (batch.server.serve; needs the 'serve' extra)
    batch bench-serve [...]    # the HTTP load generator (batch.server.bench_serve)
    batch sim [...]            # the main job, as batch-sim and python -m batch (batch.cli)
    batch --trace T [...]      # the same: options with no command are the main job's
"""
from __future__ import annotations

import sys
from typing import Sequence

USAGE = ("usage: batch {serve,bench-serve,sim} [options]   (batch COMMAND --help for each; "
         "batch --OPTION ... is batch sim --OPTION ...)")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns its exit status (2 with a usage line for an unknown one).
    Arguments that start with an option (``--trace ...``) are the main job's (``sim``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0].startswith("-"):
        args = ["sim", *args]
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        from batch.server.serve import main as run  # noqa: PLC0415 - imported only when asked for
    elif cmd == "bench-serve":
        from batch.server.bench_serve import main as run  # noqa: PLC0415
    elif cmd == "sim":
        from batch.cli import main as sim  # noqa: PLC0415

        def run(argv):
            return sim(argv, prog="batch sim")
    else:
        print(f"{USAGE}\nbatch: error: unknown command {cmd!r}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
