"""A call larger than the RPC limits goes as several RPCs in flight together, reassembled in
order; ``score_async`` returns while its RPCs are still running.

A hand-written servicer answers each completion token ``t`` with ``-t / 1000`` (entropy
``t / 1000``), so every value can be checked against the token it belongs to.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient, Cancelled, InvalidRequest, LogprobClient, MixedVersionsError
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.fake_server import sequences_of, serving

BAD_TOKEN = 999_999  # the servicer refuses a request holding it
ARRIVAL_TIMEOUT_S = 10.0


class Scripted(pb_grpc.LogprobServiceServicer):
    """Holds every request until ``together`` requests are open at once (or ``release`` is set)."""

    def __init__(self, together: int = 1) -> None:
        self.together = together
        self.requests: list[pb.ScoreRequest] = []
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def ScoreTokens(self, request, context):
        self.requests.append(request)
        if len(self.requests) >= self.together:
            self.arrived.set()
        await asyncio.wait_for(self.arrived.wait(), ARRIVAL_TIMEOUT_S)  # fails the call if parts came one by one
        if self.together == 0:
            await asyncio.wait_for(self.release.wait(), ARRIVAL_TIMEOUT_S)
        if any(BAD_TOKEN in s.completion_ids for s in sequences_of(request)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token id {BAD_TOKEN} is outside the vocabulary")
        scores = [
            pb.SequenceScores(
                logprobs=[-t / 1000 for t in s.completion_ids], entropies=[t / 1000 for t in s.completion_ids]
            )
            for s in sequences_of(request)
        ]
        return pb.ScoreResponse(request_id=request.request_id, scores=scores)


def random_dense(rng: np.random.Generator, rows: int):
    """A TRL-style batch: left-padded prompts, right-padded completions, one row fully masked."""
    p_len, c_len = 9, 11
    prompt_ids = rng.integers(3, 4096, (rows, p_len))
    completion_ids = rng.integers(3, 4096, (rows, c_len))
    prompt_mask = np.arange(p_len)[None, :] >= rng.integers(0, p_len, rows)[:, None]
    completion_mask = np.arange(c_len)[None, :] < rng.integers(1, c_len + 1, rows)[:, None]
    completion_mask[rng.integers(rows)] = False
    return prompt_ids, completion_ids, prompt_mask.astype(np.int64), completion_mask.astype(np.int64)


async def score(which: str, target: str, *args, **kwargs):
    limits = dict(max_sequences_per_rpc=kwargs.pop("max_sequences_per_rpc"), max_tokens_per_rpc=10_000)
    if which == "async":
        async with AsyncLogprobClient(target, timeout=30, **limits) as client:
            return await client.score(*args, **kwargs)
    with LogprobClient(target, timeout=30, **limits) as client:
        return await asyncio.to_thread(client.score, *args, **kwargs)


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_dense_call_is_split_sent_together_and_reassembled(which, rng):
    prompt_ids, completion_ids, prompt_mask, completion_mask = random_dense(rng, 7)  # 6 rows to send
    servicer = Scripted(together=3)  # 6 rows, 2 per RPC: all 3 RPCs must be open at once
    async with serving(servicer) as target:
        logprobs, entropies = await score(
            which,
            target,
            torch.from_numpy(prompt_ids),
            torch.from_numpy(completion_ids),
            prompt_mask=torch.from_numpy(prompt_mask),
            completion_mask=torch.from_numpy(completion_mask),
            return_entropy=True,
            max_sequences_per_rpc=2,
        )
    assert [len(sequences_of(r)) for r in servicer.requests] == [2, 2, 2]
    expected = np.where(completion_mask == 1, -completion_ids / 1000, 0.0)
    np.testing.assert_allclose(logprobs.numpy(), expected, rtol=1e-6, atol=0)
    np.testing.assert_allclose(entropies.numpy(), -expected, rtol=1e-6, atol=0)
    # The parts are contiguous runs of the unmasked rows' tokens (they may arrive in any order).
    rows = [b for b in range(7) if completion_mask[b].any()]
    expected_sent = [
        (prompt_ids[b][prompt_mask[b] == 1].tolist(), completion_ids[b][completion_mask[b] == 1].tolist()) for b in rows
    ]
    parts = [[(list(s.prompt_ids), list(s.completion_ids)) for s in sequences_of(r)] for r in servicer.requests]
    parts.sort(key=lambda part: expected_sent.index(part[0]))
    assert [seq for part in parts for seq in part] == expected_sent


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_list_call_is_split_by_tokens(which, rng):
    prompts = [rng.integers(0, 4096, int(rng.integers(1, 30))).tolist() for _ in range(9)]
    completions = [rng.integers(0, 4096, int(rng.integers(1, 30))).tolist() for _ in range(9)]
    async with serving(Scripted()) as target:
        out = await score(which, target, prompts, completions, max_sequences_per_rpc=4)
    for got, c in zip(out, completions, strict=True):
        np.testing.assert_allclose(got, -np.array(c) / 1000, rtol=1e-6, atol=0)


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_a_failed_part_fails_the_call_with_its_typed_error(which):
    prompts, completions = [[1, 2]] * 4, [[3], [4], [BAD_TOKEN], [5]]
    async with serving(Scripted(together=2)) as target:
        with pytest.raises(InvalidRequest, match=str(BAD_TOKEN)):
            await score(which, target, prompts, completions, max_sequences_per_rpc=2)


async def test_score_async_returns_while_the_server_holds_the_call():
    servicer = Scripted(together=0)  # answers only once released
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=30) as client:
            future = await asyncio.to_thread(client.score_async, [[1, 2, 3]], [[7, 8]])
            await asyncio.wait_for(servicer.arrived.wait(), ARRIVAL_TIMEOUT_S)  # the RPC reached the server
            assert not future.done()
            with pytest.raises(TimeoutError, match="still running"):
                await asyncio.to_thread(future.result, 0.01)  # the server holds it: this must time out
            servicer.release.set()
            out = await asyncio.to_thread(future.result)
            assert future.done() and out[0].tolist() == pytest.approx([-0.007, -0.008])
            assert future.result() is out  # the result is kept


async def test_score_async_can_be_cancelled():
    servicer = Scripted(together=0)
    async with serving(servicer) as target:
        with LogprobClient(target, timeout=30) as client:
            future = await asyncio.to_thread(client.score_async, [[1, 2, 3]], [[7, 8]])
            await asyncio.wait_for(servicer.arrived.wait(), ARRIVAL_TIMEOUT_S)
            future.cancel()
            with pytest.raises(Cancelled):
                await asyncio.to_thread(future.result, 5)


class Versioned(Scripted):
    """Answers the parts of a call as if an update went live between them: the first part answered
    comes from version 4, the rest from version 5 (counted when answered, not when arrived: parts
    arrive in any order and any number at once); and it echoes each request's min_version."""

    def __init__(self) -> None:
        super().__init__(together=1)
        self.min_versions: list[int] = []
        self.answered = 0

    async def ScoreTokens(self, request, context):
        self.min_versions.append(request.min_version)
        response = await super().ScoreTokens(request, context)
        self.answered += 1  # no await between the count and its use: one answer at a time
        response.model = request.model
        response.model_version = 4 if self.answered == 1 else 5
        return response


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_parts_scored_by_two_versions_raise_instead_of_mixing(which):
    prompts, completions = [[1, 2]] * 4, [[3, 4]] * 4
    async with serving(Versioned()) as target:
        with pytest.raises(MixedVersionsError, match=r"versions \[4, 5\] of model 'default'; retry with min_version=5"):
            await score(which, target, prompts, completions, max_sequences_per_rpc=2)
    servicer = Versioned()
    async with serving(servicer) as target:
        await score(which, target, prompts[:2], completions[:2], max_sequences_per_rpc=2, min_version=5)
    assert servicer.min_versions == [5]
