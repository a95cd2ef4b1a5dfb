"""Streaming a model's weights to the server (UpdateWeights), one chunk at a time.

Tensors are read one by one (a GPU tensor is copied to host memory alone, when its turn comes)
and cut into ``chunk_bytes`` pieces of their raw bytes, so the client never holds more than one
tensor plus one message, however large the model. torch is imported only when tensors are given.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from logprob_proto import logprob_pb2 as pb

DEFAULT_CHUNK_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class UpdateResult:
    """What the server reports once new weights are live."""

    model: str
    version: int
    fingerprint: str
    tensors: int
    bytes: int
    staged_on: str  # where the server staged them before the swap: "cuda:0", "cpu"
    total_s: float
    swap_s: float  # how long scoring of the model paused for the swap

    @classmethod
    def from_proto(cls, r: pb.UpdateWeightsResponse) -> UpdateResult:
        return cls(
            r.model, r.version, r.fingerprint, r.tensors, r.bytes, r.staged_on, r.total_ns / 1e9, r.swap_ns / 1e9
        )


def named_tensors(weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs from a state dict, or any iterable of pairs (e.g. ``named_parameters()``)."""
    return iter(weights.items()) if isinstance(weights, Mapping) else iter(weights)


def raw_bytes(tensor: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """A tensor or array as (dtype name, shape, little-endian C-order bytes)."""
    if sys.byteorder != "little":
        raise RuntimeError("update_weights sends raw little-endian bytes; this host is big-endian")
    if type(tensor).__module__.startswith("torch"):
        import torch

        host = tensor.detach().to("cpu").contiguous()
        dtype = str(host.dtype).removeprefix("torch.")
        data = host.view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
        return dtype, tuple(host.shape), memoryview(data).cast("B")
    array = np.ascontiguousarray(tensor)
    return array.dtype.name, tuple(array.shape), memoryview(array.view(np.uint8).reshape(-1)).cast("B")


def update_requests(
    model: str,
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    version: int,
    partial: bool,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[pb.UpdateWeightsRequest]:
    """The UpdateWeights stream: header, every tensor in ``chunk_bytes`` pieces, commit."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if version < 0:
        raise ValueError(f"version must be >= 0 (0: the live version + 1), got {version}")
    yield pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(model=model, version=version, partial=partial))
    count = 0
    for name, tensor in named_tensors(weights):
        dtype, shape, data = raw_bytes(tensor)
        for offset in range(0, max(len(data), 1), chunk_bytes):  # an empty tensor still sends one piece
            piece = pb.TensorChunk(
                name=name, dtype=dtype, shape=shape, offset=offset, data=bytes(data[offset : offset + chunk_bytes])
            )
            yield pb.UpdateWeightsRequest(tensor=piece)
        count += 1
    yield pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(tensor_count=count))
