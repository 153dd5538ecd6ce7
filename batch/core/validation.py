"""What ``Scheduler`` refuses, and how: typed errors, request and knob validation.

Bad input gets a clear, typed error and changes nothing: a request is checked completely at
``submit`` before any state changes, a knob at construction, a backend's answer before the
tick is applied (``docs/reliability.md``).
"""
from __future__ import annotations

import numbers
from typing import Any

from batch.core.isolation import Isolation
from inference_stub import Request
from spec import rules

_INT_TYPE = frozenset({int})


class RequestError(ValueError):
    """A request was refused at ``submit``; the scheduler's state is unchanged."""


class InvalidRequestError(RequestError):
    """A field of the request is malformed (the message names the field and the rule)."""


class PromptTooLongError(RequestError):
    """The prompt (with its first output token's slot) needs more KV blocks than the cap."""


class DuplicateRequestError(RequestError):
    """The same ``Request`` object, or a non-empty ``request_id``, is already in flight."""


class BackendError(RuntimeError):
    """``forward`` failed or answered malformed output; the tick was not applied.

    Attributes:
        request_ids: the ids of the batch that was passed to ``forward``.
    """

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(f"{message} (batch of {len(request_ids)}: {request_ids[:8]}"
                         f"{' ...' if len(request_ids) > 8 else ''})")
        self.request_ids = request_ids


def validate_request(sched: Any, request: Any) -> int:
    """Check a request at ``Scheduler.submit``; return its prompt length in tokens.

    Raises:
        InvalidRequestError: not a ``Request`` (or lacking its fields), an empty or non-str
            ``user_id``, a non-str ``request_id``, ``max_tokens`` not an int >= 1, an empty or
            non-list prompt, a token id not an int >= 0 (below ``vocab_size`` when the
            backend states one).
        DuplicateRequestError: this object is already in flight in ``sched``.
        PromptTooLongError: the prompt with its first output token's slot needs more blocks
            than the cache holds (checked on its length, before its ids are read).
    """
    if not isinstance(request, Request) and not all(
            hasattr(request, a) for a in ("user_id", "prompt", "max_tokens", "request_id", "generated")):
        raise InvalidRequestError(f"expected an inference_stub.Request, got {type(request).__name__}")
    if not isinstance(request.user_id, str) or not request.user_id:
        raise InvalidRequestError(f"user_id must be a non-empty str, got {request.user_id!r}")
    if not isinstance(request.request_id, str):
        raise InvalidRequestError(f"request_id must be a str, got {type(request.request_id).__name__}")
    if id(request) in sched._by_obj:  # before field checks: an in-flight object has tokens
        raise DuplicateRequestError(f"this Request object (request_id={request.request_id!r}) is already in flight")
    mt = request.max_tokens
    if not is_int(mt) or mt < 1:
        raise InvalidRequestError(f"max_tokens must be an int >= 1, got {mt!r}")
    prompt = request.prompt
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise InvalidRequestError("prompt must be a non-empty list of token ids")
    n = len(prompt)  # the length first: a huge prompt is refused without reading its tokens
    if not rules.prompt_fits(n, sched.kv_cap_blocks, sched.block_tokens):
        raise PromptTooLongError(
            f"prompt of {n} tokens needs {rules.blocks_needed(n, sched.block_tokens)} KV blocks of "
            f"{sched.block_tokens} tokens with its first output token, but the cache holds "
            f"{sched.kv_cap_blocks} blocks (prompt must be < {sched.max_model_len_tokens} tokens)")
    hi = sched.vocab_size
    for t in prompt:
        if (type(t) is not int and not is_int(t)) or t < 0 or (hi is not None and t >= hi):
            raise InvalidRequestError(
                f"prompt token ids must be ints {'>= 0' if hi is None else f'in 0..{hi - 1}'}, got {t!r}")
    if type(mt) is not int:  # np.int64 and the like: a plain int from here on (same value)
        request.max_tokens = int(mt)
    return n


def check_tokens(tokens: Any, batch: list[Any]) -> None:
    """Refuse a backend's answer that is not one int token per request of ``batch``.

    Raises:
        BackendError: a wrong count, or a token that is not an int (``numbers.Integral``,
            never a bool).
    """
    if not isinstance(tokens, (list, tuple)) or len(tokens) != len(batch):
        n = len(tokens) if isinstance(tokens, (list, tuple)) else type(tokens).__name__
        raise BackendError(f"forward returned {n} tokens for a batch of {len(batch)}",
                           [r.request_id for r in batch])
    if set(map(type, tokens)) <= _INT_TYPE:  # the common case, checked at C speed
        return
    for t in tokens:
        if type(t) is not int and (isinstance(t, bool) or not isinstance(t, numbers.Integral)):
            raise BackendError(f"forward returned a non-int token {t!r}", [r.request_id for r in batch])


#: What ``schedule()`` and ``submit`` call on a policy (``policy.Policy``).
_POLICY_METHODS = ("__len__", "add", "requeue", "remove", "admission_order", "on_service", "choose_victim")


def check_knobs(*, clock: Any, backend: Any, policy: Any, isolation: Any, record_itl: Any, check_invariants: Any,
                 admission_headroom: Any, easy_backfill: Any) -> None:
    """Refuse, at construction, a knob that would fail later inside ``submit`` or ``tick``.

    Raises:
        ValueError: naming the knob.
    """
    if clock is not None and not callable(clock):
        raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
    if backend is not None and not callable(backend) and not callable(getattr(backend, "execute_model", None)):
        raise ValueError(f"backend must be forward(batch) -> tokens or have execute_model, got {backend!r}")
    if policy is not None and not all(hasattr(policy, m) for m in _POLICY_METHODS + ("backfill",)):
        raise ValueError(f"policy must implement policy.Policy ({', '.join(_POLICY_METHODS)}, backfill), "
                         f"got {policy!r}")
    if isolation is not None and not isinstance(isolation, (bool, Isolation)):
        raise ValueError(f"isolation must be None, a bool or an isolation.Isolation, got {isolation!r}")
    for name, v, none_ok in (("record_itl", record_itl, False), ("check_invariants", check_invariants, True),
                             ("admission_headroom", admission_headroom, True),
                             ("easy_backfill", easy_backfill, True)):
        if not isinstance(v, bool) and not (none_ok and v is None):
            raise ValueError(f"{name} must be a bool{' or None' if none_ok else ''}, got {v!r}")


def is_int(v: Any) -> bool:
    """An integer token id or length: an ``int`` or another ``numbers.Integral`` (``np.int64``), never a bool."""
    return type(v) is int or (not isinstance(v, bool) and isinstance(v, numbers.Integral))


def positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v
