"""Batch: a continuous-batching (iteration-level) scheduler for LLM inference.

``Scheduler`` is the import contract's thread-safe facade (``../shared/mission/contract.md``)
over ``batch/core`` (``docs/design.md``). One ``tick()``: ``step.schedule`` (a pure decision),
``step.commit`` (blocks), ``forward``, ``step.apply``; a failed ``forward`` rolls the blocks back.
"""
from __future__ import annotations

import numbers
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import inference_stub
from batch.core import step
from batch.core.errors import (BackendError, DuplicateRequestError, InvalidRequestError, PromptTooLongError,
                               RequestError)
from batch.core.kv_cache import BlockPool
from batch.core.prefix_cache import PrefixCachingPool, block_keys
from batch.core.metrics import MetricsRecorder
from batch.core.state import Config, Entry, Plan, Seq, State
from batch.policies.policy import Policy
from batch.policies.vtc import VTCPolicy
from inference_stub import Request
from spec import fairness_rules as fr
from spec import rules

__all__ = ["Scheduler", "Plan", "Entry", "RequestError", "InvalidRequestError", "PromptTooLongError",
           "DuplicateRequestError", "BackendError", "forward", "Request"]

#: Prefill chunk: prompts longer than this are prefilled over several iterations (tokens).
PREFILL_CHUNK_TOKENS = rules.PREFILL_CHUNK_TOKENS
#: Default most requests resident at once (vLLM's ``max_num_seqs``).
MAX_RUNNING_REQUESTS = 256
#: Default of ``Scheduler(check_invariants=None)``: off, unless the environment variable
#: ``BATCH_CHECK_INVARIANTS`` is ``1`` when this module is imported. The test suite sets both
#: (``tests/conftest.py``), so a server it starts in another process (``batch-llm serve``, a Ray
#: replica) is checked too.
CHECK_INVARIANTS = os.environ.get("BATCH_CHECK_INVARIANTS") == "1"
#: Default most preemptions of one request before it is pinned (``spec.fairness_rules.pinned``):
#: ``None``, never (a pinned request holds its worst-case blocks; the aged reservation holder's
#: protection bounds a request's wait instead). ``baselines.ReservationScheduler`` pins at 0.
MAX_PREEMPTIONS = None
#: Default Q, iterations before a resident request may give its room to another user, and the
#: reservation holder's protection (``spec.fairness_rules.QUANTUM_TICKS``).
QUANTUM_TICKS = fr.QUANTUM_TICKS
#: Default W, iterations a fitting request waits behind a blocked head (``fr.HOLD_TICKS``).
HOLD_TICKS = fr.HOLD_TICKS
#: Default aging bound, ticks as the blocked head before the reservation (``reserved_after``).
AGING_TICKS = 32
#: Default K, most consecutive isolated iterations (``spec.fairness_rules.sit_out_allowed``).
MAX_SIT_OUT_TICKS = 8


class PlanPastCapError(BackendError):
    """``production_checks``: the committed plan broke the KV cap or the ledger; the tick is rolled
    back before ``forward`` and treated as a failed backend call (``max_backend_tries``)."""


def wall_clock() -> float:
    """``time.time()``, looked up at each reading (a harness may patch it after construction)."""
    return time.time()


def forward(batch: list[Request]) -> list[int]:
    """The default backend: ``inference_stub.forward``, looked up at every call (a harness may
    wrap this name or the stub's; both see every batch)."""
    return inference_stub.forward(batch)


def is_int(v: Any) -> bool:
    """An ``int`` or another ``numbers.Integral`` (``np.int64``), never a bool."""
    return type(v) is int or (not isinstance(v, bool) and isinstance(v, numbers.Integral))


def _positive(name: str, v: Any) -> int:
    if not is_int(v) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


def _non_negative(name: str, v: Any) -> int:
    if not is_int(v) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return int(v)


def _flag(name: str, v: Any, default: bool) -> bool:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool or None, got {v!r}")
    return bool(default) if v is None else v


class Scheduler:
    """Iteration-level scheduler: chunked prefill, a KV block cap, preemption by recompute, a
    per-user fair share; thread-safe (``docs/reliability.md``). Its keyword-only arguments and
    their defaults are tabled in ``docs/design.md`` ("Scheduler arguments"); a bad one is a
    ``ValueError`` naming it."""

    def __init__(self, *, kv_cap_blocks: int | None = None, block_tokens: int | None = None,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, token_budget_tokens: int | None = None,
                 max_running: int = MAX_RUNNING_REQUESTS, eos_token_id: int | None = None,
                 vocab_size: int | None = -1, clock: Callable[[], float] | None = None, backend: Any = None,
                 policy: Policy | None = None, isolation: bool | None = None, admission_headroom: bool | None = None,
                 resume_first: bool | None = None, prefix_caching: bool = False, max_preemptions: int | None = MAX_PREEMPTIONS,
                 aging_ticks: int = AGING_TICKS, max_sit_out_ticks: int = MAX_SIT_OUT_TICKS,
                 quantum_ticks: int = QUANTUM_TICKS, hold_ticks: int = HOLD_TICKS,
                 max_backend_tries: int | None = None, record_itl: bool = True,
                 max_latency_samples: int | None = None, check_invariants: bool | None = None,
                 production_checks: bool = False,
                 on_tokens: Callable[[list[tuple[Request, int]]], None] | None = None) -> None:
        stub = inference_stub
        cap = _positive("kv_cap_blocks", getattr(stub, "MAX_KV_BLOCKS", 256) if kv_cap_blocks is None else kv_cap_blocks)
        bt = _positive("block_tokens", getattr(stub, "KV_BLOCK_TOKENS", 16) if block_tokens is None else block_tokens)
        eos = getattr(stub, "EOS_TOKEN", 0) if eos_token_id is None else eos_token_id
        if vocab_size == -1:  # the backend's vocabulary, if it states one
            vocab_size = getattr(backend, "vocab_size", None)
            vocab_size = vocab_size if is_int(vocab_size) and vocab_size >= 1 else None
        for bad, what, value in (
                (not is_int(eos), "eos_token_id must be an int", eos),
                (clock is not None and not callable(clock), "clock must be a callable returning seconds", clock),
                (backend is not None and not callable(backend) and not callable(getattr(backend, "execute_model", None)),
                 "backend must be forward(batch) -> tokens or have execute_model", backend),
                (policy is not None and not isinstance(policy, Policy), "policy must be a Policy", policy),
                (on_tokens is not None and not callable(on_tokens), "on_tokens must be a callable or None", on_tokens),
                (max_preemptions is not None and (not is_int(max_preemptions) or max_preemptions < 0),
                 "max_preemptions must be an int >= 0 or None", max_preemptions),
                (not isinstance(record_itl, bool), "record_itl must be a bool", record_itl),
                (not isinstance(production_checks, bool), "production_checks must be a bool", production_checks),
                (not isinstance(prefix_caching, bool), "prefix_caching must be a bool", prefix_caching)):
            if bad:
                raise ValueError(f"{what}, got {value!r}")
        self.vocab_size = None if vocab_size is None else _positive("vocab_size", vocab_size)
        p = self.policy = policy if policy is not None else VTCPolicy()
        self.config = Config(
            kv_cap_blocks=cap, block_tokens=bt, prefill_chunk_tokens=_positive("prefill_chunk_tokens", prefill_chunk_tokens),
            token_budget_tokens=_positive("token_budget_tokens", cap * bt if token_budget_tokens is None
                                          else token_budget_tokens),
            max_running=_positive("max_running", max_running), eos_token_id=int(eos),
            max_preemptions=sys.maxsize if max_preemptions is None else int(max_preemptions),
            aging_ticks=_positive("aging_ticks", aging_ticks),
            headroom=_flag("admission_headroom", admission_headroom, p.headroom),
            isolation=_flag("isolation", isolation, p.isolation),
            resume_first=_flag("resume_first", resume_first, p.resume_first),
            max_sit_out_ticks=_positive("max_sit_out_ticks", max_sit_out_ticks), prefix_caching=prefix_caching,
            quantum_ticks=_positive("quantum_ticks", quantum_ticks), hold_ticks=_non_negative("hold_ticks", hold_ticks))
        self.clock: Callable[[], float] = clock or wall_clock
        self._backend = backend
        self.on_tokens = on_tokens
        pool = PrefixCachingPool(cap, bt) if prefix_caching else BlockPool(cap)
        self.state = State(pool, MetricsRecorder(record_itl=record_itl, max_samples=max_latency_samples))
        self.max_backend_tries = None if max_backend_tries is None else _positive("max_backend_tries",
                                                                                  max_backend_tries)
        self._checker: Any = None
        if _flag("check_invariants", check_invariants, CHECK_INVARIANTS):
            from spec.invariants import InvariantChecker  # only when asked for
            self._checker = InvariantChecker()
        self._guard: Any = None  # the cheap production subset (spec.invariants.ProductionChecker)
        if production_checks:
            from spec.invariants import ProductionChecker
            self._guard = ProductionChecker()
        self._failures = 0  # consecutive failed ticks (the retry policy's count)
        self._inflight: tuple[Plan, int] | None = None  # (plan, ticking thread) while forward runs
        self._last: tuple[Plan | None, list[Request], str | None] = (None, [], None)
        self._pending_aborts: list[Seq] = []  # aborts of in-flight requests, applied when the tick ends
        self._hook_thread: int | None = None
        self._lock = threading.RLock()
        self._tick_lock = threading.Lock()
        self._tick_done = threading.Condition(self._lock)

    running = property(lambda self: self.state.running, doc="Resident requests, admission order.")
    pool = property(lambda self: self.state.pool, doc="The KV block pool.")
    stats = property(lambda self: self.state.stats, doc="The metrics recorder.")

    def submit(self, request: Request) -> None:
        """Accept a request at once: stamps ``submitted_at``, starts it afresh (``generated`` emptied,
        ``started_at``/``completed_at`` cleared). Refusals change nothing but ``metrics()``'s count:
        ``InvalidRequestError`` (a malformed field, named), ``DuplicateRequestError`` (this object
        is in flight here), ``PromptTooLongError`` (with its first output slot, beyond the cache)."""
        with self._lock:
            st = self.state
            try:
                n = self._validate(request)
            except RequestError as e:
                st.stats.on_refuse(type(e).__name__)
                raise
            now = self.clock()
            request.submitted_at = now
            if not isinstance(request.generated, list) or request.generated:
                request.generated = []
            request.started_at = request.completed_at = None
            seq = Seq(req=request, user_id=request.user_id, rid=request.request_id, arrival_no=st.arrivals,
                      num_prompt_tokens=n, keys=block_keys(request.prompt, self.config.block_tokens)
                      if self.config.prefix_caching else ())
            st.arrivals += 1
            st.by_obj[id(request)] = seq
            if seq.rid:  # ids may repeat (the contract does not make them unique): keep all, oldest first
                st.by_id.setdefault(seq.rid, []).append(seq)
            st.stats.on_submit(now)
            st.waiting_by_user[seq.user_id] = st.waiting_by_user.get(seq.user_id, 0) + 1
            self.policy.add(seq)

    def _validate(self, request: Any) -> int:
        """Check a request completely before any change; return its prompt length."""
        if not isinstance(request, Request) and not all(
                hasattr(request, a) for a in ("user_id", "prompt", "max_tokens", "request_id", "generated")):
            raise InvalidRequestError(f"expected an inference_stub.Request, got {type(request).__name__}")
        if not isinstance(request.user_id, str) or not request.user_id:
            raise InvalidRequestError(f"user_id must be a non-empty str, got {request.user_id!r}")
        if not isinstance(request.request_id, str):
            raise InvalidRequestError(f"request_id must be a str, got {type(request.request_id).__name__}")
        if id(request) in self.state.by_obj:
            raise DuplicateRequestError(f"this Request object (request_id={request.request_id!r}) is already in flight")
        mt, prompt, cfg = request.max_tokens, request.prompt, self.config
        if not is_int(mt) or mt < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {mt!r}")
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty list of token ids")
        n = len(prompt)  # the length first: a huge prompt is refused without reading its ids
        if not rules.prompt_fits(n, cfg.kv_cap_blocks, cfg.block_tokens):
            raise PromptTooLongError(f"prompt of {n} tokens needs {rules.blocks_needed(n, cfg.block_tokens)} KV "
                                     f"blocks of {cfg.block_tokens} tokens with its first output token, but the cache "
                                     f"holds {cfg.kv_cap_blocks} blocks (prompt must be < "
                                     f"{cfg.max_model_len_tokens} tokens)")
        hi = self.vocab_size
        for t in prompt:
            if (type(t) is not int and not is_int(t)) or t < 0 or (hi is not None and t >= hi):
                raise InvalidRequestError(f"prompt token ids must be ints {'>= 0' if hi is None else f'in 0..{hi - 1}'}"
                                          f", got {t!r}")
        if type(mt) is not int:
            request.max_tokens = int(mt)
        return n

    def tick(self) -> list[Request]:
        """Run one model iteration; return the requests finished in it (EOS, ``max_tokens``, the
        cache length, or the retry policy's ``"error"``: ``last_finished`` gives each reason).

        Raises:
            BackendError: ``forward`` raised or answered a wrong count or a non-int token: the tick
                is undone (a retry redoes it); ``KeyboardInterrupt`` and the like are re-raised after
                the same undo, as is what the clock raises when read after ``forward``.
            InvariantViolation: with ``check_invariants``, a spec check failed (a scheduler bug).
            RuntimeError: called from the ``on_tokens`` hook; else what the hook raises (applied).
        """
        if self._hook_thread == threading.get_ident():
            raise RuntimeError("tick() called from the on_tokens hook; the hook runs inside tick()")
        with self._tick_lock:
            with self._lock:
                start_s = self.clock()
                if self._checker is not None:
                    self._checker.before_tick(self)
                plan = self.schedule()
                if self._checker is not None:
                    self._checker.before_commit(self, plan)
                if self._guard is not None:
                    self._guard.before_commit(self, plan)
                journal = step.commit(self.state, plan)
                if self._checker is not None:
                    self._checker.after_commit(self, plan)
                past_cap = None if self._guard is None else self._guard.before_forward(self, plan)
                self._inflight = (plan, threading.get_ident())
            tokens: Sequence[int] = []
            if plan.seqs:
                try:
                    if past_cap is not None:  # a plan past the cap never reaches the backend
                        raise PlanPastCapError(past_cap, [r.request_id for r in plan.requests])
                    tokens = self._forward(plan)
                except BaseException as e:  # any failure undoes the tick, even KeyboardInterrupt
                    with self._lock:
                        step.rollback(self.state, journal)
                        self._end_inflight()
                    if not isinstance(e, Exception):
                        raise
                    return self._on_backend_failure(plan, e)
            with self._lock:
                try:
                    now = self.clock()
                except BaseException:  # a clock that raises here leaves the tick undone
                    step.rollback(self.state, journal)
                    self._end_inflight()
                    raise
                self._failures = 0
                hook = self.on_tokens  # the requests whose token this tick keeps (rules.produces_token)
                out = [s for s, k in zip(plan.seqs, plan.num_new_tokens)
                       if s.num_computed_tokens + k == s.num_tokens] if hook is not None else ()
                try:
                    finished = self.update_from_output(plan, tokens, iteration_start_s=start_s, now_s=now)
                    self._last = (plan, finished, None)
                    if self._guard is not None:
                        self._guard.after_tick(self, plan)
                    if self._checker is not None:
                        self._checker.after_tick(self, plan, finished, tokens, now)
                finally:
                    self._end_inflight()
            if out:  # outside the state lock: the hook may submit, abort, read metrics
                self._hook_thread = threading.get_ident()
                try:
                    hook([(s.req, s.req.generated[-1]) for s in out])
                finally:
                    self._hook_thread = None
            return finished

    def _forward(self, plan: Plan) -> list[int]:
        """Call the backend (looked up now, so a wrapped ``forward`` is seen); check its answer."""
        backend = self._backend or forward
        execute_model = getattr(backend, "execute_model", None)
        if self._checker is not None:
            execute_model, backend = self._checker.count_forward(execute_model, backend)
        if execute_model is not None:
            from batch.core.backend_api import batch_items  # paged backends only
            tokens = execute_model(batch_items(plan))
        else:
            tokens = backend(plan.requests)
        if not isinstance(tokens, (list, tuple)) and hasattr(tokens, "tolist"):
            tokens = tokens.tolist()  # a numpy array or torch tensor
        ok = isinstance(tokens, (list, tuple)) and len(tokens) == len(plan.seqs)
        bad = [t for t in tokens if type(t) is not int and not is_int(t)] if ok else []
        if not ok or bad:
            n = len(tokens) if isinstance(tokens, (list, tuple)) else type(tokens).__name__
            raise BackendError(f"forward returned a non-int token {bad[0]!r}" if ok else
                               f"forward returned {n} tokens for a batch of {len(plan.seqs)}",
                               [r.request_id for r in plan.requests])
        return list(tokens)

    def schedule(self) -> Plan:
        """The next iteration's plan (``batch.core.step.schedule``); changes nothing."""
        return step.schedule(self.state, self.policy, self.config)

    def update_from_output(self, plan: Plan, tokens: Sequence[int], *, iteration_start_s: float | None = None,
                           now_s: float | None = None) -> list[Request]:
        """Apply a committed plan's output (``batch.core.step.apply``); returns the finished."""
        now = self.clock() if now_s is None else now_s
        return step.apply(self.state, self.policy, self.config, plan, tokens, now,
                          now if iteration_start_s is None else iteration_start_s)

    def _end_inflight(self) -> None:
        """The in-flight tick is over: retire the aborts deferred to its end (at each request's last
        known time if the clock raises, which is then re-raised) and wake their callers."""
        self._inflight = None
        if self._pending_aborts:
            try:
                now, err = self.clock(), None
            except BaseException as e:  # noqa: BLE001 - re-raised below, once the aborts are retired
                now, err = None, e
            for s in self._pending_aborts:
                if self.state.by_obj.get(id(s.req)) is s:
                    t = now if err is None else next(x for x in (s.last_token_s, s.admitted_s, s.req.submitted_at)
                                                     if x is not None)
                    step.retire(self.state, self.policy, s, "abort", t)
            self._pending_aborts.clear()
            self._tick_done.notify_all()
            if err is not None:
                raise err

    def _on_backend_failure(self, plan: Plan, e: Exception) -> list[Request]:
        """After a rolled-back tick: raise ``BackendError``, or fail the batch (``max_backend_tries``)."""
        with self._lock:
            self._failures += 1
            if self.max_backend_tries is None or self._failures < self.max_backend_tries:
                if isinstance(e, BackendError):
                    raise e
                raise BackendError(f"forward raised {type(e).__name__}: {e}", [r.request_id for r in plan.requests]) from e
            self._failures = 0
            now, st = self.clock(), self.state
            failed = [step.retire(st, self.policy, s, "error", now) for s in plan.seqs if st.by_obj.get(id(s.req)) is s]
            self._last = (plan, failed, "error")
            return failed

    def abort(self, request: Request | str) -> Request | None:
        """Cancel a live request (any state) by object or non-empty ``request_id`` (repeated: the
        oldest): blocks freed now, ``completed_at`` stamped, ``generated`` kept, counted under
        ``finish_reasons["abort"]``. Returns it once, or ``None`` when nothing live matches (or a
        concurrent tick finished it first). A request of a tick running on another thread is aborted
        when that tick ends, and this call waits (one iteration at most); called from inside
        ``forward`` for a request of its batch it raises ``RuntimeError`` (waiting would deadlock).
        """
        with self._lock:
            st = self.state
            if isinstance(request, str):
                cur = st.by_id.get(request, ()) if request else ()
                seq = next((q for q in cur if q not in self._pending_aborts), cur[0] if cur else None)
            else:
                seq = st.by_obj.get(id(request))
            if seq is None:
                return None
            inflight = self._inflight
            if inflight is None or (seq not in inflight[0].seqs and seq not in inflight[0].preempted):
                return step.retire(st, self.policy, seq, "abort", self.clock())
            if inflight[1] == threading.get_ident():
                raise RuntimeError(f"abort({seq.request_id!r}) from inside forward of the batch that holds it")
            mine = seq not in self._pending_aborts
            if mine:
                self._pending_aborts.append(seq)
            while self._inflight is inflight:
                self._tick_done.wait()
            return seq.req if mine and seq.finish_reason == "abort" else None

    @property
    def last_finished(self) -> list[tuple[Request, str]]:
        """``(request, finish_reason)`` for each request the last ``tick()`` returned: ``"stop"``
        (EOS), ``"length"`` (``max_tokens`` or the cache length) or ``"error"`` (retry policy)."""
        with self._lock:
            plan, finished, reason = self._last
            if reason is not None or plan is None:
                return [(r, reason or "") for r in finished]
            by_req = {id(s.req): s.finish_reason for s in plan.seqs}
            return [(r, by_req[id(r)]) for r in finished]

    def has_active(self) -> bool:
        """True while any request is queued, resident or preempted (when False, no block is used)."""
        with self._lock:
            return bool(self.state.running) or len(self.policy) > 0

    def metrics(self) -> dict[str, Any]:
        """Serving metrics: the contract's four keys and more (``MetricsRecorder.summary``)."""
        with self._lock:
            st = self.state
            m = st.stats.summary(kv_blocks_in_use=st.pool.num_used, kv_cap_blocks=self.config.kv_cap_blocks,
                                 waiting=len(self.policy), running=len(st.running))
            return m | st.pool.metrics() if self.config.prefix_caching else m

    def check_stats(self) -> dict[str, Any] | None:
        """With ``check_invariants``: ticks checked, and the ticks the reference tick
        (``spec.reference``) and trace validation (``spec.refinement``) did not validate, counted
        by reason (``spec.invariants.InvariantChecker.stats``); ``None`` without the checks."""
        with self._lock:
            return None if self._checker is None else self._checker.stats()

    def check_integrity(self) -> None:
        """Check the KV ledger, every record and the per-user counts at an idle point
        (``spec.invariants.check_state``); raises ``InvariantViolation`` (an ``AssertionError``)."""
        from spec.invariants import check_state  # tests and tools only

        with self._lock:
            check_state(self)
