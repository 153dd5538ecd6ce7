"""The engine thread: the one thread that owns and ticks the ``Scheduler``.

The scheduler is driven from exactly one thread. The asyncio side never calls it: it puts
commands (submit, abort, stop) on a ``queue.SimpleQueue``; the engine thread applies every
queued command between two ticks, ticks while anything is active and blocks on the queue when
idle. Output comes back through the scheduler's per-token hook (``Scheduler(on_tokens=...)``):
after each tick the engine hands the tick's events, one list for all requests, to the event
loop with a single ``loop.call_soon_threadsafe``; the loop routes each event to its request's
``TokenSink``.

``SeededGPU`` is the simulated GPU the server runs by default: the stub's latency model
(5 ms + 1 ms per request, times ``time_scale``, real sleeps) and its token rule, seeded so that
the tokens of a request are a pure function of ``(seed, prompt, position)``: the same prompt
gives the same output, streamed or not, whatever shares its batches.
"""
from __future__ import annotations

import asyncio
import hashlib
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import inference_stub
from inference_stub import Request
from scheduler import BackendError, RequestError, Scheduler

__all__ = ["ServedRequest", "SeededGPU", "TokenSink", "Engine", "EngineFailed", "Snapshot", "TokenEvent"]


@dataclass
class ServedRequest(Request):
    """A ``Request`` with what the server needs beside the contract's fields.

    Attributes:
        seed_key: the key ``SeededGPU`` draws this request's tokens from (a digest of the
            prompt, so that equal prompts give equal outputs); empty: the ``request_id``.
    """

    seed_key: str = ""


class SeededGPU(inference_stub.SimulatedGPU):
    """The simulated GPU in real time with a time scale, its tokens keyed by prompt; a request
    that reaches ``max_tokens`` ends with ``"length"`` (no forced EOS).

    Args:
        time_scale: multiplies the stub's iteration latency (1.0: 5 ms + 1 ms per request, as
            ``inference_stub.forward``; 0.01: a hundred times faster). Must be > 0.
        seed: the token seed (the same seed and prompt give the same tokens).
        eos_probability: chance of an early EOS per token (the stub's 0.02 by default).

    Raises:
        ValueError: ``time_scale`` is not > 0, or what ``SimulatedGPU`` refuses.
    """

    def __init__(self, *, time_scale: float = 1.0, seed: int = 0,
                 eos_probability: float = inference_stub.EOS_PROBABILITY) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
        super().__init__(base_s=inference_stub.ITERATION_BASE_S * time_scale,
                         per_request_s=inference_stub.ITERATION_PER_REQUEST_S * time_scale,
                         eos_probability=eos_probability, seed=seed)
        self.time_scale = time_scale

    def _rng_for(self, request: Request) -> random.Random:
        key = getattr(request, "seed_key", "") or request.request_id
        return random.Random(f"{self.seed}/{key}/{len(request.generated)}")

    def forward(self, batch: Sequence[Request]) -> list[int]:
        """One iteration: sleeps the scaled latency; per request EOS with ``eos_probability``,
        else a token in 1..63. Unlike the stub it does not force EOS at ``max_tokens``: the
        scheduler ends such a request itself, with finish reason ``"length"`` (as a model
        server reports it), where the stub's forced EOS would read as ``"stop"``."""
        if not batch:
            return []
        dt = self.latency_s(len(batch))
        time.sleep(dt)
        self.iterations += 1
        self.busy_s += dt
        return [self._draw(self._rng_for(r)) for r in batch]

    def _draw(self, rng: random.Random) -> int:
        """The stub's draw without its forced EOS: EOS w.p. ``eos_probability``, else 1..63."""
        if rng.random() < self.eos_probability:
            return inference_stub.EOS_TOKEN
        return rng.randint(1, inference_stub.VOCAB_SIZE - 1)

    __call__ = forward

    @staticmethod
    def prompt_key(prompt: Sequence[int]) -> str:
        """The ``seed_key`` of a prompt: a short digest of its token ids."""
        return hashlib.blake2b(repr(list(prompt)).encode(), digest_size=12).hexdigest()


@dataclass(slots=True)
class TokenEvent:
    """What one tick gave one request (delivered on the event loop).

    Attributes:
        token: the token id, or ``None`` for an event without a token (an abort, a refusal).
        finish_reason: ``"stop"``, ``"length"``, ``"error"`` or ``"abort"`` when the request
            ended with this event, else ``None``.
        t_s: engine time of the event (``time.perf_counter()`` seconds, taken after the tick).
        error: for a submit the scheduler refused, the ``RequestError``; else ``None``.
    """

    token: int | None
    finish_reason: str | None
    t_s: float
    error: Exception | None = None


class TokenSink:
    """The asyncio side of one request: where the engine's events for it land.

    Created and read on the event loop; ``push`` runs there too (the engine calls it through
    ``call_soon_threadsafe``). A streaming sink queues every event on ``queue``; any sink keeps
    the last event in ``final`` and sets ``finished`` when an event with a finish reason comes.
    The request's tokens are ``request.generated`` (the engine thread appended them before it
    handed over the events).

    Args:
        request: the request.
        stream: queue every event (a streaming response reads them one by one).
    """

    __slots__ = ("request", "stream", "queue", "finished", "final", "first_token_s", "last_token_s", "submitted_s",
                 "released")

    def __init__(self, request: ServedRequest, stream: bool = True) -> None:
        self.request = request
        self.stream = stream
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = asyncio.Event()
        self.final: TokenEvent | None = None
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.released = False  # the server's waiting count no longer includes it

    @property
    def done(self) -> bool:
        """True once an event with a finish reason arrived."""
        return self.final is not None

    def push(self, ev: TokenEvent) -> None:
        """Take one event (event loop only)."""
        if self.stream:
            self.queue.put_nowait(ev)
        if ev.finish_reason is not None:
            self.final = ev
            self.finished.set()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The scheduler's state as the engine last published it (after a tick or a command).

    Attributes:
        running: resident requests (prefilling or decoding).
        waiting: queued or preempted requests.
        kv_blocks_used: KV blocks held; ``kv_cap_blocks``: the cap.
        active: ``Scheduler.has_active()``.
        ticks: ticks run so far; ``busy_s``: wall seconds spent in ``tick()``.
        submitted, refused, finished, aborted: the engine's ``EngineCounters`` at that moment;
        ``finish_reasons``: finished requests per reason.
    """

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_cap_blocks: int = 0
    active: bool = False
    ticks: int = 0
    busy_s: float = 0.0
    submitted: int = 0
    refused: int = 0
    finished: int = 0
    aborted: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet finished or aborted (0 when the engine is drained)."""
        return self.submitted - self.finished - self.aborted


@dataclass
class _Submit:
    request: ServedRequest
    sink: TokenSink


@dataclass
class _Abort:
    request: ServedRequest
    sink: TokenSink


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future


_STOP = object()


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class EngineFailed(RuntimeError):
    """The engine thread died (a scheduler bug); the requests it held get this as their error."""


@dataclass
class EngineCounters:
    """Totals the engine thread keeps (read from other threads for /health; each an int).

    Attributes:
        submitted: requests the scheduler accepted; ``refused``: submits it refused.
        finished: requests that ended by ``tick()`` (stop, length, error); ``aborted``:
            requests ``abort`` took out (a client that went away).
    """

    submitted: int = 0
    refused: int = 0
    finished: int = 0
    aborted: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class Engine:
    """Owns a ``Scheduler`` and ticks it in one thread; talks to an asyncio loop.

    Args:
        scheduler: the scheduler (built with no ``on_tokens``: the engine sets it). Only the
            engine thread calls it once ``start`` ran.
        on_tick: optional ``on_tick(events, iteration_s)`` called on the event loop after the
            events of a tick were routed (the server's metrics); ``events`` is a list of
            ``(sink, TokenEvent)``, ``iteration_s`` the tick's wall time in seconds.

    Use ``start(loop)`` once, from the event loop's thread; then ``submit`` / ``abort`` from
    that loop; ``stop()`` ends the thread (requests still in flight are aborted), and
    ``begin_stop()`` asks it to end without waiting (the server's shutdown).

    A tick whose backend fails (``BackendError``) is rolled back by the scheduler and retried
    after ``backend_retry_s``; with ``Scheduler(max_backend_tries=N)`` (``build_engine`` gives
    3) the N-th consecutive failure fails that batch's requests (finish reason ``"error"``)
    and the engine goes on. Anything else ``tick()`` raises (a scheduler bug) ends the thread:
    every waiting request gets an ``"error"`` event (``EngineFailed``), so does every submit
    still queued (``alive`` is False from the first moment), ``error`` holds the exception and
    ``/health`` answers 503.
    """

    def __init__(self, scheduler: Scheduler,
                 on_tick: Callable[[list[tuple[TokenSink, TokenEvent]], float], None] | None = None) -> None:
        self.scheduler = scheduler
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sinks: dict[int, TokenSink] = {}  # id(request) -> sink, engine thread only
        self._pairs: list[tuple[Request, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.on_tick = on_tick
        self.counters = EngineCounters()
        self.snapshot = Snapshot(kv_cap_blocks=scheduler.config.kv_cap_blocks)
        self.iteration_s_sum = 0.0  # wall seconds in tick() over ticks that ran a batch
        self.iterations = 0
        self.token_iteration_s = 0.0  # sum over output tokens of the wall time of the tick that made each
        self.tokens_out = 0
        self.cpu_s = 0.0  # CPU seconds of the engine thread (time.thread_time), all its work
        self.error: BaseException | None = None  # what ended the thread, if anything did
        self._dead = False  # set first when the thread ends (failed or stopped): alive is False at once
        self.backend_errors = 0  # ticks the backend failed (each rolled back, then retried)
        self.last_backend_error: str | None = None
        self.backend_retry_s = 0.01  # pause before retrying a failed tick
        scheduler.on_tokens = self._pairs.extend

    # ------------------------------------------------------------ the asyncio side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread, delivering to ``loop``. Call once."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="batch-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and takes requests (False from the moment it
        started to fail or stop)."""
        return not self._dead and self._thread is not None and self._thread.is_alive()

    def submit(self, request: ServedRequest, stream: bool = True) -> TokenSink:
        """Queue ``request`` for the engine thread; returns its sink (call on the event loop).

        The scheduler's refusal, if any, arrives as the sink's first event (``error`` set,
        finish reason ``"error"``). If the engine thread ended (or is ending), the sink gets an
        ``EngineFailed`` error event instead: every submit is answered.
        """
        sink = TokenSink(request, stream)
        self._cmds.put(_Submit(request, sink))
        if self._dead:  # queued after the thread drained its queue (or while it does: the sink takes one end)
            self._deliver([(sink, TokenEvent(None, "error", time.perf_counter(), self._down_error()))], 0.0)
        return sink

    def abort(self, sink: TokenSink) -> None:
        """Ask the engine thread to abort the request of ``sink`` (a no-op if it already ended).

        Its blocks are freed on the engine thread before the next tick; the sink gets an
        ``"abort"`` event if the request was still live.
        """
        self._cmds.put(_Abort(sink.request, sink))

    def begin_stop(self) -> None:
        """Ask the engine thread to end, without waiting: from now ``alive`` is False (new
        submits get 503); the thread aborts every live request (an ``"abort"`` event each) and
        answers the submits still queued with 503."""
        self._dead = True
        self._cmds.put(_STOP)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the engine thread (``begin_stop``) and wait for it."""
        self.begin_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run ``fn()`` on the engine thread between two ticks; a future (of the engine's loop)
        for its result or exception. Call on the event loop after ``start``. For state the engine
        thread owns, e.g. the scale-out policy's counters (``batch.scaleout.ray_serve``)."""
        assert self._loop is not None, "engine not started"
        fut = self._loop.create_future()
        self._cmds.put(_Call(fn, fut))
        return fut

    def next_id(self, prefix: str) -> str:
        """A fresh request id ``<prefix>-<32 hex digits>`` (a random UUID: unique across
        restarts too, and it tells nothing of the server's load)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    # ------------------------------------------------------------ the engine thread

    def _apply(self, cmd: Any, events: list[tuple[TokenSink, TokenEvent]]) -> bool:
        """Apply one command; False for stop."""
        sched = self.scheduler
        if cmd is _STOP:
            return False
        if type(cmd) is _Submit:
            try:
                sched.submit(cmd.request)
            except RequestError as e:
                self.counters.refused += 1
                events.append((cmd.sink, TokenEvent(None, "error", time.perf_counter(), e)))
                return True
            self.counters.submitted += 1
            self._sinks[id(cmd.request)] = cmd.sink
        elif type(cmd) is _Call:
            try:
                result, error = cmd.fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the caller's future
                result, error = None, e
            self._loop.call_soon_threadsafe(_settle, cmd.future, result, error)
        else:  # _Abort
            if self._sinks.pop(id(cmd.request), None) is not None and sched.abort(cmd.request) is not None:
                self.counters.aborted += 1
                events.append((cmd.sink, TokenEvent(None, "abort", time.perf_counter())))
        return True

    def _publish(self) -> None:
        s, c = self.scheduler, self.counters
        self.snapshot = Snapshot(running=len(s.running), waiting=len(s.policy), kv_blocks_used=s.pool.num_used,
                                 kv_cap_blocks=s.config.kv_cap_blocks, active=s.has_active(),
                                 ticks=self.iterations, busy_s=self.iteration_s_sum, submitted=c.submitted,
                                 refused=c.refused, finished=c.finished, aborted=c.aborted,
                                 finish_reasons=dict(c.by_reason))

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # noqa: BLE001 - recorded for /health; the requests are failed below
            self.error = e
            self._dead = True
            self._fail_all(e)
        finally:
            self._dead = True
            self._fail_queued()
            self._publish()

    def _down_error(self) -> EngineFailed:
        e = self.error
        return EngineFailed("the engine is not running" if e is None else f"engine failed: {e!r}")

    def _fail_queued(self) -> None:
        """After the thread's end (``_dead`` set): answer every submit still queued with an
        ``EngineFailed`` error event (a submit queued later is answered by ``submit`` itself)."""
        events = []
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if type(cmd) is _Submit:
                events.append((cmd.sink, TokenEvent(None, "error", time.perf_counter(), self._down_error())))
        self._send(events)

    def _loop_forever(self) -> None:
        """Apply every queued command, tick while anything is active, block when idle; hand
        each round's events to the loop in one ``call_soon_threadsafe``. Ends at stop."""
        sched, cmds, loop, cpu = self.scheduler, self._cmds, self._loop, time.thread_time
        assert loop is not None
        running, cpu0 = True, cpu()
        while running:
            events: list[tuple[TokenSink, TokenEvent]] = []
            if not sched.has_active():
                self._publish()
                self.cpu_s += cpu() - cpu0
                running = self._apply(cmds.get(), events)  # idle: block until there is work
                cpu0 = cpu()
            while running:  # every queued command before the next tick
                try:
                    cmd = cmds.get_nowait()
                except queue.Empty:
                    break
                running = self._apply(cmd, events)
            iteration_s = self._tick(events) if running and sched.has_active() else 0.0
            c = cpu()
            self.cpu_s += c - cpu0
            cpu0 = c
            if events:
                loop.call_soon_threadsafe(self._deliver, events, iteration_s)
        self._dead = True  # stopped: new requests are refused from here on
        self._abort_all()

    def _tick(self, events: list[tuple[TokenSink, TokenEvent]]) -> float:
        """Run one tick and append its events (a token per request, a finish reason where one
        ended). Returns the tick's wall time, seconds; 0.0 after a ``BackendError`` (the
        scheduler rolled the tick back; this waits ``backend_retry_s`` before the retry)."""
        sched, pairs, sinks = self.scheduler, self._pairs, self._sinks
        t0 = time.perf_counter()
        try:
            finished = sched.tick()
        except BackendError as err:
            self.backend_errors += 1
            self.last_backend_error = repr(err)
            pairs.clear()
            time.sleep(self.backend_retry_s)
            return 0.0
        t1 = time.perf_counter()
        iteration_s = t1 - t0
        self.iterations += 1
        self.iteration_s_sum += iteration_s
        self.tokens_out += len(pairs)
        self.token_iteration_s += iteration_s * len(pairs)
        reasons = {id(r): why for r, why in sched.last_finished} if finished else None
        for req, token in pairs:
            why = reasons.get(id(req)) if reasons is not None else None
            sink = sinks.pop(id(req), None) if why is not None else sinks.get(id(req))
            if sink is not None:
                events.append((sink, TokenEvent(token, why, t1)))
        if reasons is not None:
            c = self.counters
            for r, why in sched.last_finished:
                c.finished += 1
                c.by_reason[why] = c.by_reason.get(why, 0) + 1
                sink = sinks.pop(id(r), None)  # a finish without a token (the retry policy's "error")
                if sink is not None:
                    events.append((sink, TokenEvent(None, why, t1)))
        pairs.clear()
        self._publish()
        return iteration_s

    def _abort_all(self) -> None:
        """At stop: abort every live request (blocks freed) and tell its sink."""
        events = []
        for sink in list(self._sinks.values()):
            if self.scheduler.abort(sink.request) is not None:
                self.counters.aborted += 1
            events.append((sink, TokenEvent(None, "abort", time.perf_counter())))
        self._sinks.clear()
        self._send(events)

    def _fail_all(self, e: BaseException) -> None:
        """The engine thread died: every waiting client gets an ``error`` event."""
        events = [(sink, TokenEvent(None, "error", time.perf_counter(), EngineFailed(f"engine failed: {e!r}")))
                  for sink in self._sinks.values()]
        self._sinks.clear()
        self._send(events)

    def _send(self, events: list[tuple[TokenSink, TokenEvent]]) -> None:
        if events and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, events, 0.0)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _deliver(self, events: list[tuple[TokenSink, TokenEvent]], iteration_s: float) -> None:
        """On the event loop: route a tick's events to their sinks, then ``on_tick``. An event
        for a sink that already ended is dropped (a submit answered by ``submit`` and by the
        engine's drain both)."""
        delivered = []
        for pair in events:
            sink = pair[0]
            if sink.final is None:
                sink.push(pair[1])
                delivered.append(pair)
        if self.on_tick is not None:
            self.on_tick(delivered, iteration_s)
