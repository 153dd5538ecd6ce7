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
* ``MetricsBoardActor``: ``batch.scaleout.metrics.MetricsBoard`` as a Ray actor: each replica keeps
  the single-process server's ``ServerMetrics`` and pushes its families there every
  ``metrics_period_s``; the ``Ingress`` renders them on ``GET /metrics`` with a ``replica`` label.
* ``ScaleoutClient``: calls the deployment and applies the retry rule: a request whose replica died
  (a Ray actor error) is sent again, to the replicas left, from scratch (tokens so far discarded;
  the seeded GPU regenerates the same ones; a stream skips the tokens it already delivered).
  ``Ingress`` serves ``POST /v1/completions`` (streaming or not), ``GET /health`` and
  ``GET /metrics`` through it for ``batch-llm serve --replicas N``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
import time
from typing import Any, AsyncIterator, Callable

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from batch.scaleout.counters import GlobalCounters, GlobalVTCPolicy, PendingSync, SyncReply
from batch.scaleout.metrics import MetricsBoard, render_replicas
from batch.scaleout.router import ReplicaLoad, Router, check_pins
from batch.server.app import DEFAULT_MAX_TOKENS, ApiError, CompletionBody, read_json_body, validation_error
from batch.server.auth import AuthError, Identities
from batch.server.engine import Engine, SeededGPU, ServedRequest
from batch.server.metrics import CONTENT_TYPE, ServerMetrics
from batch.server.serve import LATENCY_SAMPLES
from batch.server.sse import DONE, ChunkFormat, error_event
from batch.server.tokenizer import IncrementalDecoder
from inference_stub import EOS_PROBABILITY, KV_BLOCK_TOKENS, MAX_KV_BLOCKS
from scheduler import RequestError, Scheduler
from spec import fairness_rules as fr

__all__ = ["CountersActor", "MetricsBoardActor", "EngineReplica", "BatchRequestRouter", "ScaleoutClient", "Ingress",
           "deploy", "serve_http", "RETRYABLE"]

#: No ``max_restarts``: the store is in memory, so a restarted actor would start from empty totals,
#: below every replica's offsets (which never go down): sharing would stay frozen until the new
#: totals caught up. If it dies, each replica keeps scheduling on its frozen offsets plus its own
#: counters, keeps its deltas (``_unsent``) and retries every period (docs/scale-out.md, section 1).
CountersActor = ray.remote(num_cpus=0)(GlobalCounters)

#: Whether the replicas' policy can forget a user (``GlobalVTCPolicy.forget_users(users)``: drop the
#: per-user state of each of ``users`` that has nothing waiting or running on the replica; the core's
#: part of forgetting). The counters actor forgets idle users only then: a store that forgot a user
#: while the replicas' raise-only views remembered it would restart its published service from 0
#: under those views (docs/scale-out.md, "Forgetting idle users").
POLICY_FORGETS = callable(getattr(GlobalVTCPolicy, "forget_users", None))

#: The replicas' latest metric snapshots, for the ingress's ``/metrics`` (``batch.scaleout.metrics``).
MetricsBoardActor = ray.remote(num_cpus=0)(MetricsBoard)

log = logging.getLogger(__name__)

#: Errors that mean the replica (its actor) is gone: the client retries elsewhere.
RETRYABLE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


#: The ``EngineReplica`` methods that carry a request: counted as sent by the router (others, such
#: as ``service``, are routed, by their body's user when pinned, but never counted as load).
_REQUEST_METHODS = frozenset({"generate", "generate_stream"})


def _user_of(pending: PendingRequest | None) -> str | None:
    """The ``user`` of the call's first argument (a body dict), or ``None``."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None
    user = pending.args[0].get("user")
    return user if isinstance(user, str) else None


class BatchRequestRouter(RequestRouter):
    """Serve's request router running ``batch.scaleout.router.Router`` on the replicas' stats.

    Each replica's ``record_routing_stats`` (``waiting``, ``running``, ``free_kv_blocks``,
    ``received``, ``by_user``; every 0.05 s) is its ``ReplicaLoad``. A pick
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
                               received=int(stats.get("received", 0)), by_user=dict(stats.get("by_user") or {}))
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
        (``generate``, ``generate_stream``) are counted as sent."""
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
        eos_probability: the simulated GPU's early-EOS chance per token (default the stub's 0.02).
        period_s: counter sync period, seconds (> 0).
        weights: per-user weights (the same on every replica).
        kv_cap_blocks: KV cache blocks (default the stub's 256).
        metrics_board: a ``MetricsBoardActor`` handle: the replica keeps the single-process
            server's metrics (``ServerMetrics``) and pushes a snapshot there every
            ``metrics_period_s``; ``None``: no metrics kept.
        metrics_period_s: seconds between metrics pushes (> 0).

    Raises:
        ValueError: ``period_s`` or ``metrics_period_s`` not > 0.
    """

    def __init__(self, counters: Any = None, *, time_scale: float = 1.0, seed: int = 0,
                 eos_probability: float = EOS_PROBABILITY, period_s: float = 0.05,
                 weights: dict[str, int] | None = None, kv_cap_blocks: int | None = None,
                 metrics_board: Any = None, metrics_period_s: float = 1.0) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0 seconds, got {period_s!r}")
        if not metrics_period_s > 0:
            raise ValueError(f"metrics_period_s must be > 0 seconds, got {metrics_period_s!r}")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.policy = GlobalVTCPolicy(replica_id=self.replica_id, weights=weights or {})
        kw: dict[str, Any] = {"kv_cap_blocks": kv_cap_blocks} if kv_cap_blocks else {}
        gpu = SeededGPU(time_scale=time_scale, seed=seed, eos_probability=eos_probability)
        sched = Scheduler(backend=gpu, policy=self.policy, record_itl=False, max_backend_tries=3,
                          max_latency_samples=LATENCY_SAMPLES, production_checks=True, **kw)  # as batch-llm serve
        self.engine = Engine(sched)
        self.metrics_board = metrics_board
        self.metrics_period_s = metrics_period_s
        self.metrics: ServerMetrics | None = None
        if metrics_board is not None:
            self.metrics = ServerMetrics(self.engine)
            self.engine.on_tick = self.metrics.observe_tick
        self.counters = counters
        self.period_s = period_s
        self.received = 0
        self.syncs = 0
        self._unsent = PendingSync()  # taken on the engine thread, not yet delivered to the actor
        self._by_user: dict[str, int] = {}  # user -> its requests here not finished
        self._task: asyncio.Task | None = None
        self._metrics_task: asyncio.Task | None = None
        if counters is not None:  # a replacement or late replica: the others' service now, not 0 until a sync
            try:
                self.policy.take_reply(ray.get(counters.reply.remote(self.replica_id), timeout=5.0))
            except Exception:  # noqa: BLE001 - the actor unreachable: offsets 0 until the first sync
                pass

    def _ensure_started(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self.engine.start(loop)
            self._task = loop.create_task(self._sync_forever())
            if self.metrics_board is not None:
                self._metrics_task = loop.create_task(self._push_metrics_forever())

    async def _push_metrics_forever(self) -> None:
        """At once, then every ``metrics_period_s``: this replica's metric families (collected on
        the event loop, where ``observe_tick`` runs) to the board. A failed push is logged once per
        streak and retried next period."""
        failing = 0
        while True:
            try:
                await self.metrics_board.put.remote(self.replica_id, list(self.metrics.registry.collect()))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the board dead or unreachable: metrics only
                if not failing:
                    log.warning("replica %s: metrics push failed (%r); retrying every %s s", self.replica_id, e,
                                self.metrics_period_s)
                failing += 1
            else:
                failing = 0
            await asyncio.sleep(self.metrics_period_s)

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
        """One sync; raises what the engine call or the actor call raised. Deltas and lift levels
        taken but not delivered stay in ``_unsent`` (sent with the next sync)."""
        deltas, lifts, state = await self.engine.call(self._take)
        unsent = self._unsent
        unsent.add(deltas, lifts)
        reply = await self.counters.sync.remote(self.replica_id, unsent.deltas, state, unsent.lifts)
        unsent.clear()
        self.syncs += 1
        await self.engine.call(lambda r=reply: self._take_reply(r))

    def _take_reply(self, reply: SyncReply) -> None:
        """On the engine thread: the others' service and the lift levels; and the users the store
        forgot, forgotten by the policy too where they are idle here (``forget_users``, when the
        policy has it: the store forgets only then, ``POLICY_FORGETS``)."""
        self.policy.take_reply(reply)
        forgotten = getattr(reply, "forgotten", ())
        if forgotten and POLICY_FORGETS:
            self.policy.forget_users(forgotten)

    def _take(self) -> tuple[dict[str, int], dict[str, int], dict]:
        """On the engine thread: the deltas, the lift levels, and the state the store may measure
        the gap from."""
        resident: dict[str, int] = {}
        for q in self.engine.scheduler.running:
            resident[q.user_id] = resident.get(q.user_id, 0) + 1
        return (self.policy.take_deltas(), self.policy.take_lifts(),
                {"waiting": self.policy.waiting_users(), "resident": resident})

    async def generate(self, body: dict) -> dict:
        """Run one request to completion.

        Args:
            body: ``{"user": str, "prompt": list[int], "max_tokens": int, "request_id": str}``.

        Returns:
            ``{"request_id", "tokens", "finish_reason", "replica", "actor_name", "ttft_s",
            "prompt_tokens", "completion_tokens"}``, or with ``"error"`` (a message) when the
            scheduler refused it; ``ttft_s`` is the first token's time after submit on this
            replica, seconds. If the caller is cancelled, the request is aborted.

        Raises:
            KeyError, ValueError, TypeError: a body without ``user``, ``prompt`` or
                ``max_tokens``, or with values that are not ints where ints are due.
        """
        req = self._received(body)
        try:
            sink = self.engine.submit(req, stream=False)
            try:
                await sink.finished.wait()
            finally:
                if not sink.done:  # the caller went away (cancelled): free its blocks
                    self.engine.abort(sink)
            return self._final(req, sink.final, list(req.generated))
        finally:
            self._ended(req.user_id)

    async def generate_stream(self, body: dict) -> AsyncIterator[dict]:
        """Run one request, yielding its tokens as they come (call with ``handle.options(stream=True)``).

        Args:
            body: as ``generate``'s.

        Yields:
            ``{"tokens": [new token ids]}`` per batch of tokens the engine handed over, then one
            last ``{"tokens": [...], "finish_reason", "request_id", "replica", "actor_name",
            "ttft_s", "prompt_tokens", "completion_tokens"}`` (with ``"error"``, a message, when
            the scheduler refused it). The concatenated ``tokens`` are the request's output. If
            the caller stops reading (the generator is closed), the request is aborted.
        """
        req = self._received(body)
        try:
            sink = self.engine.submit(req, stream=True)
            q = sink.queue
            try:
                while True:
                    evs = [await q.get()]
                    while not q.empty():
                        evs.append(q.get_nowait())
                    toks = [ev.token for ev in evs if ev.token is not None]
                    end = next((ev for ev in evs if ev.finish_reason is not None), None)
                    if end is not None:
                        yield self._final(req, end, toks)
                        return
                    yield {"tokens": toks}
            finally:
                if not sink.done:
                    self.engine.abort(sink)
        finally:
            self._ended(req.user_id)

    def _received(self, body: dict) -> ServedRequest:
        """Count a request as received here (the router's ``received`` and per-user counts) and
        build it; starts the engine on the first."""
        self._ensure_started()
        self.received += 1  # first: a body that fails below was still received (the router's in-transit count)
        prompt = [int(t) for t in body["prompt"]]
        req = ServedRequest(user_id=str(body["user"]), prompt=prompt, max_tokens=int(body["max_tokens"]),
                            request_id=str(body.get("request_id", "")), seed_key=SeededGPU.prompt_key(prompt))
        user = req.user_id
        if self.metrics is not None and self._acceptable(req):  # the help says: accepted requests
            self.metrics.prompt_tokens.labels(self.metrics.user_label(user)).inc(len(prompt))
        self._by_user[user] = self._by_user.get(user, 0) + 1
        return req

    def _acceptable(self, req: ServedRequest) -> bool:
        """Whether ``Scheduler.submit`` will take ``req`` (``Scheduler._validate``, read-only: the
        request is new, so the engine thread's in-flight table cannot hold it)."""
        try:
            self.engine.scheduler._validate(req)
        except RequestError:
            return False
        return True

    def _ended(self, user: str) -> None:
        self._by_user[user] -= 1
        if not self._by_user[user]:
            del self._by_user[user]

    def _final(self, req: ServedRequest, ev: Any, tokens: list[int]) -> dict:
        """The answer's last message: ``tokens`` (all of them, or the last chunk's) and the request's facts."""
        out = {"request_id": req.request_id, "tokens": tokens, "finish_reason": ev.finish_reason,
               "replica": self.replica_id, "actor_name": self.actor_name,
               "ttft_s": None if req.started_at is None else req.started_at - req.submitted_at,
               "prompt_tokens": len(req.prompt), "completion_tokens": len(req.generated)}
        if ev.error is not None:
            out["error"] = str(ev.error)
        return out

    def record_routing_stats(self) -> dict:
        """The load report Serve hands to ``BatchRequestRouter`` (``ReplicaLoad``'s fields)."""
        s = self.engine.snapshot
        return {"waiting": s.waiting, "running": s.running, "free_kv_blocks": s.kv_cap_blocks - s.kv_blocks_used,
                "received": self.received, "by_user": dict(self._by_user)}

    async def service(self, body: dict | None = None) -> dict:
        """This replica's service per user so far and its counter offsets.

        Args:
            body: only for routing: ``{"user": u}`` with ``u`` pinned (``deploy(pin_users=...)``)
                sends this call to ``u``'s replica; ``None``: the load rule picks one.

        Returns:
            ``{"replica": id, "granted": {user: weighted tokens}, "offsets": {user: weighted
            tokens}, "lifts": {user: lift level known here, weighted tokens}, "syncs": int}``;
            ``granted`` counts published and unpublished service, so it is the same measure with
            or without the counters actor.
        """
        self._ensure_started()

        def read() -> dict:
            p = self.policy
            granted = {u: v / fr.COUNTER_SCALE for u, v in p.service_units.items()}
            for u, (pt, ot) in p._unpublished.items():  # the same package's policy
                granted[u] = granted.get(u, 0.0) + fr.service_units(pt, ot, p.prompt_price, p.output_price) / (
                    p.weight(u))
            return {"replica": self.replica_id, "granted": granted,
                    "offsets": {u: p.offset(u) / fr.COUNTER_SCALE for u in granted},
                    "lifts": {u: v / fr.COUNTER_SCALE for u, v in p.lift_levels().items()}, "syncs": self.syncs}

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

    async def _before_retry(self, attempt: int, response: Any, error: BaseException) -> None:
        """After attempt ``attempt`` failed with ``error`` (a ``RETRYABLE``): cancel the call if its
        replica may be alive (``_cancel_if_alive``); re-raise ``error`` if that was the last
        attempt, else count a retry and wait ``retry_wait_s``."""
        _cancel_if_alive(response, error)
        if attempt == self.max_tries:
            raise error
        self.retries += 1
        await asyncio.sleep(self.retry_wait_s)

    async def generate(self, body: dict) -> dict:
        """The deployment's answer for ``body`` (``EngineReplica.generate``) with ``"tries"`` added.
        If this call is cancelled, so is the replica's (which aborts the request there).

        Raises:
            the last ``RETRYABLE`` error after ``max_tries`` attempts.
        """
        for attempt in range(1, self.max_tries + 1):
            response = self.handle.generate.remote(body)
            try:
                out = await response
            except RETRYABLE as e:
                await self._before_retry(attempt, response, e)
                continue
            except asyncio.CancelledError:  # our caller went away (or the Ingress drains): stop it there too
                response.cancel()
                raise
            out["tries"] = attempt
            return out
        raise AssertionError("unreachable")

    async def generate_stream(self, body: dict) -> AsyncIterator[dict]:
        """The deployment's stream for ``body`` (``EngineReplica.generate_stream``), with the retry
        rule: if the replica dies mid-stream, the request is sent again (to the replicas left) and
        the first ``k`` tokens of the new stream are skipped, ``k`` the tokens already yielded.
        That is right because the backend is deterministic (the seeded simulated GPU: a token is a
        function of the prompt and its position), so the rerun produces the same tokens; it would
        not be with sampling. Each token is yielded exactly once.

        Yields:
            ``{"tokens": [...]}`` (only tokens not yielded before; possibly empty), then the last
            message of ``EngineReplica.generate_stream`` with ``"tries"`` added (its ``tokens``
            likewise only the new ones).

        Raises:
            the last ``RETRYABLE`` error after ``max_tries`` attempts (tokens may have been
            yielded before it).
        """
        delivered = 0  # tokens yielded to our caller, over all attempts
        stream_handle = self.handle.options(stream=True)
        for attempt in range(1, self.max_tries + 1):
            seen = 0  # tokens received in this attempt
            response = stream_handle.generate_stream.remote(body)
            ended = False
            try:
                async for msg in response:
                    toks = msg["tokens"]
                    new = toks[max(0, delivered - seen):]  # skip what an earlier attempt delivered
                    seen += len(toks)
                    delivered += len(new)
                    msg = dict(msg, tokens=new)
                    if "finish_reason" in msg:
                        ended = True
                        msg["tries"] = attempt
                        yield msg
                        return
                    yield msg
            except RETRYABLE as e:
                ended = True
                await self._before_retry(attempt, response, e)
                continue
            finally:
                if not ended:  # our caller stopped reading (or an error): stop the replica's generator
                    response.cancel()
            raise RuntimeError("the replica's stream ended without a last message")  # a replica bug, not a death
        raise AssertionError("unreachable")


def _cancel_if_alive(response: Any, error: BaseException) -> None:
    """After ``ActorUnavailableError`` the replica may still be alive (the error can be transient):
    cancel the call there, so the retry does not run the request twice (and charge it twice). A
    dead actor (``RayActorError``) has nothing to cancel."""
    if isinstance(error, ray.exceptions.ActorUnavailableError):
        try:
            response.cancel()
        except Exception:  # best effort: the actor may be gone after all
            log.debug("cancel after %r failed", error, exc_info=True)


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | int | None = None, headers: dict[str, str] | None = None) -> Any:
    """An OpenAI-shaped error response (``{"error": {message, type, param, code}}``)."""
    return ApiError(status, message, type=type, param=param, headers=headers, code=code).response()


class _Feed:
    """Reads a stream of replica messages (``ScaleoutClient.generate_stream``) one at a time, each
    read raced against a stop event (the ``Ingress``'s drain).

    A read that the stop (or a cancellation of the reader) leaves pending stays with the feed;
    ``close`` cancels it, which ends the generator from the inside (its ``finally`` cancels the
    replica's stream, which aborts the request there); awaiting ``aclose`` on a generator another
    task is still running would raise instead.

    Args:
        agen: the message stream.
    """

    def __init__(self, agen: AsyncIterator[dict]) -> None:
        self.agen = agen
        self._pending: asyncio.Task | None = None
        self._closed = False

    async def next(self, stop: asyncio.Event) -> dict | None:
        """The next message, or ``None`` if ``stop`` is set first.

        Raises:
            whatever the stream raises (``StopAsyncIteration`` at its end, ``RETRYABLE``, ...).
        """
        if stop.is_set():
            return None
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.agen.__anext__())
            self._pending.add_done_callback(_retrieved)
        halt = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((self._pending, halt), return_when=asyncio.FIRST_COMPLETED)
        finally:
            halt.cancel()
        if not self._pending.done():
            return None
        read, self._pending = self._pending, None
        return read.result()

    async def close(self) -> None:
        """End the stream: cancel a pending read, or close the generator (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()  # raised inside the generator: it ends there, cancelling the replica's call
            self._pending = None
            return
        await self.agen.aclose()


def _serve_streaming_response() -> type:
    """Starlette's ``StreamingResponse`` without its disconnect listener, for a Serve deployment.

    Serve cancels a deployment's call when its HTTP client goes away, so the stream ends by that
    cancellation; Starlette's listener would instead read Serve's ``receive``, which then raises
    ``TaskCancelledError`` and logs a traceback per cut stream ("Future exception was never
    retrieved"). ``ended`` (sync) runs when the response ends, normally or by cancellation.
    """
    from starlette.responses import StreamingResponse

    class _Response(StreamingResponse):
        def __init__(self, content: Any, ended: Callable[[], None], **kwargs: Any) -> None:
            super().__init__(content, **kwargs)
            self.ended = ended

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await self.stream_response(send)
            finally:
                self.ended()

    return _Response


def _quiet_cancelled_receives(loop: asyncio.AbstractEventLoop) -> None:
    """On ``loop`` (once): drop asyncio's "Future exception was never retrieved" report for a
    ``TaskCancelledError``, the one Serve leaves behind when its proxy cancels a request whose
    client went away (its ASGI ``receive`` call fails, and the failed future is reported with a
    traceback even after the error was raised to the deployment); every other report goes to the
    handler there was."""
    if getattr(loop, "_batch_quiet_receives", False):
        return
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), ray.exceptions.TaskCancelledError) and "never retrieved" in str(
                context.get("message", "")):
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
    loop._batch_quiet_receives = True  # type: ignore[attr-defined]


def _retrieved(task: asyncio.Task) -> None:
    """A read's outcome is taken (a read left pending at a stop and then cancelled, or failing
    after its reader left, logs no "exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
class Ingress:
    """``POST /v1/completions`` over the replicas, answered OpenAI-style, streaming or not;
    ``GET /health``.

    Body fields: ``prompt`` (text), ``max_tokens`` (int >= 1, default 16), ``user``, ``stream``
    (bool), ``stream_options.include_usage`` (bool, only with ``"stream": true``), the sampling
    parameters (checked, then ignored), ``model`` (the served name when given): the single-process
    server's body model (``batch.server.app.CompletionBody``), so a bad body gets the same 400
    naming the field and an option not implemented (``n``, ``echo``, ...) the same refusal.

    Authentication and identity are the single-process server's (``batch.server.auth.Identities``,
    given already built, so the API keys themselves never leave the process that read the config:
    only their digests do): with keys, every ``/v1`` path needs a listed key (401
    ``invalid_api_key``, before the body is read) and the key's user is the fairness identity;
    without keys, the body's ``user`` only with ``trust_user_field``, a gateway's header with
    ``user_header``, else ``anonymous``. The identity is the ``user`` the replicas and the router
    see. A client that closes its connection mid-body is a 499 (one log line).

    A streamed answer is the single-process server's chunks (``batch.server.sse``); it starts once
    the first message of the replica's stream arrives, so a refused request is a 400 either way. A
    replica dying mid-stream is retried with the tokens already sent skipped
    (``ScaleoutClient.generate_stream``); if the retries run out, the stream ends with an error
    event (503) and ``[DONE]``; before any answer, a 503. ``drain`` (the shutdown's first step)
    ends every open stream with a last chunk whose ``finish_reason`` is ``"abort"``, the usage if
    asked, and ``[DONE]`` (each replica aborts its request), answers a non-streaming request in
    flight with a 503 and every new request with a 503.

    ``GET /metrics``: every replica's ``ServerMetrics`` families (the single-process server's) with
    a ``replica`` label, from the latest snapshot each pushed to ``metrics_board`` (at most
    ``metrics_period_s`` old; a replica whose last push is older than ``10 * metrics_period_s`` is
    left out), plus the ingress's own ``batch:client_retries_total`` (requests or streams sent
    again after their replica died) and ``batch:request_rejected_total{code}`` (its error
    answers; the replicas' family of that name stays empty, since they answer no HTTP). It needs
    a key when ``metrics_need_key``.

    Args:
        replicas: the ``EngineReplica`` deployment's handle.
        model_name: the ``model`` of every answer.
        metrics_board: the ``MetricsBoardActor`` the replicas push to (``None``: ``/metrics``
            has the ingress's own families only).
        metrics_period_s: the replicas' push period, seconds (> 0).
        max_body_bytes: largest request body read (a larger one is a 413 before it is parsed, as
            on the single-process server).
        kv_cap_blocks: the replicas' KV cache blocks (``None``: the stub's 256): a prompt of
            ``kv_cap_blocks * 16`` tokens or more is a 400 here, before it is sent to a replica.
        identities: who a request is (``None``: no keys, every request ``anonymous``).
        metrics_need_key: ``/metrics`` needs a configured key too (``True`` needs keys in
            ``identities``; ``None``, the default: whenever keys are configured).
        counters: the ``CountersActor``: ``/metrics`` then has its size and memory
            (``batch:counter_store_users``, ``batch:counter_store_forgotten_total``,
            ``batch:counter_store_resident_memory_bytes``).
        auth_failure_delay_s: seconds before a 401 is answered (>= 0; the single server's tarpit).

    Raises:
        ValueError: ``metrics_period_s`` not > 0; ``max_body_bytes`` or ``kv_cap_blocks`` < 1;
            ``metrics_need_key`` without keys.
    """

    def __init__(self, replicas: Any, model_name: str = "batch-sim", metrics_board: Any = None,
                 metrics_period_s: float = 1.0, max_body_bytes: int = 4 * 1024 * 1024,
                 kv_cap_blocks: int | None = None, identities: Identities | None = None,
                 metrics_need_key: bool | None = None, counters: Any = None,
                 auth_failure_delay_s: float = 0.1) -> None:
        from batch.server.tokenizer import WordTokenizer

        if not metrics_period_s > 0:
            raise ValueError(f"metrics_period_s must be > 0 seconds, got {metrics_period_s!r}")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
        blocks = MAX_KV_BLOCKS if kv_cap_blocks is None else kv_cap_blocks
        if blocks < 1:
            raise ValueError(f"kv_cap_blocks must be >= 1, got {kv_cap_blocks!r}")
        self.identities = identities or Identities()
        if metrics_need_key and not self.identities.required:
            raise ValueError("metrics_need_key needs API keys: there is no key to ask for")
        self.metrics_need_key = self.identities.required if metrics_need_key is None else metrics_need_key
        if not 0 <= auth_failure_delay_s < math.inf:
            raise ValueError(f"auth_failure_delay_s must be a finite number >= 0, got {auth_failure_delay_s!r}")
        self.auth_failure_delay_s = auth_failure_delay_s
        self.counters = counters
        self.max_body_bytes = max_body_bytes
        self.max_prompt_tokens = blocks * KV_BLOCK_TOKENS - 1  # one slot kept for the first output token
        self.client = ScaleoutClient(replicas)
        self.tok = WordTokenizer(0)
        self.model_name = model_name
        self._model_json = json.dumps(model_name)
        self.metrics_board = metrics_board
        self.metrics_max_age_s = 10 * metrics_period_s
        self.rejected: dict[int, int] = {}  # HTTP status -> error answers
        self._n = 0
        self._draining = asyncio.Event()  # set by drain(): streams end with "abort", new requests get 503
        self._open = 0  # answers being produced (streams and non-streaming requests)
        self._quiet = asyncio.Event()  # set when _open is 0
        self._quiet.set()

    def _reject(self, status: int, message: str, type: str = "invalid_request_error",
                param: str | None = None, code: str | int | None = None,
                headers: dict[str, str] | None = None) -> Any:
        """An error answer, counted in ``batch:request_rejected_total{code}``."""
        self.rejected[status] = self.rejected.get(status, 0) + 1
        return _error(status, message, type, param, code, headers)

    def _reject_api(self, e: ApiError) -> Any:
        return self._reject(e.status, e.message, e.type, e.param, e.code, e.headers)

    def _opened(self) -> Callable[[], None]:
        """Count an answer as open; returns its ``close`` (idempotent: a stream is closed by its
        generator's end and, should Starlette never start the generator, by the response's
        background task)."""
        self._open += 1
        self._quiet.clear()
        done = False

        def close() -> None:
            nonlocal done
            if not done:
                done = True
                self._open -= 1
                if not self._open:
                    self._quiet.set()
        return close

    async def drain(self, timeout_s: float = 10.0) -> int:
        """The shutdown's first step: from now on new requests get 503, every open stream ends
        with ``finish_reason: "abort"`` and ``[DONE]`` (its request aborted on its replica), a
        non-streaming request in flight gets a 503. Returns when no answer is open any more, or
        after ``timeout_s`` seconds; the answers still open then (0 when all ended)."""
        self._draining.set()
        try:
            await asyncio.wait_for(self._quiet.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self._open

    async def __call__(self, request: Any) -> Any:
        """Route one HTTP request (Serve's ingress call); anything unexpected is a 500 in OpenAI's
        shape (Serve's own answer to an exception is plain text)."""
        try:
            return await self._route(request)
        except Exception as e:  # a bug: still OpenAI's shape, with its traceback logged
            if isinstance(e, (ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
                raise
            log.exception("%s %s: unexpected error", request.method, request.url.path)
            return self._reject(500, f"internal server error: {type(e).__name__}", type="server_error")

    async def _route(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        path = request.url.path.rstrip("/")
        if request.method == "GET" and path == "/health":
            return JSONResponse({"status": "ok"})
        try:
            if request.method == "GET" and path == "/metrics":
                if self.metrics_need_key:
                    self.identities.check_key(request.headers)
                return Response(await self.metrics_text(), media_type=CONTENT_TYPE)
            principal = self.identities.authenticate(request.headers) if path.startswith("/v1") else None
        except AuthError as e:
            if e.status == 401 and self.auth_failure_delay_s:  # a tarpit for made-up keys, as the single server's
                await asyncio.sleep(self.auth_failure_delay_s)
            return self._reject_api(ApiError.of(e))
        if request.method != "POST" or path != "/v1/completions":
            return self._reject(404, f"no route {request.method} {request.url.path}")
        if self._draining.is_set():
            return self._reject(503, "the server is shutting down", type="service_unavailable")
        _quiet_cancelled_receives(asyncio.get_running_loop())
        try:
            body = await read_json_body(request, self.max_body_bytes)  # 413 too large, 400 not JSON, 499 closed
            payload, stream, include_usage = self._parse(body, principal)
        except ApiError as e:
            return self._reject_api(e)
        except ray.exceptions.TaskCancelledError:  # the client went away mid-body: Serve's proxy cancelled the call
            log.warning("%s %s: client closed the connection while sending the body: answered 499", request.method,
                        request.url.path)
            return self._reject(499, "client closed the connection while sending the body", code=499)
        self._n += 1
        rid = payload["request_id"] = f"cmpl-{self._n}"
        if stream:
            return await self._stream(payload, include_usage)
        close = self._opened()
        try:
            call = asyncio.ensure_future(self.client.generate(payload))
            halt = asyncio.ensure_future(self._draining.wait())
            try:
                await asyncio.wait((call, halt), return_when=asyncio.FIRST_COMPLETED)
            finally:
                halt.cancel()
                if not call.done():  # draining, or this call cancelled: the replica aborts the request
                    call.cancel()
            if not call.done():  # draining: let the cancel reach the replica's call, then answer
                await asyncio.wait((call,))
            if call.cancelled():
                return self._reject(503, "the server is shutting down", type="service_unavailable")
            out = call.result()
        except RETRYABLE as e:
            return self._reject(503, f"no replica answered after {self.client.max_tries} tries: {e!r}",
                                type="service_unavailable")
        finally:
            close()
        if "error" in out:
            return self._reject(400, out["error"])
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name,
                             "choices": [{"index": 0, "text": self.tok.decode(out["tokens"]),
                                          "finish_reason": out["finish_reason"]}],
                             "usage": {"prompt_tokens": len(payload["prompt"]),
                                       "completion_tokens": len(out["tokens"])},
                             "batch": {"replica": out["replica"], "tries": out["tries"]}})

    async def metrics_text(self) -> bytes:
        """The ``/metrics`` text: the replicas' latest snapshots (``replica`` label) and the
        ingress's own families (``batch.scaleout.metrics.render_replicas``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = {}
        if self.metrics_board is not None:
            snapshots = await self.metrics_board.snapshots.remote(self.metrics_max_age_s)
        retries = CounterMetricFamily("batch:client_retries", "Requests or streams sent again because their "
                                      "replica died (ScaleoutClient's retry rule).", value=self.client.retries)
        rejected = CounterMetricFamily("batch:request_rejected", "Requests refused, by HTTP status.",
                                       labels=["code"])
        for code, n in sorted(self.rejected.items()):
            rejected.add_metric([str(code)], n)
        own = [retries, rejected]
        if self.counters is not None:
            try:
                size, proc = await asyncio.gather(self.counters.size.remote(), self.counters.process.remote())
            except Exception as e:  # noqa: BLE001 - the actor dead or unreachable: the rest of /metrics still
                log.warning("counters actor unreachable for /metrics: %r", e)
            else:
                own.append(GaugeMetricFamily("batch:counter_store_users", "Users the counters actor holds "
                                             "(service or a lift level).", value=size["users"]))
                own.append(CounterMetricFamily("batch:counter_store_forgotten", "Users the counters actor forgot "
                                               "(idle everywhere, counter at or below the lift).",
                                               value=size["forgotten"]))
                if proc["rss_bytes"] is not None:
                    own.append(GaugeMetricFamily("batch:counter_store_resident_memory_bytes", "Resident memory of "
                                                 "the counters actor's process.", value=proc["rss_bytes"]))
        return await asyncio.get_running_loop().run_in_executor(None, render_replicas, snapshots, own)

    def _parse(self, body: Any, principal: str | None = None) -> tuple[dict, bool, bool]:
        """``(replica body, stream, include_usage)`` of a request body, checked as the
        single-process server checks it (``CompletionBody``), with the identity
        (``Identities.user``: ``principal`` when the headers decided it).

        Raises:
            ApiError: 400 naming the field: a body that fails ``CompletionBody`` (types, ranges,
                ``stream_options`` without ``stream``), an option not implemented, a prompt that
                is not text or is over ``max_prompt_tokens`` tokens, a trusted ``user`` too long;
                404 for another model.
        """
        try:
            b = CompletionBody.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        b.check_supported()
        if b.model is not None and b.model != self.model_name:
            raise ApiError(404, f"the model {b.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if not isinstance(b.prompt, str):
            raise ApiError(400, "prompt: must be a string (this server takes text prompts)", param="prompt")
        try:
            user = self.identities.user(principal, b.user)
        except AuthError as e:
            raise ApiError.of(e) from None
        ids = self.tok.encode(b.prompt, self.max_prompt_tokens)
        if not ids:
            raise ApiError(400, "prompt: empty (it must hold at least one token)", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise ApiError(400, f"prompt: more than {self.max_prompt_tokens} tokens; the replicas' limit is "
                                f"{self.max_prompt_tokens} prompt tokens (their KV cache, one slot kept for the "
                                f"first output token)", param="prompt")
        include_usage = bool(b.stream_options and b.stream_options.include_usage)
        return ({"user": user, "prompt": ids, "max_tokens": b.max_tokens or DEFAULT_MAX_TOKENS}, bool(b.stream),
                include_usage)

    async def _stream(self, payload: dict, include_usage: bool) -> Any:
        """The streamed answer: waits for the replica's first message (a refusal is a 400, no
        replica a 503), then the SSE body."""
        close = self._opened()
        feed = _Feed(self.client.generate_stream(payload))
        try:
            first = await feed.next(self._draining)
        except RETRYABLE as e:
            close()
            return self._reject(503, f"no replica answered after {self.client.max_tries} tries: {e!r}",
                                type="service_unavailable")
        except BaseException:
            close()
            raise
        if first is None or "error" in first:
            await feed.close()
            close()
            if first is None:
                return self._reject(503, "the server is shutting down", type="service_unavailable")
            return self._reject(400, first["error"])
        fmt = ChunkFormat(payload["request_id"], int(time.time()), self._model_json, chat=False)

        def ended() -> None:  # the response ended or was cancelled, whether or not its generator ever ran
            close()
            asyncio.ensure_future(feed.close())  # a task of its own: the response's may be cancelled
        return _serve_streaming_response()(self._sse(first, feed, fmt, len(payload["prompt"]), include_usage, close),
                                           ended, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _sse(self, msg: dict, feed: _Feed, fmt: ChunkFormat, prompt_tokens: int,
                   include_usage: bool, close: Callable[[], None]) -> AsyncIterator[str]:
        """One ``data:`` chunk per token (a message's tokens in one write), the last token's chunk
        with the finish reason, the usage if asked, ``[DONE]``: the single-process server's. At
        ``drain``, a last chunk with ``finish_reason: "abort"``. The answer counts as open
        (``close``) until ``[DONE]`` was handed over."""
        dec = IncrementalDecoder(self.tok)
        n_out = 0
        try:
            try:
                while True:
                    toks = msg["tokens"]
                    n_out += len(toks)
                    if "finish_reason" not in msg:
                        yield "".join(fmt.chunk(dec.push(t)) for t in toks)
                        nxt = await feed.next(self._draining)
                        if nxt is None:  # shutting down: the request is aborted on its replica
                            yield fmt.chunk(dec.flush(), "abort")
                            break
                        msg = nxt
                        continue
                    if "error" in msg:
                        yield error_event(msg["error"], "invalid_request_error", None, 400)
                    else:
                        head = "".join(fmt.chunk(dec.push(t)) for t in toks[:-1])
                        last = dec.push(toks[-1]) if toks else ""
                        yield head + fmt.chunk(last + dec.flush(), msg["finish_reason"])
                    break
            except RETRYABLE as e:
                yield error_event(f"the replicas died mid-stream ({self.client.max_tries} tries): {e!r}",
                                  "service_unavailable", None, 503)
            except Exception as e:  # noqa: BLE001 - a replica bug: the stream still ends with an error and [DONE]
                log.warning("a stream ended on an unexpected error: %r", e)
                yield error_event(f"internal error: {e!r}", "server_error", None, 500)
            finally:
                await feed.close()
            if include_usage:
                yield fmt.usage(prompt_tokens, n_out)
            yield DONE
        finally:
            close()


def _counters_actor() -> Any:
    """The counters actor, forgetting idle users only when the replicas' policy can forget them too
    (``POLICY_FORGETS``), with the replicas' tolerance."""
    return CountersActor.remote(forget_idle=POLICY_FORGETS, tolerance_units=fr.TOLERANCE_TOKENS * fr.COUNTER_SCALE)


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


def deploy(replicas: int, *, time_scale: float = 1.0, seed: int = 0, eos_probability: float = EOS_PROBABILITY,
           period_s: float = 0.05,
           weights: dict[str, int] | None = None, kv_cap_blocks: int | None = None, share: bool = True,
           name: str = "batch", observe_gap: bool = False,
           pin_users: dict[str, int] | None = None, metrics_board: Any = None,
           metrics_period_s: float = 1.0) -> tuple[Any, Any]:
    """Start the counters actor and ``replicas`` engine replicas on the running Ray instance.

    Args:
        replicas: engine replicas (int >= 1).
        time_scale, seed, eos_probability, period_s, weights, kv_cap_blocks: ``EngineReplica``'s.
        share: start the counters actor (``False``: each replica runs VTC on its own counters).
        name: the Serve application's name.
        observe_gap: the actor measures the counter gap and the bound's terms at every sync
            (``GapObserver``, window ``2 * period_s + 0.05`` s, which leaves the ticks out of the
            staleness: the measured ``D`` is an underestimate, docs/scale-out.md section 1; read
            with ``counters.gap_stats``).
        pin_users: user -> replica index (``BatchRequestRouter.initialize_state``): the user's
            requests go to the live replica at that index in the sorted live replica ids, or by
            load when there is none.
        metrics_board, metrics_period_s: a ``MetricsBoardActor`` the replicas push their metrics
            to every ``metrics_period_s`` seconds (``EngineReplica``; ``None``: no metrics).

    Returns:
        ``(deployment handle, counters actor or None)``.

    Raises:
        TypeError: ``replicas`` not an int; a bad ``pin_users`` entry.
        ValueError: ``replicas`` < 1; a negative pin index.
    """
    engines = _engines(replicas, pin_users)
    counters = _counters_actor() if share else None
    if counters is not None and observe_gap:
        ray.get(counters.observe_gap.remote(2 * period_s + 0.05))
    app = engines.bind(counters, time_scale=time_scale, seed=seed, eos_probability=eos_probability,
                       period_s=period_s, weights=weights, kv_cap_blocks=kv_cap_blocks, metrics_board=metrics_board,
                       metrics_period_s=metrics_period_s)
    handle = serve.run(app, name=name, route_prefix=None)
    return handle, counters


def serve_http(replicas: int, *, host: str = "127.0.0.1", port: int = 8000, time_scale: float = 1.0, seed: int = 0,
               eos_probability: float = EOS_PROBABILITY, period_s: float = 0.05, weights: dict[str, int] | None = None,
               kv_cap_blocks: int | None = None, num_cpus: int | None = None, metrics_period_s: float = 1.0,
               max_body_bytes: int = 4 * 1024 * 1024, api_keys: dict[str, str] | None = None,
               trust_user_field: bool = False, user_header: str | None = None,
               metrics_need_key: bool | None = None, shutdown_timeout_s: float = 10.0,
               timeout_keep_alive_s: float = 5.0, auth_failure_delay_s: float = 0.1) -> None:
    """``batch-llm serve --replicas N``: a local Ray instance, the counters actor, the metrics board,
    ``replicas`` engine replicas and the ``Ingress`` on ``http://host:port`` (``/v1/completions``,
    ``/health``, ``/metrics``); blocks until interrupted.

    On ``KeyboardInterrupt`` (Ctrl-C, SIGINT or SIGTERM once it serves; Ray's own processes block
    SIGINT, so only this one gets a terminal's Ctrl-C) it prints one line, drains the ``Ingress`` (every open stream ends with ``finish_reason:
    "abort"`` and ``[DONE]``, its request aborted on its replica; a non-streaming request in flight
    and new requests get 503), waiting at most ``shutdown_timeout_s`` for the open answers, then
    shuts Serve and Ray down and raises the interrupt again for the caller's exit status.

    Args:
        replicas: engine replicas (int >= 1).
        host, port: where the HTTP proxy listens.
        time_scale, seed, eos_probability, period_s, weights, kv_cap_blocks: ``EngineReplica``'s.
        num_cpus: Ray's CPUs (``None``: the machine's).
        metrics_period_s: seconds between the replicas' metrics pushes (> 0).
        max_body_bytes: the ``Ingress``'s body limit (a larger body is a 413).
        api_keys, trust_user_field, user_header: who a request is (``batch.server.auth.Identities``,
            built here: only the keys' digests reach the ``Ingress``).
        metrics_need_key: ``/metrics`` needs a configured key (``None``: whenever keys are configured).
        shutdown_timeout_s: at Ctrl-C, the longest wait for the open answers to end (> 0).
        timeout_keep_alive_s: the proxy's idle keep-alive timeout (Serve's ``keep_alive_timeout_s``, whole
            seconds, rounded up). Serve's proxy is its own uvicorn: the head timeout, connection cap and
            head size cap of ``batch.server.limits`` do not apply to it (docs/server.md, "Connections").
        auth_failure_delay_s: the ``Ingress``'s delay before a 401 (``ServerConfig.auth_failure_delay_s``).

    Raises:
        TypeError: ``replicas`` not an int.
        ValueError: ``replicas`` < 1; ``metrics_period_s`` or ``shutdown_timeout_s`` not > 0; identity
            options that conflict (``Identities``).
        KeyboardInterrupt: after the shutdown, when interrupted.
    """
    engines = _engines(replicas, None)
    if not metrics_period_s > 0:
        raise ValueError(f"metrics_period_s must be > 0 seconds, got {metrics_period_s!r}")
    if not shutdown_timeout_s > 0:
        raise ValueError(f"shutdown_timeout_s must be > 0 seconds, got {shutdown_timeout_s!r}")
    identities = Identities(api_keys, trust_user_field=trust_user_field, user_header=user_header)
    if metrics_need_key and not identities.required:
        raise ValueError("metrics_need_key needs api_keys: there is no key to ask for")
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    ingress = None
    try:
        serve.start(http_options={"host": host, "port": port,
                                  "keep_alive_timeout_s": max(1, math.ceil(timeout_keep_alive_s))})
        counters = _counters_actor()
        board = MetricsBoardActor.remote()
        app = engines.bind(counters, time_scale=time_scale, seed=seed, eos_probability=eos_probability,
                           period_s=period_s, weights=weights, kv_cap_blocks=kv_cap_blocks, metrics_board=board,
                           metrics_period_s=metrics_period_s)
        ingress = serve.run(Ingress.bind(app, metrics_board=board, metrics_period_s=metrics_period_s,
                                         max_body_bytes=max_body_bytes, kv_cap_blocks=kv_cap_blocks,
                                         identities=identities, metrics_need_key=metrics_need_key,
                                         counters=counters, auth_failure_delay_s=auth_failure_delay_s),
                            name="batch", route_prefix="/")
        _interrupt_on(signal.SIGINT, signal.SIGTERM)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal changes nothing: the shutdown is bounded
            signal.signal(sig, signal.SIG_IGN)
        print(f"batch-llm serve: shutting down: ending the open answers (waiting at most {shutdown_timeout_s:g} s), "
              f"then Ray Serve and Ray", file=sys.stderr, flush=True)
        if ingress is not None:
            _drain(ingress, shutdown_timeout_s)
        raise
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt_on(*signals: int) -> None:
    """Each of ``signals`` raises ``KeyboardInterrupt`` in the main thread (the drain, then the
    shutdown): also where SIGINT was inherited as ignored (a shell's background job) and for
    SIGTERM (a service manager's stop), whose default would kill the process without a drain."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    for sig in signals:
        signal.signal(sig, interrupt)


def _drain(ingress: Any, timeout_s: float) -> None:
    """``Ingress.drain`` through its handle, at most ``timeout_s`` (plus a second for the call); a
    failed call ends the wait (the shutdown goes on)."""
    try:
        left = ingress.drain.remote(timeout_s).result(timeout_s=timeout_s + 1.0)
    except Exception as e:  # noqa: BLE001 - the shutdown goes on whatever happened to the drain
        print(f"batch-llm serve: the Ingress did not drain ({type(e).__name__}); cutting the open answers",
              file=sys.stderr, flush=True)
        return
    if left:
        print(f"batch-llm serve: {left} answer(s) still open after {timeout_s:g} s; cutting them", file=sys.stderr,
              flush=True)
