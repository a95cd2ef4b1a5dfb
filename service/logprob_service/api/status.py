"""The one table from the server's error codes to gRPC statuses, and the retry hint on the wire."""

from __future__ import annotations

import asyncio

import grpc

from logprob_service.errors import ErrorCode, LogprobError

STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


def status_of(err: BaseException) -> grpc.StatusCode:
    """The status a request that raised ``err`` is answered with (anything unforeseen is a bug)."""
    if isinstance(err, LogprobError):
        return STATUS[err.code]
    if isinstance(err, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def trailing_metadata(err: LogprobError) -> tuple[tuple[str, str], ...]:
    """gRPC's standard retry hint (``grpc-retry-pushback-ms``), which clients with a retry policy honour."""
    if err.retry_after_s is None:
        return ()
    return (("grpc-retry-pushback-ms", str(max(1, round(err.retry_after_s * 1000)))),)
