"""The simulated GPU: one model iteration per ``forward`` call, with a simulated KV cache.

The module-level names are the import contract (``../shared/mission/contract.md``):
``VOCAB_SIZE``, ``EOS_TOKEN``, ``KV_BLOCK_TOKENS``, ``MAX_KV_BLOCKS``, the ``Request``
dataclass, ``forward(batch)`` and ``kv_blocks_for(request)``. They behave exactly as the
original workspace's stub: ``forward`` sleeps 5 ms + 1 ms per request and draws tokens from
the global ``random`` module.

Added beside them, without changing those defaults:

* ``SimulatedGPU``: the same model with its latency (base + per-request cost) and EOS
  probability as parameters, an optional *seeded* mode in which the token a request gets at
  output position ``k`` is a pure function of ``(seed, request_id, k)`` (so a request's
  output does not depend on which requests shared its batches, nor on preemption), and an
  optional ``VirtualClock`` that ``forward`` advances instead of sleeping.
* ``VirtualClock``: simulated seconds, so a 10,000-request experiment runs in seconds.
* ``SimulatedGPU(profile=NAME)``: a ``ProfiledGPU``, whose iteration time is a real deployment's
  (``batch.sim.gpu_profile``: prefill tokens, decode sequences and KV read priced from published
  measurements). It needs each request's work this step, so it is a paged backend: the scheduler
  calls its ``execute_model(items)`` (``batch.core.backend_api.BatchItem``), never ``forward``.
  The plain ``SimulatedGPU`` keeps the stub's ``forward`` and no ``execute_model``.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

VOCAB_SIZE = 64
EOS_TOKEN = 0
KV_BLOCK_TOKENS = 16
MAX_KV_BLOCKS = 256

#: Default latency model of one iteration: ``BASE + PER_REQUEST * len(batch)`` seconds.
ITERATION_BASE_S = 0.005
ITERATION_PER_REQUEST_S = 0.001
#: Probability that a non-final output token is EOS.
EOS_PROBABILITY = 0.02


@dataclass
class Request:
    """One generation request, as the harness builds it.

    Fields (contract order): ``user_id``; ``prompt`` (token ids); ``max_tokens`` (the most
    tokens to generate, EOS included); ``request_id``; ``submitted_at``, ``started_at`` (time
    the first generated token came back) and ``completed_at``, in seconds on the scheduler's
    clock; ``generated`` (output token ids, appended by the scheduler, never by ``forward``).
    """

    user_id: str
    prompt: list[int]
    max_tokens: int
    request_id: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    completed_at: float | None = None
    generated: list[int] = field(default_factory=list)


def _draw_token(rng: random.Random, n_generated: int, max_tokens: int, eos_probability: float) -> int:
    """The stub's token rule: EOS at ``max_tokens - 1`` generated, else EOS w.p. p, else 1..63."""
    if n_generated >= max_tokens - 1:
        return EOS_TOKEN
    if rng.random() < eos_probability:
        return EOS_TOKEN
    return rng.randint(1, VOCAB_SIZE - 1)


def forward(batch: list[Request]) -> list[int]:
    """Run one model iteration on ``batch`` and return one new token per request.

    Args:
        batch: the participating requests, in any order. Not modified.

    Returns:
        ``len(batch)`` token ids, in batch order: ``EOS_TOKEN`` when a request already holds
        ``max_tokens - 1`` generated tokens, otherwise EOS with probability 0.02, otherwise a
        uniform id in ``1..VOCAB_SIZE-1``.

    Sleeps ``5 ms + 1 ms * len(batch)`` of real time (nothing for an empty batch). It knows
    nothing of prefill: every request gets a token back.
    """
    if not batch:
        return []
    time.sleep(ITERATION_BASE_S + ITERATION_PER_REQUEST_S * len(batch))
    return [_draw_token(random, len(r.generated), r.max_tokens, EOS_PROBABILITY) for r in batch]  # type: ignore[arg-type]


def kv_blocks_for(request: Request) -> int:
    """KV blocks a request holds at its current length: ``ceil((len(prompt) + len(generated)) / 16)``.

    The whole prompt counts, however much of it has been prefilled.
    """
    return math.ceil((len(request.prompt) + len(request.generated)) / KV_BLOCK_TOKENS)


class VirtualClock:
    """Simulated time in seconds; ``now()`` is a drop-in for ``time.time``.

    Args:
        start_s: the initial reading, seconds.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def now(self) -> float:
        """The current simulated time, seconds."""
        return self._now_s

    __call__ = now

    def advance(self, dt_s: float) -> None:
        """Move time forward by ``dt_s`` seconds.

        Raises:
            ValueError: ``dt_s`` is negative or not finite.
        """
        if not (dt_s >= 0.0 and math.isfinite(dt_s)):
            raise ValueError(f"dt_s must be a finite non-negative number of seconds, got {dt_s!r}")
        self._now_s += dt_s

    def advance_to(self, t_s: float) -> None:
        """Move time forward to ``t_s`` if it lies ahead; never moves it back."""
        if t_s > self._now_s:
            self._now_s = float(t_s)


class SimulatedGPU:
    """The stub's model with its parameters exposed; ``forward`` is a bound drop-in.

    ``SimulatedGPU(profile=NAME, ...)`` builds a ``ProfiledGPU`` instead (the same arguments; see
    that class): a token-aware iteration time from ``batch.sim.gpu_profile.get(NAME)``.

    Args:
        base_s: fixed cost of one iteration, seconds (default 5 ms).
        per_request_s: added cost per request in the batch, seconds (default 1 ms).
        eos_probability: chance that a token before the forced one is EOS (default 0.02).
        seed: ``None`` draws from one shared ``random.Random`` (the stub's behaviour). An int
            makes the token at output position ``k`` of request ``request_id`` a pure function
            of ``(seed, request_id, k)``: independent of batch composition and of recompute.
        clock: a ``VirtualClock`` to advance by the iteration latency instead of sleeping;
            ``None`` sleeps for real.

    Raises:
        ValueError: a latency is negative or ``eos_probability`` is outside ``[0, 1]``.
    """

    def __new__(cls, *args, profile: str | None = None, **kwargs):
        if profile is not None and cls is SimulatedGPU:
            return super().__new__(ProfiledGPU)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        base_s: float = ITERATION_BASE_S,
        per_request_s: float = ITERATION_PER_REQUEST_S,
        eos_probability: float = EOS_PROBABILITY,
        seed: int | None = None,
        clock: VirtualClock | None = None,
        profile: str | None = None,
    ) -> None:
        if profile is not None:
            raise ValueError("SimulatedGPU(profile=...) is built by ProfiledGPU; this instance has no profile")
        if base_s < 0 or per_request_s < 0:
            raise ValueError(f"latencies must be >= 0 s, got base_s={base_s}, per_request_s={per_request_s}")
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"eos_probability must lie in [0, 1], got {eos_probability}")
        self.base_s = base_s
        self.per_request_s = per_request_s
        self.eos_probability = eos_probability
        self.seed = seed
        self.clock = clock
        self._shared_rng = random.Random()
        self.iterations = 0
        self.busy_s = 0.0

    def latency_s(self, batch_size: int) -> float:
        """Iteration latency in seconds for a batch of ``batch_size`` requests (0 when empty)."""
        return self.base_s + self.per_request_s * batch_size if batch_size else 0.0

    def _rng_for(self, request: Request) -> random.Random:
        if self.seed is None:
            return self._shared_rng
        return random.Random(f"{self.seed}/{request.request_id}/{len(request.generated)}")

    def forward(self, batch: Sequence[Request]) -> list[int]:
        """One iteration: same token rule as the module's ``forward``; sleeps or advances the clock."""
        if not batch:
            return []
        dt = self.latency_s(len(batch))
        if self.clock is None:
            time.sleep(dt)
        else:
            self.clock.advance(dt)
        self.iterations += 1
        self.busy_s += dt
        return [_draw_token(self._rng_for(r), len(r.generated), r.max_tokens, self.eos_probability) for r in batch]

    __call__ = forward

    def _advance(self, dt: float) -> None:
        """Spend ``dt`` seconds: advance the clock, or sleep without one; count the iteration."""
        if self.clock is None:
            time.sleep(dt)
        else:
            self.clock.advance(dt)
        self.iterations += 1
        self.busy_s += dt


class ProfiledGPU(SimulatedGPU):
    """The stub's token rule on a real deployment's clock: a paged backend whose ``execute_model``
    prices each iteration with ``batch.sim.gpu_profile`` from what it computes.

    Args:
        profile: a ``batch.sim.gpu_profile`` profile name (``"h100-llama3-8b"``).
        eos_probability, seed, clock: as ``SimulatedGPU``'s (``base_s`` and ``per_request_s``
            are accepted and unused: the profile prices the iteration).

    Raises:
        ValueError: an unknown profile name (``gpu_profile.UnknownProfileError``), or as
            ``SimulatedGPU``.
    """

    def __init__(self, *, profile: str, eos_probability: float = EOS_PROBABILITY, seed: int | None = None,
                 clock: VirtualClock | None = None, base_s: float = ITERATION_BASE_S,
                 per_request_s: float = ITERATION_PER_REQUEST_S) -> None:
        from batch.sim import gpu_profile  # only for a profiled GPU

        super().__init__(base_s=base_s, per_request_s=per_request_s, eos_probability=eos_probability, seed=seed,
                         clock=clock)
        self.profile = gpu_profile.get(profile)

    def latency_items_s(self, items: Sequence) -> float:
        """Seconds of one iteration over ``items`` (``BatchItem``s, or anything with
        ``num_new_tokens`` and ``num_computed_tokens``): the profile's ``step_time_s``."""
        return self.profile.step_time_s([(it.num_new_tokens, it.num_computed_tokens) for it in items])

    def execute_model(self, items: Sequence) -> list[int]:
        """One iteration over ``items`` (``batch.core.backend_api.BatchItem``, batch order): advance
        the clock (or sleep) by the profile's step time; return a token per item by the stub's rule
        (the scheduler keeps it only where ``item.sample``)."""
        if not items:
            return []
        self._advance(self.latency_items_s(items))
        return [_draw_token(self._rng_for(it.request), len(it.request.generated), it.request.max_tokens,
                            self.eos_probability) for it in items]

    def forward(self, batch: Sequence[Request]) -> list[int]:
        """Not available: a profiled GPU prices the tokens each request computes, which a plain
        batch of ``Request``s does not say. Pass the object as the scheduler's backend.

        Raises:
            TypeError: always.
        """
        raise TypeError(f"ProfiledGPU({self.profile.name!r}) needs each request's tokens this step: pass the "
                        f"object as the backend (the scheduler calls its execute_model), not its forward")

    __call__ = forward


#: Type of a backend: ``forward(batch) -> tokens``, one token per request, batch order.
Forward = Callable[[list[Request]], list[int]]
