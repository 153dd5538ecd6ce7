"""Production traces: where they are and how they load.

``load_trace`` replays the normalised trace CSVs (``arrival_s,prompt_tokens,output_tokens,user_id``)
of the shared traces folder: the Azure LLM inference trace 2023 (Patel et al., Splitwise,
ISCA 2024) and the Mooncake FAST'25 traces; the anchor traces are in its ``anchors/`` folder.

A trace given by file name is looked up in the traces folder, found by a setting, never by
where this file is installed. First to last:

1. a folder passed explicitly (the main job's ``--trace-dir``, the bench scripts' ``--traces``);
2. ``$BATCH_TRACES_DIR``;
3. ``../shared/traces`` beside the checkout the current directory is in (the nearest folder at
   or above it holding ``pyproject.toml`` and ``scheduler.py``), else beside the checkout this
   package sits in (an editable install), else ``../shared/traces`` from the current directory.

Run from a checkout, the default is what it always was: ``../shared/traces`` beside the repository.
"""
from __future__ import annotations

import csv
import math
import os
import random
from pathlib import Path

from inference_stub import VOCAB_SIZE, Request

#: The setting that names the traces folder.
TRACES_ENV = "BATCH_TRACES_DIR"
#: The anchor traces' sub-folder (``bench/vllm_compare.py`` and the sweeps read them).
ANCHORS = "anchors"
_TOKEN_IDS = range(1, VOCAB_SIZE)


def project_root(start: str | os.PathLike | None = None) -> Path | None:
    """The checkout at or above ``start`` (default: the current directory): the nearest folder
    holding ``pyproject.toml`` and ``scheduler.py``; ``None`` outside one."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "scheduler.py").is_file():
            return folder
    return None


def default_traces_dir() -> Path:
    """``../shared/traces`` beside the current directory's checkout, else beside the checkout
    holding this package, else relative to the current directory (see the module docstring)."""
    root = project_root() or project_root(Path(__file__).parent)
    return (root.parent if root else Path.cwd().parent) / "shared" / "traces"


def traces_dir(folder: str | os.PathLike | None = None) -> Path:
    """The traces folder: ``folder`` if given, else ``$BATCH_TRACES_DIR``, else the default."""
    if folder:
        return Path(folder)
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else default_traces_dir()


def resolve_trace(name_or_path: str | os.PathLike, trace_dir: str | os.PathLike | None = None) -> Path:
    """Path of a trace given as a path or as a file name inside the traces folder
    (``traces_dir(trace_dir)``: ``trace_dir``, else ``$BATCH_TRACES_DIR``, else the default).

    Raises:
        FileNotFoundError: neither exists.
        IsADirectoryError: the path found is a directory, not a trace file.
    """
    p = Path(name_or_path)
    q = traces_dir(trace_dir) / p
    for found in (p, q):
        if found.is_dir():
            raise IsADirectoryError(f"trace {found} is a directory, not a CSV file")
        if found.exists():
            return found
    raise FileNotFoundError(f"no trace at {p} nor {q} (traces folder: --trace-dir, else ${TRACES_ENV}, "
                            f"else ../shared/traces beside the checkout)")


def _numbered_rows(reader: csv.DictReader, path: str | os.PathLike, limit: int | None) -> list[tuple[int, dict]]:
    """The first ``limit`` rows (``None``: all) as ``(line number, row)``, after checking the header.

    Raises:
        ValueError: the header lacks a column ``load_trace`` needs.
    """
    need = {"arrival_s", "prompt_tokens", "output_tokens"}
    if not need <= set(reader.fieldnames or ()):
        raise ValueError(f"{path}: header must have {sorted(need)}, got {reader.fieldnames}")
    out: list[tuple[int, dict]] = []
    for row in reader:
        if limit is not None and len(out) >= limit:
            break
        out.append((reader.line_num, row))
    return out


def load_trace(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    users: int = 1,
    seed: int = 0,
    trace_dir: str | os.PathLike | None = None,
) -> list[Request]:
    """Requests from a normalised trace CSV (``arrival_s,prompt_tokens,output_tokens,user_id``;
    ``user`` is read as ``user_id`` when the file has no ``user_id`` value).

    Args:
        path: a CSV path, or a file name in the traces folder (``traces_dir(trace_dir)``).
        limit: keep only the first ``limit`` rows (``None``: all).
        time_scale: multiply every arrival offset by this (0.5 replays twice as fast).
        users: the production traces carry no user id; an empty ``user_id`` becomes
            ``u1``..``u<users>``, drawn with ``seed``. A non-empty id in the file is kept: the
            ``user_id`` column, or else a ``user`` column (the anchor traces in
            ``anchors/`` folder name it so).
        seed: seed for prompt token ids and user assignment.
        trace_dir: the traces folder a bare file name is looked up in (default: ``$BATCH_TRACES_DIR``,
            else ``../shared/traces`` beside the checkout).

    Returns:
        Requests ``t0, t1, ...`` in file order: a prompt of ``prompt_tokens`` ids in 1..63,
        ``max_tokens = output_tokens``, ``submitted_at`` = the (scaled) arrival offset, seconds.
        Rows whose prompt cannot fit the KV cache are still returned: the scheduler refuses
        them at ``submit`` with a typed error, and the runner counts them.

    Raises:
        FileNotFoundError: no such trace.
        IsADirectoryError: ``path`` is a directory.
        ValueError: a malformed row, naming the file, the line and the value: a field that is
            not a number, an ``arrival_s`` that is not finite (nan, inf) or is negative (a nan
            arrival made a replay wait for ever), or a negative token count; a file that is not
            UTF-8 text or not CSV; ``time_scale`` not a finite number > 0; ``users < 1``.
    """
    if not 0 < time_scale < math.inf:
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    if users < 1:
        raise ValueError(f"users must be >= 1, got {users}")
    rng = random.Random(seed)
    out: list[Request] = []
    with open(resolve_trace(path, trace_dir), newline="", encoding="utf-8") as f:
        try:
            rows = _numbered_rows(csv.DictReader(f), path, limit)
        except (csv.Error, UnicodeDecodeError) as e:  # a NUL byte, a binary file
            raise ValueError(f"{path}: not a CSV text file: {e}") from None
    for i, (line, row) in enumerate(rows):
        where = f"{path}: line {line}"
        try:
            arrival_s = float(row["arrival_s"])
            plen = int(row["prompt_tokens"])
            olen = int(row["output_tokens"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        if not 0 <= arrival_s < math.inf:
            raise ValueError(f"{where}: arrival_s must be a finite number of seconds >= 0, got {row['arrival_s']!r}")
        arrival_s *= time_scale
        if arrival_s == math.inf:
            raise ValueError(f"{where}: arrival_s {row['arrival_s']!r} times time_scale {time_scale} is not finite")
        if plen < 0 or olen < 0:
            raise ValueError(f"{where}: token counts must be >= 0, got prompt_tokens={plen}, output_tokens={olen}")
        user = (row.get("user_id") or row.get("user") or "").strip() or f"u{rng.randint(1, users)}"
        out.append(
            Request(
                user_id=user,
                prompt=rng.choices(_TOKEN_IDS, k=plen),
                max_tokens=olen,
                request_id=f"t{i}",
                submitted_at=arrival_s,
            )
        )
    return out
