"""A push split into UpdateWeights calls: each a stream of messages, read a tensor at a time.

Tensors are read one by one (a GPU tensor is copied to host memory alone, on a worker thread
while the one before it is sent) and cut into ``chunk_bytes`` pieces of their raw bytes, so the
client never holds more than two tensors plus one message per stream, however large the model.
torch is imported only when tensors are given.

Messages are framed as ``logprob_proto.framing`` lays them out, in parts (``Message``). One gRPC
stream carries one message at a time, so a push is spread over ``streams`` calls at once
(``UpdateWeightsHeader.streams``), each with its share of the tensors (``split``), to keep more
bytes in flight. A delta push's calls are made by ``deltas.WeightDeltas``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_proto.framing import Message, dense_pieces, join, pack_pieces

# 4 MiB pieces over 4 streams, each on a connection of its own, moved the most bytes through this
# client and server on loopback (H100 host, 16 cores, 1.5B shape: 2.0-2.4 GB/s, against 1.7-1.8
# with 2 MiB pieces and 1.1-1.3 with 1 MiB; 8 streams no more; benchmarks/RESULTS.md).
DEFAULT_CHUNK_BYTES = 4 * 1024**2
DEFAULT_STREAMS = 4
T = TypeVar("T")
R = TypeVar("R")


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
        # reshape: a 0-d tensor (a scalar parameter) has no dimension to view as bytes
        data = host.reshape(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
        return dtype, tuple(host.shape), memoryview(data).cast("B")
    array = np.ascontiguousarray(tensor)
    return array.dtype.name, tuple(array.shape), memoryview(array.view(np.uint8).reshape(-1)).cast("B")


# Tensors compared ahead of the one being sent: a model's many small tensors have too few parts
# each to keep the threads busy one tensor at a time.
LOOKAHEAD = 4


@functools.cache
def tensors_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(LOOKAHEAD, thread_name_prefix="logprob-delta-tensor")


def read_ahead(items: Iterable[T], work: Callable[[T], R], ahead: int = LOOKAHEAD) -> Iterator[R]:
    """``work`` of each item, in order, done up to ``ahead`` items ahead on worker threads."""
    window: collections.deque[concurrent.futures.Future[R]] = collections.deque()
    for item in items:
        window.append(tensors_pool().submit(work, item))
        if len(window) > ahead:
            yield window.popleft().result()
    while window:
        yield window.popleft().result()


def call_messages(
    header: pb.UpdateWeightsHeader, tensors: Iterable[Iterator[Message]], chunk_bytes: int, pack: bool
) -> Iterator[Message]:
    """One UpdateWeights call's messages: the header, each tensor's pieces (``pack``: packed into
    messages of up to ``chunk_bytes``, ``pack_pieces``), the commit."""
    yield (pb.UpdateWeightsRequest(header=header).SerializeToString(),)
    count = 0

    def pieces() -> Iterator[Message]:
        nonlocal count
        for tensor in tensors:
            yield from tensor
            count += 1

    yield from pack_pieces(pieces(), chunk_bytes) if pack else pieces()
    yield (pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(tensor_count=count)).SerializeToString(),)


def check_push(version: int, chunk_bytes: int, streams: int = 1) -> None:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if version < 0:
        raise ValueError(f"version must be >= 0 (0: the live version + 1), got {version}")
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")


def _nbytes(tensor: Any) -> int:
    """A tensor's or array's bytes, read from its shape (nothing is copied)."""
    if type(tensor).__module__.startswith("torch"):
        return tensor.numel() * tensor.element_size()
    return np.asarray(tensor).nbytes


def split(sizes: Sequence[int], streams: int) -> list[list[int]]:
    """The indices of ``sizes``, dealt to at most ``streams`` groups of about equal total size
    (each in the order given): largest first, to the group with the least so far."""
    groups: list[list[int]] = [[] for _ in range(min(streams, len(sizes)) or 1)]
    totals = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        least = totals.index(min(totals))
        groups[least].append(i)
        totals[least] += sizes[i]
    return [sorted(group) for group in groups]


def push_calls(
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]], streams: int, header: pb.UpdateWeightsHeader
) -> tuple[list[Iterable[tuple[str, Any]]], pb.UpdateWeightsHeader]:
    """The ``(name, tensor)`` pairs of each call of a push over at most ``streams`` calls (``split``;
    over one call, ``weights`` as given, read lazily), and ``header`` marked for that many calls."""
    groups: list[Iterable[tuple[str, Any]]] = [named_tensors(weights)]
    if streams > 1:
        named = list(groups[0])
        groups = [[named[i] for i in group] for group in split([_nbytes(t) for _, t in named], streams)]
    if len(groups) > 1:
        header.streams, header.update_id = len(groups), uuid.uuid4().hex
    return groups, header


def update_streams(
    model: str,
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    version: int,
    partial: bool,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    streams: int = 1,
    pack: bool = True,
) -> list[Iterator[Message]]:
    """The UpdateWeights calls of one dense push, each a stream of messages (header, its tensors in
    ``chunk_bytes`` pieces, commit; ``Message``: ``join`` makes one's bytes), read lazily: a tensor
    is read when its turn comes (over one stream, ``weights`` itself is read so too). ``pack``:
    smaller pieces (a tensor's last, small tensors) go several to a message of up to
    ``chunk_bytes`` (``tensors``; servers since 2026-11-25), else each in its own."""
    check_push(version, chunk_bytes, streams)
    groups, header = push_calls(weights, streams, pb.UpdateWeightsHeader(model=model, version=version, partial=partial))
    return [
        call_messages(
            header,
            (dense_pieces(n, *read, chunk_bytes) for n, read in read_ahead(group, _read, ahead=1)),
            chunk_bytes,
            pack,
        )
        for group in groups
    ]


def _read(named: tuple[str, Any]) -> tuple[str, tuple[str, tuple[int, ...], memoryview]]:
    """A tensor's raw bytes (``raw_bytes``; a GPU tensor's copied to host memory, on a worker
    thread while the tensor before it is sent: dense pushes from a trainer's GPU ran at 1.3-2.2
    GB/s, against 2.1-3.0 from host memory, when each tensor was read only once its turn came)."""
    name, tensor = named
    return name, raw_bytes(tensor)


def update_requests(
    model: str,
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    version: int,
    partial: bool,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pack: bool = True,
) -> Iterator[bytes]:
    """The serialized messages of a push over one call: ``update_streams`` with one stream, joined."""
    (stream,) = update_streams(model, weights, version=version, partial=partial, chunk_bytes=chunk_bytes, pack=pack)
    return map(join, stream)


# Sparse pieces name elements with uint32 indices.
