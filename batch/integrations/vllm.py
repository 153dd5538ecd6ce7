"""Batch's VTC fairness inside vLLM V1 (0.33): scheduler classes for ``vllm serve --scheduler-cls``.

    vllm serve MODEL --scheduler-cls batch.integrations.vllm.AsyncFairScheduler \\
        --middleware batch.integrations.vllm.UserMiddleware

``AsyncFairScheduler`` is vLLM's ``AsyncScheduler`` (async scheduling, vLLM's default) and
``FairScheduler`` its synchronous ``Scheduler`` (``--no-async-scheduling``), each with the same
fairness (``_FairMixin``, ``docs/vllm-plugin.md``), through a Batch ``Policy`` (``VTCPolicy``
unless given: ``spec.fairness_rules``' charges, lift, weights, tolerance):

* the waiting queue is a ``PolicyQueue``: admission tries requests in ``Policy.order()``;
* each user is charged, once per step when the step's output arrives (``update_from_output``),
  the prompt tokens the step computed for the first time (``new_prompt_tokens``, counted when
  the step is scheduled) and the output tokens vLLM delivered from it (never a placeholder);
* a running request that cannot get blocks preempts ``Policy.victim`` (through vLLM's priority
  preemption path, the one that lets a caller choose); with one user among the running
  requests vLLM's own victim, the latest admitted;
* with ``policy.isolation``: while a light user's request prefills toward its first token, other
  running requests sit out and only light users are admitted (``batch.core.step``'s isolation,
  at most ``MAX_SIT_OUT_TICKS`` steps in a row).

Budgets, chunking, KV allocation, prefix caching, placeholders and outputs stay vLLM's. The
user is ``sampling_params.extra_args["user"]`` (``vllm_xargs`` over HTTP; ``UserMiddleware``
fills it from the API key or the body's ``user``); requests without one share ``DEFAULT_USER``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from itertools import compress, count
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator, Sequence

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from batch.policies.policy import Policy
from batch.policies.vtc import VTCPolicy
from scheduler import MAX_SIT_OUT_TICKS  # Batch's K: most consecutive isolated steps
from spec import fairness_rules as fr
from spec.concrete import fast

__all__ = ["FairScheduler", "AsyncFairScheduler", "PolicyQueue", "UserMiddleware", "user_of", "policy_from_env",
           "with_user", "USER_KEY", "DEFAULT_USER", "CONFIG_ENV", "TOLERANCE_ENV"]

logger = logging.getLogger(__name__)
#: The ``sampling_params.extra_args`` key (``vllm_xargs`` in an OpenAI request body) naming the user.
USER_KEY = "user"
#: The identity every request without a user shares.
DEFAULT_USER = "anonymous"
#: A users file in ``batch-llm serve``'s format (``weights``, ``api_keys``; JSON, or TOML by suffix).
CONFIG_ENV = "BATCH_USERS_CONFIG"
#: ``VTCPolicy``'s tolerance band, weighted tokens (default ``fairness_rules.TOLERANCE_TOKENS``).
TOLERANCE_ENV = "BATCH_TOLERANCE_TOKENS"
#: Set to 1 to let ``UserMiddleware`` take the body's ``user`` field when no keys are configured
#: (as ``batch-llm serve --trust-user-field``: only behind a gateway that sets it).
TRUST_USER_FIELD_ENV = "BATCH_TRUST_USER_FIELD"
_new_prompt, _high_water = fast(fr.new_prompt_tokens), fast(fr.prompt_high_water)
_sit_out_allowed, _within_share = fast(fr.sit_out_allowed), fast(fr.within_share)  # plain-int forms: every step


def user_of(request: Request) -> str:
    """The fairness identity of a vLLM request: ``extra_args["user"]`` if a non-empty string,
    else ``DEFAULT_USER``."""
    sp = request.sampling_params
    args = sp.extra_args if sp is not None else None
    user = args.get(USER_KEY) if args else None
    return user if isinstance(user, str) and user else DEFAULT_USER


def _users_config(path: str | None):
    if not path:
        return None
    from batch.server.serve import load_config  # only when a file is named
    return load_config(path)


def policy_from_env(env: dict[str, str] | None = None) -> VTCPolicy:
    """``VTCPolicy`` with the weights of ``$BATCH_USERS_CONFIG`` and the tolerance of
    ``$BATCH_TOLERANCE_TOKENS``; the other knobs at Batch's defaults.

    Raises:
        ValueError: a bad file, weight or tolerance (the message names it).
    """
    env = os.environ if env is None else env
    cfg = _users_config(env.get(CONFIG_ENV))
    tol = env.get(TOLERANCE_ENV)
    try:
        tolerance = fr.TOLERANCE_TOKENS if tol in (None, "") else int(tol)
    except ValueError:
        raise ValueError(f"{TOLERANCE_ENV} must be an int >= 0, got {tol!r}") from None
    return VTCPolicy(weights=cfg.weights if cfg else None, tolerance_tokens=tolerance)


class _Entry:
    """Batch's record of one vLLM request: the fields a ``Policy`` reads (``batch.core.state.Seq``'s
    names), the counts read through to vLLM's ``Request``."""

    __slots__ = ("vreq", "user_id", "arrival_no", "order_no", "num_prompt_tokens", "prompt_charged_tokens",
                 "admit_no", "block_table", "queued", "awaits_first")

    def __init__(self, vreq: Request, user_id: str, arrival_no: int) -> None:
        self.vreq, self.user_id, self.arrival_no = vreq, user_id, arrival_no
        self.order_no = arrival_no  # place in the admission order (kept on preemption: _preempt_request)
        self.num_prompt_tokens = vreq.num_prompt_tokens
        self.prompt_charged_tokens = 0  # most prompt tokens ever computed: charged once
        self.admit_no = -1
        self.block_table: Sequence[int] = ()  # set just before ``Policy.victim`` reads its len()
        self.queued = False  # in the policy's waiting queue
        self.awaits_first = True  # the step sampling its first token not yet scheduled (in _first_pending)

    @property
    def req(self) -> _Entry:  # ``Policy.requeue`` reads ``seq.req.generated``
        return self

    @property
    def generated(self) -> list[int]:
        return self.vreq.output_token_ids

    @property
    def num_preemptions(self) -> int:
        return self.vreq.num_preemptions

    @property
    def num_computed_tokens(self) -> int:
        return self.vreq.num_computed_tokens


class _FairRequest(Request):
    """A vLLM ``Request`` whose ``priority`` names its fair scheduler's victim: 1 for the request
    ``Policy.victim`` chooses among ``running``, 0 for the others; writes are ignored.

    vLLM's priority preemption path reads ``priority`` only as ``max(running, key=(priority,
    arrival_time))`` when a running request's blocks do not fit (``Scheduler.schedule``; its
    waiting queue, the other reader, is replaced by ``PolicyQueue``), so the victim is chosen
    only when a preemption happens and the hot path pays nothing. ``_FairMixin.add_request``
    turns each request into this class (same layout: no new slots).
    """

    _fair: _FairMixin | None = None

    @property
    def priority(self) -> int:  # read n times a preemption (vLLM's max over running): kept to attribute reads
        sched = self._fair
        if sched is None:
            return 0
        if sched._victim_of is not sched.running:
            sched._victim()
        return 1 if sched._victim_req is self else 0

    @priority.setter
    def priority(self, value: int) -> None:
        pass  # the victim is the only priority


class PolicyQueue(RequestQueue):
    """vLLM's waiting queue in a ``Policy``'s order.

    A scheduling scan (``peek_request`` / ``pop_request`` until the scheduler stops) walks one
    lazy ``Policy.order()``, so the policy's local charge of each pick's prompt holds between
    picks; popped requests leave the policy when the scan ends (``settle``: any other change,
    or the end of the scheduler's ``schedule``). ``only_users``: while set, requests of other
    users are passed over (isolation). A preempted request (``prepend_request``) goes back by
    arrival (``Policy.requeue``), not to the head.
    """

    def __init__(self, policy: Policy, entries: dict[str, _Entry]) -> None:
        self.policy = policy
        self._entries = entries  # request_id -> entry, shared with the scheduler
        self._order: Iterator[_Entry] | None = None
        self._head: _Entry | None = None
        self._taken: list[_Entry] = []  # popped in this scan, still in the policy
        self._admits = count()
        self.only_users: set[str] | None = None

    def settle(self) -> None:
        """End the current scan: popped requests leave the policy; the next peek starts afresh."""
        if self._order is None:  # no scan open (a scan starts with order(); pops follow peeks)
            return
        self._order = self._head = None
        for e in self._taken:
            self.policy.remove(e)
        self._taken.clear()

    def add_request(self, request: Request) -> None:
        self.settle()
        e = self._entries[request.request_id]
        e.queued = True
        self.policy.add(e)

    def prepend_request(self, request: Request) -> None:
        self.prepend_requests((request,))

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self.settle()
        for r in requests:
            e = self._entries[r.request_id]
            e.queued = True
            self.policy.requeue(e)

    def peek_request(self) -> Request:
        """The next request of the scan. Raises ``IndexError`` when none is left."""
        if self._head is None:
            if self._order is None:
                if len(self.policy) == len(self._taken):  # nothing left: no order() to start
                    raise IndexError("peek from an empty queue")
                self._order = self.policy.order()
            only = self.only_users
            for e in self._order:
                if only is None or e.user_id in only:
                    self._head = e
                    break
            else:
                raise IndexError("peek from an empty queue")
        return self._head.vreq

    def pop_request(self) -> Request:
        self.peek_request()
        e, self._head = self._head, None
        self._taken.append(e)
        e.queued = False
        e.admit_no = next(self._admits)
        return e.vreq

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.settle()
        for r in requests:
            e = self._entries.get(r.request_id)
            if e is not None and e.queued:
                self.policy.remove(e)
                e.queued = False

    def discard(self, e: _Entry) -> None:
        """``e`` leaves the queue if it is in it (its request is freed: vLLM may remove it from the
        waiting queue only after freeing it, as for a preempted request whose last output stopped it)."""
        if e.queued:
            self.settle()
            self.policy.remove(e)
            e.queued = False

    def __bool__(self) -> bool:
        if self.only_users is None:  # any request left: no scan needed to say so
            return len(self.policy) > len(self._taken)
        try:
            self.peek_request()
        except IndexError:
            return False
        return True

    def __len__(self) -> int:
        return len(self.policy) - len(self._taken)

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the policy's order (ends any scan)."""
        self.settle()
        return iter([e.vreq for e in self.policy.order()])


_request_id = attrgetter("request_id")
_new_token_ids = attrgetter("new_token_ids")


class _FairMixin:
    """Batch's fairness over a vLLM V1 scheduler class (``Scheduler`` or ``AsyncScheduler``): the
    methods here wrap vLLM's and call them through ``super()``, so either base keeps its own
    scheduling, placeholders and outputs (module docstring).

    Args:
        *args, **kwargs: the base class's arguments (vLLM passes them).
        fair_policy: the policy (default ``policy_from_env()``: ``VTCPolicy``). Its ``isolation``
            flag turns TTFT isolation on.

    Charges stay exact with steps in flight (async scheduling runs ``schedule()`` one step ahead
    of ``update_from_output()``, pipeline parallelism several): the prompt tokens a step computes
    for the first time are counted when it is scheduled (from ``num_computed_tokens`` and
    ``num_scheduled_tokens``; a recompute after preemption stays below the high-water mark) and
    charged when its output arrives, also for a request aborted meanwhile (its step ran); the
    output tokens are those vLLM delivers in that output (``EngineCoreOutput.new_token_ids``):
    never a placeholder, not a token vLLM drops (a request finished or aborted before its step
    returned, a stale output vLLM discards), and trimmed at a stop as vLLM trims them.

    Invariant: every live request has one entry; ``_live[u]`` counts user u's live requests
    (waiting or running; no zero entries); ``Policy.on_idle(u)`` runs when it reaches 0, after
    the charges of the step that freed the request and of every step in flight with u's prompt
    tokens (``_inflight``). Assumes what vLLM's engine core does: every ``SchedulerOutput`` that
    ``schedule()`` returns comes back once to ``update_from_output()`` (a step whose output never
    came back would keep its users from being told idle). Departs from vLLM: the request's own
    ``priority`` is ignored (``_FairRequest``).
    """

    #: Whether the class runs one step ahead (vLLM's ``scheduler_config.async_scheduling``).
    async_scheduling = False

    def __init__(self, *args: Any, fair_policy: Policy | None = None, **kwargs: Any) -> None:
        _check_config(type(self), kwargs["vllm_config"] if "vllm_config" in kwargs else args[0])
        super().__init__(*args, **kwargs)
        self.fair_policy = fair_policy if fair_policy is not None else policy_from_env()
        self._entries: dict[str, _Entry] = {}
        self._arrivals = count()
        self._live: dict[str, int] = {}
        self._user: dict[str, str] = {}  # request_id -> user, live requests (and those freed in this update)
        self._first_pending: dict[str, int] = {}  # live requests per user awaiting their first token
        self._prefilling: set[_Entry] = set()  # admitted, the step sampling the first token not yet scheduled
        self._due: dict[int, tuple[Any, dict[str, int]]] = {}  # id(SchedulerOutput) -> (it, prompt tokens by user)
        self._inflight: dict[str, int] = {}  # user -> steps in flight with its prompt tokens (no zero entries)
        self._idle_due: set[str] = set()  # users with nothing live, told idle once their steps return
        self._updating = False  # inside vLLM's update_from_output: retire freed requests after the charges
        self._freed: list[_Entry] = []
        self._victim_of: list[Request] | None = None  # the ``running`` list ``_victim_req`` was chosen in
        self._victim_req: Request | None = None
        self._one_token = self.vllm_config.speculative_config is None  # at most one token delivered a request a step
        self._streak = 0  # consecutive isolated steps
        self.num_isolated_steps = 0
        #: ``{user: [prompt tokens, output tokens]}`` charged by the latest ``update_from_output``.
        self.last_charges: dict[str, list[int]] = {}
        # vLLM's priority path preempts max(running, key=(priority, arrival_time)): the only
        # preemption path that lets a caller choose. Its waiting queue is replaced; block holders
        # keep vLLM's FCFS queue.
        self.policy = SchedulingPolicy.PRIORITY
        self.waiting = PolicyQueue(self.fair_policy, self._entries)
        self.kv_holding_waiting = create_request_queue(SchedulingPolicy.FCFS)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid not in self._entries and rid not in self.requests:
            user = user_of(request)
            request.__class__ = _FairRequest  # its priority is this scheduler's victim mark
            request._fair = self
            self._entries[rid] = _Entry(request, user, next(self._arrivals))
            self._user[rid] = user
            self._live[user] = self._live.get(user, 0) + 1
            self._first_pending[user] = self._first_pending.get(user, 0) + 1
            self._idle_due.discard(user)  # back before its steps in flight returned: never idle
        super().add_request(request)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        out = super()._free_request(request, delay_free_blocks)
        e = self._entries.pop(request.request_id, None)
        if e is not None:
            request._fair = None
            self.waiting.discard(e)
            self._prefilling.discard(e)
            if e.awaits_first:
                self._drop_first_pending(e)
            if self._updating:  # its tokens in this output are charged first
                self._freed.append(e)
            else:
                self._retire(e)
        return out

    def _retire(self, e: _Entry) -> None:
        """``e``'s request is gone: its user is told idle if it was the last one (once the user's
        steps in flight have returned)."""
        del self._user[e.vreq.request_id]
        u = e.user_id
        n = self._live[u] - 1
        if n:
            self._live[u] = n
        else:
            del self._live[u]
            if u in self._inflight:
                self._idle_due.add(u)
            else:
                self.fair_policy.on_idle(u)

    def _drop_first_pending(self, e: _Entry) -> None:
        e.awaits_first = False
        user = e.user_id
        n = self._first_pending[user] - 1
        if n:
            self._first_pending[user] = n
        else:
            del self._first_pending[user]

    # ------------------------------------------------------------------ one step

    def schedule(self, *args: Any, **kwargs: Any):
        """vLLM's ``schedule`` after ending the last scan, isolated when a light user's request
        prefills toward its first token (``policy.isolation``, at most K steps in a row); then
        the prompt tokens it computes for the first time are counted for its output's charge."""
        queue = self.waiting
        queue.settle()
        self._victim_of = None  # the counters and ``running`` changed since the last step
        light = self._light_pending() if self._first_pending and self.fair_policy.isolation and \
            _sit_out_allowed(self._streak, MAX_SIT_OUT_TICKS) else None
        if not light:
            self._streak = 0
            out = super().schedule(*args, **kwargs)
        else:
            out = self._schedule_isolated(light, args, kwargs)
        queue.settle()  # the scan is over: admitted requests leave the policy now
        new = out.scheduled_new_reqs
        if new:  # first admissions (and, on vLLM's V2 model runner, resumptions)
            entries = self._entries
            for data in new:
                e = entries.get(data.req_id)
                if e is not None and e.awaits_first:
                    self._prefilling.add(e)
        if self._prefilling:
            self._count_prompt(out)
        return out

    def _count_prompt(self, out) -> None:
        """Count the prompt tokens ``out`` computes for the first time, by user, to charge when its
        output arrives (``_due``); a request whose first token this step samples stops awaiting it.

        Source: ``batch.core.step.apply``'s prompt charge (``new_prompt_tokens`` /
        ``prompt_high_water``); vLLM has already advanced ``num_computed_tokens`` by
        ``num_scheduled_tokens`` (``_update_after_schedule``)."""
        scheduled = out.num_scheduled_tokens
        due: dict[str, int] = {}
        done: list[_Entry] = []
        prefilling = self._prefilling
        if len(scheduled) < len(prefilling):  # many waiting after a preemption mid-prefill: walk the step
            entries = self._entries
            todo = [e for e in map(entries.get, scheduled) if e is not None and e in prefilling]
        else:
            todo = prefilling
        for e in todo:
            r = e.vreq
            k = scheduled.get(r.request_id)
            if not k:
                continue
            P, hw = e.num_prompt_tokens, e.prompt_charged_tokens
            nc = r.num_computed_tokens - k
            part = _new_prompt(nc, k, P, hw)
            if part:
                due[e.user_id] = due.get(e.user_id, 0) + part
            e.prompt_charged_tokens = _high_water(hw, nc, k, P)
            if not r.is_prefill_chunk:  # this step samples its first token
                done.append(e)
        for e in done:
            self._prefilling.discard(e)
            if e.awaits_first:
                self._drop_first_pending(e)
        if due:
            self._due[id(out)] = (out, due)
            inflight = self._inflight
            for u in due:
                inflight[u] = inflight.get(u, 0) + 1

    def _light_pending(self) -> set[str]:
        """Light users with a request yet to produce its first token; empty with one user. Light:
        live requests (demand) ``within_share`` at 1/2 of the requests resident after this
        step's admissions (Batch's rule), estimated as the running ones plus the waiting ones
        that the token budget, the free blocks and the free slots could admit in 64-token chunks."""
        live = self._live
        if len(live) < 2 or not self._first_pending:
            return set()
        bs, n_run = self.block_size, len(self.running)
        chunk = self.scheduler_config.long_prefill_token_threshold or self.max_num_scheduled_tokens
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        room = min(len(self.waiting), self.max_num_scheduled_tokens // chunk, free // -(-chunk // bs),
                   self.max_num_active_reqs - n_run)
        total, weight = n_run + max(room, 0), self.fair_policy.weight
        total_w = sum(weight(u) for u in live)
        within = _within_share
        return {u for u in self._first_pending if within(live[u], weight(u), total, total_w, 1, 2)}

    def _schedule_isolated(self, light: set[str], args: tuple, kwargs: dict):
        """One step in which only light users' requests awaiting their first token run or are
        admitted; the others sit out in ``running`` (keeping their blocks and their model-runner
        slots: ``max_num_active_reqs`` is lowered by their number). A normal step instead unless
        ``_light_fits``."""
        entries = self._entries

        def light_prefills() -> list[Request]:
            out = []
            for r in self.running:
                e = entries[r.request_id]
                if e.awaits_first and e.user_id in light:
                    out.append(r)
            return out
        if not self._light_fits(light_prefills(), light):  # may preempt to make room
            self._streak = 0
            return super().schedule(*args, **kwargs)
        saved, kept = self.running, light_prefills()
        hidden = len(saved) - len(kept)
        kept_set, old = set(kept), set(saved)  # before vLLM edits ``kept`` in place
        self.running = kept
        self.waiting.only_users = light
        self.max_num_active_reqs -= hidden
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs += hidden
            self.waiting.only_users = None
            now = self.running
            alive = set(now)
            self.running = [r for r in saved if r in alive or r not in kept_set]
            self.running.extend(r for r in now if r not in old)
        self._streak = fr.next_streak(self._streak, hidden > 0 or len(self.waiting) > 0)
        self.num_isolated_steps += self._streak > 0
        return out

    def _light_fits(self, kept: list[Request], light: set[str]) -> bool:
        """The next chunks of ``kept`` fit the free blocks, and with none kept, the first light
        request in the policy's order fits: an isolated step then cannot preempt (its victims
        could only be light requests) nor be empty. Blocks count vLLM's lookahead slots
        (``num_lookahead_tokens``, speculative decoding's drafts)."""
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        chunk = self.scheduler_config.long_prefill_token_threshold or self.max_num_scheduled_tokens
        bs, held, ahead = self.block_size, self.kv_cache_manager.get_block_ids, self.num_lookahead_tokens
        for r in kept:
            nc = r.num_computed_tokens
            free -= -(-(nc + min(r.num_tokens - nc, chunk) + ahead) // bs) - len(held(r.request_id)[0])
        if free < 0:
            return False
        if kept:
            return True
        if len(self.running) + self.num_waiting_for_streaming_input >= self.max_num_active_reqs:
            return False  # no slot to admit into
        queue = self.waiting  # vLLM stops at the first request that does not fit: the head
        queue.only_users = light
        try:
            head = queue.peek_request()
        except IndexError:
            return False
        finally:
            queue.only_users = None
            queue.settle()
        n = head.num_tokens  # vLLM admits only if the whole prompt fits (scheduler_reserve_full_isl)
        need = -(-((n if self.scheduler_reserve_full_isl else min(n, chunk)) + ahead) // bs)
        return need <= free or self._make_room(head, need - free)

    def _make_room(self, head: Request, short_blocks: int) -> bool:
        """Preempt running requests of users over their weighted fair share of the running
        requests (with ``head``'s user among them), in the policy's victim order, until
        ``short_blocks`` more blocks are free; nothing is preempted if that cannot free enough.

        Source: ``batch.core.step._room`` (room for a light user's request by preemption)."""
        entries, weight = self._entries, self.fair_policy.weight
        held = self.kv_cache_manager.get_block_ids
        users = [entries[r.request_id].user_id for r in self.running]
        per_user = Counter(users)
        per_user[entries[head.request_id].user_id] += 1
        total, total_w = len(users) + 1, sum(weight(u) for u in per_user)
        over = {u for u, c in per_user.items() if not fr.within_share(c, weight(u), total, total_w, 1, 1)}
        cands = [entries[r.request_id] for r, u in zip(self.running, users)
                 if u in over and self._request_blocks_can_be_freed(r)]
        for e in cands:
            e.block_table = held(e.vreq.request_id)[0]
        victims = []
        while cands and short_blocks > 0:
            v = self.fair_policy.victim(cands)
            cands.remove(v)
            victims.append(v.vreq)
            short_blocks -= len(v.block_table)
        if short_blocks > 0:
            return False
        gone = set(victims)
        self.running = [r for r in self.running if r not in gone]
        now = time.monotonic()
        for r in victims:
            self._preempt_request(r, now, drop_stale_output=self.requires_kv_delivery)
        return True

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any):
        """vLLM's preemption (its only path back to ``waiting``). The request keeps its
        ``order_no`` (its arrival): unlike Batch's core (``Policy.requeue_behind``), the plugin
        has no resume-first step, so a preempted decode renumbered behind every arrival stalled
        its stream (TPOT p99 1.2-1.3 s against vLLM's 52 ms on trace2k)."""
        self._victim_of = None  # ``running`` changed: the next victim is chosen afresh
        return super()._preempt_request(request, *args, **kwargs)

    def _victim(self) -> Request | None:
        """The policy's victim among ``running`` (``_FairRequest.priority`` reads it), chosen once
        per step and after each preemption; with one user, vLLM's FCFS victim ``running[-1]``."""
        running = self.running
        if self._victim_of is not running:  # reset by each schedule() and each preemption
            self._victim_of, self._victim_req = running, self._choose_victim(running)
        return self._victim_req

    def _choose_victim(self, running: list[Request]) -> Request | None:
        if not running:
            return None
        if len(self._live) == 1:  # one user at all
            return running[-1]
        entries = self._entries
        cands = [entries[r.request_id] for r in running]
        if len({e.user_id for e in cands}) == 1:
            return running[-1]
        bs = self.block_size
        for e in cands:  # only len() is read: the blocks its computed tokens fill
            e.block_table = range(-(-e.vreq.num_computed_tokens // bs))
        return self.fair_policy.victim(cands).vreq

    def update_from_output(self, scheduler_output, model_runner_output):
        """vLLM's ``update_from_output``, then the step's charges (``last_charges``), then the
        users whose last request it freed are told idle."""
        due = self._due.pop(id(scheduler_output), None)
        self._updating = True
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            self._charge(due[1] if due is not None else None, outputs)
        finally:
            self._updating = False
            freed, self._freed = self._freed, []
            for e in freed:
                self._retire(e)
            if due is not None:
                self._returned(due[1])
        return outputs

    def _charge(self, prompt: dict[str, int] | None, outputs: dict) -> None:
        """Charge each user, once: the prompt tokens counted for this step and the output tokens
        vLLM delivered in ``outputs`` (recorded in ``last_charges``).

        Source: ``batch.core.step.apply`` (one ``Policy.charge`` per user per step)."""
        charges: dict[str, list[int]] = {u: [p, 0] for u, p in prompt.items()} if prompt else {}
        users = self._user
        for eco in outputs.values():
            outs = eco.outputs
            if not outs:
                continue
            if self._one_token:  # at most one token an output: count in C
                got = Counter(compress(map(users.get, map(_request_id, outs)), map(_new_token_ids, outs)))
            else:  # speculative decoding: several tokens an output
                got = Counter()
                for o in outs:
                    if o.new_token_ids:
                        got[users.get(o.request_id)] += len(o.new_token_ids)
            got.pop(None, None)
            for user, n in got.items():
                c = charges.get(user)
                if c is None:
                    charges[user] = [0, n]
                else:
                    c[1] += n
        charge = self.fair_policy.charge
        for user, (p, o) in charges.items():
            charge(user, p, o)
        self.last_charges = charges

    def _returned(self, prompt: dict[str, int]) -> None:
        """A step with these users' prompt tokens returned: a user with nothing live and no other
        step in flight is told idle now."""
        inflight = self._inflight
        for u in prompt:
            n = inflight[u] - 1
            if n:
                inflight[u] = n
            else:
                del inflight[u]
                if u in self._idle_due:
                    self._idle_due.discard(u)
                    self.fair_policy.on_idle(u)


def _check_config(cls: type, vllm_config) -> None:
    """Refuse at start-up a set-up the class does not run in (``docs/vllm-plugin.md``, "Known limits").

    Raises:
        ValueError: ``AsyncFairScheduler`` with async scheduling off (vLLM would run its
            synchronous ``Scheduler`` there: ``--no-async-scheduling``, or vLLM turned it off,
            e.g. for pipeline parallelism on its V1 model runner); the message names the class to use.
    """
    on = bool(vllm_config.scheduler_config.async_scheduling)
    if cls.async_scheduling and not on:
        raise ValueError(
            f"{cls.__name__} is vLLM's AsyncScheduler with Batch's fairness, but async scheduling is off here "
            f"(--no-async-scheduling, or vLLM turned it off for this set-up; its log says why): use "
            f"--scheduler-cls batch.integrations.vllm.FairScheduler")
    if on and not cls.async_scheduling:
        logger.warning("%s is vLLM's synchronous Scheduler with Batch's fairness, run here with async scheduling on: "
                       "its charges stay exact, but the engine cannot schedule a request while its step is in "
                       "flight. Use --scheduler-cls batch.integrations.vllm.AsyncFairScheduler, or pass "
                       "--no-async-scheduling", cls.__name__)


class FairScheduler(_FairMixin, Scheduler):
    """vLLM V1's synchronous ``Scheduler`` (``vllm serve --no-async-scheduling``) with Batch's
    fairness (``_FairMixin``)."""


class AsyncFairScheduler(_FairMixin, AsyncScheduler):
    """vLLM V1's ``AsyncScheduler`` (async scheduling, vLLM's default) with Batch's fairness
    (``_FairMixin``): ``vllm serve MODEL --scheduler-cls batch.integrations.vllm.AsyncFairScheduler``.

    Raises:
        ValueError: at construction, if vLLM's async scheduling is off (``_check_config``).
    """

    async_scheduling = True


# ---------------------------------------------------------------------- who the user is

def with_user(body: bytes, api_key: str | None, api_keys: dict[str, str], trust_user_field: bool = False) -> bytes:
    """An OpenAI request body with ``vllm_xargs["user"]`` set: the user of ``api_key`` when
    ``api_keys`` is not empty (an unknown or missing key: ``DEFAULT_USER``, whatever the body
    says), else with ``trust_user_field`` the body's ``user`` field, else ``DEFAULT_USER`` (a
    client never picks its identity). A body that is not a JSON object comes back unchanged."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(data, dict):
        return body
    if api_keys:
        user = api_keys.get(api_key or "", DEFAULT_USER)
    elif trust_user_field and isinstance(data.get("user"), str) and data.get("user"):
        user = data["user"]
    else:
        user = DEFAULT_USER
    xargs = data.get("vllm_xargs") if isinstance(data.get("vllm_xargs"), dict) else {}
    data["vllm_xargs"] = {**xargs, USER_KEY: user}
    return json.dumps(data).encode()


class UserMiddleware:
    """ASGI middleware for ``vllm serve --middleware``: every POST under ``/v1/`` carries its user
    in ``vllm_xargs`` (``with_user``), API keys from ``$BATCH_USERS_CONFIG``'s ``api_keys``
    (``Authorization: Bearer KEY``); the body's ``user`` only with ``$BATCH_TRUST_USER_FIELD=1``."""

    def __init__(self, app: Callable, api_keys: dict[str, str] | None = None,
                 trust_user_field: bool | None = None) -> None:
        self.app = app
        if api_keys is None:
            cfg = _users_config(os.environ.get(CONFIG_ENV))
            api_keys = cfg.api_keys if cfg else {}
        self.api_keys = api_keys
        self.trust_user_field = os.environ.get(TRUST_USER_FIELD_ENV) == "1" if trust_user_field is None \
            else trust_user_field

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        parts, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay([msg], receive), send)
                return
            parts.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        headers = dict((k.lower(), v) for k, v in scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode("latin-1")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        body = with_user(b"".join(parts), key, self.api_keys, self.trust_user_field)
        hs = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        hs.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": hs}, _replay([{"type": "http.request", "body": body,
                                                            "more_body": False}], receive), send)


def _replay(msgs: list[dict], receive: Callable) -> Callable:
    async def replayed() -> dict:
        return msgs.pop(0) if msgs else await receive()
    return replayed
