"""GRPO groups over gRPC: a prompt sent once (``SequenceGroup``) and run once, v1 requests whose
sequences repeat a prompt shared as well, answers in request order, and bad groups refused alone."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from logprob_client import AsyncLogprobClient, LogprobClient
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.calls import assert_matches_reference, call, request, trl_layout
from tests.helpers.metrics import value

pytestmark = pytest.mark.numerical


def shared_tokens(model: str = "default") -> float:
    return value("logprob_prompt_tokens_shared_total", model=model)


def grpo_batch(
    rng: np.random.Generator, groups: int, size: int, vocab: int = 4096
) -> tuple[list[list[int]], list[list[int]]]:
    """``groups`` prompts, each repeated for ``size`` consecutive completions (TRL's layout)."""
    prompts, completions = [], []
    for _ in range(groups):
        prompt = rng.integers(0, vocab, int(rng.integers(5, 40))).tolist()
        for _ in range(size):
            prompts.append(prompt)
            completions.append(rng.integers(0, vocab, int(rng.integers(1, 20))).tolist())
    return prompts, completions


async def test_trl_layout_sends_each_prompt_once_and_runs_it_once(running, rng):
    prompts, completions = grpo_batch(rng, groups=3, size=4)
    prompt_ids, prompt_mask, completion_ids, completion_mask = trl_layout(rng, prompts, completions)
    before = shared_tokens()
    with LogprobClient(running.target) as client:
        (wire,) = client.prepare_one(
            prompt_ids, completion_ids, {"prompt_mask": prompt_mask, "completion_mask": completion_mask}
        ).requests
        dense = await asyncio.to_thread(
            client.score, prompt_ids, completion_ids, prompt_mask=prompt_mask, completion_mask=completion_mask
        )
    assert not wire.sequences and [len(g.completions) for g in wire.groups] == [4, 4, 4]
    assert [np.frombuffer(g.prompt_ids_i32, dtype="<i4").tolist() for g in wire.groups] == prompts[::4]
    # One request, one micro-batch: each prompt ran once for its 4 completions.
    assert shared_tokens() - before == sum(3 * len(p) for p in prompts[::4])
    logprobs = [row[mask.astype(bool)] for row, mask in zip(dense, completion_mask, strict=True)]
    assert_matches_reference(running, "default", prompts, completions, logprobs)


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_score_groups_answers_group_by_group(running, rng, which):
    prompts, completions = grpo_batch(rng, groups=3, size=1, vocab=517)  # the gemma test model's
    groups = [[c, *grpo_batch(rng, 1, 2, vocab=517)[1]] for c in completions]  # 3 completions per prompt
    if which == "sync":
        with LogprobClient(running.target) as client:
            logprobs, entropies = await asyncio.to_thread(
                client.score_groups, prompts, groups, return_entropy=True, model="gemma"
            )
    else:
        async with AsyncLogprobClient(running.target) as client:
            logprobs, entropies = await client.score_groups(prompts, groups, return_entropy=True, model="gemma")
    assert [len(g) for g in logprobs] == [len(g) for g in entropies] == [3, 3, 3]
    flat_prompts = [p for p, g in zip(prompts, groups, strict=True) for _ in g]
    flat = [c for g in groups for c in g]
    assert_matches_reference(
        running,
        "gemma",
        flat_prompts,
        flat,
        [x for g in logprobs for x in g],
        entropies=[x for g in entropies for x in g],
    )


async def test_v1_sequences_with_one_prompt_are_shared_and_answered_before_groups(running, rng):
    """A request with both fields: its ``sequences`` (two repeating a prompt, as a v1 client sends
    them) are answered first, then each group's completions, in order."""
    (p, q), _ = grpo_batch(rng, groups=2, size=1)
    c = grpo_batch(rng, groups=1, size=5)[1]
    before = shared_tokens()
    response = await call(running.target, request((p, c[0]), (p, c[1]), groups=[(q, c[2:4]), (p, c[4:])]))
    assert len(response.scores) == 5 and response.metadata.tokens == 3 * len(p) + 2 * len(q) + sum(map(len, c))
    # p is run once for its three sequences (two in `sequences`, one in a group), q once for two.
    assert shared_tokens() - before == 2 * len(p) + len(q)
    assert_matches_reference(running, "default", [p, p, q, q, p], c, [np.asarray(s.logprobs) for s in response.scores])


async def test_a_bad_group_on_a_stream_fails_alone(running, rng):
    prompts, completions = grpo_batch(rng, groups=2, size=3)
    good = [request(groups=[(prompts[i], completions[i : i + 3])], request_id=f"good-{i}") for i in (0, 3)]
    bad = request(groups=[(prompts[0], [completions[0], [1, 4096]])], request_id="bad")
    async with grpc.aio.insecure_channel(running.target) as channel:
        answers = {
            r.request_id: r
            async for r in pb_grpc.LogprobServiceStub(channel).ScoreTokensStream(iter([good[0], bad, good[1]]))
        }
    assert answers["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "groups[0].completions[1].completion_ids[1]" in answers["bad"].error.message
    for i, name in ((0, "good-0"), (3, "good-3")):
        scores = answers[name].scores
        assert not answers[name].HasField("error") and len(scores) == 3
        assert_matches_reference(
            running, "default", prompts[i : i + 3], completions[i : i + 3], [np.asarray(s.logprobs) for s in scores]
        )
