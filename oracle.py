"""A clairvoyant reference policy for the benchmarks: NOT deployable.

``ClairvoyantPolicy`` is told every request's true output length before the run (the bench
computes it from the seeded token streams: ``bench.output_lengths``). No server knows this.
It exists only to measure how tight ``bench.throughput_upper_bound`` is: a schedule that
knows the future and packs greedily gets this fraction of the bound, so the rest of the gap
is the bound's idealisation (perfect packing at every iteration), not a policy's fault.

Rule: admission offers waiting requests longest remaining work first (LPT list scheduling:
prefill or recompute chunks + true output tokens left), with backfill (a request that does not
fit is passed, bounded by the scheduler's aging); the victim under KV pressure is the resident
request with the fewest computed tokens (the least recompute lost). No fairness, no TTFT care.
"""
from __future__ import annotations

from bisect import insort
from typing import Any, Iterator, Sequence


class ClairvoyantPolicy:
    """Longest-remaining-work-first admission with backfill, knowing true output lengths.

    Args:
        output_tokens_by_request: ``id(Request)`` -> tokens the request will generate (its
            true output length under the run's seeded token streams).
        prefill_chunk_tokens: the scheduler's prefill chunk (tokens).

    Raises:
        KeyError: at ``add``, for a request whose length was not given.
    """

    backfill = True
    isolation = False
    admission_headroom = False

    def __init__(self, output_tokens_by_request: dict[int, int], *, prefill_chunk_tokens: int = 64) -> None:
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
        insort(self._waiting, (-self.remaining_iterations(seq), seq.arrival_no, seq), key=lambda e: e[:2])

    requeue = add

    def remove(self, seq: Any) -> None:
        for i, e in enumerate(self._waiting):
            if e[2] is seq:
                del self._waiting[i]
                return
        raise KeyError(f"{getattr(seq, 'request_id', seq)!r} is not waiting")

    def admission_order(self) -> Iterator[Any]:
        return iter([e[2] for e in self._waiting])

    def on_service(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        return None

    def choose_victim(self, running: Sequence[Any]) -> Any:
        return min(running, key=lambda s: (s.num_computed_tokens, -s.admit_no))
