"""Workloads: the contract's Poisson ``stream``.

``stream`` is the import contract. The loader for real production traces lives in
``batch.sim.traces`` (the traces folder is ``$BATCH_TRACES_DIR``, else ``data/traces`` in the
checkout); ``load_trace`` and ``resolve_trace`` are importable from here as before.
"""
from __future__ import annotations

import math
import numbers
import random

from batch.sim.traces import load_trace, resolve_trace  # noqa: F401 - their home before the package
from inference_stub import VOCAB_SIZE, Request


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

