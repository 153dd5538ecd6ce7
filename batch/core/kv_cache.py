"""The KV-cache block pool: concrete block ids from a free list (vLLM V1's ``BlockPool``,
nano-vllm's ``BlockManager``, reduced): allocation of whole blocks, ``free + used == cap``."""
from __future__ import annotations

from typing import Callable


class BlockPoolError(RuntimeError):
    """The pool's ledger was misused (double free, foreign block id): a scheduler bug."""


class BlockPool:
    """``num_blocks`` KV blocks with ids ``0..num_blocks-1`` (``ValueError`` if < 1). ``on_free`` is
    called with the ids after every ``free`` (a paged backend may poison them in tests).
    Invariant: ``spec.rules.ledger_consistent`` and ``kv_within_cap``. LIFO: freed blocks first."""

    __slots__ = ("num_blocks", "_free", "_is_free", "on_free")

    def __init__(self, num_blocks: int, on_free: Callable[[list[int]], None] | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_blocks
        self.on_free = on_free

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks: their ids, or ``None`` (nothing taken) when fewer are free;
        ``ValueError`` for ``n < 0``."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        for b in out:
            self._is_free[b] = 0
        return out

    def free(self, blocks: list[int]) -> None:
        """Return ``blocks``; ``BlockPoolError`` (nothing freed) for an unknown or free id."""
        for b in blocks:
            if not (0 <= b < self.num_blocks) or self._is_free[b]:
                raise BlockPoolError(f"block {b} is not an allocated block of this pool")
        if len(set(blocks)) != len(blocks):
            raise BlockPoolError(f"duplicate block ids in free(): {blocks}")
        for b in blocks:
            self._is_free[b] = 1
        self._free.extend(reversed(blocks))
        if self.on_free is not None:
            self.on_free(blocks)

    def reclaim(self, blocks: list[int]) -> None:
        """Take back these exact free ids (undo of a ``free``, for rollback); ``BlockPoolError``
        (nothing taken) if one is not free."""
        if any(not (0 <= b < self.num_blocks) or not self._is_free[b] for b in blocks):
            raise BlockPoolError(f"cannot reclaim {blocks}: not all free")
        want = set(blocks)
        self._free = [b for b in self._free if b not in want]
        for b in blocks:
            self._is_free[b] = 0

    def check(self, held: list[list[int]] | None = None) -> None:
        """The free list and map agree and, with ``held`` (every block table), each block is free or
        held by exactly one table; ``BlockPoolError`` naming what is inconsistent."""
        if len(set(self._free)) != len(self._free) or sum(self._is_free) != len(self._free):
            raise BlockPoolError("free list and free map disagree")
        if held is not None:
            seen = [b for table in held for b in table]
            if len(seen) + len(self._free) != self.num_blocks or len(set(seen) | set(self._free)) != self.num_blocks:
                raise BlockPoolError(
                    f"free ({len(self._free)}) + held ({len(seen)}) != cap ({self.num_blocks}) or a block is shared")
