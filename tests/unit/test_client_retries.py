"""The client retries UNAVAILABLE and RESOURCE_EXHAUSTED (gRPC retry policy) and nothing else."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from logprob_client import InvalidRequest, LogprobClient, Overloaded, Unavailable
from logprob_client._proto import logprob_pb2 as pb
from logprob_client._proto import logprob_pb2_grpc as pb_grpc

from tests.fake_server import serving


class Flaky(pb_grpc.LogprobServiceServicer):
    """Fails the first ``failures`` calls with ``code``, then answers."""

    def __init__(self, code: grpc.StatusCode, failures: int) -> None:
        self.code, self.failures, self.calls = code, failures, 0

    async def ScoreTokens(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(
                self.code, f"failure {self.calls}", trailing_metadata=(("grpc-retry-pushback-ms", "10"),)
            )
        return pb.ScoreResponse(request_id=request.request_id, scores=[pb.SequenceScores(logprobs=[-1.5])])


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
async def test_retryable_statuses_are_retried_until_success(code):
    servicer = Flaky(code, failures=2)
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=10) as client:
            out = await asyncio.to_thread(client.score, [[1]], [[2]])
        assert out[0].tolist() == [-1.5] and servicer.calls == 3


async def test_retries_stop_after_max_attempts():
    servicer = Flaky(grpc.StatusCode.RESOURCE_EXHAUSTED, failures=100)
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=10, max_attempts=3) as client, pytest.raises(Overloaded, match="failure 3"):
            await asyncio.to_thread(client.score, [[1]], [[2]])
        assert servicer.calls == 3


async def test_invalid_argument_is_not_retried():
    servicer = Flaky(grpc.StatusCode.INVALID_ARGUMENT, failures=100)
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=10) as client, pytest.raises(InvalidRequest):
            await asyncio.to_thread(client.score, [[1]], [[2]])
        assert servicer.calls == 1


async def test_one_attempt_means_no_retries():
    servicer = Flaky(grpc.StatusCode.UNAVAILABLE, failures=100)
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=10, max_attempts=1) as client, pytest.raises(Unavailable):
            await asyncio.to_thread(client.score, [[1]], [[2]])
        assert servicer.calls == 1
