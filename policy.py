"""Scheduling policies: who is admitted next, and who is preempted under KV pressure.

A policy owns the waiting queue (queued and preempted requests) and is told about the
service each request receives. The scheduler owns everything else (KV ledger, chunking,
token budget, the lifecycle), so a policy is a few small methods.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Protocol, Sequence


class Policy(Protocol):
    """What the scheduler asks of a policy. ``seq`` arguments are the scheduler's records
    (with ``user_id``, ``arrival_no``, ``admit_no``, ``num_tokens`` attributes)."""

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

    def on_service(self, seq: Any, prompt_tokens: int, output_tokens: int) -> None:
        """``seq`` had ``prompt_tokens`` of prompt processed and ``output_tokens`` generated."""

    def choose_victim(self, running: Sequence[Any]) -> Any:
        """The request to preempt by recompute among ``running`` (non-empty)."""


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

    def on_service(self, seq: Any, prompt_tokens: int, output_tokens: int) -> None:
        return None

    def choose_victim(self, running: Sequence[Any]) -> Any:
        return max(running, key=lambda s: s.admit_no)

