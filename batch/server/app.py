"""The HTTP server: an OpenAI-compatible API on FastAPI over the engine thread.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each streaming with
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``, or not), ``GET
/v1/models``, ``GET /health`` (JSON: the scheduler's state and the engine's totals) and ``GET
/metrics`` (Prometheus). ``create_app`` builds the app; ``batch-llm serve`` runs it under uvicorn.

Request fields used: ``prompt`` (completions: a string, a list of token ids, or a list of
exactly one of those) or ``messages`` (chat), ``max_tokens`` (chat also
``max_completion_tokens``; default 16), ``stream``, ``stream_options.include_usage``,
``user``, ``model`` (must be the served name when given). Refused with a 400 naming the field,
as not implemented: ``n`` other than 1, ``best_of`` over 1, ``echo``, ``logprobs``,
``suffix``, a non-empty ``stop``. The sampling parameters (``temperature``, ``top_p``,
``presence_penalty``, ``frequency_penalty``, ``seed``, ...) are checked (type and range, a 400
naming the field) and then ignored: decoding is the backend's (the simulated GPU's draw, or the
model's greedy argmax). ``stream_options`` without ``"stream": true`` is a 400.

Authentication and the fairness identity (the scheduler's ``user_id``) follow
``batch.server.auth.Identities``: with ``api_keys`` configured, every ``/v1`` route needs a
listed key (``Authorization: Bearer KEY``; else 401 ``invalid_api_key``, checked before the body
is read) and the identity is the key's user; without keys, the body's ``user`` only with
``trust_user_field``, a trusted gateway's header with ``user_header``, else ``"anonymous"`` for
every request. ``/health`` is always open; ``/metrics`` needs a key when ``metrics_need_key`` (by
default whenever keys are configured), and ``/docs``, ``/redoc`` and ``/openapi.json`` are off then.
Connection limits (head timeout, connection cap, head size) are ``batch.server.limits``'s, through
``app.state.guard``.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 401 without a
valid key (code ``invalid_api_key``), 415 for a body whose ``content-type`` is not JSON, 400 for a
body that is not JSON whatever its bytes (``parse_json``: huge integers, deep nesting, invalid
UTF-8 included) or fails validation (strict types, finite floats; ``param`` names the field), 400 for
text that is not valid Unicode (a lone surrogate), 400 for an option not implemented (``n``,
``best_of``, ``echo``, ``logprobs``, ``suffix``, ``stop``), 400 for a prompt that can never fit
(the message names the limit), 413 for a body over ``max_body_bytes``, 404 for an unknown
model (code ``model_not_found``) or path, 429 with ``Retry-After`` when ``max_waiting``
requests already wait for their first token, 503 when the engine thread is down, 500
``server_error`` for any exception a handler did not expect. Each error answer is counted in
``batch:request_rejected_total{code}`` by the app's error handlers. A client that closes its
connection while still sending the body is counted as 499 (client closed request), with one log
line and no traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      model_validator)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from batch.server.auth import AuthError, Identities, KeyRing
from batch.server.engine import Engine, EngineFailed, SeededGPU, ServedRequest, TokenEvent, TokenSink
from batch.server.limits import ConnectionGuard, HttpLimits
from batch.server.metrics import CONTENT_TYPE, ServerMetrics
from batch.server.sse import DONE, ChunkFormat, error_event
from batch.server.tokenizer import IncrementalDecoder, Tokenizer
from scheduler import RequestError

__all__ = ["ServerConfig", "ApiError", "ClientClosed", "CompletionBody", "create_app", "parse_json", "read_json_body",
           "validation_error"]

#: ``max_tokens`` when the body gives none (OpenAI's default for completions).
DEFAULT_MAX_TOKENS = 16
#: Largest token id a prompt may hold when the backend has no vocabulary to bound it (the
#: simulated GPU): a signed 32-bit int, as a real vocabulary's ids are.
MAX_TOKEN_ID = 2**31 - 1

log = logging.getLogger("batch.server")


@dataclass
class ServerConfig:
    """What the HTTP layer needs beside the engine.

    Attributes:
        model_name: the served model's name (``/v1/models``; a request's ``model`` must match).
        max_waiting: most requests accepted and still waiting for their first token; one more
            gets 429 (backpressure). >= 1.
        retry_after_s: the ``Retry-After`` header of a 429, whole seconds.
        api_keys: API key -> user name; non-empty: every ``/v1`` request needs one of these
            keys (401 otherwise) and its user is the request's fairness identity.
        seed_by_prompt: key the simulated GPU's tokens by the prompt (``SeededGPU``).
        max_body_bytes: largest request body read; a larger one gets 413 before it is parsed.
        trust_user_field: without ``api_keys``, the body's ``user`` is the fairness identity
            (for a trusted front end that sets it); refused with ``api_keys``.
        user_header: without ``api_keys``, the fairness identity is this request header's value,
            set by a trusted gateway (``None``: off); refused with ``api_keys``.
        metrics_need_key: ``/metrics`` needs a configured key too; ``None`` (the default): when
            ``api_keys`` are configured; ``True`` needs ``api_keys``; ``False``: open.
        max_user_labels: how many users (configured or not) get their own per-user metric label;
            later ones are counted under ``user="other"``.
        limits: connection limits and timeouts (``batch.server.limits``), enforced when the app
            is served with ``app.state.guard.uvicorn_config(app, ...)`` (``batch-llm serve`` does).
        disable_fastapi_docs: no ``/docs``, ``/redoc`` nor ``/openapi.json`` (vLLM's flag);
            they are off anyway when ``api_keys`` are configured.
        auth_failure_delay_s: a 401 is answered after this many seconds (>= 0): a client
            flooding made-up keys on one connection gets at most ``1 / auth_failure_delay_s``
            answers a second, each costing the server the same as before, for nothing.
        metrics_min_interval_s: ``/metrics`` renders at least this far apart (>= 0): each scrape
            gets a render begun after it arrived (never a stale one), concurrent scrapes share
            one, so scrapers in a loop cost at most one render per interval.
    """

    model_name: str = "batch-sim"
    max_waiting: int = 2048
    retry_after_s: int = 1
    api_keys: Mapping[str, str] | KeyRing = field(default_factory=dict)
    seed_by_prompt: bool = True
    max_body_bytes: int = 4 * 1024 * 1024
    trust_user_field: bool = False
    user_header: str | None = None
    metrics_need_key: bool | None = None
    max_user_labels: int = 100
    limits: HttpLimits = field(default_factory=HttpLimits)
    disable_fastapi_docs: bool = False
    auth_failure_delay_s: float = 0.1
    metrics_min_interval_s: float = 0.1


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape.

    Args:
        status: HTTP status.
        message: what is wrong (names the limit or field).
        type: OpenAI's error type (``invalid_request_error``, ...).
        param: the offending field, or ``None``.
        headers: extra response headers (``Retry-After``).
        code: the error's ``code`` (OpenAI's, e.g. ``"model_not_found"``); default: ``status``.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers
        self.code = status if code is None else code

    @classmethod
    def of(cls, e: AuthError) -> "ApiError":
        """The answer to an identity error: a 401 carries ``WWW-Authenticate: Bearer``."""
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return cls(e.status, e.message, param=e.param, headers=headers, code=e.code)

    def response(self) -> JSONResponse:
        """The JSON response: ``{"error": {"message", "type", "param", "code"}}``."""
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


# ---------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the token counts)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class _Body(BaseModel):
    """The fields both endpoints read; strict types (no coercion: ``"5"``, ``true`` or ``2.0``
    is not an int, ``"yes"`` or ``1`` not a bool); ``null`` is the default."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # sampling parameters: checked as OpenAI (and vLLM) check them, then ignored (decoding is the backend's)
    temperature: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=1)
    presence_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2, le=2)
    seed: StrictInt | None = None
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=1)
    repetition_penalty: StrictFloat | StrictInt | None = Field(default=None, gt=0)
    # OpenAI fields this server does not implement: refused (400) unless absent or neutral
    n: StrictInt | None = None
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    logprobs: StrictBool | StrictInt | None = None
    suffix: StrictStr | None = None
    stop: StrictStr | list[StrictStr] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Body":
        if self.stream_options is not None and self.stream is not True:
            raise ValueError("stream_options: only allowed with \"stream\": true")
        return self

    def check_supported(self) -> None:
        """Raise a 400 naming the field for an option this server would otherwise ignore:
        ``n`` != 1, ``best_of`` > 1, ``echo``, ``logprobs``, ``suffix`` or a non-empty ``stop``."""
        for param, unsupported, what in (
                ("n", self.n is not None and self.n != 1, "only n = 1 is supported"),
                ("best_of", self.best_of is not None and self.best_of > 1, "only best_of = 1 is supported"),
                ("echo", bool(self.echo), "echo is not supported"),
                ("logprobs", self.logprobs is not None and self.logprobs is not False, "logprobs are not supported"),
                ("suffix", bool(self.suffix), "suffix is not supported"),
                ("stop", bool(self.stop), "stop sequences are not supported")):
            if unsupported:
                raise ApiError(400, f"{param}: {what} by this server", param=param)


class CompletionBody(_Body):
    """``/v1/completions``: ``prompt`` is text, token ids, or a list of exactly one of those."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class ChatMessage(BaseModel):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    """``/v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


async def _body(model: Any, request: Request, max_body_bytes: int, srv: Any) -> Any:
    """The request's body as ``model`` (``CompletionBody`` or ``ChatBody``), checked: valid JSON
    within ``max_body_bytes``, the model's fields, no unsupported option, the served model.

    Raises:
        ApiError: the OpenAI-style error for whichever check failed (400, 404 or 413).
    """
    try:
        body = model.model_validate(await read_json_body(request, max_body_bytes))
    except ValidationError as e:
        raise validation_error(e) from None
    body.check_supported()
    srv.check_model(body.model)
    return body


def validation_error(e: ValidationError) -> ApiError:
    """The first validation error as a 400 naming the top-level field (``param``); a check of the
    whole body (``stream_options`` without ``stream``) names the field its message starts with."""
    err = e.errors()[0]
    loc = err.get("loc", ())
    param = str(loc[0]) if loc else None
    if param == "prompt":
        msg = "must be a string, a list of token ids, or a list of one of those"
    elif param is None and err.get("type") == "value_error":
        text = str(err.get("ctx", {}).get("error", err.get("msg", "invalid")))
        param = text.split(":", 1)[0]
        return ApiError(400, text, param=param)
    else:
        where = ".".join(str(x) for x in loc[1:])
        msg = f"{where + ': ' if where else ''}{err.get('msg', 'invalid')}"
    return ApiError(400, f"{param or 'body'}: {msg}", param=param)


def _check_text(text: str, param: str) -> str:
    """``text`` if it encodes as UTF-8; else a 400 naming ``param`` (JSON may carry a lone
    surrogate such as ``"\\ud800"``, which no tokenizer can encode)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: not valid Unicode text ({e.reason} at position {e.start})",
                       param=param) from None
    return text


def _text_of(m: ChatMessage) -> str:
    """The text of a message; a text part whose ``text`` is not a string is a 400 (``str()`` of
    an arbitrarily nested value could not be bounded)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for p in m.content:
        if p.get("type") == "text":
            text = p.get("text", "")
            if not isinstance(text, str):
                raise ApiError(400, "messages: a text part's \"text\" must be a string", param="messages")
            parts.append(text)
    return "".join(parts)


# ---------------------------------------------------------------- the app


class _Server:
    """The app's state: engine, tokenizer, metrics, the waiting count."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, cfg: ServerConfig) -> None:
        if cfg.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {cfg.max_waiting}")
        if cfg.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {cfg.max_body_bytes}")
        for name in ("auth_failure_delay_s", "metrics_min_interval_s"):
            if not 0 <= getattr(cfg, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(cfg, name)!r}")
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.identities = Identities(cfg.api_keys, trust_user_field=cfg.trust_user_field, user_header=cfg.user_header)
        if cfg.metrics_need_key and not self.identities.required:
            raise ValueError("metrics_need_key needs api_keys: there is no key to ask for")
        self.metrics_need_key = self.identities.required if cfg.metrics_need_key is None else cfg.metrics_need_key
        self.metrics = ServerMetrics(engine, cfg.max_user_labels)
        rejected = self.metrics.rejected
        self.guard = ConnectionGuard(cfg.limits, on_reject=lambda status: rejected.labels(str(status)).inc())
        self.metrics.registry.register(self.guard)
        self.metrics_text = SpacedRenders(self.metrics.render, cfg.metrics_min_interval_s)
        self.waiting = 0  # accepted, no first token or end yet (event loop only)
        self.created = int(time.time())
        self.max_prompt_tokens = engine.scheduler.config.max_model_len_tokens - 1
        engine.on_tick = self._on_tick
        self._model_json = json.dumps(cfg.model_name)

    def _on_tick(self, events: list[tuple[TokenSink, TokenEvent]], iteration_s: float) -> None:
        for sink, _ in events:
            if not sink.released:
                sink.released = True
                self.waiting -= 1
        self.metrics.observe_tick(events, iteration_s)

    # ------------------------------------------------------------ request handling

    def authenticate(self, request: Request) -> str | None:
        """Before the body is read: the identity the headers give (the key's user, or a trusted
        gateway's header), or ``None`` when the body's ``user`` decides (``Identities``).

        Raises:
            ApiError: 401 without a valid key when keys are configured; 400 for a bad header.
        """
        try:
            return self.identities.authenticate(request.headers)
        except AuthError as e:
            raise ApiError.of(e) from None

    def user_of(self, principal: str | None, body_user: str | None) -> str:
        """The fairness identity: ``principal`` when the headers decided, else the body's
        ``user`` (trusted only with ``trust_user_field``), else ``anonymous``.

        Raises:
            ApiError: 400 naming ``user`` for a trusted ``user`` that is too long.
        """
        try:
            return self.identities.user(principal, body_user)
        except AuthError as e:
            raise ApiError.of(e) from None

    def check_model(self, model: str | None) -> None:
        """Raise a 404 ``ApiError`` unless ``model`` is ``None`` or the served name."""
        if model is not None and model != self.cfg.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                           param="model", code="model_not_found")

    async def tokenize(self, text: str | None = None, messages: list[dict[str, str]] | None = None) -> list[int]:
        """Token ids of ``text``, or of the chat prompt of ``messages``. The simulated tokenizers
        stop past ``max_prompt_tokens`` (enough to refuse a prompt too long); a tokenizer with
        ``encode_off_loop`` (Hugging Face's) runs in a worker thread, off the event loop."""
        tok, limit = self.tok, self.max_prompt_tokens

        def run() -> list[int]:
            return tok.encode(tok.chat_prompt(messages) if messages is not None else text, limit)

        if getattr(tok, "encode_off_loop", False):
            return await asyncio.get_running_loop().run_in_executor(None, run)
        return run()

    def too_long(self, n_tokens: int) -> ApiError:
        """The 400 for a prompt over ``max_prompt_tokens`` (``max_prompt_tokens + 1``: counting
        stopped there, so the message says "more than")."""
        s, limit = self.engine.scheduler, self.max_prompt_tokens
        n = f"more than {limit}" if n_tokens == limit + 1 else str(n_tokens)
        return ApiError(400, f"prompt: {n} tokens; this server's limit is {limit} prompt tokens (KV cache "
                             f"{s.config.kv_cap_blocks} blocks x {s.config.block_tokens} tokens = {s.config.max_model_len_tokens}, "
                             f"one slot kept for the first output token)", param="prompt")

    async def prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a completion prompt (text or ids; a list of one of them)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: a list of {len(prompt)} prompts; this server takes one per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.tokenize(_check_text(prompt, "prompt"))
        if len(prompt) > self.max_prompt_tokens:
            raise self.too_long(len(prompt))
        vocab = self.engine.scheduler.vocab_size
        top = MAX_TOKEN_ID if vocab is None else vocab - 1
        for t in prompt:
            if not 0 <= t <= top:
                shown = str(t) if -10**20 < t < 10**20 else f"{str(t)[:12]}... ({len(str(abs(t)))} digits)"
                raise ApiError(400, f"prompt: token id {shown} outside 0..{top}", param="prompt")
        return list(prompt)

    def admit(self, ids: list[int], max_tokens: int, user: str, prefix: str, stream: bool) -> TokenSink:
        """Check a prompt's size and the backpressure; submit to the engine.

        Raises:
            ApiError: 400 empty or too long a prompt (naming the limit), 429 queue full, 503
                engine down.
        """
        if not self.engine.alive:
            raise ApiError(503, "the engine is not running", type="service_unavailable")
        if not ids:
            raise ApiError(400, "prompt: empty (it must hold at least one token)", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise self.too_long(len(ids))
        if self.waiting >= self.cfg.max_waiting:
            raise ApiError(429, f"server busy: {self.waiting} requests already wait for their first token "
                                f"(max_waiting = {self.cfg.max_waiting}); retry later",
                           type="rate_limit_error", headers={"Retry-After": str(self.cfg.retry_after_s)})
        rid = self.engine.next_id(prefix)
        req = ServedRequest(user_id=user, prompt=ids, max_tokens=max_tokens, request_id=rid,
                            seed_key=SeededGPU.prompt_key(ids) if self.cfg.seed_by_prompt else "")
        self.waiting += 1
        self.metrics.prompt_tokens.labels(self.metrics.user_label(user)).inc(len(ids))
        return self.engine.submit(req, stream)

    def abort(self, sink: TokenSink) -> None:
        """Abort a request whose client went away (no-op if it ended)."""
        if not sink.done:
            self.engine.abort(sink)


class SpacedRenders:
    """Renders of a text (``/metrics``) at least ``min_interval_s`` apart, each in a worker thread
    (off the event loop), shared by the callers that wait for the same render.

    ``get`` returns a render begun after the call (never an older one): a call joins the render
    waiting for its turn if there is one, else starts one, which waits until ``min_interval_s``
    after the previous render's end. So any number of callers in a loop cost at most one render
    per ``min_interval_s`` (plus their HTTP requests), and a lone caller waits at most that long.

    Args:
        render: the render (thread-safe; called in the loop's default executor).
        min_interval_s: seconds between a render's end and the next one's start (>= 0).
    """

    def __init__(self, render: Any, min_interval_s: float) -> None:
        self.render, self.min_interval_s = render, min_interval_s
        self._next: asyncio.Future | None = None  # the render not yet begun, which new callers join
        self._last: asyncio.Future | None = None  # the latest render task (begun or not)
        self._free_at = 0.0  # loop time the next render may begin
        self.renders = 0

    async def get(self) -> Any:
        """A render begun after this call."""
        if self._next is None:
            self._next = self._last = asyncio.ensure_future(self._run(self._last))
        return await asyncio.shield(self._next)

    async def _run(self, previous: asyncio.Future | None) -> Any:
        loop = asyncio.get_running_loop()
        if previous is not None:
            await asyncio.wait((previous,))  # one render at a time
        wait = self._free_at - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self._next = None  # from here on, a new caller waits for the next render: this one began before it
        try:
            return await loop.run_in_executor(None, self.render)
        finally:
            self.renders += 1
            self._free_at = loop.time() + self.min_interval_s


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (or the response is complete: uvicorn says so too)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class ClientClosed(ApiError):
    """The client closed its connection while still sending the body: 499 (nginx's "client
    closed request"), not a server error; nobody reads the answer."""

    def __init__(self, message: str) -> None:
        super().__init__(499, message, code=499)


def _json_media_type(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type (parameters such as ``charset`` allowed)."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed as JSON, or a 400 whatever it holds: not JSON, not UTF-8 (nor UTF-16/32),
    an integer over Python's 4,300-digit conversion limit (a ``ValueError`` inside the parser),
    nesting too deep for the parser (``RecursionError``). ``NaN`` and ``Infinity`` parse (Python's
    reading); the body models refuse them in any field they read (``allow_inf_nan=False``).

    Raises:
        ApiError: 400 ``invalid_request_error``.
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON here: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int-str digit limit
        msg = str(e)
        if "integer string conversion" in msg:
            msg = f"an integer over {sys.get_int_max_str_digits()} digits"
        elif len(msg) > 200:
            msg = msg[:200] + "..."
        raise ApiError(400, f"the body is not valid JSON: {msg}") from None


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The body parsed as JSON (``parse_json``); 415 unless ``content-type`` is JSON (so a web
    page cannot post ``text/plain`` to the server without a CORS preflight), 413 past
    ``max_bytes`` (by ``Content-Length`` before reading, or by the bytes read), 400 if it is not
    JSON, 499 when the client closes the connection before the body's end (logged as one line).

    Raises:
        ApiError: 415, 413 or 400, as above; ``ClientClosed`` (499) (the replicas' ``Ingress``
            answers with them too).
    """
    content_type = request.headers.get("content-type", "")
    if not _json_media_type(content_type):
        shown = content_type[:80] if content_type.isprintable() else repr(content_type[:80])
        raise ApiError(415, f"content-type must be application/json, got {shown or 'none'}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the body is {int(declared)} bytes; this server's limit is {max_bytes} bytes")
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > max_bytes:
                raise ApiError(413, f"the body is over this server's limit of {max_bytes} bytes")
            parts.append(part)
    except ClientDisconnect:
        of = f" of {int(declared)}" if declared.isdigit() else ""
        msg = f"client closed the connection while sending the body ({size}{of} bytes read)"
        log.warning("%s %s: %s: answered 499", request.method, request.url.path, msg)
        raise ClientClosed(msg) from None
    return parse_json(b"".join(parts))


def create_app(engine: Engine, tokenizer: Tokenizer, cfg: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app over ``engine`` (started by the app's lifespan, stopped at shutdown).

    Args:
        engine: an ``Engine`` not yet started.
        tokenizer: text <-> ids for the engine's backend (``batch.server.tokenizer``).
        cfg: the HTTP layer's settings (``ServerConfig()`` by default).

    Returns:
        The app; ``app.state.server`` holds its state (``engine``, ``metrics``, ``waiting``).
    """
    cfg = cfg or ServerConfig()
    srv = _Server(engine, tokenizer, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        """Start the engine thread on this loop; at shutdown stop it (live requests aborted)."""
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    docs = not (cfg.disable_fastapi_docs or srv.identities.required)  # no API description for anonymous readers
    app = FastAPI(title="Batch", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.server = srv
    app.state.guard = srv.guard

    # Every error answer goes through one of these handlers, which count it in
    # batch:request_rejected_total{code} (the one place where requests refused are counted).
    rejected = srv.metrics.rejected

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        rejected.labels(str(e.status)).inc()
        if e.status == 401 and cfg.auth_failure_delay_s:  # a tarpit for made-up keys (ServerConfig)
            await asyncio.sleep(cfg.auth_failure_delay_s)
        return e.response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        # Any exception a handler did not expect (a bug): OpenAI's shape, never plain text.
        # Starlette re-raises it after sending this, so uvicorn still logs its traceback.
        return await _api_error(request, ApiError(500, f"internal server error: {type(e).__name__}",
                                                  type="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return await _api_error(request, ApiError(e.status_code, str(e.detail)))

    @app.get("/health")
    async def health() -> JSONResponse:
        """The scheduler's state and the engine's totals (JSON); 503 when the engine is down."""
        s = engine.snapshot
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "error", "engine_alive": ok,
                             "engine_error": None if engine.error is None else repr(engine.error),
                             "running": s.running, "waiting": s.waiting, "kv_blocks_used": s.kv_blocks_used,
                             "kv_cap_blocks": s.kv_cap_blocks, "active": s.active, "in_flight": s.in_flight,
                             "submitted": s.submitted, "finished": s.finished, "aborted": s.aborted,
                             "refused": s.refused, "finish_reasons": s.finish_reasons, "ticks": s.ticks,
                             "busy_s": s.busy_s, "http_waiting": srv.waiting,
                             "backend_errors": engine.backend_errors,
                             "last_backend_error": engine.last_backend_error},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Every metric in Prometheus' text format (``batch.server.metrics``); a 401 without a
        configured key when ``metrics_need_key`` (by default when keys are configured)."""
        if srv.metrics_need_key:
            try:
                srv.identities.check_key(request.headers)
            except AuthError as e:
                raise ApiError.of(e) from None
        return Response(await srv.metrics_text.get(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        """The one served model, OpenAI's list shape."""
        srv.authenticate(request)
        return JSONResponse({"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                                         "created": srv.created, "owned_by": "batch"}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's completions: a ``text_completion`` object, or its chunks as server-sent events."""
        principal = srv.authenticate(request)  # before the body is read
        body = await _body(CompletionBody, request, cfg.max_body_bytes, srv)
        user = srv.user_of(principal, body.user)
        ids = await srv.prompt_ids(body.prompt)
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
        sink = srv.admit(ids, max_tokens, user, "cmpl", bool(body.stream))
        return await _respond(srv, request, sink, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        """OpenAI's chat completions: a ``chat.completion`` object, or ``chat.completion.chunk`` events."""
        principal = srv.authenticate(request)  # before the body is read
        body = await _body(ChatBody, request, cfg.max_body_bytes, srv)
        user = srv.user_of(principal, body.user)
        msgs = [{"role": _check_text(m.role, "messages"), "content": _check_text(_text_of(m), "messages")}
                for m in body.messages]
        ids = await srv.tokenize(messages=msgs)
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        sink = srv.admit(ids, max_tokens, user, "chatcmpl", bool(body.stream))
        return await _respond(srv, request, sink, body, chat=True)

    return app


def _event_error(error: Exception) -> ApiError:
    """The error of a request's error event: the scheduler refused it (400
    ``invalid_request_error``), the engine is down (503 ``service_unavailable``), or anything
    else (500 ``server_error``)."""
    if isinstance(error, RequestError):
        return ApiError(400, str(error))
    if isinstance(error, EngineFailed):
        return ApiError(503, str(error), type="service_unavailable")
    return ApiError(500, str(error), type="server_error")


def _usage(sink: TokenSink) -> dict[str, int]:
    n_prompt, n_out = len(sink.request.prompt), len(sink.request.generated)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


async def _respond(srv: _Server, request: Request, sink: TokenSink, body: _Body, chat: bool) -> Response:
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(srv, sink, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watch = asyncio.ensure_future(_wait_disconnect(request))
    done_wait = asyncio.ensure_future(sink.finished.wait())
    try:
        await asyncio.wait((watch, done_wait), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        done_wait.cancel()
        if not sink.done:  # the client went away (or the handler was cancelled): free its blocks
            srv.abort(sink)
    if not sink.done:
        return Response(status_code=499)  # nobody reads it
    final = sink.final
    assert final is not None
    if final.error is not None:  # refused by the scheduler (400), or the engine died (503)
        raise _event_error(final.error)
    if final.finish_reason == "error":
        raise ApiError(500, "the backend failed on this request's batch (after retries)", type="server_error")
    req = sink.request
    text = srv.tok.decode(req.generated)
    rid, created, model = req.request_id, int(time.time()), srv.cfg.model_name
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": final.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                         "usage": _usage(sink)})


async def _stream(srv: _Server, sink: TokenSink, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body (``batch.server.sse``): one ``data:`` chunk per token (events already queued
    are sent in one write), a last chunk with the finish reason, a usage chunk if asked, then
    ``data: [DONE]``. If the client goes away, Starlette cancels this generator and ``finally``
    aborts the request."""
    req = sink.request
    fmt = ChunkFormat(req.request_id, int(time.time()), srv._model_json, chat)  # one creation time for all chunks
    chunk = fmt.chunk
    dec = IncrementalDecoder(srv.tok)
    q = sink.queue
    try:
        if chat:
            yield fmt.role()
        final: TokenEvent | None = None
        while final is None:
            evs = [await q.get()]
            while not q.empty():
                evs.append(q.get_nowait())
            out = []
            for ev in evs:
                if ev.error is not None:
                    e = _event_error(ev.error)
                    out.append(error_event(e.message, e.type, e.param, e.code))
                    final = ev
                    break
                text = dec.push(ev.token) if ev.token is not None else ""
                if ev.finish_reason is not None:
                    final = ev
                    out.append(chunk(text + dec.flush(), ev.finish_reason))
                    break
                out.append(chunk(text, None))
            yield "".join(out)
        if include_usage:
            u = _usage(sink)
            yield fmt.usage(u["prompt_tokens"], u["completion_tokens"])
        yield DONE
    finally:
        srv.abort(sink)
