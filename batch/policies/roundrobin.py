"""Per-user round robin: a baseline for the fairness benchmarks (not on the default path).

Admission takes one request per backlogged user in turn; a user whose request is admitted
moves behind the others. Within a user, first come first served; a preempted request returns
ahead of its user's later arrivals. It equalises admissions, not service: a user with long
requests gets more tokens. The victim is vLLM's (the most recently admitted).
"""
from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING, Iterator

from batch.policies.policy import Policy

if TYPE_CHECKING:
    from batch.core.state import Seq


class RoundRobinPolicy(Policy):
    """Round robin over backlogged users, oldest request of each first."""

    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._queues: dict[str, list[Seq]] = {}  # user -> waiting requests by arrival; dict order = turns
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, seq: Seq) -> None:
        self._queues.setdefault(seq.user_id, []).append(seq)
        self._n += 1

    def requeue(self, seq: Seq) -> None:
        insort(self._queues.setdefault(seq.user_id, []), seq, key=lambda s: s.arrival_no)
        self._n += 1

    def remove(self, seq: Seq) -> None:
        q = self._queues.pop(seq.user_id)  # the user moves behind the others
        q.remove(seq)
        self._n -= 1
        if q:
            self._queues[seq.user_id] = q

    def order(self, light=None) -> Iterator[Seq]:
        """Rounds over the users in turn order, one request per user per round (a snapshot)."""
        queues = [list(q) for q in self._queues.values()]
        for i in range(max(map(len, queues), default=0)):
            for q in queues:
                if i < len(q):
                    yield q[i]
