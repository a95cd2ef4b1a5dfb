"""A call larger than its client's share of the queue (max_queued_tokens_per_client), on a real
server: the client paces its parts to the share the server tells (ListModels) instead of sending
them all to be refused and retried, and a deadline that passes says what held the call back."""

from __future__ import annotations

import asyncio

import pytest
from logprob_client import AsyncLogprobClient, DeadlineExceeded, LogprobClient
from prometheus_client import REGISTRY

from tests.helpers.calls import Gate, assert_matches_reference, random_sequence
from tests.helpers.server import settings, start, stop

SHARE = 800  # tokens of one client queued at once
PART_TOKENS = 80  # two sequences of 40 tokens a part
SEQUENCES = 60  # 2400 tokens: 30 parts, three times the share


def refusals() -> float:
    """RESOURCE_EXHAUSTED answers to ScoreTokens so far, every server of this process together."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "logprob_requests"
        for sample in metric.samples
        if sample.name == "logprob_requests_total"
        and sample.labels.get("rpc") == "ScoreTokens"
        and sample.labels.get("code") == "RESOURCE_EXHAUSTED"
    )


async def started():
    return await start(
        settings(
            {"default": "builtin:tiny-llama"},
            max_tokens_per_request=400,
            max_queued_tokens_per_client=SHARE,
            max_queued_tokens=4 * SHARE,
        )
    )


async def score(which: str, target: str, prompts, completions, timeout: float):
    limits = dict(timeout=timeout, max_tokens_per_rpc=PART_TOKENS)
    if which == "async":
        async with AsyncLogprobClient(target, **limits) as client:
            return await client.score(prompts, completions)
    with LogprobClient(target, **limits) as client:
        return await asyncio.to_thread(client.score, prompts, completions)


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_a_call_three_times_the_share_is_paced_through_without_refusals(which, rng):
    running = await started()
    try:
        prompts, completions = zip(*(random_sequence(rng, 20, 20) for _ in range(SEQUENCES)), strict=True)
        before = refusals()
        logprobs = await score(which, running.target, list(prompts), list(completions), timeout=60)
        # Sent all at once, two thirds of the parts were refused (and retried) at least once.
        assert refusals() - before <= 1
        assert_matches_reference(running, "default", prompts, completions, logprobs)
        assert not running.service.device_side.scheduler.admission.client_tokens
        async with AsyncLogprobClient(running.target) as client:
            (model,) = await client.list_models()
        assert (model.limits.max_queued_tokens, model.limits.max_queued_tokens_per_client) == (4 * SHARE, SHARE)
    finally:
        await stop(running)


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_a_deadline_that_passes_names_the_share_and_what_was_done(which, rng):
    running = await started()
    gate = Gate(running)  # nothing is scored: the call can only run out of time
    try:
        prompts, completions = zip(*(random_sequence(rng, 20, 20) for _ in range(SEQUENCES)), strict=True)
        with pytest.raises(DeadlineExceeded) as caught:
            await score(which, running.target, list(prompts), list(completions), timeout=1.5)
        message = str(caught.value)
        assert f"max_queued_tokens_per_client={SHARE} tokens" in message, message
        assert "0 of 30 parts answered (0 of 60 sequences, 0 of 2400 tokens)" in message, message
        assert f"at most {SHARE // 2} tokens of its parts in flight" in message, message
        assert "5 sent and not yet answered, 25 not sent" in message, message
    finally:
        gate.restore()
        await stop(running)
