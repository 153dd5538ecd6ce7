"""Per-user service counters shared by the replicas of a scale-out deployment.

Each replica runs its own ``Scheduler`` with a ``GlobalVTCPolicy``: VTC whose counter for a user
is the replica's own counter (its local service and lifts) plus the service the *other* replicas
granted that user, as last read from a ``GlobalCounters`` store, plus the lifts the others made.
Every ``period_s`` a replica calls ``GlobalVTCPolicy.sync(store)``: it publishes the service it
granted since its last sync (deltas, counter units) and its users' lift levels, and reads back the
others' service totals and the global lift levels in the same call (one round trip; the Ray
deployment holds the store in one actor, ``batch.scaleout.ray_serve``).

A user's global counter is ``c_u = S_u + L_u``: ``S_u`` its service on all replicas (summed),
``L_u`` its lift level, the most any replica lifted it (a max-register, not a sum: two replicas
lifting the same returning user at once, each unaware of the other, lift it once). On one replica
this is VTC's counter exactly (its lifts add up to the level). Every replica's view stays at or
below ``c_u`` (``docs/scale-out.md`` section 2 needs it: a lift kept on one replica would put that
replica's view above the counter the others see), exactly when every weight divides
``COUNTER_SCALE`` (weights 1..16 do); otherwise the replica's own counter rounds each charge up
when it folds it and ``take_deltas`` once per sync, so a view can differ from ``c_u`` by a few
counter units (well under one weighted token).

Staleness: a replica's view of another's service lags by at most ``S`` seconds, where ``S = P``
when all replicas sync at the same instants (the virtual-clock simulation) and, on Ray, where they
sync on their own timers and each engine call waits for the current tick,
``S <= 2 * (P + tick + round trip) + tick`` (one period before the other publishes, one before this
one reads, the ticks in between). ``docs/scale-out.md`` derives what ``S`` costs the counter-gap bound.

Standard library only.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from batch.policies.vtc import VTCPolicy
from spec import fairness_rules as fr

__all__ = ["GlobalCounters", "GlobalVTCPolicy", "GapObserver", "SyncReply", "PendingSync"]


class SyncReply(NamedTuple):
    """What a replica reads back at a sync (counter units).

    Attributes:
        service: user -> service published by every replica but the caller.
        lifts: user -> lift level (the most any replica lifted the user; absent: 0).
        forgotten: users the store forgot since this replica's last sync (``GlobalCounters``,
            ``forget_idle``): their published counters carried no information; the replica's
            policy forgets them too where they are idle (``forget_users``).
    """

    service: dict[str, int]
    lifts: dict[str, int]
    forgotten: tuple[str, ...] = ()


class PendingSync:
    """What a replica has taken for the store but not yet delivered: service deltas (summed) and
    lift levels (the highest kept: levels are absolute). A sync that fails keeps them for the next.

    Attributes:
        deltas: user -> counter units of service not yet published.
        lifts: user -> lift level not yet published, counter units.
    """

    def __init__(self) -> None:
        self.deltas: dict[str, int] = {}
        self.lifts: dict[str, int] = {}

    def add(self, deltas: Mapping[str, int], lifts: Mapping[str, int]) -> None:
        """Add ``deltas`` to the pending service and keep the higher of each lift level."""
        for u, d in deltas.items():
            self.deltas[u] = self.deltas.get(u, 0) + d
        for u, level in lifts.items():
            if level > self.lifts.get(u, 0):
                self.lifts[u] = level

    def clear(self) -> None:
        """They were delivered."""
        self.deltas, self.lifts = {}, {}


def _check_units(what: str, values: Mapping[str, int]) -> None:
    for user, d in values.items():
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{what} of user {user!r} must be an int >= 0 counter units, got {d!r}")


class GlobalCounters:
    """The shared store: each replica's published service per user, and each user's lift level.

    Counter units are ``spec.fairness_rules.COUNTER_SCALE`` per weighted token (a charge already
    divided by the user's weight). Totals only grow: the service of a replica that died stays
    counted. A lift level is a max-register: a publish keeps the larger of the stored and the new
    level. Thread-safe (one lock); as a Ray actor its methods run one at a time anyway.

    **Forgetting** (``forget_idle``): at each ``sync`` that reports the replica's state, the store
    forgets every user that is idle on every replica (nothing waiting or resident in any replica's
    latest report) and whose global counter ``c_u`` is at or below what the lift would give it
    back on return: ``forgettable(c_u, lift_floor(0, m, True, T))``, i.e.
    ``c_u <= m - T - 1``, ``m`` the least global counter among the users waiting on any replica and
    ``T`` at least the tolerance the policy lifts with, counter units (``VTCPolicy`` lifts at
    ``fairness_rules.LIFT_TOLERANCE_TOKENS``, 0, whatever its band; the Ray deployment passes the
    band, ``TOLERANCE_TOKENS``, which forgets less). Such a counter carries no information: on return
    the user is lifted to at least ``m - T - 1`` whether it is remembered or not (docs/scale-out.md,
    "Forgetting idle users"). Its service, lift level and per-replica entries are dropped, and each
    replica hears of it in its next ``SyncReply.forgotten`` so that its policy forgets the user too
    (a store that forgot while a replica's policy remembered would restart the user's published
    service from 0 under that replica's raise-only offsets). Nothing is forgotten while nobody
    waits (no lift to come back to), nor while a replica that published has not reported its state.
    A replica silent for ``stale_replica_s`` is dropped from the reports (a dead one would otherwise
    pin its last users and collect news forever); its published service stays counted.

    Args:
        forget_idle: forget as above (off: totals are kept for the life of the store).
        tolerance_units: ``T`` above, counter units: at least the policy's lift tolerance
            (``LIFT_TOLERANCE_TOKENS * COUNTER_SCALE``, 0); every replica uses the same.
        stale_replica_s: seconds without a sync after which a replica's report no longer counts.
        clock: seconds (default ``time.monotonic``).

    Raises:
        ValueError: ``tolerance_units`` not an int >= 0, or ``stale_replica_s`` not > 0.
    """

    def __init__(self, *, forget_idle: bool = False, tolerance_units: int = 0, stale_replica_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(tolerance_units, bool) or not isinstance(tolerance_units, int) or tolerance_units < 0:
            raise ValueError(f"tolerance_units must be an int >= 0, got {tolerance_units!r}")
        if not stale_replica_s > 0:
            raise ValueError(f"stale_replica_s must be > 0 seconds, got {stale_replica_s!r}")
        self._by_replica: dict[str, dict[str, int]] = {}
        self._total: dict[str, int] = {}
        self._lift: dict[str, int] = {}
        self._lock = threading.Lock()
        self.syncs = 0
        self.observer: GapObserver | None = None
        self.forget_idle = forget_idle
        self.tolerance_units = tolerance_units
        self.stale_replica_s = stale_replica_s
        self.clock = clock
        self._waiting: dict[str, frozenset[str]] = {}  # replica -> users waiting there (its latest report)
        self._active: dict[str, frozenset[str]] = {}  # replica -> users waiting or resident there
        self._seen_s: dict[str, float] = {}  # replica -> time of its latest report (live ones)
        self._reported: set[str] = set()  # replicas that ever reported their state
        self._news: dict[str, list[str]] = {}  # replica -> users forgotten since its last sync
        self.forgotten = 0  # users forgotten so far

    def publish(self, replica_id: str, deltas: Mapping[str, int], lifts: Mapping[str, int] | None = None) -> None:
        """Add ``deltas`` (user -> counter units >= 0) to ``replica_id``'s published service, and
        raise each user's lift level to ``lifts[user]`` (counter units >= 0) where that is higher.

        Raises:
            ValueError: a delta or a lift level is not an int >= 0 (nothing is changed then).
        """
        _check_units("delta", deltas)
        _check_units("lift level", lifts or {})
        with self._lock:
            self._publish(replica_id, deltas, lifts or {})

    def _publish(self, replica_id: str, deltas: Mapping[str, int], lifts: Mapping[str, int]) -> dict[str, int]:
        """Under the lock; returns the rise of each lift level it raised."""
        own = self._by_replica.setdefault(replica_id, {})
        for user, d in deltas.items():
            if d:
                own[user] = own.get(user, 0) + d
                self._total[user] = self._total.get(user, 0) + d
        rose = {}
        for user, level in lifts.items():
            old = self._lift.get(user, 0)
            if level > old:
                self._lift[user] = level
                rose[user] = level - old
        return rose

    def others(self, replica_id: str) -> dict[str, int]:
        """user -> counter units published by every replica but ``replica_id`` (O(users))."""
        with self._lock:
            own = self._by_replica.get(replica_id, {})
            return {u: t - own.get(u, 0) for u, t in self._total.items()}

    def lifts(self) -> dict[str, int]:
        """user -> lift level, counter units (users never lifted are absent)."""
        with self._lock:
            return dict(self._lift)

    def reply(self, replica_id: str) -> SyncReply:
        """``SyncReply(others(replica_id), lifts())``: what a replica reads (also at its start)."""
        with self._lock:
            return self._reply_locked(replica_id)

    def _reply_locked(self, replica_id: str) -> SyncReply:
        own = self._by_replica.get(replica_id, {})
        news = self._news.get(replica_id)
        if news:
            self._news[replica_id] = []
        return SyncReply({u: t - own.get(u, 0) for u, t in self._total.items()}, dict(self._lift),
                         tuple(news or ()))

    def sync(self, replica_id: str, deltas: Mapping[str, int], state: Mapping[str, Any] | None = None,
             lifts: Mapping[str, int] | None = None) -> SyncReply:
        """``publish(replica_id, deltas, lifts)`` then ``reply(replica_id)``, in one step under the
        lock: one round trip.

        ``state`` (optional): the replica's ``{"waiting": [users], "resident": {user: requests}}``
        at this sync: what forgetting goes by (``forget_idle``), and handed to ``observer`` (a
        ``GapObserver``) if one is set.

        Raises:
            ValueError: as ``publish`` (nothing is changed then).
        """
        _check_units("delta", deltas)
        _check_units("lift level", lifts or {})
        with self._lock:
            rose = self._publish(replica_id, deltas, lifts or {})
            self.syncs += 1
            if state is not None:
                waiting = frozenset(state.get("waiting", ()))
                self._waiting[replica_id] = waiting
                self._active[replica_id] = waiting | frozenset(state.get("resident", {}))
                self._seen_s[replica_id] = self.clock()
                self._reported.add(replica_id)
                self._news.setdefault(replica_id, [])
            if self.observer is not None and state is not None:
                rises = dict(deltas)
                for u, r in rose.items():
                    rises[u] = rises.get(u, 0) + r
                self.observer.observe(replica_id, rises, state, self._counters_locked())
            if self.forget_idle and state is not None:
                self._forget_locked()
            return self._reply_locked(replica_id)

    def _forget_locked(self) -> list[str]:
        """Under the lock: forget the users whose counters carry no information (class doc);
        returns them. O(users)."""
        now = self.clock()
        for r in [r for r, t in self._seen_s.items() if now - t > self.stale_replica_s]:
            for d in (self._waiting, self._active, self._seen_s, self._news):
                d.pop(r, None)
        if any(r not in self._reported for r in self._by_replica):
            return []  # a replica that published never reported what is active there
        waiting = frozenset().union(*self._waiting.values())
        if not waiting:
            return []  # nobody to be lifted against: a returning user would keep its own counter
        total, lift = self._total, self._lift
        least = min(total.get(u, 0) + lift.get(u, 0) for u in waiting)
        tol = self.tolerance_units
        floor = fr.lift_floor(0, least, True, tol)  # at most what a returning user is lifted to, anywhere
        if floor <= 0:
            return []
        active = frozenset().union(*self._active.values())
        gone = [u for u in {*total, *lift} if u not in active
                and fr.forgettable(total.get(u, 0) + lift.get(u, 0), floor)]
        for u in gone:
            total.pop(u, None)
            lift.pop(u, None)
            for own in self._by_replica.values():
                own.pop(u, None)
        if gone:
            for news in self._news.values():
                news.extend(gone)
            self.forgotten += len(gone)
        return gone

    def size(self) -> dict[str, int]:
        """How much the store holds: ``users`` (with service or a lift level), ``entries``
        (per-replica service entries), ``pending_news`` (forgotten users not yet told to a
        replica), ``forgotten`` (so far)."""
        with self._lock:
            return {"users": len({*self._total, *self._lift}),
                    "entries": sum(len(m) for m in self._by_replica.values()),
                    "pending_news": sum(len(n) for n in self._news.values()), "forgotten": self.forgotten}

    def process(self) -> dict[str, int | None]:
        """The store's process: ``pid`` and ``rss_bytes`` (resident memory, from
        ``/proc/self/statm``; ``None`` where there is none): the Ray actor's, for ``/metrics``."""
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = None
        return {"pid": os.getpid(), "rss_bytes": rss}

    def observe_gap(self, staleness_s: float) -> None:
        """Start measuring the counter gap and its bound's terms at each sync (``GapObserver``)."""
        self.observer = GapObserver(staleness_s)

    def gap_stats(self) -> dict[str, Any] | None:
        """The ``GapObserver``'s figures (``None`` if not observing)."""
        return None if self.observer is None else self.observer.stats()

    def totals(self) -> dict[str, int]:
        """user -> service (counter units) published by all replicas."""
        with self._lock:
            return dict(self._total)

    def counters(self) -> dict[str, int]:
        """user -> published global counter ``S_u + L_u`` (service plus lift level), counter units."""
        with self._lock:
            return self._counters_locked()

    def _counters_locked(self) -> dict[str, int]:
        out = dict(self._total)
        for u, level in self._lift.items():
            out[u] = out.get(u, 0) + level
        return out

    def by_replica(self) -> dict[str, dict[str, int]]:
        """replica id -> user -> counter units it published (a copy)."""
        with self._lock:
            return {r: dict(m) for r, m in self._by_replica.items()}


class GapObserver:
    """Measures, at each sync the store receives, what ``docs/scale-out.md``'s bound is about.

    From the replicas' published counters (service plus lift level, each replica's part as of its
    own last sync) and their reported states: the largest difference of global counter between two
    users waiting on every replica that has reported (``max_gap_tokens``, weighted tokens); the most
    requests one user held resident on all replicas (``max_resident``, summing each replica's last
    report); and the most one user's published counter rose (service and lift) within
    ``staleness_s`` seconds (``max_window_tokens``: the measured ``D``). The counters lag by up to
    one period per replica, so the gap is measured to within ``D``.

    Args:
        staleness_s: the window for ``D``, seconds (S: ``2 * (period_s + tick + round trip) + tick`` on Ray).
        clock: seconds (default ``time.monotonic``).
    """

    def __init__(self, staleness_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.staleness_s = staleness_s
        self.clock = clock
        self.max_gap_tokens = 0.0
        self.max_resident: dict[str, int] = {}
        self.max_window_tokens = 0.0
        self._waiting: dict[str, set[str]] = {}
        self._resident: dict[str, dict[str, int]] = {}
        self._log: deque[tuple[float, str, int]] = deque()
        self._window: dict[str, int] = {}

    def observe(self, replica_id: str, rises: Mapping[str, int], state: Mapping[str, Any],
                counters: Mapping[str, int]) -> None:
        """Take one replica's sync: ``rises`` (user -> rise of the published counter, counter
        units: its service plus any lift-level rise), its ``state``, the store's ``counters``."""
        now = self.clock()
        for user, d in rises.items():
            if d:
                self._log.append((now, user, d))
                self._window[user] = self._window.get(user, 0) + d
        while self._log and self._log[0][0] < now - self.staleness_s:
            _, user, d = self._log.popleft()
            self._window[user] -= d
        if self._window:
            self.max_window_tokens = max(self.max_window_tokens, max(self._window.values()) / fr.COUNTER_SCALE)
        self._waiting[replica_id] = set(state.get("waiting", ()))
        self._resident[replica_id] = dict(state.get("resident", {}))
        every = set.intersection(*self._waiting.values()) if self._waiting else set()
        if len(every) >= 2:
            vals = [counters.get(u, 0) for u in every]
            self.max_gap_tokens = max(self.max_gap_tokens, (max(vals) - min(vals)) / fr.COUNTER_SCALE)
        summed: dict[str, int] = {}
        for res in self._resident.values():
            for u, n in res.items():
                summed[u] = summed.get(u, 0) + n
        for u, n in summed.items():
            if n > self.max_resident.get(u, 0):
                self.max_resident[u] = n

    def stats(self) -> dict[str, Any]:
        """``{"max_gap_tokens", "max_resident", "max_window_tokens", "staleness_s"}``."""
        return {"max_gap_tokens": self.max_gap_tokens, "max_resident": dict(self.max_resident),
                "max_window_tokens": self.max_window_tokens, "staleness_s": self.staleness_s}


class GlobalVTCPolicy(VTCPolicy):
    """``VTCPolicy`` whose counters are the replica's view of the global counters.

    ``counter(user)`` is the replica's own VTC counter (its service and the lifts it made) plus
    ``offset(user)``, the service the other replicas published for ``user`` at the last ``sync``,
    plus what brings the user's lift up to the global lift level read at that sync. So the view is
    ``own service + others' service as last read + lift level as known here``, never above the
    global counter ``c_u = S_u + L_u`` (module doc). A lift (``VTCPolicy``'s lift of a returning
    user, taken on the view) raises this replica's lift level for the user by the lift, and the
    level is published at the next sync. Views only grow (published service never goes back, a
    lift level is a max), so counters stay monotone and the policy's lazy heap (stored keys never
    above the true ones) stays valid between syncs. With no sync ever run it is exactly
    ``VTCPolicy``: one replica needs nothing shared.

    Departs from single-replica VTC on purpose: between syncs the other replicas' service and lifts
    are unseen, so a user can run ahead on the global counters by what it was granted elsewhere in
    one staleness period (``docs/scale-out.md``, section 2).

    Args:
        replica_id: this replica's name in the store (non-empty str).
        **kwargs: ``VTCPolicy``'s (weights, tolerance, prices, ...): every replica must be built
            with the same weights and prices, or the published units mean different things.

    Raises:
        ValueError: ``replica_id`` is not a non-empty str, or what ``VTCPolicy`` raises.
    """

    def __init__(self, *, replica_id: str = "r0", **kwargs: Any) -> None:
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError(f"replica_id must be a non-empty str, got {replica_id!r}")
        super().__init__(**kwargs)
        self.replica_id = replica_id
        self._offset: dict[str, int] = {}  # user -> others' service, counter units, as last synced
        self._add: dict[str, int] = {}  # user -> what the view adds to the own counter: offset + lift catch-up
        self._lift_level: dict[str, int] = {}  # user -> its lift level as known here, counter units
        self._lift_changed: set[str] = set()  # users whose level rose here since the last take_lifts
        self._unpublished: dict[str, list[int]] = {}  # user -> [prompt, output] tokens since the last sync
        self._pending = PendingSync()  # taken for the store, not yet delivered (``sync``)
        self.service_units: dict[str, int] = {}  # user -> service this replica granted, counter units

    def counter(self, user: str) -> int:
        """The user's counter on the global view, counter units (class doc)."""
        return super().counter(user) + self._add.get(user, 0)

    def offset(self, user: str) -> int:
        """The other replicas' service to ``user`` as last synced, counter units (0 if none)."""
        return self._offset.get(user, 0)

    def lift_level(self, user: str) -> int:
        """The user's lift level as known here (its own lifts and the level last read), counter units."""
        return self._lift_level.get(user, 0)

    def lift_levels(self) -> dict[str, int]:
        """user -> ``lift_level(user)`` for every user lifted here or read lifted (a copy)."""
        return dict(self._lift_level)

    def lift(self, user: str) -> None:
        before = self.counter(user)
        super().lift(user)
        rise = self.counter(user) - before
        if rise:
            self._lift_level[user] = self._lift_level.get(user, 0) + rise
            self._lift_changed.add(user)

    def charge(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """``VTCPolicy.charge``, and remember the tokens for the next ``sync``. O(1)."""
        super().charge(user_id, prompt_tokens, output_tokens)
        acc = self._unpublished.get(user_id)
        if acc is None:
            self._unpublished[user_id] = [prompt_tokens, output_tokens]
        else:
            acc[0] += prompt_tokens
            acc[1] += output_tokens

    def on_idle(self, user_id: str) -> None:
        """Forgets nothing on its own (a view adds the others' service as last synced, which a
        forgotten own counter would not restore): the store says whom to forget (``forget_users``)."""
        self._active.discard(user_id)

    def take_deltas(self) -> dict[str, int]:
        """The service granted since the last call, user -> counter units (weighted, rounded up
        once per call as ``charged_counter`` does); clears it. Adds it to ``service_units``."""
        out: dict[str, int] = {}
        for user, (p, o) in self._unpublished.items():
            units = fr.charged_counter(0, fr.service_units(p, o, self.prompt_price, self.output_price),
                                       self.weight(user))
            out[user] = units
            self.service_units[user] = self.service_units.get(user, 0) + units
        self._unpublished = {}
        return out

    def take_lifts(self) -> dict[str, int]:
        """user -> lift level (counter units) for each user whose level rose here by a lift since
        the last call; clears the list. Levels are absolute: sending one twice is harmless."""
        out = {u: self._lift_level[u] for u in self._lift_changed}
        self._lift_changed = set()
        return out

    def set_offsets(self, others: Mapping[str, int]) -> None:
        """Take the others' service (user -> counter units) as the new offsets; an offset never
        goes down (a smaller reading, e.g. from a store that lost a replica's entry, is ignored)."""
        self._raise_to(self._offset, others)

    def set_lifts(self, levels: Mapping[str, int]) -> None:
        """Raise each user's lift level here to the global one read (user -> counter units); a
        lower reading is ignored. The view rises by the difference."""
        self._raise_to(self._lift_level, levels)

    def _raise_to(self, known: dict[str, int], readings: Mapping[str, int]) -> None:
        """Raise ``known[user]`` to each higher reading, and the user's view by as much."""
        add = self._add
        for user, v in readings.items():
            old = known.get(user, 0)
            if v > old:
                known[user] = v
                add[user] = add.get(user, 0) + v - old

    def take_reply(self, reply: SyncReply) -> None:
        """``set_offsets(reply.service)`` and ``set_lifts(reply.lifts)``."""
        self.set_offsets(reply.service)
        self.set_lifts(reply.lifts)

    def sync(self, store: Any) -> None:
        """Publish the deltas and lift levels to ``store`` and read the others' back: ``store.sync``.

        ``store`` is a ``GlobalCounters`` or anything with its ``sync(replica_id, deltas, lifts=)``.
        If ``store.sync`` raises, what was taken stays pending and goes with the next sync.
        """
        pending = self._pending
        pending.add(self.take_deltas(), self.take_lifts())
        reply = store.sync(self.replica_id, pending.deltas, lifts=pending.lifts)
        pending.clear()
        self.take_reply(reply)

    def forget_users(self, users: Iterable[str]) -> None:
        """Drop what this replica knows of ``users`` the store forgot, where they are idle here:
        their counter, offset, lift level and unpublished service (a forgotten user reads 0
        everywhere, and the store's rule makes that what its return would give it)."""
        for u in users:
            if u not in self._active:
                for known in (self._counter, self._offset, self._add, self._lift_level, self._unpublished):
                    known.pop(u, None)
                self._lift_changed.discard(u)

    def waiting_users(self) -> list[str]:
        """Users with a request waiting in this policy's queue."""
        return list(self._queues)
