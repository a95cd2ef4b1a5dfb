"""Routed experts (router replay) through gRPC and the client: each completion token's expert ids
per MoE layer, equal to transformers' own router choices (``output_router_logits`` top-k, of the
served model's weights in float64) for packed sequences and a shared-prompt group, over the sync,
async and stream calls and the dense (TRL) layout; off by default; a dense model refuses the flag
with INVALID_ARGUMENT naming it while a concurrent request is answered.

The served MoE is ``tests.helpers.moe``'s tiny Qwen3-MoE (8 experts, 2 per token, 2 layers), whose
router spread keeps its top-k far from ties, so float32 serving and the float64 reference agree."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from logprob_client import AsyncLogprobClient, LogprobClient, ScoreInput, TeacherScores
from logprob_client.inputs import prepare
from logprob_client.wire import result
from logprob_proto import logprob_pb2 as pb
from logprob_service.api.wire import response_from_result
from logprob_service.domain import ScoreResult, SequenceScores, TokenSequence

from tests.helpers.calls import call, expect, trl_layout
from tests.helpers.fake_server import at_once
from tests.helpers.models import VOCAB, stock_copy
from tests.helpers.moe import EXPERTS, TOP_K, hf_router_choices, make_moe_model
from tests.helpers.seeds import session_seed
from tests.helpers.server import settings, start, stop

pytestmark = pytest.mark.numerical

LAYERS = 2  # the tiny MoE's, every one with a router


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe-checkpoint")
    make_moe_model("qwen3_moe", seed=session_seed("qwen3-moe-checkpoint")).save_pretrained(path)
    return path


@pytest_asyncio.fixture
async def moe_server(moe_checkpoint: Path):
    """Model "moe" (the checkpoint, float32 on the CPU) beside "default", a dense tiny Llama."""
    server = await start(settings({"default": "builtin:tiny-llama", "moe": str(moe_checkpoint)}))
    yield server
    await stop(server)


def batch(rng, n: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist() for _ in range(n)]
    return prompts, [rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist() for _ in range(n)]


def check(server, prompts, completions, routed) -> None:
    """Each sequence's routed experts against the float64 model's own router choices, alone."""
    reference = stock_copy(server.scorer("moe").model, torch.float64)
    assert len(routed) == len(prompts)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        want = hf_router_choices(reference, TokenSequence(np.asarray(p), np.asarray(c)))
        assert routed[i].shape == (len(c), LAYERS, TOP_K), (i, routed[i].shape)
        np.testing.assert_array_equal(routed[i], want, err_msg=f"sequence {i}")


async def test_sync_packed_and_grouped_equal_the_models_router_choices_and_are_off_by_default(moe_server, rng):
    prompts, completions = batch(rng, 5)
    group = [rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist() for _ in range(3)]
    with LogprobClient(moe_server.target) as client:
        answer = await asyncio.to_thread(
            client.score, prompts, completions, model="moe", return_routed_experts=True, return_entropy=True
        )
        grouped = await asyncio.to_thread(
            client.score_groups,
            [prompts[0], prompts[1]],
            [group, completions[1:2]],
            model="moe",
            return_routed_experts=True,
        )
        plain = await asyncio.to_thread(client.score, prompts, completions, model="moe")
    assert isinstance(answer, TeacherScores) and len(answer.entropies) == 5 and answer.top_ids is None
    check(moe_server, prompts, completions, answer.routed_experts)
    assert all(np.array_equal(a, b) for a, b in zip(answer.logprobs, plain))  # the same log-probs
    assert [len(g) for g in grouped.routed_experts] == [3, 1]  # cut back into the caller's groups
    check(
        moe_server,
        [prompts[0]] * 3 + [prompts[1]],
        [*group, completions[1]],
        [*grouped.routed_experts[0], *grouped.routed_experts[1]],
    )
    # Off by default: a plain answer is log-probs alone, and the wire carries no routed experts.
    assert isinstance(plain, list)
    request = pb.ScoreRequest(
        model="moe", sequences=[pb.Sequence(prompt_ids=prompts[0], completion_ids=completions[0])]
    )
    (scores,) = (await call(moe_server.target, request)).scores
    assert not scores.HasField("routed_experts")
    request.return_routed_experts = True
    (scores,) = (await call(moe_server.target, request)).scores
    routed = scores.routed_experts
    assert (routed.layers, routed.top_k, len(routed.ids)) == (LAYERS, TOP_K, 2 * len(completions[0]) * LAYERS * TOP_K)
    np.testing.assert_array_equal(
        np.frombuffer(routed.ids, "<i2").reshape(-1, LAYERS, TOP_K), answer.routed_experts[0]
    )  # int16: the model has at most 32,768 experts


async def test_async_dense_trl_layout(moe_server, rng):
    prompts, completions = batch(rng, 4)
    prompt_ids, prompt_mask, completion_ids, completion_mask = trl_layout(rng, prompts, completions)
    async with AsyncLogprobClient(moe_server.target) as client:
        dense = await client.score(
            prompt_ids,
            completion_ids,
            model="moe",
            prompt_mask=prompt_mask,
            completion_mask=completion_mask,
            top_k=3,
            return_routed_experts=True,
        )
    width = completion_ids.shape[1]
    assert dense.routed_experts.shape == (4, width, LAYERS, TOP_K) and dense.top_ids.shape == (4, width, 3)
    mask = completion_mask.astype(bool)
    assert not dense.routed_experts[~mask].any()  # 0 where nothing was sent
    check(moe_server, prompts, completions, [dense.routed_experts[i][mask[i]] for i in range(4)])


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_stream(moe_server, rng, which):
    batches = [batch(rng, 3) for _ in range(3)]
    inputs = [ScoreInput(p, c) for p, c in batches]
    if which == "sync":
        with LogprobClient(moe_server.target) as client:
            results = await asyncio.to_thread(client.score_many, inputs, model="moe", return_routed_experts=True)
    else:
        async with AsyncLogprobClient(moe_server.target) as client:
            results = await client.score_many(inputs, model="moe", return_routed_experts=True)
    for (prompts, completions), answer in zip(batches, results, strict=True):
        check(moe_server, prompts, completions, answer.routed_experts)


async def test_a_dense_model_refuses_the_flag_by_name_and_others_are_answered(moe_server, rng):
    prompts, completions = batch(rng, 2)
    sequences = [pb.Sequence(prompt_ids=p, completion_ids=c) for p, c in zip(prompts, completions)]
    good = pb.ScoreRequest(model="moe", sequences=sequences, return_routed_experts=True)
    bad = pb.ScoreRequest(model="default", sequences=sequences, return_routed_experts=True)
    answers = await asyncio.gather(
        call(moe_server.target, good),
        expect(
            moe_server.target,
            bad,
            grpc.StatusCode.INVALID_ARGUMENT,
            "return_routed_experts: model 'default' (LlamaForCausalLM) has no mixture-of-experts routers",
        ),
        call(moe_server.target, good),
    )
    for response in (answers[0], answers[-1]):
        assert [len(s.routed_experts.ids) for s in response.scores] == [
            2 * len(c) * LAYERS * TOP_K for c in completions
        ]
    with LogprobClient(moe_server.target) as client:
        models = {m.name: m.num_experts for m in await asyncio.to_thread(client.list_models)}
        assert models == {"default": 0, "moe": EXPERTS}  # ListModels says which model has routers
        plain = await asyncio.to_thread(client.score, prompts, completions)  # the dense model without the flag
    assert [len(lp) for lp in plain] == [len(c) for c in completions]


def test_legacy_wire_refuses_the_flag(moe_server):
    with LogprobClient(moe_server.target, legacy_wire=True) as client, pytest.raises(ValueError, match="legacy_wire"):
        client.score([[1]], [[2]], model="moe", return_routed_experts=True)


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_ids_cross_the_wire_as_int16_or_int32_as_the_scorer_holds_them(rng, dtype):
    """int32 for a model of more than 32,768 experts (none of the tests' models): the client tells
    the element size from the length, so both decode to the same ids."""
    experts = 40_000 if dtype == np.int32 else EXPERTS
    routed = [rng.integers(0, experts, (c, 3, 4)).astype(dtype) for c in (2, 5)]
    scores = [SequenceScores(np.zeros(len(r), np.float32), routed_experts=r) for r in routed]
    response = at_once(response_from_result(ScoreResult("r", "m", 0, scores, tokens=9), scores_f32=True))
    assert [len(s.routed_experts.ids) for s in response.scores] == [r.nbytes for r in routed]
    answer = result(prepare([[1], [2]], [[3, 4], [5, 6, 7, 8, 9]]), [response], False, return_routed_experts=True)
    for got, want in zip(answer.routed_experts, routed, strict=True):
        np.testing.assert_array_equal(got, want)
