"""Connection limits and timeouts for ``batch-llm serve``: what uvicorn does not bound by itself.

What uvicorn (0.54; its httptools or h11 protocol) bounds and what it leaves open, read in its
source (``uvicorn/protocols/http/*_impl.py``):

* ``timeout_keep_alive`` closes a connection left idle *after a response*. Nothing times out a
  connection that never sends a byte, nor one that sends its request head a byte at a time: both
  are held for ever (slowloris), each holding a file descriptor. With the usual soft limit of
  1,024 open files, 1,100 such sockets leave the server unable to accept anyone.
* ``limit_concurrency`` answers a request with a plain-text 503 once the connections (or tasks)
  reach the limit, but it still accepts and holds every connection: idle ones count against the
  limit, so a few hundred idle sockets make every honest request a 503.
* httptools (the parser uvicorn picks when it is installed) has no bound on a request head's size
  or header count; h11 bounds the head (``h11_max_incomplete_event_size``, 16 KiB by default).
* A request the parser refuses (a NUL byte in a header, ...) gets a plain-text 400.

``ConnectionGuard.protocol_class()`` subclasses the protocol uvicorn would use and adds:

* **a head timeout** (``timeout_headers``): a request head (request line and headers) must be
  complete within this many seconds of the connection's opening or of the previous response's
  end; else the connection is closed (``batch:http_header_timeouts_total``). A connection with a
  request running (a long stream) is never closed by it.
* **a cap on open connections** (``limit_concurrency``, uvicorn's name): a connection that would
  exceed it first closes the connection idle longest (no request running: one that never sent a
  complete head, or a keep-alive connection between requests;
  ``batch:http_connections_evicted_total``), so idle and slow sockets cannot lock anyone out; only
  when every open connection has a request running is the new one refused, with a 503 in OpenAI's
  error shape and ``connection: close`` (``batch:http_connections_refused_total``, and
  ``batch:request_rejected_total{code="503"}``). The cap is kept below the open-files limit
  (``FD_RESERVE`` descriptors spare), which ``raise_open_files_limit`` raises to its hard limit.
* **a cap on the request head** with vLLM's names: at most ``h11_max_incomplete_event_size`` bytes
  (request line and headers) and ``h11_max_header_count`` header lines, whichever parser runs; a
  larger head gets a 431 in OpenAI's shape and the connection is closed, before the parser holds it.
* **the parser's 400 in OpenAI's shape** (JSON, ``connection: close``), counted in
  ``batch:request_rejected_total{code="400"}``.

The idle keep-alive timeout stays uvicorn's (``timeout_keep_alive``). Everything here runs on the
event loop; ``ConnectionGuard.collect`` exports the counts to ``/metrics``.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["HttpLimits", "ConnectionGuard", "raise_open_files_limit", "open_files_limit", "FD_RESERVE",
           "DEFAULT_LIMIT_CONCURRENCY"]


#: Open connections when ``limit_concurrency`` is not given (then at most the open-files limit
#: less ``FD_RESERVE``).
DEFAULT_LIMIT_CONCURRENCY = 4096
#: File descriptors kept spare below the open-files limit for what is not a client connection
#: (the listening socket, log files, the tokenizer's files, Python's own).
FD_RESERVE = 64


@dataclass
class HttpLimits:
    """The connection limits and timeouts (``batch-llm serve``'s flags of the same names).

    Attributes:
        timeout_keep_alive: seconds an idle keep-alive connection is kept after a response
            (uvicorn's ``timeout_keep_alive``, vLLM's default 5).
        timeout_headers: seconds a request head may take, from the connection's opening or the
            previous response's end (> 0).
        limit_concurrency: most connections open at once (``None``: ``DEFAULT_LIMIT_CONCURRENCY``);
            kept below the open-files limit.
        h11_max_incomplete_event_size: largest request head (request line and headers), bytes;
            h11's default 16 KiB.
        h11_max_header_count: most header lines in a request head (vLLM's default 256).

    Raises:
        ValueError: a value that is not > 0 (the message names it).
    """

    timeout_keep_alive: float = 5.0
    timeout_headers: float = 10.0
    limit_concurrency: int | None = None
    h11_max_incomplete_event_size: int = 16 * 1024
    h11_max_header_count: int = 256

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_headers", "h11_max_incomplete_event_size",
                     "h11_max_header_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.limit_concurrency is not None and (isinstance(self.limit_concurrency, bool)
                                                   or self.limit_concurrency < 1):
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency!r}")


def open_files_limit() -> int | None:
    """The process's soft limit on open files (``None`` where there is no such limit to read)."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> tuple[int | None, int | None]:
    """Raise the process's soft limit on open files to its hard limit (as a server should: each
    connection holds a descriptor, and the usual soft limit of 1,024 is below what a few idle
    sockets can take). Returns ``(before, after)`` (``None`` where there is no such limit)."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # e.g. a hard limit above the kernel's nr_open
            pass
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _raw_error(status: int, reason: str, message: str, type: str = "invalid_request_error") -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode("ascii") + body


class ConnectionGuard:
    """The connection limits of one server and their counts (module doc).

    Args:
        limits: the limits.
        on_reject: called with the HTTP status of each answer the guard itself sends (400, 431,
            503), so that ``batch:request_rejected_total{code}`` counts it.

    Attributes:
        max_connections: the cap in force: ``limits.limit_concurrency`` (or the default), at most
            the open-files limit less ``FD_RESERVE`` (read when the guard is built).
        open, refused, evicted, header_timeouts, too_large, bad_requests: connections open now;
            refused at the cap; idle ones closed to make room; closed for a head not complete in
            time; heads over the size or count cap (431); heads the parser refused (400).
    """

    def __init__(self, limits: HttpLimits | None = None, on_reject: Callable[[int], None] | None = None) -> None:
        self.limits = limits or HttpLimits()
        cap = self.limits.limit_concurrency or DEFAULT_LIMIT_CONCURRENCY
        nofile = open_files_limit()
        if nofile is not None and cap > nofile - FD_RESERVE:
            cap = max(1, nofile - FD_RESERVE)
        self.max_connections = cap
        self.on_reject = on_reject or (lambda status: None)
        self.idle: dict[Any, None] = {}  # connections with no request running, longest idle first
        self.open = self.refused = self.evicted = self.header_timeouts = self.too_large = self.bad_requests = 0

    def protocol_class(self, base: type | None = None) -> type:
        """A subclass of ``base`` (default: the HTTP protocol uvicorn picks, httptools when
        installed, else h11) enforcing this guard; give it to ``uvicorn.Config(http=...)``."""
        if base is None:
            from uvicorn.protocols.http.auto import AutoHTTPProtocol

            base = AutoHTTPProtocol
        try:
            from uvicorn.protocols.http.h11_impl import H11Protocol
        except ImportError:  # pragma: no cover - h11 is a dependency of uvicorn
            H11Protocol = None
        mixin = _H11Guard if H11Protocol is not None and issubclass(base, H11Protocol) else _HttpToolsGuard
        return type(f"Guarded{base.__name__}", (mixin, base), {"_guard": self})

    def uvicorn_config(self, app: Any, base: type | None = None, **kwargs: Any) -> Any:
        """``uvicorn.Config(app, **kwargs)`` with this guard's protocol (over ``base``, as
        ``protocol_class``), keep-alive timeout and h11 head limit."""
        import uvicorn

        return uvicorn.Config(app, http=self.protocol_class(base), timeout_keep_alive=self.limits.timeout_keep_alive,
                              h11_max_incomplete_event_size=self.limits.h11_max_incomplete_event_size, **kwargs)

    def _evict_one(self) -> bool:
        """Close the connection idle longest; ``False`` when none is idle."""
        for proto in self.idle:  # noqa: B007 - the first (idle longest), used below
            break
        else:
            return False
        del self.idle[proto]
        self.evicted += 1
        proto.transport.close()
        return True

    def _refuse(self, transport: Any, status: int, data: bytes) -> None:
        self.on_reject(status)
        transport.write(data)
        transport.close()

    def collect(self) -> Iterator[Any]:
        """The guard's metric families (``prometheus_client`` collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("batch:http_connections", "HTTP connections open.", self.open)
        yield GaugeMetricFamily("batch:http_connections_limit", "Most HTTP connections open at once "
                                "(--limit-concurrency, below the open-files limit).", self.max_connections)
        yield CounterMetricFamily("batch:http_connections_refused", "Connections refused with a 503: the cap "
                                  "reached and every open connection running a request.", self.refused)
        yield CounterMetricFamily("batch:http_connections_evicted", "Idle connections (no request running) "
                                  "closed to make room for a new one at the cap.", self.evicted)
        yield CounterMetricFamily("batch:http_header_timeouts", "Connections closed because no complete request "
                                  "head arrived within --timeout-headers.", self.header_timeouts)


_REFUSED = _raw_error(503, "Service Unavailable", "too many connections open; retry later",
                      type="service_unavailable")
_TOO_LARGE = _raw_error(431, "Request Header Fields Too Large", "the request head (request line and headers) is "
                        "over this server's limit")
_BAD_REQUEST = _raw_error(400, "Bad Request", "invalid HTTP request (the request line or a header could not be "
                          "parsed)")
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


def _head_end(tail: bytes, data: bytes) -> int:
    """How many bytes of ``data`` belong to the head being read, up to and including the blank
    line that ends it (which may begin in ``tail``, the head's last bytes so far); -1 when the
    head does not end in ``data``."""
    end = -1
    for mark in _HEAD_ENDS:
        k = -1
        if tail:
            j = (tail + data[:len(mark) - 1]).find(mark)
            if j >= 0:
                k = j + len(mark) - len(tail)
        if k < 0:
            k = data.find(mark)
            if k >= 0:
                k += len(mark)
        if k >= 0 and (end < 0 or k < end):
            end = k
    return end


class _GuardBase(asyncio.Protocol):
    """What both parsers' guarded protocols share; ``_in_head`` (a request head is being read)
    is the parser's own, and so is the call of ``_head_complete``."""

    _guard: ConnectionGuard
    transport: Any
    cycle: Any

    def _in_head(self) -> bool:  # pragma: no cover - each subclass says
        raise NotImplementedError

    def _running(self) -> bool:
        """A request of this connection is running (its response not complete)."""
        return self.cycle is not None and not self.cycle.response_complete

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        g = self._guard
        super().connection_made(transport)  # type: ignore[misc]
        self._head_bytes = self._head_lines = 0
        self._head_tail = b""
        self._head_timer: asyncio.TimerHandle | None = None
        self._gone = False
        full = g.open >= g.max_connections
        g.open += 1
        if full and not g._evict_one():
            g.refused += 1
            g._refuse(transport, 503, _REFUSED)
            return
        g.idle[self] = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._gone:
            self._gone = True
            self._guard.open -= 1
            self._guard.idle.pop(self, None)
            self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._in_head() and not self._head_fits(data):
            g = self._guard
            g.too_large += 1
            self._cancel_head_timer()
            g._refuse(self.transport, 431, _TOO_LARGE)
            return
        super().data_received(data)  # type: ignore[misc]

    def _head_fits(self, data: bytes) -> bool:
        """Count ``data``'s part of the head being read; ``False`` once the head is over a cap."""
        end = _head_end(self._head_tail, data)
        part = len(data) if end < 0 else end
        self._head_bytes += part
        self._head_lines += data.count(b"\n", 0, part)
        if end < 0:
            self._head_tail = data[-3:] if len(data) >= 3 else (self._head_tail + data)[-3:]
        lim = self._guard.limits
        # the request line and the blank line end in a newline too
        return (self._head_bytes <= lim.h11_max_incomplete_event_size
                and self._head_lines <= lim.h11_max_header_count + 2)

    def _head_complete(self) -> None:
        """A request's head is in and its request starts: not idle, no head timer, counts reset."""
        self._head_bytes = self._head_lines = 0
        self._head_tail = b""
        self._cancel_head_timer()
        self._guard.idle.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self.transport.is_closing() or self._running():  # closing, or a pipelined request started
            return
        g = self._guard
        g.idle.pop(self, None)
        g.idle[self] = None  # idle from now: last in line for eviction
        self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request: a 400 in OpenAI's shape (uvicorn's is plain text)."""
        g = self._guard
        g.bad_requests += 1
        self._cancel_head_timer()
        g._refuse(self.transport, 400, _BAD_REQUEST)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(self._guard.limits.timeout_headers,
                                                                 self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._running():
            return
        self._guard.header_timeouts += 1
        self.transport.close()


class _HttpToolsGuard(_GuardBase):
    """httptools: a head is read from the connection's start, or a message's end, until the
    parser's ``on_headers_complete``."""

    _head_open = True

    def _in_head(self) -> bool:
        return self._head_open

    def on_headers_complete(self) -> None:
        self._head_open = False
        super().on_headers_complete()  # type: ignore[misc]
        self._head_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        self._head_open = True


class _H11Guard(_GuardBase):
    """h11: a head is read while the client's side is ``IDLE`` (no request event yet)."""

    def _in_head(self) -> bool:
        import h11

        return self.conn.their_state is h11.IDLE  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        was_in_head = self._in_head()
        super().data_received(data)
        if was_in_head and not self._in_head() and not self.transport.is_closing():
            self._head_complete()
