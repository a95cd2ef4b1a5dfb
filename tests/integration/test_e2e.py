"""End to end over real gRPC on loopback: both clients, both input layouts, the stream RPC,
health, reflection and ListModels. Scores are checked against the float64 full-logits
reference of the very model the server holds."""

from __future__ import annotations

import asyncio
import gc

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from logprob_client import AsyncLogprobClient, LogprobClient, ScoreInput
from logprob_proto import logprob_pb2

from tests.helpers.calls import assert_matches_reference, random_batch, trl_layout
from tests.helpers.server import start, stop, test_settings


@pytest.mark.parametrize("model_name", ["default", "gemma"])
async def test_sync_client_lists(running, model_name, rng):
    vocab = running.service.device_side.registry.get(model_name).info.vocab_size
    prompts, completions = random_batch(rng, 5, vocab)
    with LogprobClient(running.target) as client:
        logprobs, entropies = await asyncio.to_thread(
            client.score, prompts, completions, model=model_name, temperature=0.8, return_entropy=True
        )
    assert [len(x) for x in logprobs] == [len(c) for c in completions]
    assert_matches_reference(running, model_name, prompts, completions, logprobs, 0.8, entropies)


async def test_async_client_lists(running, rng):
    prompts, completions = random_batch(rng, 4, 4096)
    async with AsyncLogprobClient(running.target) as client:
        logprobs = await client.score(prompts, completions)
    assert_matches_reference(running, "default", prompts, completions, logprobs)


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("which", ["sync", "async"])
async def test_dense_trainer_layout(running, as_torch, which, rng):
    prompts, completions = random_batch(rng, 6, 4096)
    prompt_ids, prompt_mask, completion_ids, completion_mask = trl_layout(rng, prompts, completions)
    completion_mask[2] = 0  # a row with nothing to score
    if as_torch:
        prompt_ids, prompt_mask, completion_ids, completion_mask = map(
            torch.from_numpy, (prompt_ids, prompt_mask, completion_ids, completion_mask)
        )
    kwargs = dict(prompt_mask=prompt_mask, completion_mask=completion_mask)
    if which == "sync":
        with LogprobClient(running.target) as client:
            out = await asyncio.to_thread(client.score, prompt_ids, completion_ids, **kwargs)
    else:
        async with AsyncLogprobClient(running.target) as client:
            out = await client.score(prompt_ids, completion_ids, **kwargs)
    assert isinstance(out, torch.Tensor) == as_torch
    out = np.asarray(out)
    assert out.shape == completion_ids.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out[np.asarray(completion_mask) == 0], 0.0)
    kept = [i for i in range(len(prompts)) if i != 2]
    per_row = [out[i, : len(completions[i])] for i in kept]
    assert_matches_reference(running, "default", [prompts[i] for i in kept], [completions[i] for i in kept], per_row)


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_stream_rpc_pipelines_requests_and_isolates_failures(running, which, rng):
    batches = [random_batch(rng, int(rng.integers(1, 5)), 4096) for _ in range(6)]
    inputs = [ScoreInput(p, c) for p, c in batches]
    inputs.insert(3, ScoreInput([[1, 2]], [[99999]]))  # a bad one in the middle of the stream
    if which == "sync":
        with LogprobClient(running.target) as client:
            results = await asyncio.to_thread(client.score_many, inputs, return_exceptions=True)
    else:
        async with AsyncLogprobClient(running.target) as client:
            results = await client.score_many(inputs, return_exceptions=True)
    assert len(results) == len(inputs)
    from logprob_client import InvalidRequest

    assert isinstance(results[3], InvalidRequest) and "99999" in results[3].message
    good = results[:3] + results[4:]
    for (prompts, completions), logprobs in zip(batches, good):
        assert_matches_reference(running, "default", prompts, completions, logprobs)


async def test_stream_rpc_has_several_requests_in_flight(running, rng):
    """Responses arrive as their requests finish, not one request at a time: the server reads
    all requests before the first response is consumed."""
    from logprob_proto import logprob_pb2 as pb
    from logprob_proto import logprob_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(running.target) as channel:
        call = pb_grpc.LogprobServiceStub(channel).ScoreTokensStream()
        ids = [f"r{i}" for i in range(5)]
        for rid in ids:
            p, c = random_batch(rng, 2, 4096)
            await call.write(
                pb.ScoreRequest(
                    request_id=rid, sequences=[pb.Sequence(prompt_ids=a, completion_ids=b) for a, b in zip(p, c)]
                )
            )
        # All five written before reading any response: the server must accept them concurrently.
        received = {}
        for _ in ids:
            response = await call.read()
            received[response.request_id] = response
        await call.done_writing()
        assert sorted(received) == ids
        assert all(len(r.scores) == 2 and not r.HasField("error") for r in received.values())


async def test_health_serving_after_warm_up_and_not_before(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint), warm=False)
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "logprob.v1.LogprobService"):
                status = (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            await running.service.warm_up()
            for service in ("", "logprob.v1.LogprobService"):
                status = (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
                assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await stop(running)


async def test_reflection_lists_the_service(running):
    def services():
        with grpc.insecure_channel(running.target) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            names = db.get_services()
            methods = [m.name for m in db.FindFileContainingSymbol("logprob.v1.LogprobService").service[0].method]
            return names, methods

    names, methods = await asyncio.to_thread(services)
    assert "logprob.v1.LogprobService" in names and "grpc.health.v1.Health" in names
    # The service as the .proto declares it (tests/client/test_proto_stubs.py lists its methods).
    assert methods == [m.name for m in logprob_pb2.DESCRIPTOR.services_by_name["LogprobService"].methods]


async def test_list_models(running, gemma_checkpoint):
    async with AsyncLogprobClient(running.target) as client:
        models = {m.name: m for m in await client.list_models()}
    assert set(models) == {"default", "gemma"}
    tiny = models["default"]
    assert tiny.architecture == "LlamaForCausalLM" and tiny.vocab_size == 4096 and tiny.max_positions == 4096
    assert tiny.dtype == "float32" and tiny.device == "cpu" and tiny.version == 0
    assert tiny.source == "builtin:tiny-llama" and len(tiny.fingerprint) == 32
    assert tiny.limits.max_sequences_per_request == 16 and tiny.limits.max_tokens_per_request == 4000
    assert models["gemma"].architecture == "Gemma2ForCausalLM" and models["gemma"].source == str(gemma_checkpoint)
    assert tiny.fingerprint != models["gemma"].fingerprint


async def test_response_metadata_accounts_for_time_and_tokens(running):
    from logprob_proto import logprob_pb2 as pb
    from logprob_proto import logprob_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(running.target) as channel:
        response = await pb_grpc.LogprobServiceStub(channel).ScoreTokens(
            pb.ScoreRequest(request_id="meta-1", sequences=[pb.Sequence(prompt_ids=[5, 6, 7], completion_ids=[8, 9])])
        )
    assert response.request_id == "meta-1" and response.model == "default" and response.model_version == 0
    m = response.metadata
    assert m.tokens == 5 and m.compute_ns > 0 and m.queue_ns >= 0
    assert m.total_ns >= m.queue_ns + m.compute_ns


async def test_what_is_alive_after_start_up_is_frozen_out_of_the_collectors_reach(gemma_checkpoint):
    """``gc_freeze`` (on by default; off in the other tests, which start many servers in one
    process): once warm, the server collects and freezes the heap, so a full collection walks only
    what came after (the service itself among what it skips)."""
    gc.unfreeze()
    running = await start(test_settings(gemma_checkpoint, gc_freeze=True))
    try:
        assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()  # torch, transformers, the models
        assert not any(obj is running.service for obj in gc.get_objects()), "the service is still walked"
    finally:
        await stop(running)
    assert gc.get_freeze_count() == 0, "closing the service gives the heap back to the collector"
