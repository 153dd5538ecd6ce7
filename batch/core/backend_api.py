"""The richer backend interface: what a paged model runner needs from one iteration.

The stub's ``forward(list[Request]) -> list[int]`` knows nothing of prefill or of the KV
cache. A real model runner needs, per participating request, the tokens to process, where
they sit in the sequence and where their KV goes. A backend that has a method
``execute_model(items: list[BatchItem]) -> list[int]`` gets exactly that from
``Scheduler.tick()``; any other backend is called as ``backend(list[Request])`` as before.

Source: vLLM V1's ``SchedulerOutput`` -> ``ModelRunner.execute_model`` split (per request:
``num_scheduled_tokens``, ``num_computed_tokens``, ``block_ids``), reduced to one flat item.
"""
from __future__ import annotations

from dataclasses import dataclass

from batch.core.state import Plan
from inference_stub import Request

__all__ = ["BatchItem", "batch_items"]


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request's work in one iteration.

    Attributes:
        request: the caller's ``Request`` (read-only for the backend).
        token_ids: the tokens to process now, in order: a prompt chunk, prompt + generated
            tokens being recomputed after a preemption, or the last generated token (a decode).
            Never empty.
        num_computed_tokens: the position of ``token_ids[0]`` in the sequence (prompt then
            generated tokens); positions ``0 .. num_computed_tokens - 1`` already have KV in
            the cache, written by earlier iterations of this request since its last admission.
        block_table: the KV block ids the request holds, final for this iteration. Position
            ``p`` lives in block ``block_table[p // block_tokens]`` at offset
            ``p % block_tokens``; it covers at least ``num_computed_tokens + len(token_ids)``
            positions.
        sample: the token produced after ``token_ids[-1]`` is kept (appended to
            ``request.generated``). When False (a non-final prefill chunk) the scheduler
            discards the token returned for this item.
    """

    request: Request
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_table: tuple[int, ...]
    sample: bool

    @property
    def num_new_tokens(self) -> int:
        """Tokens processed this iteration: ``len(token_ids)``."""
        return len(self.token_ids)


def _token_slice(req: Request, num_prompt_tokens: int, start: int, end: int) -> tuple[int, ...]:
    """Tokens ``start .. end - 1`` of prompt + generated, without copying the whole sequence."""
    gen = req.generated
    if start >= num_prompt_tokens:
        return tuple(gen[start - num_prompt_tokens:end - num_prompt_tokens])
    if end <= num_prompt_tokens:
        return tuple(req.prompt[start:end])
    return tuple(req.prompt[start:]) + tuple(gen[:end - num_prompt_tokens])


def batch_items(plan: Plan) -> list[BatchItem]:
    """The plan's batch as ``BatchItem``s, in batch order.

    Call after the plan's blocks are committed (``batch.core.step.commit``) and before
    ``step.apply``: block tables are then final and ``num_computed_tokens`` not yet advanced.
    """
    out: list[BatchItem] = []
    for seq, n in zip(plan.seqs, plan.num_new_tokens):
        start = seq.num_computed_tokens
        end = start + n
        out.append(BatchItem(request=seq.req, token_ids=_token_slice(seq.req, seq.num_prompt_tokens, start, end),
                             num_computed_tokens=start, block_table=tuple(seq.block_table),
                             sample=end == seq.num_tokens))
    return out
