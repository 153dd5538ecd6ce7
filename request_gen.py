"""Workloads: the contract's Poisson ``stream`` and a loader for real production traces.

``stream`` is the import contract. ``load_trace`` replays the normalised CSVs in
``../shared/traces/`` (``arrival_s,prompt_tokens,output_tokens,user_id``): the Azure LLM
inference trace 2023 (Patel et al., Splitwise, ISCA 2024) and the Mooncake FAST'25 traces.
"""
from __future__ import annotations

import csv
import math
import numbers
import os
import random
from pathlib import Path

from inference_stub import VOCAB_SIZE, Request

#: Where the shared traces live, relative to this file's folder.
TRACES_DIR = Path(__file__).resolve().parent.parent / "shared" / "traces"
_TOKEN_IDS = range(1, VOCAB_SIZE)


def stream(n: int = 50, lam: float = 5.0, seed: int = 42) -> list[Request]:
    """``n`` requests with Poisson arrivals.

    Args:
        n: number of requests.
        lam: arrival rate, requests per second.
        seed: seed of the generator; the same seed gives the same requests.

    Returns:
        ``n`` requests ``r0, r1, ...`` whose ``submitted_at`` is the arrival offset in seconds
        from the start (non-decreasing), prompt length uniform in 5..199 tokens (ids 1..63),
        ``max_tokens`` uniform in 10..99, users ``u1``..``u5``. The caller decides when to
        submit them.

    Raises:
        ValueError: ``n`` is not an int >= 0, or ``lam`` is not a finite number > 0 (a
            negative rate gave decreasing, negative arrival offsets; 0 a ZeroDivisionError).
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:  # np.int64 too
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not 0 < lam < math.inf:
        raise ValueError(f"lam must be a finite number of requests/s > 0, got {lam!r}")
    n, lam = int(n), float(lam)  # numpy scalars as plain numbers: submitted_at stays a float
    rng = random.Random(seed)
    t = 0.0
    out: list[Request] = []
    for i in range(n):
        t += rng.expovariate(lam)
        plen = rng.randint(5, 199)
        out.append(
            Request(
                user_id=f"u{rng.randint(1, 5)}",
                prompt=[rng.randint(1, VOCAB_SIZE - 1) for _ in range(plen)],
                max_tokens=rng.randint(10, 99),
                request_id=f"r{i}",
                submitted_at=t,
            )
        )
    return out


def resolve_trace(name_or_path: str | os.PathLike) -> Path:
    """Path of a trace given as a path or as a file name inside ``TRACES_DIR``.

    Raises:
        FileNotFoundError: neither exists.
        IsADirectoryError: the path found is a directory, not a trace file.
    """
    p = Path(name_or_path)
    q = TRACES_DIR / p
    for found in (p, q):
        if found.is_dir():
            raise IsADirectoryError(f"trace {found} is a directory, not a CSV file")
        if found.exists():
            return found
    raise FileNotFoundError(f"no trace at {p} nor {q}")


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
) -> list[Request]:
    """Requests from a normalised trace CSV (``arrival_s,prompt_tokens,output_tokens,user_id``;
    ``user`` is read as ``user_id`` when the file has no ``user_id`` value).

    Args:
        path: a CSV path, or a file name in ``../shared/traces/``.
        limit: keep only the first ``limit`` rows (``None``: all).
        time_scale: multiply every arrival offset by this (0.5 replays twice as fast).
        users: the production traces carry no user id; an empty ``user_id`` becomes
            ``u1``..``u<users>``, drawn with ``seed``. A non-empty id in the file is kept: the
            ``user_id`` column, or else a ``user`` column (the anchor traces in
            ``../shared/traces/anchors/`` name it so).
        seed: seed for prompt token ids and user assignment.

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
    with open(resolve_trace(path), newline="", encoding="utf-8") as f:
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
