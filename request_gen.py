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
    """
    p = Path(name_or_path)
    if p.exists():
        return p
    q = TRACES_DIR / p
    if q.exists():
        return q
    raise FileNotFoundError(f"no trace at {p} nor {q}")


def load_trace(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    users: int = 1,
    seed: int = 0,
) -> list[Request]:
    """Requests from a normalised trace CSV (``arrival_s,prompt_tokens,output_tokens,user_id``).

    Args:
        path: a CSV path, or a file name in ``../shared/traces/``.
        limit: keep only the first ``limit`` rows (``None``: all).
        time_scale: multiply every arrival offset by this (0.5 replays twice as fast).
        users: the traces carry no user id; an empty ``user_id`` becomes ``u1``..``u<users>``,
            drawn with ``seed``. A non-empty id in the file is kept.
        seed: seed for prompt token ids and user assignment.

    Returns:
        Requests ``t0, t1, ...`` in file order: a prompt of ``prompt_tokens`` ids in 1..63,
        ``max_tokens = output_tokens``, ``submitted_at`` = the (scaled) arrival offset, seconds.
        Rows whose prompt cannot fit the KV cache are still returned: the scheduler refuses
        them at ``submit`` with a typed error, and the runner counts them.

    Raises:
        FileNotFoundError: no such trace. ValueError: a malformed row (names the line),
        ``time_scale <= 0`` or ``users < 1``.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if users < 1:
        raise ValueError(f"users must be >= 1, got {users}")
    rng = random.Random(seed)
    out: list[Request] = []
    with open(resolve_trace(path), newline="") as f:
        reader = csv.DictReader(f)
        need = {"arrival_s", "prompt_tokens", "output_tokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: header must have {sorted(need)}, got {reader.fieldnames}")
        for i, row in enumerate(reader):
            if limit is not None and i >= limit:
                break
            try:
                arrival_s = float(row["arrival_s"]) * time_scale
                plen = int(row["prompt_tokens"])
                olen = int(row["output_tokens"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: line {i + 2}: {e}") from None
            user = (row.get("user_id") or "").strip() or f"u{rng.randint(1, users)}"
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
