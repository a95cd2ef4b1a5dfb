"""The limits beyond one request's own: queued tokens per client (the fair share), what a
shared-prompt group counts for, deadlines the queue would pass, RPCs per connection, and the
message size. Every refusal names its limit and the limit's value."""

from __future__ import annotations

import asyncio
import re
import secrets
import statistics
import time

import grpc
import numpy as np
import pytest
from logprob_client import LogprobClient
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.engine.admission import DEFAULT_RETRY_S

from tests.helpers.calls import Gate, assert_matches_reference, expect, random_sequence, request
from tests.helpers.server import start, stop, test_settings
from tests.helpers.waiting import eventually


async def score_raw(target, req, token=None, timeout=60):
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.LogprobServiceStub(channel).ScoreTokens(req, metadata=metadata, timeout=timeout)


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
    scheduler = running.service.device_side.scheduler
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
    scheduler = running.service.device_side.scheduler
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


def logprobs_of(response) -> list[np.ndarray]:
    return [np.asarray(s.logprobs) for s in response.scores]


def pushback_s(err: grpc.aio.AioRpcError) -> float:
    return int(dict(err.trailing_metadata())["grpc-retry-pushback-ms"]) / 1000


# The case scaled down: a 512-token prompt with 512 one-token completions is 1,024 tokens,
# as are two plain sequences of 512. It runs as two micro-batches of 256 completions (the default
# max_batch_sequences), each running the prompt (513 with its first completion), and each further
# completion reads the prompt's 512 keys, a token's worth (engine.costs.KEYS_PER_TOKEN): 2 x (513 + 255 x 2).
GROUP_COST = 2 * (513 + 255 * 2)


def group_of_one_token_completions(rng) -> tuple[list[int], list[list[int]]]:
    return rng.integers(0, 4096, 512).tolist(), [[int(t)] for t in rng.integers(0, 4096, 512)]


async def test_a_shared_prompt_group_counts_what_it_runs_against_the_fair_share(gemma_checkpoint, rng):
    settings = test_settings(
        gemma_checkpoint,
        max_sequences_per_request=512,
        max_tokens_per_request=1024,
        max_queued_tokens_per_client=3100,
        max_batch_tokens=4096,
    )
    running = await start(settings)
    gate = Gate(running)
    scheduler = running.service.device_side.scheduler
    try:
        plain = [[random_sequence(rng, 511, 1) for _ in range(2)] for _ in range(3)]  # 1,024 tokens each
        prompt, completions = group_of_one_token_completions(rng)
        held = [asyncio.create_task(score_raw(running.target, request(*seqs))) for seqs in plain[:2]]
        await gate.wait_entered()
        await eventually(lambda: scheduler.admission.queued_tokens == 2048, "two plain requests queued")
        # 2,048 + 2,046 pass the client's share (3,100); 2,048 + 1,024 would not.
        await expect(
            running.target,
            request(groups=[(prompt, completions)]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"client '127.0.0.1' has 2048 tokens queued; this request's {GROUP_COST}",
            "max_queued_tokens_per_client=3100",
            timeout=10,
        )
        held.append(asyncio.create_task(score_raw(running.target, request(*plain[2]))))  # a plain one is admitted
        await eventually(lambda: scheduler.admission.queued_tokens == 3072, "the third plain request")
        gate.release.set()
        for response, seqs in zip(await asyncio.gather(*held), plain, strict=True):
            assert_matches_reference(running, "default", *zip(*seqs), logprobs_of(response))
        # With the queue empty, the group is admitted and scored (four of its completions checked).
        response = await score_raw(running.target, request(groups=[(prompt, completions)]))
        assert len(response.scores) == 512
        assert_matches_reference(running, "default", [prompt] * 4, completions[:4], logprobs_of(response)[:4])
        await eventually(lambda: scheduler.admission.queued_tokens == 0, "every share to be released")
    finally:
        gate.restore()
        await stop(running)


async def test_a_group_that_costs_more_than_a_client_may_queue_is_invalid(gemma_checkpoint, rng):
    settings = test_settings(
        gemma_checkpoint,
        max_sequences_per_request=512,
        max_tokens_per_request=1024,
        max_queued_tokens_per_client=2000,
        max_batch_tokens=4096,
    )
    running = await start(settings)
    try:
        # 1,024 tokens, within max_tokens_per_request, but no amount of waiting admits 2,046.
        await expect(
            running.target,
            request(groups=[group_of_one_token_completions(rng)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"groups: the request costs {GROUP_COST} token-equivalents",
            "max_queued_tokens_per_client=2000",
        )
    finally:
        await stop(running)


async def test_a_fresh_servers_retry_hint_is_modest(gemma_checkpoint, rng):
    """The warm-up's few tokens are no measure of the throughput (they once made the first hint 30 s)."""
    settings = test_settings(gemma_checkpoint, max_tokens_per_request=4000, max_queued_tokens_per_client=8000)
    running = await start(settings)
    gate = Gate(running)
    try:
        seqs = [random_sequence(rng, 499, 1) for _ in range(16)]  # 8,000 tokens: the client's whole share
        held = [asyncio.create_task(score_raw(running.target, request(*seqs[i : i + 8]))) for i in (0, 8)]
        await gate.wait_entered()
        await eventually(
            lambda: running.service.device_side.scheduler.admission.queued_tokens == 8000, "the share queued"
        )
        err = await expect(
            running.target,
            request(*[random_sequence(rng, 499, 1) for _ in range(8)]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max_queued_tokens_per_client=8000",
        )
        # Past the share by 4,000 tokens: at the rate of the warm-up's 16 tokens, seconds (3 s here).
        assert pushback_s(err) == DEFAULT_RETRY_S
        assert running.service.device_side.scheduler.admission.throughput is None
        gate.release.set()
        await asyncio.gather(*held)
    finally:
        gate.restore()
        await stop(running)


async def test_a_request_that_cannot_finish_by_its_deadline_is_refused_and_one_that_can_is_served(
    gemma_checkpoint, rng
):
    running = await start(test_settings(gemma_checkpoint, max_batch_tokens=4096, max_tokens_per_request=4000))
    gate = None
    admission = running.service.device_side.scheduler.admission

    def full() -> pb.ScoreRequest:  # 4,000 tokens: one micro-batch, measured (a quarter of 4,096 or more)
        return request(*[random_sequence(rng, 499, 1) for _ in range(8)])

    try:
        took = []
        for _ in range(3):  # the server measures its throughput, and so does the test
            start_s = time.monotonic()
            await score_raw(running.target, full())
            took.append(time.monotonic() - start_s)
        gate = Gate(running)
        queued = [asyncio.create_task(score_raw(running.target, full(), timeout=120)) for _ in range(8)]
        await gate.wait_entered()
        await eventually(lambda: admission.queued_tokens == 32000, "8 requests queued")
        finish_s = 9 * statistics.median(took)  # the queue and one more request, as the test measured them
        # A deadline a quarter of that away: refused at once, the wait and the queue named, with a
        # hint of when the queue will have room for it.
        err = await expect(
            running.target,
            full(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "its deadline is",
            "36000 tokens would run before it finishes (its 4000, 32000 its client queued before it",
            timeout=finish_s / 4,
        )
        estimate = re.search(r"at the measured (\d+) tokens/s take about ([\d.]+) s", err.details())
        assert estimate is not None, err.details()
        throughput, server_finish_s = int(estimate[1]), float(estimate[2])
        assert server_finish_s == pytest.approx(36000 / throughput, rel=1e-3, abs=0.01)  # as printed
        assert server_finish_s - finish_s / 4 <= pushback_s(err) <= server_finish_s + 0.01
        # A deadline well beyond: admitted, and served.
        seqs = [random_sequence(rng, 499, 1) for _ in range(8)]
        served = asyncio.create_task(score_raw(running.target, request(*seqs), timeout=finish_s + 60))
        await eventually(lambda: admission.queued_tokens == 36000, "the request with time to spare admitted")
        gate.release.set()
        await asyncio.gather(*queued)
        assert_matches_reference(running, "default", *zip(*seqs), logprobs_of(await served))
    finally:
        if gate is not None:
            gate.restore()
        await stop(running)
