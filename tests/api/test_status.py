"""The one table from error codes to gRPC statuses covers every code, and retry hints go on the wire."""

from __future__ import annotations

import asyncio

import grpc
from logprob_service import errors
from logprob_service.api.status import STATUS, status_of, trailing_metadata


def test_every_error_code_has_a_status_of_the_same_name():
    assert set(STATUS) == set(errors.ErrorCode)
    assert all(status.name == code.name for code, status in STATUS.items())


def test_status_of_errors_cancellation_and_bugs():
    assert status_of(errors.InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(errors.Overloaded("x", retry_after_s=1.0)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(asyncio.CancelledError()) == grpc.StatusCode.CANCELLED
    assert status_of(KeyError("a bug")) == grpc.StatusCode.INTERNAL


def test_retry_hints_become_grpc_pushback():
    assert trailing_metadata(errors.Overloaded("full", retry_after_s=0.25)) == (("grpc-retry-pushback-ms", "250"),)
    assert trailing_metadata(errors.Unavailable("draining")) == (
        ("grpc-retry-pushback-ms", str(round(errors.UNAVAILABLE_RETRY_S * 1000))),
    )
    assert trailing_metadata(errors.InvalidArgument("bad")) == ()
