"""The scheduler's typed data: request records, one iteration's plan, the knobs, the state
that ``batch.core.step`` reads and changes (``docs/design.md``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from batch.core.kv_cache import BlockPool
from batch.core.metrics import MetricsRecorder
from inference_stub import Request
from spec import lifecycle as lc


@dataclass(slots=True, eq=False)
class Seq:
    """The scheduler's record of one request (vLLM's ``Request``); compares by identity.

    ``num_tokens`` = prompt + generated; ``num_computed_tokens`` of them have KV in the blocks of
    ``block_table``. The caller's ``Request`` only receives the contract's fields.
    """

    req: Request
    user_id: str
    rid: str  # request_id at submit (the key of State.by_id, whatever the caller does to the field)
    arrival_no: int
    num_prompt_tokens: int
    order_no: int = -1  # position in the admission order: arrival_no, or later once requeued behind (VTC)
    state: str = lc.QUEUED
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    prompt_charged_tokens: int = 0  # most prompt tokens ever computed: a prompt is charged once
    admit_no: int = -1  # admission sequence number (the victim order's tie-break)
    admit_tick: int = -1
    progress_tick: int = -1  # the tick it first computed past prompt_charged_tokens since admit_tick (``fr.past_high_water``)
    blocked_ticks: int = 0  # ticks as the blocked head of the admission order (aging)
    pinned: bool = False  # admitted with its worst-case blocks after max_preemptions; never a victim
    holder: bool = False  # admitted as the reservation holder: protected for the quantum (``fr.protected``)
    admitted_s: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None
    keys: tuple = ()  # its full prompt blocks' keys, with prefix caching (``prefix_cache.block_keys``)

    def __post_init__(self) -> None:
        if self.order_no < 0:
            self.order_no = self.arrival_no

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.req.generated)

    @property
    def request_id(self) -> str:
        return self.req.request_id


class Entry(NamedTuple):
    """One request's share of an iteration: ``num_new_tokens`` computed (a prefill chunk, or 1
    for a decode) after ``new_blocks`` are added to its block table; ``admitted``: it leaves the
    waiting queue in this iteration."""

    seq: Seq
    num_new_tokens: int
    new_blocks: int
    admitted: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """The decision for one iteration (vLLM V1's ``SchedulerOutput``, reduced): ``seqs``,
    ``num_new_tokens``, ``new_blocks`` parallel in ``forward`` order, the last ``num_admitted``
    admitted from the waiting queue; ``preempted`` by recompute before it; ``sat_out`` (resident,
    keeping their blocks) in an ``isolated`` iteration; ``blocked``: the first waiting request that
    did not fit (it ages); ``admission_stop``: ``empty``, ``kv``, ``budget``, ``max_running``,
    ``preempted`` or ``room`` (room was made for a light user); ``hits``: cached blocks shared at
    admission (prefix caching)."""

    seqs: tuple[Seq, ...]
    num_new_tokens: tuple[int, ...]
    new_blocks: tuple[int, ...]
    num_admitted: int = 0
    preempted: tuple[Seq, ...] = ()
    sat_out: tuple[Seq, ...] = ()
    blocked: Seq | None = None
    admission_stop: str = "empty"
    isolated: bool = False
    hits: dict[Seq, list[int]] = field(default_factory=dict)  # admissions' prefix-cache hits

    @property
    def batch(self) -> tuple[Entry, ...]:
        """The iteration as ``Entry`` records, in ``forward`` order."""
        k = len(self.seqs) - self.num_admitted
        return tuple(Entry(s, n, b, i >= k) for i, (s, n, b) in
                     enumerate(zip(self.seqs, self.num_new_tokens, self.new_blocks)))

    @property
    def requests(self) -> list[Request]:
        """The ``Request`` objects passed to ``forward``, in batch order."""
        return [s.req for s in self.seqs]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(frozen=True, slots=True)
class Config:
    """The knobs a tick reads (``scheduler.Scheduler``'s arguments, validated there); units:
    ``*_blocks`` KV blocks, ``*_tokens`` tokens, ``*_ticks`` iterations."""

    kv_cap_blocks: int
    block_tokens: int
    prefill_chunk_tokens: int
    token_budget_tokens: int
    max_running: int
    eos_token_id: int
    max_preemptions: int
    aging_ticks: int
    headroom: bool  # admissions leave spec.fairness_rules.growth_headroom_blocks free
    isolation: bool  # TTFT isolation of light users (room by preemption, sit-outs)
    resume_first: bool  # preempted decodes are tried before the admission order
    max_sit_out_ticks: int  # K: most consecutive isolated iterations
    prefix_caching: bool = False  # full prompt blocks shared by content (``batch.core.prefix_cache``)
    quantum_ticks: int = 128  # Q: iterations before a resident request may give room to another user
    hold_ticks: int = 8  # W: iterations a fitting request waits behind a blocked head

    @property
    def max_model_len_tokens(self) -> int:
        return self.kv_cap_blocks * self.block_tokens


@dataclass(slots=True, eq=False)
class State:
    """What a tick reads and changes (``Scheduler`` holds its lock around every use): ``running``
    in admission order; live records by ``id(Request)`` and by request id (oldest first: ids
    may repeat); live counts per user (no zero entries); the aged request admitted before
    anything else (``reserved_after``); the isolation ``streak``; ticks run."""

    pool: BlockPool
    stats: MetricsRecorder
    running: list[Seq] = field(default_factory=list)
    by_obj: dict[int, Seq] = field(default_factory=dict)
    by_id: dict[str, list[Seq]] = field(default_factory=dict)
    resident_by_user: dict[str, int] = field(default_factory=dict)
    waiting_by_user: dict[str, int] = field(default_factory=dict)
    reserved: Seq | None = None
    protected: Seq | None = None  # the last reservation holder admitted (protected within the quantum)
    streak: int = 0
    tick_no: int = 0
    arrivals: int = 0
    admissions: int = 0
