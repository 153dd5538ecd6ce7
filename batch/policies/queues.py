"""Per-user waiting queues: O(1) arrival and head removal, lazy removal elsewhere, preempted
requests back in arrival order (used by ``VTCPolicy`` and ``RoundRobinPolicy``)."""
from __future__ import annotations

from bisect import insort
from collections import deque
from heapq import merge
from typing import Any, Iterator


class _UserQueue:
    """One user's waiting requests: fresh arrivals in arrival order, plus the preempted ones
    (kept sorted by ``arrival_no``, so each keeps its place ahead of later arrivals)."""

    __slots__ = ("fresh", "requeued", "live")

    def __init__(self) -> None:
        self.fresh: deque[Any] = deque()
        self.requeued: list[Any] = []
        self.live = 0


class _Waiting:
    """Per-user FIFO queues with O(1) push and head removal and lazy removal elsewhere.

    A request removed from the middle of ``fresh`` (backfill, abort) is marked gone and dropped
    when it reaches the head; ``iter_user`` skips it. A preempted request lives in ``requeued``
    (its old ``fresh`` entry, if any, stays marked gone).
    """

    __slots__ = ("users", "gone", "n")

    def __init__(self) -> None:
        self.users: dict[str, _UserQueue] = {}
        self.gone: set[Any] = set()
        self.n = 0

    def push(self, seq: Any) -> bool:
        """Append a new arrival; True when its user was not backlogged before."""
        q = self.users.get(seq.user_id)
        if q is None:
            q = self.users[seq.user_id] = _UserQueue()
        q.fresh.append(seq)
        q.live += 1
        self.n += 1
        return q.live == 1

    def push_front(self, seq: Any) -> bool:
        """Put a preempted request back by its arrival order; True when its user was idle."""
        q = self.users.get(seq.user_id)
        if q is None:
            q = self.users[seq.user_id] = _UserQueue()
        insort(q.requeued, seq, key=_arrival)
        q.live += 1
        self.n += 1
        return q.live == 1

    def discard(self, seq: Any) -> bool:
        """Remove a waiting request; True when its user has nothing left waiting.

        Raises:
            KeyError: ``seq``'s user has nothing waiting, or ``seq`` was already removed.
        """
        q = self.users.get(seq.user_id)
        if q is None:
            raise KeyError(f"{getattr(seq, 'request_id', seq)!r} is not waiting")
        if seq in q.requeued:  # short: bounded by the requests preempted while the user waits
            q.requeued.remove(seq)
        elif q.fresh and q.fresh[0] is seq:
            q.fresh.popleft()
        elif seq in self.gone:
            raise KeyError(f"{getattr(seq, 'request_id', seq)!r} was already removed")
        else:
            self.gone.add(seq)  # O(1): its entry in `fresh` is dropped when it reaches the head
        q.live -= 1
        self.n -= 1
        if q.live == 0:
            for s in q.fresh:
                self.gone.discard(s)
            del self.users[seq.user_id]
        else:
            while q.fresh and q.fresh[0] in self.gone:
                self.gone.discard(q.fresh.popleft())
        return q.live == 0

    def backlogged(self, user: str) -> bool:
        """Whether ``user`` has a waiting request."""
        return user in self.users

    def min_arrival(self, user: str) -> int:
        """The smallest arrival number among ``user``'s waiting requests (it has one)."""
        q = self.users[user]
        if not q.requeued:
            return q.fresh[0].arrival_no
        return min(q.requeued[0].arrival_no, q.fresh[0].arrival_no) if q.fresh else q.requeued[0].arrival_no

    def iter_user(self, user: str) -> Iterator[Any]:
        """The user's waiting requests, oldest arrival first (a lazy snapshot)."""
        q = self.users[user]
        gone = self.gone
        fresh: Iterator[Any] = (s for s in q.fresh if s not in gone) if gone else iter(q.fresh)
        return merge(q.requeued, fresh, key=_arrival) if q.requeued else fresh


def _arrival(seq: Any) -> int:
    return seq.arrival_no
