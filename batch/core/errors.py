"""The scheduler's typed errors (re-exported by ``scheduler``): bad input is refused with one of
these and changes nothing; a failed backend call undoes its tick (``docs/reliability.md``)."""
from __future__ import annotations


class RequestError(ValueError):
    """A request was refused at ``submit``; the scheduler's state is unchanged."""


class InvalidRequestError(RequestError):
    """A field of the request is malformed (the message names the field and the rule)."""


class PromptTooLongError(RequestError):
    """The prompt (with its first output token's slot) needs more KV blocks than the cap."""


class DuplicateRequestError(RequestError):
    """This ``Request`` object is already in flight in this scheduler."""


class BackendError(RuntimeError):
    """``forward`` failed or answered malformed output; the tick was not applied.

    Attributes:
        request_ids: the ids of the batch that was passed to ``forward``.
    """

    def __init__(self, message: str, request_ids: list[str]) -> None:
        more = " ..." if len(request_ids) > 8 else ""
        super().__init__(f"{message} (batch of {len(request_ids)}: {request_ids[:8]}{more})")
        self.request_ids = request_ids
