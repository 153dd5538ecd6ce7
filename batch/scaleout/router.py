"""The request router of a scale-out deployment: each request goes to the least-loaded replica.

Each replica reports its load (``ReplicaLoad``: waiting requests, resident requests, free KV
blocks, and how many requests it has received in all). The router counts the requests it has
sent to each replica, so requests sent after the replica's last report (not yet in its waiting
count) still count as load: ``pending = sent - received``.

The rule (``Router.pick``): the smallest ``waiting + pending``; among equals, the most free KV
blocks; among equals, the replica picked least recently (so a burst that arrives before any
report is spread round robin, not piled on the first replica).

Standard library only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Iterable

__all__ = ["ReplicaLoad", "Router", "NoReplicaError"]


class NoReplicaError(RuntimeError):
    """No live replica to send a request to."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as it reports it.

    Attributes:
        waiting: requests queued or preempted (not resident).
        running: resident requests (prefilling or decoding).
        free_kv_blocks: KV blocks not held.
        received: requests this replica has accepted or refused since it started (a running
            total; the router subtracts it from what it sent to get those still in transit).
    """

    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    received: int = 0


class Router:
    """Picks a replica for each request by load (``pick``), fed by the replicas' reports.

    Args:
        replicas: the replica ids to start with (any hashable; order is the first tie-break).

    Cost: ``pick`` is O(R) for R live replicas.
    """

    def __init__(self, replicas: Iterable[Hashable] = ()) -> None:
        self._load: dict[Hashable, ReplicaLoad] = {}
        self._sent: dict[Hashable, int] = {}
        self._last_pick: dict[Hashable, int] = {}
        self._clock = itertools.count(1)
        self.picks: dict[Hashable, int] = {}  # replica -> requests sent to it (all time)
        for r in replicas:
            self.add(r)

    @property
    def replicas(self) -> list[Hashable]:
        """The live replica ids, in the order they were added."""
        return list(self._load)

    def add(self, replica: Hashable, load: ReplicaLoad | None = None) -> None:
        """Start routing to ``replica`` (a new or restarted one); ``load`` its first report."""
        self._load[replica] = load or ReplicaLoad()
        self._sent[replica] = (load.received if load else 0)
        self._last_pick.setdefault(replica, 0)
        self.picks.setdefault(replica, 0)

    def remove(self, replica: Hashable) -> None:
        """Stop routing to ``replica`` (it died or was drained); unknown ids are ignored."""
        self._load.pop(replica, None)
        self._sent.pop(replica, None)

    def report(self, replica: Hashable, load: ReplicaLoad) -> None:
        """Take ``replica``'s latest load report (ignored for a replica not routed to)."""
        if replica in self._load:
            self._load[replica] = load

    def pending(self, replica: Hashable) -> int:
        """Requests sent to ``replica`` that its last report did not count yet (>= 0)."""
        return max(0, self._sent[replica] - self._load[replica].received)

    def score(self, replica: Hashable) -> tuple[int, int, int]:
        """The sort key ``pick`` minimises: (waiting + pending, -free KV blocks, last pick)."""
        load = self._load[replica]
        return (load.waiting + self.pending(replica), -load.free_kv_blocks, self._last_pick[replica])

    def pick(self, exclude: Iterable[Hashable] = ()) -> Hashable:
        """The replica for the next request; counts it as sent there.

        Args:
            exclude: replicas not to pick (e.g. the one a retried request came from).

        Raises:
            NoReplicaError: no live replica outside ``exclude``.
        """
        ex = set(exclude)
        best = None
        best_key = None
        for r in self._load:
            if r in ex:
                continue
            k = self.score(r)
            if best_key is None or k < best_key:
                best, best_key = r, k
        if best is None:
            raise NoReplicaError("no live replica to route to")
        self._sent[best] += 1
        self._last_pick[best] = next(self._clock)
        self.picks[best] += 1
        return best
