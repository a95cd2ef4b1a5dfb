"""The limits beyond one request's own: queued tokens per client (the fair share), RPCs per
connection, and the message size. Every refusal names its limit and the limit's value."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import numpy as np
import pytest
from logprob_client import LogprobClient
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.calls import Gate, assert_matches_reference, expect, random_sequence, request
from tests.helpers.server import start, stop, test_settings
from tests.helpers.waiting import eventually


async def score_raw(target, req, token=None):
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.LogprobServiceStub(channel).ScoreTokens(req, metadata=metadata, timeout=60)


async def test_fair_share_refuses_a_greedy_client_and_admits_the_others(gemma_checkpoint, tmp_path, rng):
    greedy, modest = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    path = tmp_path / "tokens.yaml"
    path.write_text(
        f"tokens:\n  - {{name: greedy, scopes: [score], token: {greedy}}}\n"
        f"  - {{name: modest, scopes: [score], token: {modest}}}\n"
    )
    settings = test_settings(
        gemma_checkpoint,
        auth_tokens_file=path,
        max_tokens_per_request=400,
        max_queued_tokens_per_client=1000,
        max_queued_tokens=4000,
    )
    running = await start(settings)
    gate = Gate(running)
    scheduler = running.service.scheduler
    try:
        seqs = [random_sequence(rng, 150, 50) for _ in range(8)]  # 200 tokens each
        # The greedy client queues 1000 tokens (its whole share); the first is held on the device.
        held = [asyncio.create_task(score_raw(running.target, request(s), greedy)) for s in seqs[:5]]
        await eventually(lambda: scheduler.admission.queued_tokens == 1000, "the greedy client's 1000 tokens")
        await gate.wait_entered()
        metadata = (("authorization", f"Bearer {greedy}"),)
        async with grpc.aio.insecure_channel(running.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.LogprobServiceStub(channel).ScoreTokens(request(seqs[5]), metadata=metadata, timeout=10)
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "client 'greedy' has 1000 tokens queued; this request's 200" in err.details()
        assert "max_queued_tokens_per_client=1000" in err.details()
        assert int(dict(err.trailing_metadata())["grpc-retry-pushback-ms"]) > 0
        # The global queue has room: the other client is admitted while the greedy one is refused.
        others = [asyncio.create_task(score_raw(running.target, request(s), modest)) for s in seqs[6:]]
        await eventually(lambda: scheduler.admission.queued_tokens == 1400, "the modest client's 400 tokens")
        assert dict(scheduler.admission.client_tokens) == {"greedy": 1000, "modest": 400}
        gate.release.set()
        answered = await asyncio.gather(*held, *others)
        for response, (p, c) in zip(answered, seqs[:5] + seqs[6:], strict=True):
            assert_matches_reference(running, "default", [p], [c], [np.asarray(response.scores[0].logprobs)])
        await eventually(lambda: not scheduler.admission.client_tokens, "every client's share to be released")
        assert scheduler.admission.queued_tokens == 0
    finally:
        gate.restore()
        await stop(running)


async def test_without_authentication_the_client_is_its_ip_address(gemma_checkpoint, rng):
    running = await start(test_settings(gemma_checkpoint, max_tokens_per_request=300, max_queued_tokens_per_client=300))
    gate = Gate(running)
    try:
        first = asyncio.create_task(score_raw(running.target, request(random_sequence(rng, 100, 100))))
        await gate.wait_entered()
        # Another connection from the same host is the same client.
        await expect(
            running.target,
            request(random_sequence(rng, 60, 60)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "client '127.0.0.1' has 200 tokens queued; this request's 120",
            "max_queued_tokens_per_client=300",
        )
        gate.release.set()
        assert len((await first).scores[0].logprobs) == 100
    finally:
        gate.restore()
        await stop(running)


async def test_rpcs_beyond_the_connection_limit_wait_for_a_stream(gemma_checkpoint, rng):
    # Three streams a connection: the client's health watch holds one (client.channel), two are left.
    running = await start(test_settings(gemma_checkpoint, max_concurrent_rpcs_per_connection=3))
    gate = Gate(running)
    scheduler = running.service.scheduler
    try:
        seqs = [random_sequence(rng, 3, 2) for _ in range(7)]  # 5 tokens each
        with LogprobClient(running.target) as client:
            # Six calls on one connection: two streams are free at a time, so two reach the server.
            pending = [client.score_async([p], [c]) for p, c in seqs[:6]]
            await gate.wait_entered()
            await eventually(lambda: scheduler.admission.queued_tokens == 10, "two calls")
            await asyncio.sleep(0.5)
            assert scheduler.admission.queued_tokens == 10, "more RPCs arrived than the connection limit allows"
            # Another connection has streams of its own.
            other = asyncio.create_task(score_raw(running.target, request(seqs[6])))
            await eventually(lambda: scheduler.admission.queued_tokens == 15, "the other connection's call")
            gate.release.set()
            for future, (p, c) in zip(pending, seqs[:6], strict=True):
                assert_matches_reference(running, "default", [p], [c], await asyncio.to_thread(future.result, 60))
            assert_matches_reference(
                running, "default", [seqs[6][0]], [seqs[6][1]], [np.asarray((await other).scores[0].logprobs)]
            )
    finally:
        gate.restore()
        await stop(running)


async def test_a_message_over_the_size_limit_names_the_limit(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint, max_message_bytes=4 * 1024**2), warm=False)
    try:
        huge = request(*[(list(range(100_000, 104_000)), [1] * 320)] * 450)  # ~5.2 MB
        # gRPC's own check, before any handler: its message carries the size and the limit.
        await expect(running.target, huge, grpc.StatusCode.RESOURCE_EXHAUSTED, f"vs. {4 * 1024**2}")
    finally:
        await stop(running)
