"""OpenAI's streaming chunks as server-sent events, shared by the single-process server
(``batch.server.app``) and the Ray Serve ingress (``batch.scaleout.ray_serve.Ingress``).

A stream is: for chat, a first chunk with the assistant's role; one chunk per token (its text
delta, ``finish_reason`` null); a last chunk with the finish reason; a usage chunk if the client
asked (``stream_options.include_usage``); then ``data: [DONE]``. An error mid-stream is one
``data: {"error": {...}}`` event in OpenAI's error shape, then the usage chunk if asked and
``[DONE]``. Standard library only (no web framework).
"""
from __future__ import annotations

import json

__all__ = ["ChunkFormat", "error_event", "DONE"]

#: The last event of every stream.
DONE = "data: [DONE]\n\n"


class ChunkFormat:
    """The ``data:`` events of one streamed response; every chunk has the same ``id``,
    ``object``, ``created`` and ``model``.

    Args:
        request_id: the response's ``id``.
        created: the response's creation, Unix seconds (one value for all its chunks).
        model_json: the model's name, already JSON-encoded (``json.dumps(name)``).
        chat: ``chat.completion.chunk`` events with ``delta`` (else ``text_completion`` with ``text``).
    """

    __slots__ = ("_head", "_usage_head", "chat")

    def __init__(self, request_id: str, created: int, model_json: str, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        rid = json.dumps(request_id)
        self.chat = chat
        self._usage_head = f'data: {{"id":{rid},"object":"{obj}","created":{created},"model":{model_json},'
        self._head = self._usage_head + '"choices":[{"index":0,'

    def role(self) -> str:
        """Chat's first event: the assistant's role, empty content."""
        return f'{self._head}"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n'

    def chunk(self, text: str, reason: str | None = None) -> str:
        """One event with the text delta ``text``; ``reason`` the finish reason on the last one."""
        r = "null" if reason is None else json.dumps(reason)
        if self.chat:
            return f'{self._head}"delta":{{"content":{json.dumps(text)}}},"logprobs":null,"finish_reason":{r}}}]}}\n\n'
        return f'{self._head}"text":{json.dumps(text)},"logprobs":null,"finish_reason":{r}}}]}}\n\n'

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The usage event (no choices), token counts."""
        u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
        return f'{self._usage_head}"choices":[],"usage":{json.dumps(u)}}}\n\n'


def error_event(message: str, type: str, param: str | None, code: str | int) -> str:
    """An error mid-stream: one event in OpenAI's error shape ``{"error": {message, type, param, code}}``."""
    return f"data: {json.dumps({'error': {'message': message, 'type': type, 'param': param, 'code': code}})}\n\n"
