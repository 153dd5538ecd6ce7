"""``uvicorn.Server`` with a bounded, clean shutdown for ``batch-llm serve``.

On the first SIGINT or SIGTERM, uvicorn stops accepting connections and waits for the open ones
to finish, up to ``timeout_graceful_shutdown`` seconds, before the app's lifespan shutdown.
A stream may run for minutes, so ``GracefulServer`` first stops the engine: every request still
in flight is aborted (a stream ends with a last chunk whose ``finish_reason`` is ``"abort"``,
then ``data: [DONE]``; a non-streaming request answers its text so far with that finish
reason), submits still queued get 503, and new requests 503; then uvicorn's wait ends as soon
as those responses are written. It prints one line to stderr when it begins. A second signal
does not force the exit (uvicorn's forced exit skips the lifespan shutdown and prints a
traceback per open task); the shutdown is bounded by the timeout.
"""
from __future__ import annotations

import socket
import sys
from types import FrameType

import uvicorn

from batch.server.engine import Engine

__all__ = ["GracefulServer"]


class GracefulServer(uvicorn.Server):
    """A ``uvicorn.Server`` that aborts the engine's requests as its shutdown begins.

    Args:
        config: uvicorn's config (its ``timeout_graceful_shutdown`` bounds the wait).
        engine: the app's engine.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A first signal starts the shutdown; a later one changes nothing (uvicorn's forced
        exit would skip the lifespan shutdown and print a traceback per open task; the
        shutdown is bounded by ``timeout_graceful_shutdown`` anyway)."""
        if not self.should_exit:
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Abort every request in flight (their responses end at once), then uvicorn's shutdown."""
        n = self.engine.snapshot.in_flight
        print(f"batch-llm serve: shutting down: aborting {n} request(s) in flight (waiting at most "
              f"{self.config.timeout_graceful_shutdown} s for their responses)", file=sys.stderr, flush=True)
        self.engine.begin_stop()
        await super().shutdown(sockets)
