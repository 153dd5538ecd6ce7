"""Text <-> token ids for the server.

* ``WordTokenizer``: the simulated GPU's. Text in: the prompt is split on whitespace and each
  word becomes one token id, ``1 + crc32(word) % 63`` (ids 1..63, never the stub's EOS 0), so
  the prompt's length in tokens is its number of words. Text out: token ``t`` is the text
  ``" tok<t>"``; EOS (0) is no text. Deterministic, no vocabulary file.
* ``ByteTokenizer``: the tiny seeded Llama's (vocabulary 256): UTF-8 bytes in and out.
* ``HFTokenizer``: a Hugging Face tokenizer read from the model folder (``--model PATH``).

Every tokenizer has ``encode(text, limit=None) -> list[int]`` (with ``limit``, the simulated
tokenizers stop after ``limit + 1`` ids: enough to tell that a prompt is too long without
tokenizing all of it), ``decode(ids) -> str`` and
``chat_prompt(messages) -> str``; an ``IncrementalDecoder`` turns a growing token list into
text deltas for streaming.
"""
from __future__ import annotations

import zlib
from typing import Any, Protocol, Sequence

__all__ = ["Tokenizer", "WordTokenizer", "ByteTokenizer", "HFTokenizer", "IncrementalDecoder", "plain_chat_prompt"]


class Tokenizer(Protocol):
    """What the server needs of a tokenizer."""

    name: str

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of ``text``; with ``limit``, possibly only the first ``limit + 1`` of them
        (a tokenizer may ignore ``limit`` and return them all)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (EOS and special tokens left out)."""
        ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """One prompt text from ``[{"role", "content"}]`` messages."""
        ...


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """Messages as plain text: one ``role: content`` line each, then ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class WordTokenizer:
    """Whitespace words hashed to ids 1..63 in; ``" tok<id>"`` out (the simulated GPU's).

    Args:
        eos_token_id: the id that decodes to no text (the stub's EOS, 0).
    """

    name = "words-crc32-63"

    def __init__(self, eos_token_id: int = 0) -> None:
        self.eos_token_id = eos_token_id

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """One id per whitespace-separated word, ``1 + crc32(word) % 63``; ``[]`` for blank text.
        With ``limit``: the first ``limit + 1`` words at most (the rest is not split)."""
        words = text.split() if limit is None else text.split(None, limit + 1)[:limit + 1]
        return [1 + zlib.crc32(w.encode()) % 63 for w in words]

    def decode(self, ids: Sequence[int]) -> str:
        """``" tok<id>"`` per id, EOS left out."""
        return "".join(f" tok{t}" for t in ids if t != self.eos_token_id)

    chat_prompt = staticmethod(plain_chat_prompt)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (for the tiny seeded Llama, whose vocabulary is 256).

    Args:
        eos_token_id: the model's EOS id, left out of decoded text.
    """

    name = "utf8-bytes"

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """The UTF-8 bytes of ``text``; with ``limit``, the first ``limit + 1`` of them at most."""
        if limit is None:
            return list(text.encode())
        return list(text[:limit + 1].encode()[:limit + 1])  # a character is at least one byte

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes as UTF-8, undecodable ones as U+FFFD, EOS left out."""
        return bytes(t for t in ids if t != self.eos_token_id and 0 <= t < 256).decode(errors="replace")

    chat_prompt = staticmethod(plain_chat_prompt)


class HFTokenizer:
    """A Hugging Face tokenizer from a model folder (``AutoTokenizer``, local files only).

    Args:
        path: the checkpoint directory (with the tokenizer's files).

    Raises:
        OSError: the folder has no tokenizer (from ``transformers``).
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # the optional 'model' extra

        self.tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.encode_off_loop = True  # the server runs encode in a worker thread (it may be slow)
        self.name = f"hf:{path}"

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of ``text``, with the tokenizer's special tokens (BOS) as it adds them
        (all of them: ``limit`` is ignored)."""
        return list(self.tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens left out."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The tokenizer's chat template when it has one, else ``plain_chat_prompt``."""
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return plain_chat_prompt(messages)


class IncrementalDecoder:
    """Text deltas of a growing token list (streaming detokenization).

    ``push(token)`` returns the new text since the last call. Text that ends in an incomplete
    UTF-8 sequence (U+FFFD at the end) is held back until the next token completes it; ``flush``
    returns what is left. Decodes the whole output at each call (O(n) per token), which is
    cheap for the server's output lengths; ``WordTokenizer`` takes a shortcut (per-token text).
    """

    __slots__ = ("tok", "ids", "sent", "_words")

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.sent = 0
        self._words = isinstance(tok, WordTokenizer)

    def push(self, token: int) -> str:
        """Add ``token``; return the text it completes (possibly empty)."""
        if self._words:
            return self.tok.decode((token,))
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def flush(self) -> str:
        """Whatever is held back (an incomplete sequence at the very end), as decoded."""
        if self._words:
            return ""
        text = self.tok.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta
