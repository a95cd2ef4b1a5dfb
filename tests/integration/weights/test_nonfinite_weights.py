"""NaN and infinite weights and scores (issue 38, item 7), through a real server on loopback (CPU,
float32).

A weight update any of whose tensors holds a NaN or an infinity is refused with INVALID_ARGUMENT
naming the tensor, whether it comes whole, partial, over several streams, as a sparse delta or
from a file, and the live weights stay (``check_finite_weights``, on by default). Scores that come
out non-finite anyway (weights that went live unchecked) are INTERNAL naming the model and its
version, and the server goes on serving.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from logprob_client import AsyncLogprobClient, InvalidRequest, LogprobError
from logprob_client.weights import WeightDeltas
from logprob_service.models.weights import model_fingerprint
from safetensors.torch import save_file

from tests.helpers.models import make_model, random_sequences
from tests.helpers.server import as_lists, assert_scores_match, live, new_seed, settings, start, stop

LAYER = "model.layers.1.mlp.down_proj.weight"


def poisoned(state: dict[str, torch.Tensor], name: str, value: float, at: int) -> dict[str, torch.Tensor]:
    """``state`` with element ``at`` of tensor ``name`` set to ``value``."""
    bad = state[name].clone()
    bad.view(-1)[at] = value
    return {**state, name: bad}


async def test_pushes_holding_nan_or_inf_are_refused_naming_the_tensor(policy_server, tmp_path, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    state = new.state_dict()
    sequences = random_sequences(rng, 4)
    at = int(rng.integers(state[LAYER].numel()))
    async with AsyncLogprobClient(policy_server.target, model="policy") as client:
        before = await live(client, "policy")
        refusals = {
            "a full push, NaN": dict(weights=poisoned(state, LAYER, math.nan, at)),
            "a full push over 3 streams, -inf": dict(weights=poisoned(state, LAYER, -math.inf, at), streams=3),
            "a partial push, +inf": dict(weights={LAYER: poisoned(state, LAYER, math.inf, at)[LAYER]}, partial=True),
        }
        for what, push in refusals.items():
            weights = push.pop("weights")
            with pytest.raises(InvalidRequest, match=rf"tensor '{LAYER}': holds NaN or infinite values") as info:
                await client.update_weights("policy", weights, **push)
            assert "nothing applied" in str(info.value), what
            assert await live(client, "policy") == before, what

        # Two tensors at once: the message names one and counts the other.
        both = poisoned(poisoned(state, LAYER, math.nan, at), "model.norm.weight", math.inf, 0)
        with pytest.raises(InvalidRequest, match=r"holds NaN or infinite values \(as do 1 more: '"):
            await client.update_weights("policy", both)

        # A sparse delta: the finite first push goes live, a step that changes one element to NaN does not.
        client.deltas["policy"] = WeightDeltas()
        assert (await client.update_weights("policy", state, delta=True)).version == 1
        with pytest.raises(InvalidRequest, match=rf"tensor '{LAYER}': holds NaN or infinite values"):
            await client.update_weights("policy", poisoned(state, LAYER, math.nan, at), delta=True)
        assert client.deltas["policy"].last["sparse"] >= 1, "the refused step went sparse"

        # From a file.
        file = tmp_path / "m.safetensors"
        save_file({k: v.contiguous() for k, v in poisoned(state, LAYER, math.nan, at).items()}, file)
        with pytest.raises(InvalidRequest, match=rf"tensor '{LAYER}': holds NaN or infinite values"):
            await client.load_weights("policy", str(file))

        after = await live(client, "policy")
        assert after.version == 1 and after.fingerprint == model_fingerprint(new)
        assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))


async def test_nonfinite_scores_are_internal_naming_the_model_and_version(policy_server, rng):
    """Weights that hold a NaN some other way than through an update (here: written in place, as a
    checkpoint loaded at start-up could hold it): their scores are refused, the server serves on."""
    sequences = random_sequences(rng, 3)
    weight = policy_server.scorer("policy").model.get_parameter(LAYER)
    kept = weight.detach().clone()
    async with AsyncLogprobClient(policy_server.target, model="policy", max_attempts=1) as client:
        expected = await client.score(*as_lists(sequences))
        with torch.no_grad():
            weight.view(-1)[int(rng.integers(weight.numel()))] = math.nan
        try:
            with pytest.raises(LogprobError) as info:
                await client.score(*as_lists(sequences))
        finally:
            with torch.no_grad():
                weight.copy_(kept)
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert "model 'policy' version 0 scored NaN or infinite log-probabilities" in info.value.message
        assert "request_id=" in info.value.message
        health = await policy_server.service.edge.health.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        again = await client.score(*as_lists(sequences))
        assert all((a == b).all() for a, b in zip(again, expected, strict=True))


async def test_with_the_check_off_nonfinite_weights_go_live(llama_checkpoint, rng):
    running = await start(settings({"policy": str(llama_checkpoint)}, check_finite_weights=False))
    try:
        new = make_model("llama", tied=False, seed=new_seed(rng))
        async with AsyncLogprobClient(running.target, model="policy", max_attempts=1) as client:
            assert (await client.update_weights("policy", poisoned(new.state_dict(), LAYER, math.nan, 0))).version == 1
    finally:
        await stop(running)
