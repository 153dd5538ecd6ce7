"""Batch: a continuous-batching (iteration-level) scheduler for LLM inference.

``Scheduler`` is the import contract's facade (``../shared/mission/contract.md``):
``submit`` / ``tick`` / ``has_active`` / ``metrics``. One ``tick()`` is one model iteration:

    plan = self.schedule()                       # pure decision: no clock, no I/O, no mutation
    tokens = forward(plan.requests)              # the backend, looked up at call time
    finished = self.update_from_output(plan, tokens)   # commit: KV ledger, tokens, lifecycle

Because the plan is committed only after ``forward`` returns good tokens, a backend failure
leaves the scheduler exactly as it was before the tick.

Each request is an explicit state machine (``spec.lifecycle``): queued -> prefilling ->
decoding -> done, plus preempted (by recompute) and aborted. The KV ledger hands out concrete
block ids from ``kv_cache.BlockPool``; the arithmetic is ``spec.rules``, the same functions
the z3 proofs check.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Sequence

import inference_stub
from batch.core.backend_api import batch_items
from batch.core.admission import BACKFILL_WINDOW, admit_waiting, easy_shadow  # noqa: F401 (BACKFILL_WINDOW: re-exported)
from batch.core.backfill import Shadow, WorstCaseProfile
from batch.core.isolation import Isolation
from batch.core.kv_cache import BlockPool
from batch.core.metrics import MetricsRecorder
from batch.core.book import RequestBook
from batch.core.output import OutputStep
from batch.core.plan import MACHINE, ScheduledSeq, SchedulePlan  # noqa: F401 (MACHINE: the shared lifecycle machine)
from batch.core.plan import Seq as _Seq
from batch.core.running import schedule_running
from batch.core.validation import (BackendError, DuplicateRequestError, InvalidRequestError,  # noqa: F401 (exported)
                                   PromptTooLongError, RequestError, check_knobs, check_tokens, is_int, positive,
                                   validate_request)
from batch.policies.policy import Policy, VTCPolicy
from inference_stub import Request
from spec import fairness_rules as fr
from spec import rules
from spec.invariants import InvariantChecker, InvariantViolation

__all__ = ["Scheduler", "SchedulePlan", "ScheduledSeq", "RequestError", "InvalidRequestError",
           "PromptTooLongError", "DuplicateRequestError", "BackendError", "forward", "Request",
           "InvariantViolation"]

#: Prefill chunk: prompts longer than this are prefilled over several iterations (tokens).
PREFILL_CHUNK_TOKENS = 64
#: Default most requests resident at once (vLLM's ``max_num_seqs``).
MAX_RUNNING_REQUESTS = 256
#: Default of ``Scheduler(check_invariants=None)``; the test suite turns it on (``tests/conftest.py``).
CHECK_INVARIANTS = False
#: Default most preemptions of one request; then it is pinned (``spec.fairness_rules.pinned``).
MAX_PREEMPTIONS = 4
#: Default aging bound: ticks as the first waiting request that does not fit, then it holds the
#: reservation (``spec.fairness_rules.reserved_after``).
AGING_TICKS = 32


def wall_clock() -> float:
    """The default clock: ``time.time()``, looked up at every call, so that a harness that
    patches ``time.time`` after building the scheduler gets stamps on its own clock."""
    return time.time()


def forward(batch: list[Request]) -> list[int]:
    """The default backend: ``inference_stub.forward``, looked up at every call.

    A harness may wrap either this name or ``inference_stub.forward``; both see every batch.
    """
    return inference_stub.forward(batch)


# ---------------------------------------------------------------- the scheduler


class Scheduler(RequestBook, OutputStep):
    """Iteration-level scheduler with chunked prefill, a KV block cap and preemption by recompute.

    All arguments are keyword-only and optional; defaults come from the ``inference_stub``
    module in use at construction time.

    Args:
        kv_cap_blocks: KV blocks in the cache (``MAX_KV_BLOCKS``, 256).
        block_tokens: tokens per block (``KV_BLOCK_TOKENS``, 16).
        prefill_chunk_tokens: largest prefill chunk per request per iteration (64).
        token_budget_tokens: most tokens processed per iteration, all requests together
            (default: the cache's capacity in tokens, so for the stub it never binds).
        max_running: most resident requests (256).
        eos_token_id: the token that ends a request (``EOS_TOKEN``, 0); a negative id never
            matches, so requests end only at ``max_tokens`` or the cache length.
        vocab_size: prompts must use ids below this. Default: the backend's own ``vocab_size``
            attribute when it has one (``model_backend.ModelBackend``), else no upper bound:
            the stub never reads prompt ids, and a harness may pass real tokenizer ids. ``None``
            disables the bound.
        clock: a callable returning seconds; default ``wall_clock`` (``time.time()`` looked up
            at each reading).
        backend: ``forward(batch) -> tokens``; default: this module's ``forward``, looked up
            at every call. A backend with an ``execute_model`` method (``backend_api``) is
            given ``BatchItem``s instead: token ids, ``num_computed_tokens``, block table.
        policy: admission and victim policy: ``policy.VTCPolicy()`` (fair share across users)
            by default; ``policy.FCFSPolicy()`` and ``policy.RoundRobinPolicy()`` exist too.
        record_itl: keep per-token gaps for ITL percentiles (see ``MetricsRecorder``).
        check_invariants: evaluate every ``spec.invariants`` predicate after every tick and
            raise ``InvariantViolation`` naming the property (O(requests) per tick; default
            ``CHECK_INVARIANTS``).
        max_backend_tries: the retry policy for backend faults. ``None`` (default): every failed
            tick raises ``BackendError`` and changes nothing, for ever. ``N``: the N-th
            consecutive failed tick fails the requests of its batch instead (finish reason
            ``"error"``, blocks freed, returned by that ``tick()``); other requests are untouched.
        max_preemptions: most preemptions of one request (4); then it is re-admitted with its
            worst-case blocks reserved and never preempted again. ``None``: no cap.
        aging_ticks: ticks a request may be the first waiting request that does not fit while
            backfill passes it (32); then blocks are reserved for it until it fits.
        isolation: TTFT isolation for under-served users (``isolation.Isolation``): ``None``
            turns it on when the policy asks for it (``VTCPolicy`` does), ``True``/``False``
            force it, or pass a configured ``Isolation``.
        admission_headroom: admissions leave ``ceil(resident / block_tokens)`` blocks free for
            the next iteration's growth (``spec.fairness_rules.growth_headroom_blocks``), so a
            request is not preempted right after its admission. ``None``: when the policy asks
            for it (``VTCPolicy`` does; FCFS and round robin pack the cache as vLLM V1 does).
        easy_backfill: when the first candidate does not fit, later candidates that cannot
            delay it in the worst case are admitted past it (EASY backfilling, ``backfill.py``;
            past the aging reservation only under ``spec.fairness_rules.may_pass_reservation``;
            inactive when the token budget may bind: ``backfill.budget_never_binds``).
            ``None``: when the policy asks for it (``VTCPolicy`` does).
        on_tokens: the per-token output hook, ``on_tokens(pairs) -> None`` or ``None`` (default;
            also settable later as the attribute ``on_tokens``). After every tick that produced
            output tokens, ``tick()`` calls it once, on the ticking thread, after the tick was
            applied, with ``pairs``: one ``(request, token_id)`` per request that received a
            token in that tick, in batch order (the tokens ``tick()`` appended to ``generated``;
            a finishing request's last token, EOS included, is among them; prefill chunks that
            produce no token are not). It runs without the state lock but **inside** ``tick()``,
            with the tick lock held: it may call ``submit``, ``abort``, ``metrics`` and the
            read-only methods, but not ``tick()`` (a re-entrant ``tick()`` from the hook raises
            ``RuntimeError``; another thread's ``tick()`` waits until the hook returns).
            ``tick()``'s return value is unchanged. Whatever the hook raises propagates from
            ``tick()``: the tick stays applied, and the requests it finished, which ``tick()``
            then does not return, are in ``last_finished`` (with their finish reasons) until the
            next tick. Unset, it costs one local ``None`` test per token.

    Raises:
        ValueError: a knob is not a positive int (``max_preemptions``: a non-negative int;
            ``eos_token_id``: any int), ``clock`` is not callable, ``backend`` neither
            callable nor with ``execute_model``, ``policy`` lacks a ``policy.Policy`` method, or a
            flag is not a bool (``isolation``: also an ``Isolation``); the message names it.

    Thread safety: ``submit``, ``abort``, ``has_active`` and ``metrics`` may be called from
    other threads while ``tick()`` runs; ``forward`` is called without holding the state lock,
    and ticks are serialised (a second thread's ``tick()`` waits for the first). See
    ``docs/reliability.md``.
    """

    def __init__(
        self,
        *,
        kv_cap_blocks: int | None = None,
        block_tokens: int | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        token_budget_tokens: int | None = None,
        max_running: int = MAX_RUNNING_REQUESTS,
        eos_token_id: int | None = None,
        vocab_size: int | None = -1,
        clock: Callable[[], float] | None = None,
        backend: Callable[[list[Request]], list[int]] | None = None,
        policy: Policy | None = None,
        record_itl: bool = True,
        check_invariants: bool | None = None,
        max_backend_tries: int | None = None,
        max_preemptions: int | None = MAX_PREEMPTIONS,
        aging_ticks: int = AGING_TICKS,
        isolation: Isolation | bool | None = None,
        admission_headroom: bool | None = None,
        easy_backfill: bool | None = None,
        on_tokens: Callable[[list[tuple[Request, int]]], None] | None = None,
    ) -> None:
        stub = inference_stub
        self.kv_cap_blocks = positive("kv_cap_blocks", getattr(stub, "MAX_KV_BLOCKS", 256)
                                       if kv_cap_blocks is None else kv_cap_blocks)
        self.block_tokens = positive("block_tokens", getattr(stub, "KV_BLOCK_TOKENS", 16)
                                      if block_tokens is None else block_tokens)
        self.prefill_chunk_tokens = positive("prefill_chunk_tokens", prefill_chunk_tokens)
        self.max_model_len_tokens = rules.max_model_len_tokens(self.kv_cap_blocks, self.block_tokens)
        self.token_budget_tokens = positive("token_budget_tokens", self.max_model_len_tokens
                                             if token_budget_tokens is None else token_budget_tokens)
        self.max_running = positive("max_running", max_running)
        self.eos_token_id = getattr(stub, "EOS_TOKEN", 0) if eos_token_id is None else eos_token_id
        if not is_int(self.eos_token_id):  # a negative id never matches: requests end at max_tokens or length
            raise ValueError(f"eos_token_id must be an int, got {self.eos_token_id!r}")
        self.eos_token_id = int(self.eos_token_id)  # np.int64 (a tokenizer's) as a plain int
        if vocab_size == -1:  # the backend's vocabulary, if it states one as a positive int
            vocab_size = getattr(backend, "vocab_size", None)
            if not (is_int(vocab_size) and vocab_size >= 1):
                vocab_size = None
        self.vocab_size = vocab_size
        if self.vocab_size is not None:
            self.vocab_size = positive("vocab_size", int(self.vocab_size) if is_int(self.vocab_size)
                                        else self.vocab_size)
        check_knobs(clock=clock, backend=backend, policy=policy, isolation=isolation, record_itl=record_itl,
                     check_invariants=check_invariants, admission_headroom=admission_headroom,
                     easy_backfill=easy_backfill)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens must be a callable or None, got {on_tokens!r}")
        self.on_tokens: Callable[[list[tuple[Request, int]]], None] | None = on_tokens
        self._tick_tokens: list[tuple[Request, int]] | None = None  # this tick's pairs, for on_tokens
        self._hook_thread: int | None = None  # the thread running on_tokens (inside tick()), else None
        self.clock: Callable[[], float] = clock or wall_clock
        self._backend = backend
        self.policy: Policy = policy if policy is not None else VTCPolicy()
        if max_preemptions is None:
            max_preemptions = sys.maxsize
        elif isinstance(max_preemptions, bool) or not isinstance(max_preemptions, int) or max_preemptions < 0:
            raise ValueError(f"max_preemptions must be an int >= 0 or None, got {max_preemptions!r}")
        self.max_preemptions = max_preemptions
        self.aging_ticks = positive("aging_ticks", aging_ticks)
        if isolation is None:
            isolation = bool(getattr(self.policy, "isolation", False))
        self.isolation: Isolation | None = (isolation if isinstance(isolation, Isolation)
                                            else Isolation() if isolation else None)
        self.admission_headroom = bool(getattr(self.policy, "admission_headroom", False)
                                       if admission_headroom is None else admission_headroom)
        self.easy_backfill = bool(getattr(self.policy, "easy_backfill", False)
                                  if easy_backfill is None else easy_backfill)
        self._weight_of: Callable[[str], int] = getattr(self.policy, "weight_of", None) or _unit_weight
        self._resident_by_user: dict[str, int] = {}  # user -> resident requests
        self._resident_weight = 0  # sum of the weights of users with a resident request
        self._waiting_by_user: dict[str, int] = {}  # user -> queued or preempted requests
        self._reserved: _Seq | None = None  # tried first; nothing else admitted until it fits
        self.pool = BlockPool(self.kv_cap_blocks)
        self.running: list[_Seq] = []
        self._by_obj: dict[int, _Seq] = {}
        self._by_id: dict[str, _Seq | list[_Seq]] = {}  # a list only for an id in flight twice
        self._arrivals = 0
        self._admissions = 0
        self._lock = threading.RLock()
        self._tick_lock = threading.Lock()  # one tick at a time; forward runs outside self._lock
        self.stats = MetricsRecorder(record_itl=record_itl)
        on = CHECK_INVARIANTS if check_invariants is None else check_invariants
        self._checker: InvariantChecker | None = InvariantChecker() if on else None
        self.max_backend_tries = None if max_backend_tries is None else positive("max_backend_tries",
                                                                                  max_backend_tries)
        self._backend_failures = 0  # consecutive failed ticks (the retry policy's count)
        self._inflight: tuple[SchedulePlan, int] | None = None  # (plan, ticking thread) while forward runs
        self._last_tick: tuple[SchedulePlan | None, list[Request], str | None] = (None, [], None)
        self._pending_aborts: list[_Seq] = []  # aborts of in-flight requests, applied when the tick ends
        self._tick_end_s: float | None = None  # tick()'s clock reading after forward, for update_from_output
        self._tick_done = threading.Condition(self._lock)  # notified when pending aborts were applied

    # ------------------------------------------------------------ the contract

    def submit(self, request: Request) -> None:
        """Accept a request; returns at once. Stamps ``submitted_at`` with the scheduler's clock.

        Raises:
            InvalidRequestError: empty ``user_id``; a prompt that is empty, not a list of ints,
                or has an id below 0 (or at or above ``vocab_size``, when there is one);
                ``max_tokens`` not an int >= 1. An int is an ``int`` or another
                ``numbers.Integral`` such as ``np.int64``, never a bool.
            PromptTooLongError: the prompt plus its first output token needs more than
                ``kv_cap_blocks`` blocks (it could never run).
            DuplicateRequestError: this ``Request`` object is in flight in this scheduler.
                Another object with the same ``request_id`` is accepted: the contract does not
                make ids unique (a harness may number user A's and user B's requests alike);
                ``abort(request_id)`` then reaches the oldest in flight.

        On any error nothing changes except the refusal count in ``metrics()`` (the request's
        fields included). On acceptance the request starts afresh, whatever it held: a
        ``Request`` that finished, was aborted or was left behind in this or another scheduler
        may be submitted again (``submitted_at`` is stamped, ``generated`` becomes a new empty
        list unless it is an empty list already, ``started_at`` and ``completed_at`` are
        cleared). An object in flight in another live scheduler must not be submitted: both would
        append to its ``generated``. Thread-safe: may be called from any thread, also while
        ``tick()`` runs (the request joins a later tick).
        A prompt that fits but whose ``prompt + max_tokens`` exceeds the cache is accepted; it
        finishes with reason ``"length"`` when prompt + generated reach ``kv_cap_blocks *
        block_tokens`` tokens (vLLM's ``max_model_len`` rule).
        """
        with self._lock:
            try:
                n_prompt = self._validate(request)
            except RequestError as e:
                self.stats.on_refuse(type(e).__name__)
                raise
            now = self.clock()
            request.submitted_at = now
            # A request that ran before (here or in another scheduler) starts afresh: a new list, so
            # that a caller who kept the old one keeps its tokens; an empty list (or list
            # subclass) the caller gave is kept.
            if not isinstance(request.generated, list) or request.generated:
                request.generated = []
            request.started_at = request.completed_at = None
            seq = _Seq(req=request, user_id=request.user_id, arrival_no=self._arrivals, num_prompt_tokens=n_prompt,
                       rid=request.request_id)
            self._arrivals += 1
            self._by_obj[id(request)] = seq
            rid = seq.rid
            if rid:  # ids may repeat (the contract does not make them unique): keep all, oldest first
                cur = self._by_id.get(rid)
                if cur is None:
                    self._by_id[rid] = seq
                elif type(cur) is list:
                    cur.append(seq)
                else:
                    self._by_id[rid] = [cur, seq]
            self.stats.on_submit(now)
            self.policy.add(seq)
            self._waiting_by_user[seq.user_id] = self._waiting_by_user.get(seq.user_id, 0) + 1

    def tick(self) -> list[Request]:
        """Run one model iteration.

        Returns:
            The requests that finished in this iteration (EOS, ``max_tokens``, or the cache's
            length limit), each with ``completed_at`` set and its blocks already freed; with
            ``max_backend_tries``, the requests of a batch failed by the retry policy.
            ``last_finished`` gives each one's finish reason. Aborted requests are never
            returned here (``abort`` returns them).

        Raises:
            BackendError: ``forward`` raised, or returned a wrong number of tokens or a
                non-int (it may return a list, a tuple, or an array with ``tolist()``: numpy,
                torch); the tick is not applied, so calling ``tick()`` again retries it.
            InvariantViolation: with ``check_invariants``, a spec invariant failed after the
                tick (a scheduler bug; the tick was applied).
            BaseException: one that is not an ``Exception`` (``KeyboardInterrupt``) raised
                inside ``forward`` is re-raised as it is, after the same rollback.
            Exception: whatever the clock raises when it is read after ``forward``, re-raised
                as it is after the same rollback (the tick is undone; ``tick()`` retries it).
                If it raises later, when the aborts deferred to the end of the tick are applied,
                the aborts are applied (completed at the request's last known time) and their
                callers woken; the tick was applied (``last_finished`` lists what it finished),
                or rolled back if ``forward`` had failed (the clock's exception then replaces
                the ``BackendError``).
            Exception: whatever an override of ``update_from_output`` raises, as it is; the
                tick is no longer in flight and its deferred aborts are applied.
            RuntimeError: called from the ``on_tokens`` hook (which runs inside ``tick()``).
            Exception: whatever the ``on_tokens`` hook raises, as it is; the tick was applied
                and ``last_finished`` lists what it finished.
        """
        if self._hook_thread is not None and self._hook_thread == threading.get_ident():
            raise RuntimeError("tick() called from the on_tokens hook; the hook runs inside tick() (tick lock held)")
        with self._tick_lock:
            with self._lock:
                start_s = self.clock()
                if self._checker is not None:  # the trace validator's snapshot (spec.refinement)
                    self._checker.before_tick(self)
                plan = self.schedule()
                if self._checker is not None:  # the plan's grants fit (plan_within_free), before any change
                    self._checker.before_commit(self, plan)
                journal = self._commit_blocks(plan)
                self._inflight = (plan, threading.get_ident())
            batch = plan.requests
            tokens: Sequence[int] = []
            if batch:
                backend = self._backend or forward  # looked up now, so a wrapped forward is seen
                execute_model = getattr(backend, "execute_model", None)  # a paged model runner
                if self._checker is not None:  # count forward calls (one_forward_per_tick)
                    if execute_model is not None:
                        execute_model = self._checker.count_forward(execute_model)
                    else:
                        backend = self._checker.count_forward(backend)
                try:
                    tokens = execute_model(batch_items(plan)) if execute_model else backend(batch)
                    if not isinstance(tokens, (list, tuple)) and hasattr(tokens, "tolist"):
                        tokens = tokens.tolist()  # a numpy array or torch tensor of token ids
                    self._check_tokens(tokens, batch)
                except BaseException as e:  # any failure undoes the tick, even KeyboardInterrupt
                    with self._lock:
                        self._rollback_blocks(journal)
                        self._end_inflight()
                    if not isinstance(e, Exception):
                        raise
                    return self._on_backend_failure(plan, e)
            with self._lock:
                try:  # read before any change: a clock that raises here leaves the tick undone too
                    self._tick_end_s = self.clock()  # update_from_output's "now"
                except BaseException:
                    self._rollback_blocks(journal)
                    self._end_inflight()
                    raise
                self._backend_failures = 0
                try:  # even if update_from_output raises (an override, a bug): no tick stays in flight
                    finished = self.update_from_output(plan, tokens, iteration_start_s=start_s)
                    self._last_tick = (plan, finished, None)
                    if self._checker is not None:  # before deferred aborts apply: the plan's own outcome
                        self._checker.after_tick(self, plan, finished)
                finally:
                    self._tick_end_s = None  # unread if an override skipped the base: not left for a later call
                    self._end_inflight()
                    pairs, self._tick_tokens = self._tick_tokens, None
            hook = self.on_tokens
            if hook is not None and pairs:  # outside the state lock: the hook may call abort, submit, metrics
                self._hook_thread = threading.get_ident()
                try:
                    hook(pairs)
                finally:
                    self._hook_thread = None
            return finished

    def abort(self, request: Request | str) -> Request | None:
        """Cancel a request in any live state (queued, prefilling, decoding, preempted).

        The request leaves at once: its KV blocks are freed in this call, its lifecycle fires
        ``abort`` (state ``aborted``), ``completed_at`` is stamped, ``generated`` keeps the
        tokens it had, and it is counted under ``finish_reasons["abort"]`` in ``metrics()``
        (not in the latency or throughput figures). It is returned here, once; ``tick()``
        never returns it.

        Thread-safe. If the request takes part in a ``tick()`` running in another thread (in
        its batch, whose block tables ``forward`` may be reading, or among its preempted), the
        abort is deferred to the end of that tick and this call waits for it (one iteration,
        never more): the tick aborts the request right after applying its output, in the
        same locked step that ends it, so no later tick can schedule it. If that tick
        finished the request (EOS, length, or the retry policy's ``"error"``), ``tick()``
        returns it and this call returns ``None``. Any other request is aborted without
        waiting. When two threads abort the same in-flight request, one gets it.

        Args:
            request: the ``Request`` object, or its non-empty ``request_id`` (an id in flight
                more than once: the oldest of them that no other ``abort`` call is waiting on).

        Returns:
            The aborted ``Request``; ``None`` when nothing live matches (unknown, empty or
            already finished / aborted id): a no-op.

        Raises:
            RuntimeError: called from inside ``forward`` (on the ticking thread) for a request
                of the batch being computed; waiting would deadlock.
        """
        with self._lock:
            seq = self._lookup(request)
            if seq is None:
                return None
            inflight = self._inflight
            if inflight is None or not _in_plan(seq, inflight[0]):
                return self._retire(seq, "abort", self.clock())
            if inflight[1] == threading.get_ident():
                raise RuntimeError(f"abort({seq.request_id!r}) from inside forward of the batch that holds it")
            mine = not any(p is seq for p in self._pending_aborts)
            if mine:
                self._pending_aborts.append(seq)
            while self._inflight is inflight:  # _end_inflight retires it and wakes us
                self._tick_done.wait()
            return seq.req if mine and seq.finish_reason == "abort" else None

    @property
    def last_finished(self) -> list[tuple[Request, str]]:
        """``(request, finish_reason)`` for each request the last ``tick()`` returned, in order.

        Reasons: ``"stop"`` (EOS), ``"length"`` (``max_tokens`` or the cache length) and
        ``"error"`` (failed by the ``max_backend_tries`` retry policy). Replaced at every tick
        that returns; only that tick's requests are kept.
        """
        with self._lock:
            plan, finished, reason = self._last_tick
            if reason is not None or plan is None:
                return [(r, reason or "") for r in finished]
            by_req = {id(s.seq.req): s.seq.finish_reason for s in plan.batch}
            return [(r, by_req[id(r)]) for r in finished]

    def has_active(self) -> bool:
        """True while any request is queued, resident (prefilling or decoding) or preempted.

        When it is False, no KV block is in use. Thread-safe (also during ``tick()``).
        """
        with self._lock:
            return bool(self.running) or len(self.policy) > 0

    def metrics(self) -> dict[str, Any]:
        """Serving metrics; see ``metrics.MetricsRecorder.summary`` for every key.

        Returns:
            A dict with at least ``throughput_tokens_per_sec`` (output tokens per second from
            the first submit to the last completion), ``avg_latency_s`` and ``p99_latency_s``
            (``completed_at - submitted_at``, linear-interpolation percentile) and
            ``gpu_utilization`` (non-empty ticks / ticks), all floats, 0.0 before any finish.
            Refused submits are counted in ``refusals`` / ``refusals_by_reason``; aborted and
            failed requests in ``finish_reasons`` only. Thread-safe (also during ``tick()``).
        """
        with self._lock:
            return self.stats.summary(kv_blocks_in_use=self.pool.num_used, kv_cap_blocks=self.kv_cap_blocks,
                                      waiting=len(self.policy), running=len(self.running))

    # ------------------------------------------------------------ the step, in two halves

    def schedule(self) -> SchedulePlan:
        """Decide the next iteration without changing any state, in four named steps.

        1. ``running.schedule_running``: running requests first (in admission order), each a
           prefill chunk or a decode within the token budget, growing its block table
           (``spec.rules.growth_blocks``) or preempting the policy's victim by recompute.
        2. ``admission.admit_waiting``: unless something was preempted, waiting requests in
           the policy's order while ``spec.fairness_rules.can_admit`` holds (EASY backfilling
           past a blocked first candidate, the aging reservation first).
        3. ``Isolation.refine`` (when on): TTFT protection of light users, sit-outs, the
           iteration target.
        4. ``PlanDraft.freeze``: the frozen ``SchedulePlan``.

        Returns:
            The plan. Invariant: applying it keeps ``spec.rules.kv_within_cap``.
        """
        d = schedule_running(self)  # 1. running requests: grow, or preempt by recompute
        admit_waiting(self, d)  # 2. waiting requests: order, fit, backfill, reservation
        if self.isolation is not None:  # 3. TTFT isolation and the iteration target
            d.aging_due = bool(d.blocked) and fr.reserved_after(d.blocked[0].blocked_ticks + 1, self.aging_ticks)
            self.isolation.refine(d, self)
        return d.freeze(self.token_budget_tokens)  # 4. the plan

    # ------------------------------------------------------------ helpers

    def _easy_shadow(self, live: list[_Seq], admitted: list[_Seq], grants: dict[_Seq, Sequence[int]],
                     need_blocks: int) -> tuple[WorstCaseProfile, Shadow] | None:
        """``admission.easy_shadow`` (a method so that a subclass or a test can observe it)."""
        return easy_shadow(self, live, admitted, grants, need_blocks)

    def _validate(self, request: Any) -> int:
        """Check a request at submit (``validation.validate_request``); return its prompt length."""
        return validate_request(self, request)

    _check_tokens = staticmethod(check_tokens)

def _unit_weight(user: str) -> int:
    return 1


def _in_plan(seq: _Seq, plan: SchedulePlan) -> bool:
    """Whether ``seq`` takes part in ``plan`` (in its batch or among its preempted)."""
    return any(s.seq is seq for s in plan.batch) or any(p is seq for p in plan.preempted)
