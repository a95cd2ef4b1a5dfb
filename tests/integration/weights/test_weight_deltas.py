"""Sparse weight deltas (``update_weights(..., delta=True)``) through a real server on loopback (CPU,
float32): only the changed elements travel, the result is bit for bit a dense push of the same
weights (equal fingerprints, equal scores), and a bad or stale delta leaves the live weights."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient
from logprob_client.weights import WeightDeltas
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.engine.weights import update as weights_update
from logprob_service.models.weights import model_fingerprint

from tests.helpers.models import make_model, random_sequences
from tests.helpers.seeds import session_seed
from tests.helpers.server import as_lists, assert_scores_match, live, settings, start, stop


@pytest.fixture
async def served(tmp_path):
    make_model("llama", tied=False, seed=session_seed("llama-deltas")).save_pretrained(tmp_path)
    running = await start(settings({"policy": str(tmp_path)}))
    yield running
    await stop(running)


def changed(weights: dict[str, torch.Tensor], rng: np.random.Generator, fraction: float) -> dict[str, torch.Tensor]:
    """A copy with ``fraction`` of each tensor's elements (at least one) given new random values."""
    out = {}
    for name, tensor in weights.items():
        flat = tensor.detach().clone().reshape(-1)
        where = rng.choice(flat.numel(), max(1, round(fraction * flat.numel())), replace=False)
        flat[torch.from_numpy(where)] += torch.from_numpy(rng.standard_normal(where.size).astype(np.float32))
        out[name] = flat.reshape(tensor.shape)
    return out


def model_with(weights: dict[str, torch.Tensor], like: torch.nn.Module) -> torch.nn.Module:
    model = make_model("llama", tied=False, seed=0)
    model.load_state_dict(weights)
    assert set(weights) == set(like.state_dict())
    return model.eval()


# on_device: the client holds and compares torch tensors where they are (here the CPU, with torch).
# batch: the server stages sparse tensors 2 at a time (several batches and a last one at commit),
# or as many as it does by default (one batch for this model).
@pytest.mark.parametrize("batch", [2, weights_update.SPARSE_BATCH_TENSORS])
@pytest.mark.parametrize("on_device", [False, True])
async def test_a_delta_sends_the_changed_elements_and_lands_as_a_dense_push_would(
    served, rng, on_device, batch, monkeypatch
):
    monkeypatch.setattr(weights_update, "SPARSE_BATCH_TENSORS", batch)
    start_weights = {k: v.clone() for k, v in served.scorer("policy").model.state_dict().items()}
    dense_bytes = sum(t.nbytes for t in start_weights.values())
    sequences = random_sequences(rng, 4)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        client.deltas["policy"] = WeightDeltas(on_device=on_device)
        first = await client.update_weights("policy", start_weights, delta=True)  # nothing held yet: dense
        assert client.deltas["policy"].last == {"dense": len(start_weights), "sparse": 0, "unchanged": 0}
        assert first.bytes == dense_bytes and first.fingerprint == (await live(client, "policy")).fingerprint

        # 2% of every element changed: indices (4 bytes) and float32 values (4) of 2% is 4% of dense.
        step = changed(start_weights, rng, 0.02)
        result = await client.update_weights("policy", step, delta=True)
        assert client.deltas["policy"].last == {"dense": 0, "sparse": len(step), "unchanged": 0}
        assert result.bytes <= 0.10 * dense_bytes, (result.bytes, dense_bytes)
        expected = model_with(step, served.scorer("policy").model)
        assert result.version == first.version + 1 and result.fingerprint == model_fingerprint(expected)
        assert_scores_match(expected, sequences, await client.score(*as_lists(sequences)))

        # One tensor rewritten whole goes dense, one untouched is not sent, the rest go sparse.
        names = sorted(step)
        again = changed(step, rng, 0.01) | {names[0]: step[names[0]] + 1.0, names[1]: step[names[1]]}
        result = await client.update_weights("policy", again, delta=True)
        assert client.deltas["policy"].last == {"dense": 1, "sparse": len(names) - 2, "unchanged": 1}
        assert result.tensors == len(names) - 1
        expected = model_with(again, served.scorer("policy").model)
        assert result.fingerprint == model_fingerprint(expected)
        assert_scores_match(expected, sequences, await client.score(*as_lists(sequences)))
        # What the client holds for the next delta (sparse tensors took their changes in place).
        held = {n: np.asarray(h).view(np.uint8) for n, h in client.deltas["policy"].held.items()}
        assert all(np.array_equal(held[n], again[n].numpy().view(np.uint8).reshape(-1)) for n in names)


async def test_a_delta_against_a_version_the_server_left_is_pushed_again_dense(served, rng):
    base = {k: v.clone() for k, v in served.scorer("policy").model.state_dict().items()}
    async with (
        AsyncLogprobClient(served.target, model="policy") as trainer,
        AsyncLogprobClient(served.target, model="policy") as other,
    ):
        await trainer.update_weights("policy", base, delta=True)  # version 1, held by the trainer
        await other.update_weights("policy", changed(base, rng, 0.5))  # version 2: not what it holds
        step = changed(base, rng, 0.02)
        result = await trainer.update_weights("policy", step, delta=True)
        # Refused as a delta against version 1, then sent dense and whole.
        assert result.version == 3 and trainer.deltas["policy"].last["dense"] == len(step)
        assert result.fingerprint == model_fingerprint(model_with(step, served.scorer("policy").model))
        assert trainer.deltas["policy"].version == 3


def sparse_stream(name: str, shape, indices, values, *, base, changed=None, offset=0, commit=True):
    """A raw UpdateWeights stream of one sparse tensor piece."""
    header = pb.UpdateWeightsHeader(model="policy", partial=True)
    if base is not None:
        header.base_version = base
    piece = pb.TensorChunk(
        name=name,
        dtype="float32",
        shape=shape,
        offset=offset,
        changed=len(indices) if changed is None else changed,
        indices=np.asarray(indices, dtype="<u4").tobytes(),
        data=np.asarray(values, dtype="<f4").tobytes(),
    )
    messages = [pb.UpdateWeightsRequest(header=header), pb.UpdateWeightsRequest(tensor=piece)]
    if commit:
        messages.append(pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(tensor_count=1)))
    return messages


NORM = "model.norm.weight"


@pytest.mark.parametrize(
    ("stream", "status", "fragments"),
    [
        (dict(indices=[1, 5], values=[0.5, 0.25], base=None), "INVALID_ARGUMENT", [NORM, "no base_version"]),
        (dict(indices=[1, 5], values=[0.5, 0.25], base=7), "FAILED_PRECONDITION", ["base_version", "version 7"]),
        (dict(indices=[1, 10**6], values=[0.5, 0.25], base=0), "INVALID_ARGUMENT", [NORM, "index 1000000"]),
        (dict(indices=[5, 1], values=[0.5, 0.25], base=0), "INVALID_ARGUMENT", [NORM, "changed element 1 has index 1"]),
        (dict(indices=[1, 5], values=[0.5], base=0), "INVALID_ARGUMENT", [NORM, "2 indices but 4 bytes"]),
        (dict(indices=[1, 5], values=[0.5, 0.25], base=0, changed=3), "ABORTED", [NORM, "2 of its 3 changed"]),
        (dict(indices=[1, 5], values=[0.5, 0.25], base=0, offset=2), "INVALID_ARGUMENT", [NORM, "expected 0"]),
        (dict(indices=[1, 5], values=[0.5, 0.25], base=0, commit=False), "ABORTED", ["before its commit"]),
        # More changed elements than the tensor has: refused before anything is allocated for them
        # (2**34 was a MemoryError, INTERNAL; 2**31 allocated 16 GiB).
        *(
            (dict(indices=[1, 5], values=[0.5, 0.25], base=0, changed=n), "INVALID_ARGUMENT", [NORM, f"changed {n} "])
            for n in (2**34, 2**31)
        ),
    ],
    ids=[
        "no-base",
        "stale-base",
        "index-out-of-range",
        "not-ascending",
        "values-short",
        "too-few",
        "order",
        "no-commit",
        "changed-2**34",
        "changed-2**31",
    ],
)
async def test_a_bad_sparse_piece_names_the_tensor_and_changes_nothing(served, stream, status, fragments):
    shape = list(served.scorer("policy").model.get_parameter(NORM).shape)
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.LogprobServiceStub(channel).UpdateWeights(iter(sparse_stream(NORM, shape, **stream)))
        assert caught.value.code() == getattr(grpc.StatusCode, status), caught.value.details()
        for fragment in fragments:
            assert fragment in caught.value.details()
        assert await live(client, "policy") == before


async def test_changed_past_the_tensors_elements_is_refused_naming_the_limit(served):
    shape = list(served.scorer("policy").model.get_parameter(NORM).shape)
    numel = int(np.prod(shape))
    async with grpc.aio.insecure_channel(served.target) as channel:
        stream = sparse_stream(NORM, shape, [1, 5], [0.5, 0.25], base=0, changed=numel + 1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.LogprobServiceStub(channel).UpdateWeights(iter(stream))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {NORM!r}: changed {numel + 1} is more than its {numel} elements" in caught.value.details()


async def test_a_good_sparse_piece_changes_exactly_its_elements(served):
    model = served.scorer("policy").model
    before = model.get_parameter(NORM).detach().clone()
    async with grpc.aio.insecure_channel(served.target) as channel:
        stream = sparse_stream(NORM, list(before.shape), [1, 5], [0.5, 0.25], base=0)
        response = await pb_grpc.LogprobServiceStub(channel).UpdateWeights(iter(stream))
    after = model.get_parameter(NORM).detach()
    expected = before.clone()
    expected[[1, 5]] = torch.tensor([0.5, 0.25])
    assert response.version == 1 and response.bytes == 2 * 4 + 2 * 4 and torch.equal(after, expected)
