"""Domain errors, each with the gRPC status it is answered with.

Raised anywhere below the servicer; ``interceptors.ExceptionToStatusInterceptor`` (unary RPCs)
and the stream handler turn them into statuses. Messages name the field, the index, the bad
value and the limit, so a caller can fix the request without reading server logs.
"""

from __future__ import annotations

import asyncio

import grpc


class LogprobError(Exception):
    """Base of the errors a caller can act on."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable = False  # the clients' retry policy retries this status

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class InvalidArgument(LogprobError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(LogprobError):
    status = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(LogprobError):
    """The request is well-formed but the server's state does not allow it (yet)."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(LogprobError):
    """A weight update that ended before its commit; nothing of it was applied."""

    status = grpc.StatusCode.ABORTED


# Unavailable's retry hint. gRPC lets a call make at most 5 attempts, which its own backoff would
# spend within about a second; spaced by this hint they cover several seconds of a restart.
UNAVAILABLE_RETRY_S = 2.0


def _pushback(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """gRPC's standard retry hint, which clients with a retry policy honour."""
    return (("grpc-retry-pushback-ms", str(max(1, round(retry_after_s * 1000)))),)


class Overloaded(LogprobError):
    """The queue is over its token budget. Retryable, with a hint (``grpc-retry-pushback-ms``)."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry after {retry_after_s * 1000:.0f} ms")
        self.retry_after_s = retry_after_s

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return _pushback(self.retry_after_s)


class DeadlineExceeded(LogprobError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(LogprobError):
    """Not serving yet (loading, warming up) or any more (draining). Retryable, here once started
    or restarted, or elsewhere, with a hint of ``UNAVAILABLE_RETRY_S``."""

    status = grpc.StatusCode.UNAVAILABLE
    retryable = True

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return _pushback(UNAVAILABLE_RETRY_S)


class Unauthenticated(LogprobError):
    """No credentials, or credentials the server does not know."""

    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LogprobError):
    """Known credentials without the scope the method needs."""

    status = grpc.StatusCode.PERMISSION_DENIED


def status_of(err: BaseException) -> grpc.StatusCode:
    """The status a request that raised ``err`` is answered with (anything unforeseen is a bug)."""
    if isinstance(err, LogprobError):
        return err.status
    if isinstance(err, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL
