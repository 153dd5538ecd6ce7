"""Seeded workloads for the benchmarks: the A/B fairness burst, long requests, an on/off
pattern, plus a catalogue (``WORKLOADS``) of every workload ``bench/bench.py`` runs.

Every generator returns fresh ``Request`` objects whose ``submitted_at`` is the arrival offset
in seconds (as ``request_gen.stream``); the same arguments give the same requests. Prompt and
output lengths follow ``request_gen.stream`` unless stated (prompt 5..199 tokens, ``max_tokens``
10..99), so the stub's early EOS (p = 0.02 per token) applies.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import inference_stub
import request_gen
from batch.sim import traces
from inference_stub import VOCAB_SIZE, Request

__all__ = ["ab_burst", "long_requests", "on_off", "Workload", "WORKLOADS", "QUICK_WORKLOADS"]


def _request(rng: random.Random, rid: str, user: str, t_s: float, prompt: tuple[int, int],
             output: tuple[int, int]) -> Request:
    plen = rng.randint(*prompt)
    return Request(user_id=user, prompt=[rng.randint(1, VOCAB_SIZE - 1) for _ in range(plen)],
                   max_tokens=rng.randint(*output), request_id=rid, submitted_at=t_s)


def ab_burst(n_a: int = 100, n_b: int = 5, window_s: float = 1.0, seed: int = 4,
             users: tuple[str, str] = ("A", "B")) -> list[Request]:
    """The fairness burst of the problem statement: ``n_a`` requests of user A and ``n_b`` of
    user B, arrivals uniform in ``[0, window_s)`` seconds, lengths as ``request_gen.stream``.

    Returns:
        Requests ``a0..`` and ``b0..`` sorted by arrival. Filtering to user B gives the
        "B alone" reference with the same requests and arrival times.
    """
    rng = random.Random(seed)
    out = [_request(rng, f"a{i}", users[0], rng.uniform(0, window_s), (5, 199), (10, 99)) for i in range(n_a)]
    out += [_request(rng, f"b{i}", users[1], rng.uniform(0, window_s), (5, 199), (10, 99)) for i in range(n_b)]
    return sorted(out, key=lambda r: r.submitted_at)


def long_requests(n: int = 30, prompt: tuple[int, int] = (256, 1024), output: tuple[int, int] = (256, 1024),
                  users: int = 5, seed: int = 5) -> list[Request]:
    """``n`` long requests all arriving at t = 0 (KV pressure): prompt and ``max_tokens``
    uniform in the given ranges (tokens), users ``u1..u<users>``. Meant to run with early EOS
    off, so each request reaches ``max_tokens`` and the cache fills up."""
    rng = random.Random(seed)
    return [_request(rng, f"L{i}", f"u{rng.randint(1, users)}", 0.0, prompt, output) for i in range(n)]


def on_off(n: int = 1500, rate_on: float = 60.0, on_s: float = 5.0, off_s: float = 10.0,
           users: int = 5, seed: int = 6) -> list[Request]:
    """Bursty traffic: Poisson arrivals at ``rate_on`` requests/s during ``on_s`` seconds, then
    silence for ``off_s`` seconds, repeated until ``n`` requests; lengths as ``request_gen.stream``."""
    rng = random.Random(seed)
    out: list[Request] = []
    t, active = 0.0, 0.0  # t: clock; active: seconds of "on" time elapsed
    while len(out) < n:
        active += rng.expovariate(rate_on)
        cycles, into = divmod(active, on_s)
        t = cycles * (on_s + off_s) + into
        out.append(_request(rng, f"r{len(out)}", f"u{rng.randint(1, users)}", t, (5, 199), (10, 99)))
    return out


@dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Attributes:
        name: short key used in file names and tables.
        title: one line saying what it is.
        recipe: the Python expression that builds it (reproducible from the repository root).
        build: returns fresh requests (a run mutates them).
        kv_cap_blocks: the KV cap for this workload, blocks of 16 tokens.
        eos_probability: the simulated GPU's early-EOS chance per token (0 runs each request
            to ``max_tokens``).
        time_scale: factor applied to trace arrival offsets (1.0 = as recorded).
        seed: the workload's seed (the simulated GPU's token seed is ``bench.GPU_SEED``).
    """

    name: str
    title: str
    recipe: str
    build: Callable[[], list[Request]] = field(repr=False)
    kv_cap_blocks: int = inference_stub.MAX_KV_BLOCKS
    eos_probability: float = inference_stub.EOS_PROBABILITY
    time_scale: float = 1.0
    seed: int = 0


def _stream(name: str, title: str, n: int, lam: float, seed: int) -> Workload:
    return Workload(name, title, f"request_gen.stream(n={n}, lam={lam}, seed={seed})",
                    lambda: request_gen.stream(n=n, lam=lam, seed=seed), seed=seed)


def _trace(name: str, title: str, file: str, limit: int, cap: int, seed: int, time_scale: float = 1.0) -> Workload:
    return Workload(name, title,
                    f"request_gen.load_trace({file!r}, limit={limit}, time_scale={time_scale}, users=5, seed={seed})",
                    lambda: traces.load_trace(file, limit=limit, time_scale=time_scale, users=5, seed=seed),
                    kv_cap_blocks=cap, eos_probability=0.0, time_scale=time_scale, seed=seed)


#: Everything ``make bench`` runs. The stub's capacity on ``stream`` lengths is about 27
#: requests/s (measured: ~820 output tokens/s), so 5, 20 and 60 requests/s are low, medium
#: (~75%) and saturating (~2.2x).
WORKLOADS: tuple[Workload, ...] = (
    _stream("stream-low", "request_gen.stream at 5 req/s (~20% load)", 3000, 5.0, 1),
    _stream("stream-medium", "request_gen.stream at 20 req/s (~75% load)", 3000, 20.0, 2),
    _stream("stream-saturating", "request_gen.stream at 60 req/s (~2.2x capacity)", 3000, 60.0, 3),
    Workload("ab-burst", "fairness burst: 100 requests of user A + 5 of user B within 1 s",
             "workloads.ab_burst(n_a=100, n_b=5, window_s=1.0, seed=4)",
             lambda: ab_burst(n_a=100, n_b=5, window_s=1.0, seed=4), seed=4),
    Workload("long-kv", "KV pressure: 30 long requests at t=0 (prompt and max_tokens 256..1024, no early EOS)",
             "workloads.long_requests(n=30, seed=5)", lambda: long_requests(n=30, seed=5),
             eos_probability=0.0, seed=5),
    Workload("on-off", "bursty: 60 req/s for 5 s, silent for 10 s, repeated (1500 requests)",
             "workloads.on_off(n=1500, rate_on=60.0, on_s=5.0, off_s=10.0, seed=6)",
             lambda: on_off(n=1500, rate_on=60.0, on_s=5.0, off_s=10.0, seed=6), seed=6),
    _trace("azure-code", "Azure LLM inference 2023, code (first 600 rows)", "norm_azure2023_code.csv", 600, 512, 7),
    _trace("azure-conv", "Azure LLM inference 2023, conversation (first 600 rows)", "norm_azure2023_conv.csv",
           600, 512, 8),
    _trace("mooncake-conv", "Mooncake FAST'25 conversation trace (first 200 rows)",
           "norm_mooncake_conversation.csv", 200, 2048, 9),
)

#: Small versions for smoke runs (``bench/bench.py --quick``) and the tests.
QUICK_WORKLOADS: tuple[Workload, ...] = (
    _stream("stream-saturating", "request_gen.stream at 60 req/s (small)", 150, 60.0, 3),
    Workload("ab-burst", "fairness burst: 20 requests of user A + 3 of user B within 1 s",
             "workloads.ab_burst(n_a=20, n_b=3, window_s=1.0, seed=4)",
             lambda: ab_burst(n_a=20, n_b=3, window_s=1.0, seed=4), seed=4),
    Workload("long-kv", "KV pressure: 8 long requests at t=0 (no early EOS)",
             "workloads.long_requests(n=8, prompt=(128, 512), output=(128, 512), seed=5)",
             lambda: long_requests(n=8, prompt=(128, 512), output=(128, 512), seed=5),
             eos_probability=0.0, seed=5),
)
