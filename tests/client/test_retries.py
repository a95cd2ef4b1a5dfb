"""The client retries UNAVAILABLE and RESOURCE_EXHAUSTED (gRPC retry policy for unary calls; the
stream is resumed with its unanswered requests) and nothing else."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from logprob_client import (
    AsyncLogprobClient,
    InvalidRequest,
    LogprobClient,
    Overloaded,
    ScoreInput,
    ServerError,
    Unavailable,
)
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.fake_server import sequences_of, serving


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


class BreakingStream(pb_grpc.LogprobServiceServicer):
    """Answers stream requests (log-probs derived from the ids, so results can be checked), but the
    first ``broken`` streams end with ``code`` after answering ``answer_first`` requests. On the
    first stream, the request at index i in ``inband`` is answered with the in-band error inband[i]."""

    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, answer_first=3, broken=1, inband=None) -> None:
        self.code, self.answer_first, self.broken, self.inband = code, answer_first, broken, inband or {}
        self.streams: list[list[str]] = []  # the request ids each stream received

    async def ScoreTokensStream(self, request_iterator, context):
        received: list[str] = []
        self.streams.append(received)
        async for request in request_iterator:
            if len(self.streams) <= self.broken and len(received) == self.answer_first:
                await context.abort(self.code, "server going away")
            received.append(request.request_id)
            if len(self.streams) == 1 and len(received) - 1 in self.inband:
                error = pb.Error(code=self.inband[len(received) - 1].value[0], message="in-band")
                yield pb.ScoreResponse(request_id=request.request_id, error=error)
            else:
                yield pb.ScoreResponse(
                    request_id=request.request_id,
                    scores=[pb.SequenceScores(logprobs=expected(s.completion_ids)) for s in sequences_of(request)],
                )


def expected(completion_ids) -> list[float]:
    return [-(c % 97) - 0.5 for c in completion_ids]


def batches(rng: np.random.Generator, n: int) -> list[ScoreInput]:
    return [ScoreInput([rng.integers(0, 1000, 3).tolist()], [rng.integers(1, 1000, 2).tolist()]) for _ in range(n)]


async def score_many(target: str, inputs, aio: bool, **kwargs):
    if aio:
        async with AsyncLogprobClient(target, timeout=10, **kwargs) as client:
            return await client.score_many(inputs, return_exceptions=True)
    with LogprobClient(target, timeout=10, **kwargs) as client:
        return await asyncio.to_thread(client.score_many, inputs, return_exceptions=True)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
async def test_a_broken_stream_resumes_with_the_unanswered_requests_only(aio, rng):
    servicer = BreakingStream(answer_first=3)
    inputs = batches(rng, 8)
    async with serving(servicer) as target:
        results = await score_many(target, inputs, aio)
    assert [r[0].tolist() for r in results] == [expected(i.completion_ids[0]) for i in inputs]
    first, second = servicer.streams
    assert len(first) == 3 and len(second) == 5 and not set(first) & set(second)


async def test_retryable_in_band_answers_are_sent_again_and_others_stand(rng):
    inputs = batches(rng, 4)
    servicer = BreakingStream(
        broken=0, inband={1: grpc.StatusCode.RESOURCE_EXHAUSTED, 2: grpc.StatusCode.INVALID_ARGUMENT}
    )
    async with serving(servicer) as target:
        results = await score_many(target, inputs, aio=False)
    assert results[0][0].tolist() == expected(inputs[0].completion_ids[0])
    assert results[1][0].tolist() == expected(inputs[1].completion_ids[0])  # answered on the second stream
    assert isinstance(results[2], InvalidRequest)  # not retryable: its error stands
    assert results[3][0].tolist() == expected(inputs[3].completion_ids[0])
    assert len(servicer.streams) == 2 and len(servicer.streams[1]) == 1


async def test_a_stream_broken_for_good_raises(rng):
    async with serving(BreakingStream(code=grpc.StatusCode.INTERNAL)) as target:
        with LogprobClient(target, timeout=10) as client, pytest.raises(ServerError, match="server going away"):
            await asyncio.to_thread(client.score_many, batches(rng, 4))
    servicer = BreakingStream(answer_first=1, broken=100)
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=10, max_attempts=3) as client, pytest.raises(Unavailable):
            await asyncio.to_thread(client.score_many, batches(rng, 6))
    assert [len(s) for s in servicer.streams] == [1, 1, 1]  # each stream answered one more, then no attempts left
