"""The request router of a scale-out deployment: each request goes to the least-loaded replica.

Each replica reports its load (``ReplicaLoad``: waiting requests, resident requests, free KV
blocks, and how many requests it has received in all). The router counts the requests it has
sent to each replica, so requests sent after the replica's last report (not yet in its waiting
count) still count as load: ``pending = sent - received``.

The rule (``Router.pick``): the smallest ``waiting + pending + mine``, where ``mine`` is the
requests of the same user the router sent there that have not finished (``done``); among equals,
the most free KV blocks; among equals, the replica picked least recently (so a burst that arrives
before any report is spread round robin, not piled on the first replica).

User affinity (``pin_users``): a pinned user's requests go to the replica at its index in the
sorted order of the live replica ids, and fall back to the rule above when there is no replica at
that index (fewer live replicas) or it is excluded. The index is into the live set at pick time, so
when a replica dies or a replacement joins, the pins may move: this is affinity (keep a session's
requests, and their prefixes, on one replica), not a guarantee of one physical replica. A pinned
user is not spread over the replicas, which is what the shared counters are for: the other
replicas' service to a spread user is charged on the pinned replica too (docs/scale-out.md).

Why ``mine``: with load alone, users whose requests arrive in a cycle (A, B, C, D, A, ...) over
replicas that are equally loaded get routed in the same cycle, so with two replicas A and C land
only on one and B and D only on the other, and no scheduler can then balance A against B. Counting
the user's own requests spreads each user over the replicas (``docs/scale-out.md``); it adds at most
the user's own in-flight count to a replica's load.

Standard library only.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

__all__ = ["ReplicaLoad", "Router", "NoReplicaError", "check_pins"]


class NoReplicaError(RuntimeError):
    """No live replica to send a request to."""


def check_pins(pin_users: Mapping[str, int] | None) -> dict[str, int]:
    """``pin_users`` checked and copied: user -> replica index.

    Args:
        pin_users: user name (non-empty ``str``) -> index (``int`` >= 0) into the sorted live
            replica ids; ``None`` for no pins.

    Returns:
        A new dict (empty for ``None``).

    Raises:
        TypeError: not a mapping, a user that is not a non-empty string, or an index that is
            not an int (``bool`` is refused).
        ValueError: a negative index.
    """
    if pin_users is None:
        return {}
    if not isinstance(pin_users, Mapping):
        raise TypeError(f"pin_users must be a mapping user -> replica index, got {type(pin_users).__name__}")
    out: dict[str, int] = {}
    for user, index in pin_users.items():
        if not isinstance(user, str) or not user:
            raise TypeError(f"pin_users: a user must be a non-empty string, got {user!r}")
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"pin_users[{user!r}]: the replica index must be an int, got {index!r}")
        if index < 0:
            raise ValueError(f"pin_users[{user!r}]: the replica index must be >= 0, got {index}")
        out[user] = index
    return out


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as it reports it.

    Attributes:
        waiting: requests queued or preempted (not resident).
        running: resident requests (prefilling or decoding).
        free_kv_blocks: KV blocks not held.
        received: requests this replica has accepted or refused since it started (a running
            total; the router subtracts it from what it sent to get those still in transit).
        by_user: user -> its unfinished requests there (users with none absent), for a router
            that cannot see requests end (Ray Serve's); ``None`` when the router counts them itself
            (``Router.done``). The router adds the user's requests still in transit (sent, not yet
            counted in ``received``).
    """

    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    received: int = 0
    by_user: dict[str, int] | None = None


class Router:
    """Picks a replica for each request by load (``pick``), fed by the replicas' reports.

    Args:
        replicas: the replica ids to start with (any hashable; order is the first tie-break;
            with ``pin_users`` they must also be mutually orderable, e.g. all ``str``).
        pin_users: user -> replica index: that user's requests go to the live replica at that
            index in the sorted ids, or by the load rule when there is none (``pinned``).

    Raises:
        TypeError, ValueError: a bad ``pin_users`` (``check_pins``).

    Cost: ``pick`` is O(R) for R live replicas; O(R log R) for a pinned user.
    """

    def __init__(self, replicas: Iterable[Hashable] = (), pin_users: Mapping[str, int] | None = None) -> None:
        self.pin_users = check_pins(pin_users)
        self._load: dict[Hashable, ReplicaLoad] = {}
        self._sent: dict[Hashable, int] = {}
        self._last_pick: dict[Hashable, int] = {}
        self._clock = itertools.count(1)
        self._mine: dict[Hashable, dict[str, int]] = {}  # replica -> user -> sent, not done (none: absent)
        # requests in transit, for replicas that report by_user: the users of the sends not yet counted
        # in the replica's ``received``, in send order (taken as arrival order), and their count per user
        self._transit: dict[Hashable, deque[str | None]] = {}
        self._transit_user: dict[Hashable, dict[str, int]] = {}  # replica -> user -> in transit (none: absent)
        self._acked: dict[Hashable, int] = {}  # replica -> sends its reports have counted
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
        self._mine[replica] = {}
        self._transit[replica] = deque()
        self._transit_user[replica] = {}
        self._acked[replica] = self._sent[replica]
        self.picks.setdefault(replica, 0)

    def remove(self, replica: Hashable) -> None:
        """Stop routing to ``replica`` (it died or was drained); unknown ids are ignored."""
        self._load.pop(replica, None)
        self._sent.pop(replica, None)
        self._mine.pop(replica, None)
        self._transit.pop(replica, None)
        self._transit_user.pop(replica, None)
        self._acked.pop(replica, None)

    def done(self, replica: Hashable, user: str) -> None:
        """A request of ``user`` sent to ``replica`` finished (or was aborted or refused)."""
        mine = self._mine.get(replica)
        if mine is not None and mine.get(user, 0) > 0:
            mine[user] -= 1
            if not mine[user]:
                del mine[user]  # per-user state only while the user has requests there

    def report(self, replica: Hashable, load: ReplicaLoad) -> None:
        """Take ``replica``'s latest load report (ignored for a replica not routed to); the sends it
        counts as received leave the in-transit list, oldest first."""
        if replica in self._load:
            self._load[replica] = load
            transit, counts = self._transit[replica], self._transit_user[replica]
            arrived = min(load.received, self._sent[replica]) - self._acked[replica]
            for _ in range(max(0, arrived)):
                user = transit.popleft()
                if user is not None:
                    counts[user] -= 1
                    if not counts[user]:
                        del counts[user]
            self._acked[replica] += max(0, arrived)

    def pending(self, replica: Hashable) -> int:
        """Requests sent to ``replica`` that its last report did not count yet (>= 0)."""
        return max(0, self._sent[replica] - self._load[replica].received)

    def score(self, replica: Hashable, user: str | None = None) -> tuple[int, int, int]:
        """The sort key ``pick`` minimises: (waiting + pending + the user's unfinished requests
        there, -free KV blocks, last pick)."""
        load = self._load[replica]
        mine = 0
        if user is not None:
            if load.by_user is None:  # the router's own count (``done``)
                mine = self._mine[replica].get(user, 0)
            else:  # the replica's, plus what was sent since its report
                mine = load.by_user.get(user, 0) + self._transit_user[replica].get(user, 0)
        return (load.waiting + self.pending(replica) + mine, -load.free_kv_blocks, self._last_pick[replica])

    def pinned(self, user: str | None, exclude: Iterable[Hashable] = ()) -> Hashable | None:
        """The replica ``user`` is pinned to now, or ``None`` (not pinned; no live replica at its
        index; or that replica is in ``exclude``): then the load rule decides.

        Departs from the load rule on purpose: a pinned user's requests all go to one replica
        whatever its load; fairness between users is left to the (shared) counters.
        """
        index = self.pin_users.get(user) if user is not None else None
        if index is None:
            return None
        live = sorted(self._load)  # type: ignore[type-var]
        if index >= len(live) or live[index] in set(exclude):
            return None
        return live[index]

    def pick(self, user: str | None = None, exclude: Iterable[Hashable] = ()) -> Hashable:
        """The replica for the next request of ``user``; counts it as sent there.

        Args:
            user: the request's user (``None``: load alone). Call ``done(replica, user)`` when
                the request ends. A pinned user (``pin_users``) goes to its replica if there is
                one (``pinned``), else by load.
            exclude: replicas not to pick (e.g. an affinity constraint).

        Raises:
            NoReplicaError: no live replica outside ``exclude``.
        """
        ex = set(exclude)
        pin = self.pinned(user, ex)
        if pin is not None:
            self.note_sent(pin, user)
            return pin
        best = None
        best_key = None
        for r in self._load:
            if r in ex:
                continue
            k = self.score(r, user)
            if best_key is None or k < best_key:
                best, best_key = r, k
        if best is None:
            raise NoReplicaError("no live replica to route to")
        self.note_sent(best, user)
        return best

    def note_sent(self, replica: Hashable, user: str | None = None) -> None:
        """Count a request of ``user`` as sent to ``replica`` (``pick`` does it; a router that
        learns where a request went after the fact, as Ray Serve's does, calls it instead)."""
        self._sent[replica] += 1
        self._last_pick[replica] = next(self._clock)
        self.picks[replica] += 1
        self._transit[replica].append(user)
        if user is not None:
            if self._load[replica].by_user is None:  # the router counts them itself (``done``)
                mine = self._mine[replica]
                mine[user] = mine.get(user, 0) + 1
            counts = self._transit_user[replica]
            counts[user] = counts.get(user, 0) + 1
