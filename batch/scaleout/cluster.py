"""N replicas in one process on virtual clocks: the router, the shared counters and the retry rule.

``LocalCluster`` is the scale-out design without Ray: each replica is a ``Scheduler`` with a
``GlobalVTCPolicy`` on its own simulated GPU and ``VirtualClock`` (replicas run in parallel, so
each has its own clock; a discrete-event loop always runs the event that comes first: a kill, a
counter sync, an arrival, or the tick of the replica whose clock is earliest). The router
(``Router``) places each arrival; every ``period_s`` of simulated time all live replicas publish
their service and lift levels to one ``GlobalCounters`` and then all read the others' (lockstep, so the
staleness is ``S = period_s``); ``period_s = 0`` syncs a replica before each of its ticks
(staleness: the other replicas' iterations in progress).

The retry rule (``LocalCluster.kill``): when a replica dies, every request it held and had not
finished (waiting, prefilling, decoding or preempted) is routed again, by the same rule, among the
live replicas and submitted there as a fresh request: **the tokens it had generated are discarded**
and recomputed (``Scheduler.submit`` gives it an empty ``generated``). Under a deterministic backend
(the seeded simulated GPU, greedy decoding) the recomputed tokens are the same ones, so a stream
that already delivered ``k`` tokens can skip the first ``k`` of the retry. Its arrival time is kept
(``arrival_s``) for TTFT; the service the dead replica granted since its last sync is lost from the
shared counters (at most one period's), and the retry is charged again where it reruns. Killing the
last live replica while it holds unfinished requests is refused (``NoReplicaError``; nothing is
dropped).

Standard library only (``bench/scaleout_sim.py`` drives it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from batch.scaleout.counters import GlobalCounters, GlobalVTCPolicy
from batch.scaleout.router import NoReplicaError, ReplicaLoad, Router
from inference_stub import Request, SimulatedGPU, VirtualClock
from scheduler import RequestError, Scheduler
from spec import fairness_rules as fr

__all__ = ["SimReplica", "LocalCluster", "ClusterResult", "GapMeter"]


@dataclass(eq=False)
class SimReplica:
    """One replica: a ``Scheduler`` with a ``GlobalVTCPolicy`` on its own simulated GPU and clock.

    Attributes:
        replica_id: its name (router and store key).
        clock: its ``VirtualClock`` (seconds).
        gpu: its ``SimulatedGPU`` (advances ``clock``).
        scheduler: its scheduler.
        policy: the scheduler's policy.
        in_flight: ``id(request) -> request`` submitted here and not finished.
        received: requests submitted to it (accepted or refused), a running total.
        alive: False once killed.
        finished_tokens: output tokens of the requests that finished here.
    """

    replica_id: str
    clock: VirtualClock
    gpu: SimulatedGPU
    scheduler: Scheduler
    policy: GlobalVTCPolicy
    in_flight: dict[int, Request] = field(default_factory=dict)
    received: int = 0
    alive: bool = True
    finished_tokens: int = 0

    def load(self) -> ReplicaLoad:
        """Its load report for the router."""
        s = self.scheduler
        return ReplicaLoad(waiting=len(s.policy), running=len(s.running),
                           free_kv_blocks=s.config.kv_cap_blocks - s.pool.num_used, received=self.received)

    def granted_tokens(self, user: str) -> float:
        """Service it granted ``user`` so far (synced or not), weighted tokens."""
        p = self.policy
        units = p.service_units.get(user, 0)
        acc = p._unpublished.get(user)  # the same package's policy
        if acc is not None:
            units += fr.charged_counter(0, fr.service_units(acc[0], acc[1], p.prompt_price, p.output_price),
                                        p.weight(user))
        return units / fr.COUNTER_SCALE

    def backlogged_users(self) -> set[str]:
        """Users with a request waiting here."""
        return set(self.policy.waiting_users())


class GapMeter:
    """The largest service gap between two users over intervals in which both stay backlogged.

    Fed samples ``(service: user -> weighted tokens, backlogged: set of users)``; for each pair
    it tracks the range of ``service_p - service_q`` over the current run of samples in which both
    are backlogged (the interval starts at the sample before: ``bench_fairness.max_service_gap``'s
    measure). ``gap`` is the largest range seen, weighted tokens. O(U^2) a sample.
    """

    def __init__(self) -> None:
        self.gap = 0.0
        self._range: dict[tuple[str, str], list[float]] = {}
        self._prev: dict[str, float] = {}

    def sample(self, service: dict[str, float], backlogged: set[str]) -> None:
        """Take one sample."""
        users = sorted(backlogged)
        live = set()
        for i, f in enumerate(users):
            for g in users[i + 1:]:
                d = service.get(f, 0.0) - service.get(g, 0.0)
                r = self._range.get((f, g))
                if r is None:
                    start = self._prev.get(f, 0.0) - self._prev.get(g, 0.0)
                    r = self._range[(f, g)] = [start, start]
                r[0], r[1] = min(r[0], d), max(r[1], d)
                self.gap = max(self.gap, r[1] - r[0])
                live.add((f, g))
        for k in [k for k in self._range if k not in live]:
            del self._range[k]
        self._prev = dict(service)


@dataclass
class ClusterResult:
    """What ``LocalCluster.run`` produced.

    Attributes:
        finished: requests that finished (any reason), in completion order.
        refused: ``(request, error)`` refused at submit.
        retried: request id -> times it was resubmitted after its replica died.
        arrival_s: ``id(request) -> arrival time`` (seconds), unchanged by retries.
        first_arrival_s, last_completion_s: the run's span on the virtual clocks, seconds.
        gap_tokens: the largest service gap between two users over intervals in which both are
            backlogged on every live replica (``GapMeter``), weighted tokens.
        counter_gap_tokens: the largest difference of global counter (``LocalCluster.counter_tokens``:
            service on all replicas plus lift level) between two users backlogged on every live
            replica at the same sample, weighted tokens. Being backlogged where the other is
            served is the derived bound's premise.
        counter_gap_any_tokens: the same between users waiting on *some* replica: not bounded (a
            user whose backlog is left on one replica cannot be served on the others).
        max_period_rise_tokens: the most any user's global counter rose (service on all
            replicas, and lifts), within one sync period (between two sync instants), weighted
            tokens: the measured ``D`` of docs/scale-out.md. With ``period_s = 0`` (staleness: the others'
            iterations in progress) it is taken between two samples instead, an estimate, not a
            bound (docs/scale-out.md section 2); 0 when never synced.
        max_resident: user -> the most requests it held resident across all replicas after any tick.
        routed: replica id -> requests the router sent there (retries included).
        replica_tokens: replica id -> output tokens of the requests that finished there.
        replica_service: replica id -> user -> weighted tokens granted there.
        share_service: replica id -> user -> weighted tokens granted there while every user was
            backlogged on the cluster (the fair-share window).
        counter_syncs: syncs with the shared store.
    """

    finished: list[Request]
    refused: list[tuple[Request, RequestError]]
    retried: dict[str, int]
    arrival_s: dict[int, float]
    first_arrival_s: float
    last_completion_s: float
    gap_tokens: float
    counter_gap_tokens: float
    counter_gap_any_tokens: float
    max_period_rise_tokens: float
    max_resident: dict[str, int]
    routed: dict[str, int]
    replica_tokens: dict[str, int]
    replica_service: dict[str, dict[str, float]]
    share_service: dict[str, dict[str, float]]
    counter_syncs: int

    @property
    def output_tokens(self) -> int:
        """Output tokens of every finished request."""
        return sum(len(r.generated) for r in self.finished)

    @property
    def throughput_tokens_per_s(self) -> float:
        """Output tokens per second over first arrival to last completion (virtual seconds)."""
        span = self.last_completion_s - self.first_arrival_s
        return self.output_tokens / span if span > 0 else 0.0

    def balance(self) -> float:
        """max / min output tokens over the replicas that finished anything (1.0: perfectly even)."""
        v = [t for t in self.replica_tokens.values()]
        return max(v) / min(v) if v and min(v) > 0 else math.inf

    def ttft_s(self, request: Request) -> float:
        """Time to first token from the request's arrival (retries included), seconds."""
        return request.started_at - self.arrival_s[id(request)]


class LocalCluster:
    """``n`` replicas, a router and the shared counters, in one process on virtual clocks.

    Args:
        replicas: how many (int >= 1).
        period_s: counter sync period, simulated seconds (> 0), or 0: sync a replica before each
            of its ticks. ``None``: never sync (independent replicas: per-replica VTC only).
        seed: the simulated GPUs' token seed (tokens are a pure function of seed, request id and
            position, so a retried request regenerates the same tokens).
        weights: per-user weights, the same on every replica.
        sample_s: how often the fairness meters sample, simulated seconds (default ``period_s``,
            or 0.05 s when that is 0 or ``None``).
        scheduler_kwargs: extra ``Scheduler`` knobs for every replica.
        gpu_kwargs: extra ``SimulatedGPU`` knobs (``base_s``, ``per_request_s``, ``eos_probability``).

    Raises:
        ValueError: ``replicas`` < 1 or ``period_s`` < 0.
    """

    def __init__(self, replicas: int, *, period_s: float | None = 0.05, seed: int = 0,
                 weights: dict[str, int] | None = None, sample_s: float | None = None,
                 scheduler_kwargs: dict[str, Any] | None = None, gpu_kwargs: dict[str, Any] | None = None) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if period_s is not None and not period_s >= 0:
            raise ValueError(f"period_s must be >= 0 seconds or None, got {period_s!r}")
        self.period_s = period_s
        self.sample_s = sample_s or (period_s if period_s else 0.05)
        self.weights = dict(weights or {})
        self.store = GlobalCounters()
        self.replicas: dict[str, SimReplica] = {}
        for i in range(replicas):
            rid = f"r{i}"
            clock = VirtualClock()
            gpu = SimulatedGPU(seed=seed, clock=clock, **(gpu_kwargs or {}))
            policy = GlobalVTCPolicy(replica_id=rid, weights=self.weights)
            sched = Scheduler(clock=clock, backend=gpu, policy=policy, record_itl=False, **(scheduler_kwargs or {}))
            self.replicas[rid] = SimReplica(rid, clock, gpu, sched, policy)
        self.router = Router(self.replicas)
        self.retried: dict[str, int] = {}
        self.arrival_s: dict[int, float] = {}
        self.finished: list[Request] = []
        self.refused: list[tuple[Request, RequestError]] = []
        self._where: dict[int, str] = {}  # id(request) -> replica holding it

    def live(self) -> list[SimReplica]:
        """The live replicas."""
        return [r for r in self.replicas.values() if r.alive]

    # ---------------------------------------------------------------- routing and retry

    def submit(self, request: Request, now_s: float, *, exclude: Iterable[str] = ()) -> str:
        """Route ``request`` (the router's pick) and submit it there at ``now_s``; returns the
        replica id. A refusal (``RequestError``) is recorded in ``refused``, not raised.

        Raises:
            NoReplicaError: no live replica.
        """
        rid = self.router.pick(request.user_id, exclude)
        rep = self.replicas[rid]
        rep.clock.advance_to(now_s)  # an idle replica's clock catches up; a busy one is past it
        rep.received += 1
        self.arrival_s.setdefault(id(request), now_s)
        try:
            rep.scheduler.submit(request)
        except RequestError as e:
            self.refused.append((request, e))
            self.router.done(rid, request.user_id)
        else:
            rep.in_flight[id(request)] = request
            self._where[id(request)] = rid
        self.router.report(rid, rep.load())
        return rid

    def kill(self, replica_id: str, now_s: float) -> list[Request]:
        """Replica ``replica_id`` dies at ``now_s``: stop routing to it and resubmit each request it
        held and had not finished to a live replica (tokens so far discarded: the module's rule).

        Returns:
            the resubmitted requests.

        Raises:
            KeyError: no such replica. NoReplicaError: it is the last live replica and holds
                unfinished requests, which would have nowhere to go: it is *not* killed (nothing
                changes), so no request is dropped.
        """
        rep = self.replicas[replica_id]
        if not rep.alive:
            return []
        if rep.in_flight and not any(r.alive for r in self.replicas.values() if r is not rep):
            raise NoReplicaError(f"refusing to kill {replica_id}, the last live replica: its "
                                 f"{len(rep.in_flight)} unfinished requests would be lost")
        rep.alive = False
        self.router.remove(replica_id)
        moved = list(rep.in_flight.values())
        rep.in_flight.clear()
        for req in moved:
            self.retried[req.request_id] = self.retried.get(req.request_id, 0) + 1
            self.submit(req, now_s)
        return moved

    # ---------------------------------------------------------------- counters

    def sync_all(self) -> None:
        """Lockstep sync: every live replica publishes its deltas and lift levels, then every one
        reads the others' service and the lift levels."""
        live = self.live()
        for r in live:
            self.store.publish(r.replica_id, r.policy.take_deltas(), r.policy.take_lifts())
        for r in live:
            r.policy.take_reply(self.store.reply(r.replica_id))
        self.store.syncs += len(live)

    def service_tokens(self) -> dict[str, float]:
        """user -> weighted tokens granted by all replicas (dead ones up to their death)."""
        out: dict[str, float] = {}
        for rep in self.replicas.values():
            for u in set(rep.policy.service_units) | set(rep.policy._unpublished):
                out[u] = out.get(u, 0.0) + rep.granted_tokens(u)
        return out

    def counter_tokens(self) -> dict[str, float]:
        """user -> its true global counter ``c_u = S_u + L_u``, weighted tokens: the service of all
        replicas (``service_tokens``) plus the highest lift level any replica holds, published or not
        (docs/scale-out.md, section 2)."""
        out = self.service_tokens()
        levels: dict[str, int] = {}
        for rep in self.replicas.values():
            for u, level in rep.policy.lift_levels().items():
                levels[u] = max(levels.get(u, 0), level)
        for u, level in levels.items():
            out[u] = out.get(u, 0.0) + level / fr.COUNTER_SCALE
        return out

    # ---------------------------------------------------------------- the event loop

    def run(self, requests: Sequence[Request], *, kill: Sequence[tuple[float, str]] = (),
            on_tick: Callable[[SimReplica, list[Request]], None] | None = None,
            exclude: Callable[[Request], Iterable[str]] | None = None,
            max_ticks: int = 10_000_000) -> ClusterResult:
        """Replay ``requests`` (each arrives at its ``submitted_at`` offset, seconds) until every
        one finished or was refused.

        Args:
            requests: the workload (arrival order need not be sorted).
            kill: ``(time_s, replica_id)`` deaths to inject.
            on_tick: called after each tick with the replica and the requests it finished.
            exclude: ``exclude(request)`` -> replica ids the router must not pick for it on
                arrival (an affinity constraint, e.g. a user pinned to some replicas); retries
                ignore it.
            max_ticks: a safety stop.

        Raises:
            RuntimeError: ``max_ticks`` ticks ran with work left (a stuck cluster).
        """
        arrivals = sorted(requests, key=lambda r: r.submitted_at)
        kills = sorted(kill)
        ai = ki = 0
        inf = math.inf
        period = self.period_s
        next_sync = period if period else inf
        next_sample = self.sample_s
        first = arrivals[0].submitted_at if arrivals else 0.0
        meter = GapMeter()
        users = sorted({r.user_id for r in requests})
        prev_counter: dict[str, float] = {}  # counter_tokens() at the last sync (or sample)
        max_period = 0.0
        max_resident: dict[str, int] = {}
        share = {rid: {u: 0.0 for u in users} for rid in self.replicas}
        prev_rep_service = {rid: {u: 0.0 for u in users} for rid in self.replicas}
        last_completion = first
        counter_gap = [0.0, 0.0]  # users backlogged on every live replica; on any
        resident_by: dict[str, dict[str, int]] = {rid: {} for rid in self.replicas}  # after its last tick
        resident: dict[str, int] = {}  # user -> resident requests on all replicas
        ticks = 0
        while True:
            active = [r for r in self.replicas.values() if r.alive and r.scheduler.has_active()]
            t_tick = min((r.clock.now() for r in active), default=inf)
            t_arr = arrivals[ai].submitted_at if ai < len(arrivals) else inf
            t_kill = kills[ki][0] if ki < len(kills) else inf
            if t_tick == inf and t_arr == inf and t_kill == inf:
                break
            t = min(t_tick, t_arr, t_kill)
            if next_sample <= t:  # meters first: they see the state at the sample instant
                svc = self.service_tokens()
                ctr = self.counter_tokens()
                if period == 0:  # D over a sample interval: an estimate (docs/scale-out.md section 2)
                    max_period = max([max_period] + [ctr[u] - prev_counter.get(u, 0.0) for u in ctr])
                    prev_counter = ctr
                per_replica = [r.backlogged_users() for r in self.live()]
                backlogged = set().union(*per_replica) if per_replica else set()
                everywhere = set.intersection(*per_replica) if per_replica else set()
                meter.sample(svc, everywhere)
                for group, attr in ((everywhere, 0), (backlogged, 1)):
                    if len(group) >= 2:
                        vals = [ctr.get(u, 0.0) for u in group]
                        counter_gap[attr] = max(counter_gap[attr], max(vals) - min(vals))
                all_backlogged = bool(users) and all(u in backlogged for u in users)
                for rid, rep in self.replicas.items():
                    cur = {u: rep.granted_tokens(u) for u in users}
                    if all_backlogged:
                        for u in users:
                            share[rid][u] += cur[u] - prev_rep_service[rid][u]
                    prev_rep_service[rid] = cur
                next_sample += self.sample_s
                continue
            if next_sync <= t:
                ctr = self.counter_tokens()
                if prev_counter or ctr:
                    max_period = max([max_period] + [ctr[u] - prev_counter.get(u, 0.0) for u in ctr])
                prev_counter = ctr
                self.sync_all()
                next_sync += period
                continue
            if t == t_kill:
                rid = kills[ki][1]
                for u, n in resident_by[rid].items():
                    resident[u] -= n
                resident_by[rid] = {}
                self.kill(rid, t)
                ki += 1
            elif t == t_arr:
                self.submit(arrivals[ai], t, exclude=exclude(arrivals[ai]) if exclude else ())
                ai += 1
            else:
                rep = min(active, key=lambda r: r.clock.now())
                if period == 0:
                    rep.policy.sync(self.store)
                done = rep.scheduler.tick()
                ticks += 1
                if ticks > max_ticks:
                    raise RuntimeError(f"cluster still busy after {max_ticks} ticks")
                for req in done:
                    rep.in_flight.pop(id(req), None)
                    self._where.pop(id(req), None)
                    self.router.done(rep.replica_id, req.user_id)
                    rep.finished_tokens += len(req.generated)
                    self.finished.append(req)
                    last_completion = max(last_completion, req.completed_at)
                self.router.report(rep.replica_id, rep.load())
                now_res: dict[str, int] = {}
                for q in rep.scheduler.running:
                    now_res[q.user_id] = now_res.get(q.user_id, 0) + 1
                old = resident_by[rep.replica_id]
                for u in old.keys() | now_res.keys():
                    n = resident[u] = resident.get(u, 0) + now_res.get(u, 0) - old.get(u, 0)
                    if n > max_resident.get(u, 0):
                        max_resident[u] = n
                resident_by[rep.replica_id] = now_res
                if on_tick is not None:
                    on_tick(rep, done)
        return ClusterResult(
            finished=self.finished, refused=self.refused, retried=dict(self.retried), arrival_s=self.arrival_s,
            first_arrival_s=first, last_completion_s=last_completion, gap_tokens=meter.gap, counter_gap_tokens=counter_gap[0],
            counter_gap_any_tokens=counter_gap[1],
            max_period_rise_tokens=max_period, max_resident=max_resident, routed=dict(self.router.picks),
            replica_tokens={rid: r.finished_tokens for rid, r in self.replicas.items()},
            replica_service={rid: {u: r.granted_tokens(u) for u in users} for rid, r in self.replicas.items()},
            share_service=share, counter_syncs=self.store.syncs)
