"""The token-budget micro-batcher under concurrency, cancellation and out-of-memory errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from logprob_client import AsyncLogprobClient, Overloaded
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.calls import OK, Gate, call, request
from tests.helpers.models import as_sequences, assert_scores_close
from tests.helpers.server import start, stop, test_settings


class LaunchSpy:
    """Records every micro-batch the scorer launches: its sequence count, tokens and temperature."""

    def __init__(self, scorer):
        self.scorer, self.original = scorer, scorer.launch
        self.batches: list[tuple[int, int, float]] = []
        scorer.launch = self._launch

    def _launch(self, batch, options):
        self.batches.append((len(batch.completion_lengths), batch.num_tokens, options.temperature))
        return self.original(batch, options)

    def restore(self):
        self.scorer.launch = self.original


def check(model, prompts, completions, logprobs, temperature):
    assert_scores_close(model, as_sequences(prompts, completions), logprobs, temperature=temperature)


async def test_many_concurrent_clients_get_their_own_results_in_order(gemma_checkpoint, rng):
    # Every request (at most 6 x 118 tokens) fits one micro-batch, so fewer micro-batches than
    # requests means requests were batched together.
    running = await start(test_settings(gemma_checkpoint, max_batch_tokens=1000, max_wait_ms=5, max_wait_quiet_ms=5))
    spy = LaunchSpy(running.scorer("default"))
    model = running.scorer("default").model

    async def client_session(client_id: int) -> list:
        done = []
        async with AsyncLogprobClient(running.target) as client:
            for _ in range(3):
                n = int(rng.integers(1, 7))
                prompts = [rng.integers(0, 4096, int(rng.integers(1, 60))).tolist() for _ in range(n)]
                completions = [rng.integers(0, 4096, int(rng.integers(1, 60))).tolist() for _ in range(n)]
                temperature = [1.0, 0.5][client_id % 2]
                out = await client.score(prompts, completions, temperature=temperature)
                done.append((prompts, completions, out, temperature))
        return done

    try:
        sessions = await asyncio.gather(*(client_session(i) for i in range(12)))
        for session in sessions:
            for prompts, completions, out, temperature in session:
                assert [len(x) for x in out] == [len(c) for c in completions]
                check(model, prompts, completions, out, temperature)
        total_sequences = sum(len(p) for s in sessions for p, *_ in s)
        # The spy was installed after the warm-up: it saw exactly the clients' sequences.
        assert sum(n for n, _, _ in spy.batches) == total_sequences  # nothing lost or duplicated
        assert all(tokens <= 1000 for _, tokens, _ in spy.batches)  # the budget holds
        assert len(spy.batches) < sum(len(s) for s in sessions), "requests were never batched together"
    finally:
        spy.restore()
        await stop(running)


async def test_large_request_is_split_balanced_and_reassembled_in_order(gemma_checkpoint, rng):
    running = await start(test_settings(gemma_checkpoint, max_batch_tokens=200, max_batch_sequences=4))
    spy = LaunchSpy(running.scorer("default"))
    prompts = [rng.integers(0, 4096, int(rng.integers(1, 80))).tolist() for _ in range(15)]
    completions = [rng.integers(0, 4096, int(rng.integers(1, 80))).tolist() for _ in range(15)]
    prompts.append(rng.integers(0, 4096, 150).tolist())  # longer than the budget: scored alone
    completions.append(rng.integers(0, 4096, 100).tolist())
    try:
        async with AsyncLogprobClient(running.target) as client:
            out = await client.score(prompts, completions)
        check(running.scorer("default").model, prompts, completions, out, 1.0)
        batches = spy.batches
        assert len(batches) >= 4 and all(n <= 4 for n, _, _ in batches)
        assert (1, 250, 1.0) in batches
        assert all(tokens <= 200 for n, tokens, _ in batches if n > 1)
    finally:
        spy.restore()
        await stop(running)


async def test_cancelled_rpc_leaves_the_queue_without_compute(running):
    gate = Gate(running)
    scheduler = running.service.device_side.scheduler
    try:
        blocker = asyncio.create_task(call(running.target, request(OK)))
        await gate.wait_entered()
        async with grpc.aio.insecure_channel(running.target) as channel:
            queued = pb_grpc.LogprobServiceStub(channel).ScoreTokens(request(([1] * 40, [2] * 60)))
            for _ in range(100):
                if scheduler.admission.queued_tokens == 5 + 100:
                    break
                await asyncio.sleep(0.01)
            assert scheduler.admission.queued_tokens == 105
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
        for _ in range(100):
            if scheduler.admission.queued_tokens == 5:
                break
            await asyncio.sleep(0.01)
        assert scheduler.admission.queued_tokens == 5, "the cancelled request still holds queue tokens"
        gate.release.set()
        await blocker
        await call(running.target, request(OK))
        assert gate.calls == [1, 1], "the cancelled request must never reach the model"
        assert scheduler.admission.queued_tokens == 0
    finally:
        gate.restore()


class OomAbove:
    """Raises CUDA out-of-memory for micro-batches of more than ``limit`` tokens."""

    def __init__(self, scorer, limit):
        self.scorer, self.original, self.limit = scorer, scorer.launch, limit
        self.attempts: list[int] = []
        scorer.launch = self._launch

    def _launch(self, batch, options):
        self.attempts.append(batch.num_tokens)
        if batch.num_tokens > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.original(batch, options)

    def restore(self):
        self.scorer.launch = self.original


async def test_out_of_memory_splits_and_recovers(running, rng):
    oom = OomAbove(running.scorer("default"), limit=60)
    prompts = [rng.integers(0, 4096, 10).tolist() for _ in range(7)]
    completions = [rng.integers(0, 4096, 10).tolist() for _ in range(7)]
    try:
        async with AsyncLogprobClient(running.target) as client:
            out = await client.score(prompts, completions)
        check(running.scorer("default").model, prompts, completions, out, 1.0)
        assert oom.attempts[0] == 140 and min(oom.attempts) <= 60  # halved until it fit
    finally:
        oom.restore()


async def test_a_sequence_that_cannot_fit_alone_fails_alone(running):
    oom = OomAbove(running.scorer("default"), limit=100)
    try:
        async with AsyncLogprobClient(running.target, max_attempts=1) as client:
            with pytest.raises(Overloaded, match=r"120 tokens \(70 prompt \+ 50 completion\)"):
                await client.score([[1] * 70], [[2] * 50])
            # The server keeps serving, and a request that fits is scored.
            out = await client.score([[1, 2, 3]], [[4, 5]])
        assert out[0].shape == (2,)
    finally:
        oom.restore()


async def test_temperatures_and_models_batch_separately(gemma_checkpoint, rng):
    running = await start(test_settings(gemma_checkpoint, max_wait_ms=50, max_wait_quiet_ms=50))
    spy = LaunchSpy(running.scorer("default"))
    try:
        async with AsyncLogprobClient(running.target) as client:
            calls = [
                client.score([rng.integers(0, 4096, 5).tolist()], [rng.integers(0, 4096, 5).tolist()], temperature=t)
                for t in (1.0, 0.7, 1.0, 0.7, 1.3)
            ]
            await asyncio.gather(*calls)
        temps = [round(t, 5) for _, _, t in spy.batches]  # the wire carries float32
        assert sorted(temps) == [0.7, 1.0, 1.3]  # one micro-batch per temperature, none mixed
    finally:
        spy.restore()
        await stop(running)
