"""The scheduling rules the scheduler runs, as pure integer functions.

Each function uses only ``+ - <= ==`` and ``spec.logic``, so it evaluates on Python ints in
``scheduler.py`` and on ``z3.Int`` terms in ``spec/verify.py``: the proofs are about this code.
Units: ``*_tokens`` are token counts, ``*_blocks`` KV-cache blocks.
"""
from __future__ import annotations

from typing import Any

from spec.logic import And, If, Max, Min, Or, Sum, cdiv

Int = Any  # a Python int or a z3 integer term

#: The problem's prefill chunk, tokens: long prompts are prefilled in 64-token chunks
#: (``../shared/mission/seed.md``). ``Scheduler``'s default ``prefill_chunk_tokens`` must be it
#: (``tests/test_stateful.py`` checks it).
PREFILL_CHUNK_TOKENS = 64


def blocks_for(num_tokens: Int, block_tokens: Int) -> Int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_tokens)``.

    Source: ``inference_stub.kv_blocks_for`` (and vLLM's ``cdiv`` block arithmetic).
    """
    return cdiv(num_tokens, block_tokens)


def blocks_needed(num_tokens: Int, block_tokens: Int) -> Int:
    """Blocks a resident request must hold before an iteration: its tokens plus one lookahead slot.

    ``num_tokens`` is ``len(prompt) + len(generated)``. The slot is for the token this
    iteration may produce, so that after the token is appended ``kv_blocks_for(request)``
    still fits in what the request holds (vLLM calls it a lookahead slot).
    """
    return blocks_for(num_tokens + 1, block_tokens)


def max_model_len_tokens(cap_blocks: Int, block_tokens: Int) -> Int:
    """The longest sequence (prompt + generated tokens) the KV cache can hold, in tokens."""
    return cap_blocks * block_tokens


def prompt_fits(num_prompt_tokens: Int, cap_blocks: Int, block_tokens: Int) -> Any:
    """A prompt is admissible iff, with its first generated token's slot, it fits an empty cache.

    A prompt failing this is refused at ``submit`` (vLLM refuses prompts longer than
    ``max_model_len`` the same way).
    """
    return And(num_prompt_tokens >= 1, blocks_needed(num_prompt_tokens, block_tokens) <= cap_blocks)


def can_allocate(free_blocks: Int, need_blocks: Int) -> Any:
    """The admission / growth guard: ``need_blocks`` may be taken from ``free_blocks``."""
    return need_blocks <= free_blocks


def growth_blocks(held_blocks: Int, num_tokens: Int, block_tokens: Int) -> Int:
    """Blocks a resident request must add before its next iteration (0 if it holds enough)."""
    return Max(0, blocks_needed(num_tokens, block_tokens) - held_blocks)


def chunk_tokens(num_tokens: Int, num_computed_tokens: Int, chunk_tokens_max: Int, budget_left_tokens: Int) -> Int:
    """Tokens a request processes this iteration: catch ``num_computed_tokens`` up to ``num_tokens``.

    Bounded by the prefill chunk size and the tick's remaining token budget. A decode
    (``num_computed_tokens == num_tokens - 1``) gets 1. Source: vLLM V1's one rule for chunked
    prefill and decode (``num_new_tokens = min(num_tokens - num_computed_tokens, budget)``)
    with Sarathi-Serve's chunk cap.
    """
    return Min(Min(chunk_tokens_max, num_tokens - num_computed_tokens), budget_left_tokens)


def decode_ready(held_blocks: Int, num_tokens: Int, num_computed_tokens: Int, block_tokens: Int) -> Any:
    """A resident request's next step is a plain decode: one token left to compute, and its
    block table already holds the slot for the token this iteration produces.

    A fast-path guard, not a new rule: ``spec.verify`` (check ``decode_fast_path``) proves
    that when it holds (and the token budget and the chunk size are at least 1)
    ``growth_blocks`` is 0, ``chunk_tokens`` is 1 and the growth guard passes, so the
    scheduler may skip computing them for the common decode.
    """
    return And(num_computed_tokens + 1 == num_tokens, num_tokens + 1 <= held_blocks * block_tokens)


def produces_token(num_computed_tokens: Int, num_new_tokens: Int, num_tokens: Int) -> Any:
    """The iteration's token is kept (appended) iff it computes the request's last known token."""
    return num_computed_tokens + num_new_tokens == num_tokens


def reached_length(num_generated: Int, max_tokens: Int, num_tokens: Int, max_model_len: Int) -> Any:
    """Finish with reason ``length``: ``max_tokens`` generated, or the cache-wide length reached."""
    return Or(num_generated >= max_tokens, num_tokens >= max_model_len)


# ---------------------------------------------------------------- invariants


def kv_within_cap(used_blocks: Int, cap_blocks: Int) -> Any:
    """Safety: the blocks in use never exceed the cap."""
    return And(0 <= used_blocks, used_blocks <= cap_blocks)


def ledger_consistent(free_blocks: Int, held_blocks: list[Int], cap_blocks: Int) -> Any:
    """The pool is exact: free + sum of blocks held by resident requests == cap."""
    return free_blocks + Sum(held_blocks) == cap_blocks


def resident_covered(held_blocks: Int, num_tokens: Int, block_tokens: Int) -> Any:
    """A resident request holds at least what ``kv_blocks_for`` counts for it."""
    return blocks_for(num_tokens, block_tokens) <= held_blocks


# ---------------------------------------------------------------- prefix caching (shared blocks)


def hit_matches(stored_key: Any, wanted_key: Any) -> Any:
    """A prefix-cache hit returns a block only if its stored content is the request's: the same
    tokens and the same parent (``batch.core.prefix_cache.block_keys``)."""
    return stored_key == wanted_key


def may_evict(refcount: Int) -> Any:
    """A cached block may be evicted (reused for other content) only when no request holds it."""
    return refcount == 0


def refcount_is_holders(refcount: Int, holders: Int) -> Any:
    """A block's reference count is the number of block tables that hold it."""
    return refcount == holders


def kv_used_distinct(used_blocks: Int, refcounts: list[Int], cap_blocks: Int) -> Any:
    """The KV cap over distinct physical blocks: the blocks in use are those held at least once
    (a block shared by several requests counts once), and at most the cap."""
    return And(used_blocks == Sum([If(r > 0, 1, 0) for r in refcounts]), used_blocks <= cap_blocks)
