"""Batch on Ray Serve: N engine replicas, the load router, the per-user counters in one Ray actor.

Needs the ``scaleout`` extra (``ray[serve]``); nothing else in the project imports this module.

* ``EngineReplica`` (a Serve deployment): each replica owns a ``Scheduler`` with a
  ``GlobalVTCPolicy`` on the simulated GPU (``SeededGPU``: tokens keyed by prompt, real time times
  ``time_scale``), ticked by the HTTP server's engine thread (``batch.server.engine.Engine``). It
  reports its load to the router through Serve's ``record_routing_stats`` (every
  ``stats_period_s``) and syncs its counters with the ``CountersActor`` every ``period_s``: the
  deltas are taken and the offsets set on the engine thread (``Engine.call``), the actor call in
  between, so the staleness is at most ``2 * (period_s + tick + round trip) + tick``, ``tick`` the
  longest iteration (each ``Engine.call`` waits for the current tick).
* ``BatchRequestRouter`` (a Serve ``RequestRouter``): ``batch.scaleout.router.Router`` over the
  replicas' reported stats (waiting + in transit + the user's own unfinished requests there, then
  free KV blocks, then least recently picked); a user pinned by ``deploy(pin_users=...)`` goes to
  the live replica at its index in the sorted replica ids (by load when there is none).
* ``CountersActor``: ``GlobalCounters`` as a Ray actor (one per deployment, made by ``deploy``).
* ``ScaleoutClient``: calls the deployment and applies the retry rule: a request whose replica died
  (a Ray actor error) is sent again, to the replicas left, from scratch (tokens so far discarded;
  the seeded GPU regenerates the same ones). ``Ingress`` serves ``POST /v1/completions``
  (non-streaming) through it for ``batch serve --replicas N``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from batch.scaleout.counters import GlobalCounters, GlobalVTCPolicy
from batch.scaleout.router import ReplicaLoad, Router, check_pins
from batch.server.engine import Engine, SeededGPU, ServedRequest
from scheduler import Scheduler
from spec import fairness_rules as fr

__all__ = ["CountersActor", "EngineReplica", "BatchRequestRouter", "ScaleoutClient", "Ingress", "deploy",
           "serve_http", "RETRYABLE"]

#: No ``max_restarts``: the store is in memory, so a restarted actor would start from empty totals,
#: below every replica's offsets (which never go down): sharing would stay frozen until the new
#: totals caught up. If it dies, each replica keeps scheduling on its frozen offsets plus its own
#: counters, keeps its deltas (``_unsent``) and retries every period (docs/scale-out.md, section 1).
CountersActor = ray.remote(num_cpus=0)(GlobalCounters)

log = logging.getLogger(__name__)

#: Errors that mean the replica (its actor) is gone: the client retries elsewhere.
RETRYABLE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


#: The ``EngineReplica`` methods that carry a request: counted as sent by the router (others, such
#: as ``service``, are routed, by their body's user when pinned, but never counted as load).
_REQUEST_METHODS = frozenset({"generate"})


def _user_of(pending: PendingRequest | None) -> str | None:
    """The ``user`` of the call's first argument (a body dict), or ``None``."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None
    user = pending.args[0].get("user")
    return user if isinstance(user, str) else None


class BatchRequestRouter(RequestRouter):
    """Serve's request router running ``batch.scaleout.router.Router`` on the replicas' stats.

    Each replica's ``record_routing_stats`` (``waiting``, ``running``, ``free_kv_blocks``,
    ``received``, ``by_user``, ``received_by_user``; every 0.05 s) is its ``ReplicaLoad``. A pick
    is counted as sent when it is made (``choose_replicas``). Each user's unfinished requests per
    replica come from the replica's report plus the router's sends since: Serve does not tell a
    request router when a request ends.
    """

    def initialize_state(self, pin_users: dict[str, int] | None = None, **kwargs: Any) -> None:
        """Serve calls this once with the deployment's ``request_router_kwargs``.

        Args:
            pin_users: user -> replica index (``deploy(pin_users=...)``): a pinned user's requests
                go to the live replica at that index in the sorted order of the live replica ids
                (Serve's unique ids), whatever its load; if there is no replica at that index
                (fewer live replicas; the ids shift when one dies or a replacement joins), the
                load rule decides. Session or prefix affinity; fairness is the counters' job.
            kwargs: ignored (Serve's own).

        Raises:
            TypeError, ValueError: a bad ``pin_users`` (``batch.scaleout.router.check_pins``).
        """
        self._router = Router(pin_users=pin_users)

    def _sync_replicas(self, candidates: list[RunningReplica]) -> None:
        r = self._router
        for rep in candidates:
            rid = rep.replica_id.unique_id
            stats = rep.routing_stats or {}
            load = ReplicaLoad(waiting=int(stats.get("waiting", 0)), running=int(stats.get("running", 0)),
                               free_kv_blocks=int(stats.get("free_kv_blocks", 0)),
                               received=int(stats.get("received", 0)), by_user=dict(stats.get("by_user") or {}),
                               received_by_user=dict(stats.get("received_by_user") or {}))
            if rid in r.replicas:
                r.report(rid, load)
            else:
                r.add(rid, load)
        live = {rid.unique_id for rid in self.curr_replicas}
        for rid in r.replicas:
            if rid not in live:
                r.remove(rid)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The user's pinned replica (``Router.pinned``) or else the least-loaded candidate
        (``Router.score``) first, then the others as a fallback rank. Only request methods
        (``generate``) are counted as sent."""
        if not candidate_replicas:
            return []
        self._sync_replicas(candidate_replicas)
        by_id = {rep.replica_id.unique_id: rep for rep in candidate_replicas}
        user = _user_of(pending_request)
        order = sorted(by_id, key=lambda rid: self._router.score(rid, user))
        pin = self._router.pinned(user)
        if pin in by_id:
            order.remove(pin)
            order.insert(0, pin)
        # counted as sent now, not in ``on_send_request``: Serve routes a burst's requests in
        # concurrent tasks, which would all see the same counts and pick the same replica. Serve
        # sends to the first rank unless that replica rejects (it does not: no strict
        # max_ongoing_requests), so a count that was not sent is rare and costs one request of bias.
        if pending_request is not None and pending_request.metadata.call_method in _REQUEST_METHODS:
            self._router.note_sent(order[0], user)
        return [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]] if len(order) > 1 else [[by_id[order[0]]]]


def _router_config(pin_users: dict[str, int] | None = None) -> RequestRouterConfig:
    """``BatchRequestRouter`` with the replicas' load reports every 0.05 s, and ``pin_users``."""
    return RequestRouterConfig(request_router_class=BatchRequestRouter, request_routing_stats_period_s=0.05,
                               request_routing_stats_timeout_s=5.0,
                               request_router_kwargs={"pin_users": pin_users} if pin_users else {})


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=100_000, health_check_period_s=1.0,
                  request_router_config=_router_config())
class EngineReplica:
    """One Batch engine as a Serve replica (see the module doc).

    Args:
        counters: the ``CountersActor`` handle (``None``: no sharing, per-replica VTC only).
        time_scale: the simulated GPU's latency factor (> 0; 1.0 is the stub's 5 ms + 1 ms/request).
        seed: the simulated GPU's token seed.
        period_s: counter sync period, seconds (> 0).
        weights: per-user weights (the same on every replica).
        kv_cap_blocks: KV cache blocks (default the stub's 256).
    """

    def __init__(self, counters: Any = None, *, time_scale: float = 1.0, seed: int = 0, period_s: float = 0.05,
                 weights: dict[str, int] | None = None, kv_cap_blocks: int | None = None) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0 seconds, got {period_s!r}")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.policy = GlobalVTCPolicy(replica_id=self.replica_id, weights=weights or {})
        kw: dict[str, Any] = {"kv_cap_blocks": kv_cap_blocks} if kv_cap_blocks else {}
        sched = Scheduler(backend=SeededGPU(time_scale=time_scale, seed=seed), policy=self.policy,
                          record_itl=False, max_backend_tries=3, **kw)
        self.engine = Engine(sched)
        self.counters = counters
        self.period_s = period_s
        self.received = 0
        self.syncs = 0
        self._unsent: dict[str, int] = {}
        self._by_user: dict[str, int] = {}  # user -> its requests here not finished
        self._received_by_user: dict[str, int] = {}  # user -> its requests received here (all time)
        self._task: asyncio.Task | None = None
        if counters is not None:  # a replacement or late replica: the others' service now, not 0 until a sync
            try:
                self.policy.set_offsets(ray.get(counters.others.remote(self.replica_id), timeout=5.0))
            except Exception:  # noqa: BLE001 - the actor unreachable: offsets 0 until the first sync
                pass

    def _ensure_started(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self.engine.start(loop)
            self._task = loop.create_task(self._sync_forever())

    async def _sync_forever(self) -> None:
        """At once (the engine's start), then every ``period_s``: take the deltas on the engine
        thread, sync with the actor, set the offsets on the engine thread. Deltas a failed call did
        not deliver are sent next time."""
        first = True
        failing = 0  # consecutive failed syncs: logged once per streak
        while self.counters is not None:
            if not first:
                await asyncio.sleep(self.period_s)
            first = False
            try:
                await self._sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the actor dead or unreachable, the engine erring: retry
                if not failing:
                    log.warning("replica %s: counter sync failed (%r); sharing paused (offsets frozen, deltas "
                                "kept), retrying every %s s", self.replica_id, e, self.period_s)
                failing += 1
                continue
            if failing:
                log.warning("replica %s: counter sync back after %d failed tries", self.replica_id, failing)
                failing = 0

    async def _sync_once(self) -> None:
        """One sync; raises what the engine call or the actor call raised. Deltas taken but not
        delivered stay in ``_unsent`` (sent with the next sync)."""
        deltas, state = await self.engine.call(self._take)
        for u, d in deltas.items():
            self._unsent[u] = self._unsent.get(u, 0) + d
        others = await self.counters.sync.remote(self.replica_id, self._unsent, state)
        self._unsent = {}
        self.syncs += 1
        await self.engine.call(lambda o=others: self.policy.set_offsets(o))

    def _take(self) -> tuple[dict[str, int], dict]:
        """On the engine thread: the deltas, and the state the store may measure the gap from."""
        resident: dict[str, int] = {}
        for q in self.engine.scheduler.running:
            resident[q.user_id] = resident.get(q.user_id, 0) + 1
        return self.policy.take_deltas(), {"waiting": self.policy.waiting_users(), "resident": resident}

    async def generate(self, body: dict) -> dict:
        """Run one request to completion.

        Args:
            body: ``{"user": str, "prompt": list[int], "max_tokens": int, "request_id": str}``.

        Returns:
            ``{"request_id", "tokens", "finish_reason", "replica", "actor_name", "ttft_s"}``, or
            with ``"error"`` (a message) when the scheduler refused it; ``ttft_s`` is the first
            token's time after submit on this replica, seconds.
        """
        self._ensure_started()
        self.received += 1
        user = str(body["user"])
        self._by_user[user] = self._by_user.get(user, 0) + 1
        self._received_by_user[user] = self._received_by_user.get(user, 0) + 1
        try:
            return await self._generate(body)
        finally:
            self._by_user[user] -= 1
            if not self._by_user[user]:
                del self._by_user[user]

    async def _generate(self, body: dict) -> dict:
        prompt = [int(t) for t in body["prompt"]]
        req = ServedRequest(user_id=str(body["user"]), prompt=prompt, max_tokens=int(body["max_tokens"]),
                            request_id=str(body.get("request_id", "")), seed_key=SeededGPU.prompt_key(prompt))
        sink = self.engine.submit(req, stream=False)
        await sink.finished.wait()
        ev = sink.final
        out = {"request_id": req.request_id, "tokens": list(req.generated), "finish_reason": ev.finish_reason,
               "replica": self.replica_id, "actor_name": self.actor_name,
               "ttft_s": None if req.started_at is None else req.started_at - req.submitted_at}
        if ev.error is not None:
            out["error"] = str(ev.error)
        return out

    def record_routing_stats(self) -> dict:
        """The load report Serve hands to ``BatchRequestRouter`` (``ReplicaLoad``'s fields)."""
        s = self.engine.snapshot
        return {"waiting": s.waiting, "running": s.running, "free_kv_blocks": s.kv_cap_blocks - s.kv_blocks_used,
                "received": self.received, "by_user": dict(self._by_user),
                "received_by_user": dict(self._received_by_user)}

    async def service(self, body: dict | None = None) -> dict:
        """This replica's service per user so far and its counter offsets.

        Args:
            body: only for routing: ``{"user": u}`` with ``u`` pinned (``deploy(pin_users=...)``)
                sends this call to ``u``'s replica; ``None``: the load rule picks one.

        Returns:
            ``{"replica": id, "granted": {user: weighted tokens}, "offsets": {user: weighted
            tokens}, "syncs": int}``; ``granted`` counts published and unpublished service, so it
            is the same measure with or without the counters actor.
        """
        self._ensure_started()

        def read() -> dict:
            p = self.policy
            granted = {u: v / fr.COUNTER_SCALE for u, v in p.service_units.items()}
            for u, (pt, ot) in p._unpublished.items():  # noqa: SLF001 - the same package's policy
                granted[u] = granted.get(u, 0.0) + fr.service_units(pt, ot, p.prompt_price, p.output_price) / (
                    p.weight_of(u))
            return {"replica": self.replica_id, "granted": granted,
                    "offsets": {u: p.offset(u) / fr.COUNTER_SCALE for u in granted}, "syncs": self.syncs}

        return await self.engine.call(read)


class ScaleoutClient:
    """Sends requests to the ``EngineReplica`` deployment with the retry rule.

    Args:
        handle: the deployment's handle.
        max_tries: attempts per request (>= 1) before the error is raised.
        retry_wait_s: pause before a retry, seconds (Serve needs a moment to drop a dead replica).
    """

    def __init__(self, handle: Any, *, max_tries: int = 5, retry_wait_s: float = 0.2) -> None:
        self.handle = handle
        self.max_tries = max_tries
        self.retry_wait_s = retry_wait_s
        self.retries = 0

    async def generate(self, body: dict) -> dict:
        """The deployment's answer for ``body`` (``EngineReplica.generate``) with ``"tries"`` added.

        Raises:
            the last ``RETRYABLE`` error after ``max_tries`` attempts.
        """
        for attempt in range(1, self.max_tries + 1):
            try:
                out = await self.handle.generate.remote(body)
            except RETRYABLE:
                if attempt == self.max_tries:
                    raise
                self.retries += 1
                await asyncio.sleep(self.retry_wait_s)
                continue
            out["tries"] = attempt
            return out
        raise AssertionError("unreachable")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
class Ingress:
    """``POST /v1/completions`` (non-streaming; ``prompt`` text, ``max_tokens``, ``user``) over the
    replicas, answered OpenAI-style; ``GET /health``."""

    def __init__(self, replicas: Any, model_name: str = "batch-sim") -> None:
        from batch.server.tokenizer import WordTokenizer  # noqa: PLC0415

        self.client = ScaleoutClient(replicas)
        self.tok = WordTokenizer(0)
        self.model_name = model_name
        self._n = 0

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse  # noqa: PLC0415

        if request.method == "GET":
            return JSONResponse({"status": "ok"})
        try:
            body = await request.json()
            prompt = self.tok.encode(str(body["prompt"]))
            max_tokens = int(body.get("max_tokens", 16))
        except Exception as e:  # noqa: BLE001 - a malformed body is the client's error
            return JSONResponse({"error": {"message": f"bad request: {e!r}"}}, status_code=400)
        self._n += 1
        rid = f"cmpl-{self._n}"
        out = await self.client.generate({"user": str(body.get("user") or "anonymous"), "prompt": prompt,
                                          "max_tokens": max_tokens, "request_id": rid})
        if "error" in out:
            return JSONResponse({"error": {"message": out["error"]}}, status_code=400)
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name,
                             "choices": [{"index": 0, "text": self.tok.decode(out["tokens"]),
                                          "finish_reason": out["finish_reason"]}],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out["tokens"])},
                             "batch": {"replica": out["replica"], "tries": out["tries"]}})


def _engines(replicas: int, pin_users: dict[str, int] | None) -> Any:
    """``EngineReplica`` with ``replicas`` replicas and the router's ``pin_users`` (checked)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, got {replicas!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas!r}")
    pins = check_pins(pin_users)
    if not pins:
        return EngineReplica.options(num_replicas=replicas)
    return EngineReplica.options(num_replicas=replicas, request_router_config=_router_config(pins))


def deploy(replicas: int, *, time_scale: float = 1.0, seed: int = 0, period_s: float = 0.05,
           weights: dict[str, int] | None = None, kv_cap_blocks: int | None = None, share: bool = True,
           name: str = "batch", observe_gap: bool = False,
           pin_users: dict[str, int] | None = None) -> tuple[Any, Any]:
    """Start the counters actor and ``replicas`` engine replicas on the running Ray instance.

    Args:
        replicas: engine replicas (int >= 1).
        time_scale, seed, period_s, weights, kv_cap_blocks: ``EngineReplica``'s.
        share: start the counters actor (``False``: each replica runs VTC on its own counters).
        name: the Serve application's name.
        observe_gap: the actor measures the counter gap and the bound's terms at every sync
            (``GapObserver``, window ``2 * period_s + 0.05`` s, which leaves the ticks out of the
            staleness: the measured ``D`` is an underestimate, docs/scale-out.md section 1; read
            with ``counters.gap_stats``).
        pin_users: user -> replica index (``BatchRequestRouter.initialize_state``): the user's
            requests go to the live replica at that index in the sorted live replica ids, or by
            load when there is none.

    Returns:
        ``(deployment handle, counters actor or None)``.

    Raises:
        TypeError: ``replicas`` not an int; a bad ``pin_users`` entry.
        ValueError: ``replicas`` < 1; a negative pin index.
    """
    engines = _engines(replicas, pin_users)
    counters = CountersActor.remote() if share else None
    if counters is not None and observe_gap:
        ray.get(counters.observe_gap.remote(2 * period_s + 0.05))
    app = engines.bind(counters, time_scale=time_scale, seed=seed, period_s=period_s, weights=weights,
                       kv_cap_blocks=kv_cap_blocks)
    handle = serve.run(app, name=name, route_prefix=None)
    return handle, counters


def serve_http(replicas: int, *, host: str = "127.0.0.1", port: int = 8000, time_scale: float = 1.0, seed: int = 0,
               period_s: float = 0.05, weights: dict[str, int] | None = None, kv_cap_blocks: int | None = None,
               num_cpus: int | None = None) -> None:
    """``batch serve --replicas N``: a local Ray instance, the counters actor, ``replicas`` engine
    replicas and the ``Ingress`` on ``http://host:port/v1/completions``; blocks until interrupted.

    Raises:
        ValueError: ``replicas`` < 1.
    """
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        counters = CountersActor.remote()
        engines = EngineReplica.options(num_replicas=replicas).bind(counters, time_scale=time_scale, seed=seed,
                                                                    period_s=period_s, weights=weights,
                                                                    kv_cap_blocks=kv_cap_blocks)
        serve.run(Ingress.bind(engines), name="batch", route_prefix="/", blocking=True)
    finally:
        serve.shutdown()
        ray.shutdown()
