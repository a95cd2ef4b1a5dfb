"""Weights as named tensors (server side) and their streaming (client side), without a server."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from logprob_client.weights import update_requests
from logprob_service.errors import InvalidArgument
from logprob_service.models.weights import UpdatableWeights, fingerprint, model_digests, tensor_digests

from tests.helpers.calls import parsed, unpacked
from tests.helpers.models import make_model


def test_tied_weights_answer_to_either_name_and_count_once(seed):
    model = make_model("gemma2", tied=True, seed=seed)
    weights = UpdatableWeights(model.state_dict())
    assert weights.canonical("lm_head.weight") == weights.canonical("model.embed_tokens.weight")
    everything_but_the_embedding = [n for n in model.state_dict() if n != "model.embed_tokens.weight"]
    assert weights.missing(everything_but_the_embedding) == []  # lm_head.weight is the same storage
    assert weights.missing([n for n in everything_but_the_embedding if n != "lm_head.weight"]) == [
        "model.embed_tokens.weight"
    ]
    assert len(model_digests(model)) == len(model.state_dict()) - 1


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "message"),
    [
        ("model.norm.weight", "float32", (3,), "shape [3] does not match the model's [64]"),
        ("model.norm.weight", "float16", (64,), "dtype float16 does not match the model's float32"),
        ("model.nope", "float32", (64,), "'model.nope': no such weight"),
    ],
)
def test_check_names_the_tensor_and_what_is_wrong(name, dtype, shape, message):
    weights = UpdatableWeights(make_model("llama", tied=False, seed=3).state_dict())
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        weights.check(name, dtype, shape)


def test_fingerprint_covers_names_dtypes_shapes_and_bytes(rng):
    a = {"w": torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32))}
    base = fingerprint(tensor_digests(a))
    assert fingerprint(tensor_digests({"w": a["w"].clone()})) == base
    assert fingerprint(tensor_digests({"v": a["w"]})) != base  # name
    assert fingerprint(tensor_digests({"w": a["w"].reshape(5, 4)})) != base  # shape, same bytes
    assert fingerprint(tensor_digests({"w": a["w"].view(torch.int32)})) != base  # dtype, same bytes
    changed = a["w"].clone()
    changed[3, 4] = torch.nextafter(changed[3, 4], torch.tensor(np.inf))  # one ulp
    assert fingerprint(tensor_digests({"w": changed})) != base


def reassemble(messages) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    tensors: dict[str, tuple[str, tuple[int, ...], bytearray]] = {}
    for m in messages:
        if m.WhichOneof("kind") == "tensor":
            t = m.tensor
            dtype, shape, data = tensors.setdefault(t.name, (t.dtype, tuple(t.shape), bytearray()))
            assert t.offset == len(data) and (t.dtype, tuple(t.shape)) == (dtype, shape)
            data += t.data
    return {k: (d, s, bytes(b)) for k, (d, s, b) in tensors.items()}


def test_update_stream_carries_every_byte_in_order_in_small_pieces(rng):
    weights = {
        "bf16": torch.randn(33, 17).to(torch.bfloat16),
        "f32": rng.standard_normal((5, 7)).astype(np.float32),  # numpy works too
        "f16-strided": torch.randn(10, 8, dtype=torch.float16).t(),  # not contiguous: sent in C order
        "empty": torch.empty(0, 4),
    }
    messages = unpacked(parsed(update_requests("m", weights.items(), version=3, partial=True, chunk_bytes=100)))
    assert messages[0].header.model == "m" and messages[0].header.version == 3 and messages[0].header.partial
    assert messages[-1].commit.tensor_count == 4
    assert max(len(m.tensor.data) for m in messages[1:-1]) == 100
    got = reassemble(messages)
    assert got["bf16"] == ("bfloat16", (33, 17), weights["bf16"].view(torch.int16).numpy().tobytes())
    assert got["f32"] == ("float32", (5, 7), weights["f32"].tobytes())
    assert got["f16-strided"] == ("float16", (8, 10), weights["f16-strided"].contiguous().numpy().tobytes())
    assert got["empty"] == ("float32", (0, 4), b"")


def test_update_stream_reads_one_tensor_ahead():
    """The generator is lazy: a tensor is read while the one before it is sent, no sooner."""
    read = []

    def weights():
        for i in range(3):
            read.append(i)
            yield f"t{i}", torch.randn(4)

    # pack=False: each piece is sent alone (packed, small pieces wait for the ones after them).
    stream = update_requests("m", weights(), version=0, partial=True, pack=False)
    next(stream), next(stream)  # header, first piece of t0
    assert read == [0, 1]
