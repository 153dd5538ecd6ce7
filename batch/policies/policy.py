"""The policy interface, with vLLM V1's first-come-first-served rule as its defaults. A policy
owns the waiting queue: the order admission tries, the charges, the victim. Every policy
implements every member; the scheduler reads nothing else (``docs/design.md``)."""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    from batch.core.state import Seq


class Policy:
    """FCFS as vLLM V1's ``Scheduler.schedule``: the oldest waiting request first, a preempted one
    back at the head (``prepend_request``), the newest admission as victim (``running.pop()``).
    The class attributes are the mechanisms a policy asks of the scheduler (``docs/design.md``)."""

    name = "fcfs"
    isolation = False
    headroom = False
    resume_first = False
    requeue_behind = False  # a preempted decode takes a new place (``Seq.order_no``) behind every arrival

    def __init__(self) -> None:
        self._waiting: deque[Seq] = deque()

    def __len__(self) -> int:
        """Requests waiting (queued or preempted)."""
        return len(self._waiting)

    def add(self, seq: Seq) -> None:
        """A new arrival waits behind every earlier one."""
        self._waiting.append(seq)

    def requeue(self, seq: Seq) -> None:
        """A preempted request waits again, at the head."""
        self._waiting.appendleft(seq)

    def remove(self, seq: Seq) -> None:
        """``seq`` leaves the waiting queue (admitted or aborted)."""
        if self._waiting[0] is seq:
            self._waiting.popleft()
        else:
            self._waiting.remove(seq)

    def order(self, light: Callable[[str], bool] | None = None) -> Iterator[Seq]:
        """The waiting requests in the order admission tries them (lazy: admission stops early).
        ``light(user)``: the user is light (``fairness_rules.light_user``); a policy that favours
        light users yields their requests first. FCFS ignores it."""
        return iter(self._waiting)

    def resumable(self) -> Iterable[Seq]:
        """Waiting preempted decodes to try before ``order`` (with ``resume_first``): none here."""
        return ()

    def charge(self, user_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """``user_id`` had ``prompt_tokens`` of prompt computed for the first time and
        ``output_tokens`` generated in one iteration (once per user per iteration)."""

    def weight(self, user_id: str) -> int:
        """The user's share weight (an int >= 1)."""
        return 1

    def pressure(self, user_id: str, resident_requests: int) -> int | None:
        """The user's residency pressure with ``resident_requests`` resident
        (``fairness_rules.pressure_units``), or ``None``: the policy keeps no shares among
        resident requests (no victim by user, no room for another user's request). FCFS: ``None``."""
        return None

    def victim(self, candidates: Sequence[Seq]) -> Seq:
        """The request to preempt by recompute among ``candidates`` (non-empty, none pinned)."""
        return max(candidates, key=_admit_no)

    def on_idle(self, user_id: str) -> None:
        """``user_id`` has nothing waiting or resident: per-user state may be dropped."""


FCFSPolicy = Policy


def _admit_no(seq: Seq) -> int:
    return seq.admit_no
