"""A clairvoyant reference policy for the benchmarks: NOT deployable.

``ClairvoyantPolicy`` is told every request's true output length before the run (the bench
computes it from the seeded token streams: ``bench.output_lengths``). No server knows this.
It exists only to measure how tight ``bench.throughput_upper_bound`` is: a schedule that
knows the future and packs greedily gets this fraction of the bound, so the rest of the gap
is the bound's idealisation (perfect packing at every iteration), not a policy's fault.

Rule: admission offers waiting requests longest remaining work first (LPT list scheduling:
prefill or recompute chunks + true output tokens left); the victim under KV pressure is the resident
request with the fewest computed tokens (the least recompute lost). No fairness, no TTFT care.
"""
from __future__ import annotations

from bisect import insort
from typing import Any, Iterator, Sequence

from batch.policies.policy import Policy


class ClairvoyantPolicy(Policy):
    """Longest-remaining-work-first admission, knowing true output lengths.

    Args:
        output_tokens_by_request: ``id(Request)`` -> tokens the request will generate (its
            true output length under the run's seeded token streams).
        prefill_chunk_tokens: the scheduler's prefill chunk (tokens).
        order: the admission order, by remaining iterations (true lengths): ``"lpt"`` longest
            first (the default, LPT list scheduling), ``"spt"`` shortest first, ``"fifo"``
            arrival order (lengths then matter only through the victim rule). Other list
            rules are for ``bench/bench_throughput.py --only orders``: how far any of them gets.

    Raises:
        KeyError: at ``add``, for a request whose length was not given.
        ValueError: ``order`` is not one of the three.
    """

    name = "clairvoyant"
    ORDERS = ("lpt", "spt", "fifo")

    def __init__(self, output_tokens_by_request: dict[int, int], *, prefill_chunk_tokens: int = 64,
                 order: str = "lpt") -> None:
        if order not in self.ORDERS:
            raise ValueError(f"order must be one of {self.ORDERS}, got {order!r}")
        super().__init__()
        self.order_name = order
        self._lengths = output_tokens_by_request
        self._chunk = prefill_chunk_tokens
        self._waiting: list[tuple[int, int, Any]] = []  # (-remaining iterations, arrival_no, seq), sorted

    def remaining_iterations(self, seq: Any) -> int:
        """Iterations ``seq`` still needs: chunks to (re)compute its tokens, then its decodes left."""
        left = self._lengths[id(seq.req)] - len(seq.req.generated)
        return -(-seq.num_tokens // self._chunk) + max(0, left - 1)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, seq: Any) -> None:
        left = self.remaining_iterations(seq)
        key = -left if self.order_name == "lpt" else left if self.order_name == "spt" else 0
        insort(self._waiting, (key, seq.arrival_no, seq), key=lambda e: e[:2])

    requeue = add

    def remove(self, seq: Any) -> None:
        for i, e in enumerate(self._waiting):
            if e[2] is seq:
                del self._waiting[i]
                return
        raise KeyError(f"{getattr(seq, 'request_id', seq)!r} is not waiting")

    def order(self, light=None) -> Iterator[Any]:
        return iter([e[2] for e in self._waiting])

    def victim(self, running: Sequence[Any]) -> Any:
        return min(running, key=lambda s: (s.num_computed_tokens, -s.admit_no))
