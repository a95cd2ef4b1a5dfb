"""Errors a caller can act on, each with a protocol-neutral code.

Raised anywhere in the server; the gRPC edge maps each code to a status in one table
(``api/status.py``). Messages name the field, the index, the bad value and the limit, so a caller
can fix the request without reading server logs.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """What went wrong, in the caller's terms (the edge picks the wire status for each)."""

    INVALID_ARGUMENT = "the request is malformed or breaks a limit"
    NOT_FOUND = "no such model"
    FAILED_PRECONDITION = "the server's state does not allow it (yet)"
    ABORTED = "a weight update ended before its commit, or raced another"
    RESOURCE_EXHAUSTED = "over the queue's budget or the device's memory"
    DEADLINE_EXCEEDED = "the deadline passed before the work was done"
    UNAVAILABLE = "not serving yet, or any more"
    UNAUTHENTICATED = "no credentials, or unknown ones"
    PERMISSION_DENIED = "the credentials lack the scope"
    INTERNAL = "a bug"


# Unavailable's retry hint. gRPC lets a call make at most 5 attempts, which its own backoff would
# spend within about a second; spaced by this hint they cover several seconds of a restart.
UNAVAILABLE_RETRY_S = 2.0


class LogprobError(Exception):
    """Base of the errors a caller can act on. ``retry_after_s``: a hint for retryable ones."""

    code = ErrorCode.INTERNAL
    retryable = False  # the clients' retry policy retries this error's status
    retry_after_s: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(LogprobError):
    code = ErrorCode.INVALID_ARGUMENT


class ModelNotFound(LogprobError):
    code = ErrorCode.NOT_FOUND


class FailedPrecondition(LogprobError):
    """The request is well-formed but the server's state does not allow it (yet)."""

    code = ErrorCode.FAILED_PRECONDITION


class Aborted(LogprobError):
    """A weight update that ended before its commit; nothing of it was applied."""

    code = ErrorCode.ABORTED


class Overloaded(LogprobError):
    """The queue is over its token budget, or the work does not fit the device. Retryable, with a hint."""

    code = ErrorCode.RESOURCE_EXHAUSTED
    retryable = True

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry after {retry_after_s * 1000:.0f} ms")
        self.retry_after_s = retry_after_s


class DeadlineExceeded(LogprobError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Unavailable(LogprobError):
    """Not serving yet (loading, warming up) or any more (draining). Retryable, here once started
    or restarted, or elsewhere, after ``UNAVAILABLE_RETRY_S``."""

    code = ErrorCode.UNAVAILABLE
    retryable = True
    retry_after_s = UNAVAILABLE_RETRY_S


class Unauthenticated(LogprobError):
    """No credentials, or credentials the server does not know."""

    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(LogprobError):
    """Known credentials without the scope the method needs."""

    code = ErrorCode.PERMISSION_DENIED
