"""``/metrics`` for N replicas: each replica's own ``ServerMetrics`` (``batch.server.metrics``, the
single-process server's metrics, unchanged), collected on the replica and pushed as a snapshot to a
``MetricsBoard``; the ingress renders the latest snapshot of every replica with a ``replica`` label,
plus its own families (the client's retries, the requests it refused), as one Prometheus text.

A snapshot is the list of ``prometheus_client`` ``Metric`` families (``registry.collect()``),
which pickle as plain objects, so nothing is parsed back from text. A replica's series are
at most one push period old, and vanish once its last snapshot is older than the board's
``max_age_s`` (a dead or removed replica). Needs ``prometheus_client`` (the ``serve`` extra); no Ray.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

__all__ = ["MetricsBoard", "render_replicas", "REPLICA_LABEL"]

#: The label every replica's sample gets: the replica's id.
REPLICA_LABEL = "replica"


class MetricsBoard:
    """The latest metrics snapshot of each replica (on Ray: one actor, ``ray_serve.MetricsBoardActor``).

    Args:
        clock: seconds, monotone (``time.monotonic``); for the snapshots' age.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[str, tuple[float, list[Metric]]] = {}  # replica -> (time put, families)

    def put(self, replica_id: str, families: list[Metric]) -> None:
        """Store ``replica_id``'s snapshot (replacing its previous one).

        Raises:
            ValueError: ``replica_id`` is empty.
        """
        if not replica_id:
            raise ValueError("replica_id must be a non-empty string")
        self._latest[replica_id] = (self._clock(), list(families))

    def snapshots(self, max_age_s: float) -> dict[str, list[Metric]]:
        """replica -> its latest families, for the snapshots put at most ``max_age_s`` seconds ago
        (older ones are dropped from the board: their replica stopped pushing).

        Raises:
            ValueError: ``max_age_s`` not > 0.
        """
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0 seconds, got {max_age_s!r}")
        now = self._clock()
        for rid in [r for r, (t, _) in self._latest.items() if now - t > max_age_s]:
            del self._latest[rid]
        return {rid: fams for rid, (_, fams) in self._latest.items()}


class _Families:
    """A collector that yields the families it was given."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        """The given families."""
        return iter(self._families)


def render_replicas(snapshots: Mapping[str, Iterable[Metric]], own: Iterable[Metric] = ()) -> bytes:
    """One Prometheus text exposition of every replica's families, each sample labelled
    ``replica="<id>"``, merged by family name (one ``# HELP``/``# TYPE`` per family), with the
    ingress's own families ``own`` (samples unlabelled by replica) merged in the same way.

    Args:
        snapshots: replica id -> its families (``MetricsBoard.snapshots``).
        own: the ingress's families (e.g. ``CounterMetricFamily``).

    Returns:
        The text, UTF-8 (``batch.server.metrics.CONTENT_TYPE``).

    Raises:
        ValueError: two families of one name with different types (replicas running different code),
            or a sample that already has a ``replica`` label.
    """
    merged: dict[str, Metric] = {}

    def add(family: Metric, replica: str | None) -> None:
        m = merged.get(family.name)
        if m is None:
            m = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        elif m.type != family.type:
            raise ValueError(f"metric {family.name}: type {family.type} here, {m.type} elsewhere")
        for s in family.samples:
            if replica is None:
                m.samples.append(s)
                continue
            if REPLICA_LABEL in s.labels:
                raise ValueError(f"metric {s.name} already has a {REPLICA_LABEL!r} label")
            m.samples.append(s._replace(labels={**s.labels, REPLICA_LABEL: replica}))

    for rid in sorted(snapshots):
        for fam in snapshots[rid]:
            add(fam, rid)
    for fam in own:
        add(fam, None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
