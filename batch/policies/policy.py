"""Scheduling policies: who is admitted next, and who is preempted under KV pressure.

``Policy`` is the protocol; ``FCFSPolicy`` and ``RoundRobinPolicy`` are here, ``VTCPolicy`` (the
default) in ``batch.policies.vtc`` and re-exported from here.

A policy owns the waiting queue (queued and preempted requests) and is told about the
service each request receives. The scheduler owns everything else (KV ledger, chunking,
token budget, the lifecycle), so a policy is a few small methods.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Iterator, Protocol, Sequence

from batch.policies.queues import _Waiting
from batch.policies.vtc import DRAIN_SHARE, MAX_DRAIN_PASSES, VTCPolicy, remaining_iterations  # noqa: F401 (re-exported)


class Policy(Protocol):
    """What the scheduler asks of a policy. ``seq`` arguments are the scheduler's records
    (with ``user_id``, ``arrival_no``, ``admit_no``, ``num_tokens``, ``num_prompt_tokens`` attributes).

    Optional: ``before_admission(resident_requests, prefill_chunk_tokens)`` (called in every
    ``schedule()``) and ``resume_first()`` (waiting requests the scheduler tries before
    ``admission_order``, admitting those that fit now: ``VTCPolicy.resume_first``)."""

    #: Whether admission may pass a waiting request that does not fit and try later ones.
    backfill: bool

    def __len__(self) -> int: ...

    def add(self, seq: Any) -> None:
        """A new request arrived; it waits behind earlier arrivals."""

    def requeue(self, seq: Any) -> None:
        """A preempted request waits again, ahead of later arrivals."""

    def remove(self, seq: Any) -> None:
        """``seq`` leaves the waiting queue (admitted or aborted)."""

    def admission_order(self) -> Iterator[Any]:
        """Waiting requests in the order admission should try them (a snapshot)."""

    def on_service(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """In one iteration, ``user_id``'s requests had ``prompt_tokens`` of prompt processed
        (first time only) and ``output_tokens`` generated; called once per user per iteration,
        users in batch order (those with prompt tokens first), so every run makes the same calls."""

    def choose_victim(self, running: Sequence[Any]) -> Any:
        """The request to preempt by recompute among ``running`` (non-empty)."""

    # Optional: ``discard(seq) -> None``, called instead of ``remove`` when a waiting request
    # is aborted (``VTCPolicy`` has it: an abort does not pass anyone in its drain phase).
    # Optional: ``before_admission(resident_requests: int, prefill_chunk_tokens: int) -> None``,
    # called by the scheduler in every ``schedule()`` (before admission and isolation's peek)
    # with the resident requests of the plan and the largest prefill chunk an iteration can
    # process, tokens (``VTCPolicy`` has it).


class FCFSPolicy:
    """First come, first served, with vLLM V1's preemption rule.

    Admission tries the oldest waiting request and stops at the first that does not fit
    (no backfill: head-of-line blocking, but nothing starves). A preempted request goes back
    to the head of the queue. The victim is the most recently admitted running request.

    Source: vLLM V1 ``Scheduler.schedule`` (FCFS policy): ``self.running.pop()`` as victim,
    ``self.waiting.prepend_request`` for the preempted.
    """

    backfill = False

    def __init__(self) -> None:
        self._waiting: deque[Any] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, seq: Any) -> None:
        self._waiting.append(seq)

    def requeue(self, seq: Any) -> None:
        self._waiting.appendleft(seq)

    def remove(self, seq: Any) -> None:
        if self._waiting and self._waiting[0] is seq:
            self._waiting.popleft()
        else:
            self._waiting.remove(seq)

    def admission_order(self) -> Iterator[Any]:
        return iter(self._waiting)  # lazy: admission stops at the first request that does not fit

    def on_service(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        return None

    def choose_victim(self, running: Sequence[Any]) -> Any:
        return max(running, key=lambda s: s.admit_no)


# ---------------------------------------------------------------- round robin


class RoundRobinPolicy:
    """Per-user round robin: admission takes one request per backlogged user in turn.

    Users rotate: a user whose request is admitted moves behind the others. Within a user,
    first come first served; a preempted request returns ahead of its user's later arrivals.
    The victim is the most recently admitted request (vLLM's rule). A baseline for the
    fairness benchmark: it equalises admissions, not service (a user with long requests gets
    more tokens).

    Args:
        backfill: admission may pass a waiting request that does not fit.
    """

    def __init__(self, *, backfill: bool = False) -> None:
        self.backfill = backfill
        self._q = _Waiting()
        self._turns: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return self._q.n

    def add(self, seq: Any) -> None:
        if self._q.push(seq):
            self._turns[seq.user_id] = None

    def requeue(self, seq: Any) -> None:
        if self._q.push_front(seq):
            self._turns[seq.user_id] = None

    def remove(self, seq: Any) -> None:
        if self._q.discard(seq):
            del self._turns[seq.user_id]
        else:
            self._turns.move_to_end(seq.user_id)

    def admission_order(self) -> Iterator[Any]:
        """Rounds over the backlogged users in turn order, one request per user per round."""
        active = []
        for user in self._turns:  # the first round is lazy: admission usually stops early
            it = self._q.iter_user(user)
            seq = next(it, None)
            if seq is not None:
                yield seq
                active.append(it)
        while active:
            still = []
            for it in active:
                seq = next(it, None)
                if seq is not None:
                    yield seq
                    still.append(it)
            active = still

    def on_service(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        return None

    def choose_victim(self, running: Sequence[Any]) -> Any:
        return max(running, key=lambda s: s.admit_no)
