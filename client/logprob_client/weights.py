"""Streaming a model's weights to the server (UpdateWeights), one chunk at a time.

Tensors are read one by one (a GPU tensor is copied to host memory alone, on a worker thread
while the one before it is sent) and cut into ``chunk_bytes`` pieces of their raw bytes, so the
client never holds more than two tensors plus one message per stream, however large the model.
A delta push (``WeightDeltas``) also holds the bytes last pushed, and compares up to
``LOOKAHEAD`` tensors ahead of the one it sends (copies held on a GPU: all of a push's tensors
together, while its calls start). torch is imported only when tensors are given.

Messages are serialized here, in parts (``Message``): a dense piece is the framing protobuf would
write around a view of the tensor's bytes (``dense_parts``). Joined (gRPC's request serializer
on this process's own calls), that is one copy of the bytes into the message, where protobuf would
make two (into the message object, then out of it); the push processes (``push_processes``) copy the
parts into shared memory instead, and join them in another process. One gRPC stream carries one
message at a time, so a push is spread over ``streams`` calls at once
(``UpdateWeightsHeader.streams``), each with its share of the tensors (``split``), to keep more
bytes in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import math
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from logprob_proto import logprob_pb2 as pb

from .errors import FailedPrecondition, LogprobError

# 4 MiB pieces over 4 streams, each on a connection of its own, moved the most bytes through this
# client and server on loopback (H100 host, 16 cores, 1.5B shape: 2.0-2.4 GB/s, against 1.7-1.8
# with 2 MiB pieces and 1.1-1.3 with 1 MiB; 8 streams no more; benchmarks/RESULTS.md).
DEFAULT_CHUNK_BYTES = 4 * 1024**2
DEFAULT_STREAMS = 4
T = TypeVar("T")
R = TypeVar("R")
# One UpdateWeightsRequest, serialized, in parts: joined, they are the bytes protobuf writes for it.
Message = tuple[bytes | memoryview, ...]


def join(message: Message) -> bytes:
    """A message's bytes (``Message``): its parts copied into one ``bytes``."""
    return b"".join(message)


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


def _varint(value: int) -> bytes:
    """protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_TENSOR_TAG = b"\x12"  # UpdateWeightsRequest.tensor: field 2, length-delimited
_DATA_TAG = b"\x2a"  # TensorChunk.data: field 5, length-delimited
_CHANGED_TAG = b"\x30"  # TensorChunk.changed: field 6, varint
_INDICES_TAG = b"\x3a"  # TensorChunk.indices: field 7, length-delimited
_TENSORS_TAG = b"\x22"  # UpdateWeightsRequest.tensors: field 4, length-delimited
_CHUNK_TAG = b"\x0a"  # TensorChunks.chunks: field 1, length-delimited


def dense_parts(name: str, dtype: str, shape: tuple[int, ...], offset: int, data: memoryview) -> Message:
    """A dense piece's UpdateWeightsRequest as protobuf writes it (fields in number order, ``data``
    last, and left out when empty), in parts: ``data`` is one of them, not copied."""
    fields = pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset).SerializeToString()
    data_head = _DATA_TAG + _varint(len(data)) if len(data) else b""
    return _TENSOR_TAG, _varint(len(fields) + len(data_head) + len(data)), fields, data_head, data


def dense_piece(name: str, dtype: str, shape: tuple[int, ...], offset: int, data: memoryview) -> bytes:
    """``dense_parts`` joined: the piece's bytes, made with one copy of ``data``."""
    return join(dense_parts(name, dtype, shape, offset, data))


def _dense_pieces(name: str, dtype: str, shape: tuple[int, ...], data: memoryview, chunk_bytes: int):
    for offset in range(0, max(len(data), 1), chunk_bytes):  # an empty tensor still sends one piece
        yield dense_parts(name, dtype, shape, offset, data[offset : offset + chunk_bytes])


def sparse_parts(
    name: str, dtype: str, shape: tuple[int, ...], offset: int, changed: int, indices: memoryview, values: memoryview
) -> Message:
    """A sparse piece's UpdateWeightsRequest as protobuf writes it (fields in number order:
    ``data``, the values, before ``changed`` and ``indices``), in parts: ``indices`` (little-endian
    uint32s) and ``values`` (their raw bytes) are two of them, not copied."""
    fields = pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset).SerializeToString()
    parts = [
        fields,
        *((_DATA_TAG, _varint(len(values)), values) if len(values) else ()),
        *((_CHANGED_TAG, _varint(changed)) if changed else ()),
        *((_INDICES_TAG, _varint(len(indices)), indices) if len(indices) else ()),
    ]
    return _TENSOR_TAG, _varint(sum(len(p) for p in parts)), *parts


def sparse_piece(
    name: str, dtype: str, shape: tuple[int, ...], offset: int, changed: int, indices: memoryview, values: memoryview
) -> bytes:
    """``sparse_parts`` joined: the piece's bytes, made with one copy of ``indices`` and ``values``."""
    return join(sparse_parts(name, dtype, shape, offset, changed, indices, values))


def _sparse_pieces(
    name: str, dtype: str, shape: tuple[int, ...], indices: np.ndarray, values: np.ndarray, chunk_bytes: int
):
    """``indices``: uint32; ``values``: their raw bytes (uint8)."""
    count, itemsize = indices.size, values.nbytes // indices.size
    per_piece = max(1, chunk_bytes // (4 + itemsize))
    index_bytes = memoryview(indices.astype("<u4", copy=False)).cast("B")
    value_bytes = memoryview(values)
    for start in range(0, count, per_piece):
        end = min(start + per_piece, count)
        yield sparse_parts(
            name,
            dtype,
            shape,
            start,
            count,
            index_bytes[start * 4 : end * 4],
            value_bytes[start * itemsize : end * itemsize],
        )


def packed(pieces: list[Message]) -> Message:
    """Pieces' messages as one UpdateWeightsRequest holding them all (``tensors``), in order; one
    piece's message as it is. A piece's message is its tag, its TensorChunk's length and parts; as
    an element of TensorChunks.chunks it is the same with the element's tag, so nothing is copied."""
    if len(pieces) == 1:
        return pieces[0]
    parts = [part for piece in pieces for part in (_CHUNK_TAG, *piece[1:])]
    return _TENSORS_TAG, _varint(sum(len(p) for p in parts)), *parts


def _pack(pieces: Iterable[Message], most_bytes: int) -> Iterator[Message]:
    """``pieces``' messages packed in order into messages of at most ``most_bytes`` each (``packed``):
    a piece that fills them goes alone, as it came, and at once, not held for the piece after it."""
    batch: list[Message] = []
    size = 0
    for piece in pieces:
        n = sum(len(p) for p in piece)
        if batch and size + n > most_bytes:
            yield packed(batch)
            batch, size = [], 0
        batch.append(piece)
        size += n
        if size >= most_bytes:
            yield packed(batch)
            batch, size = [], 0
    if batch:
        yield packed(batch)


def _stream(
    header: pb.UpdateWeightsHeader, tensors: Iterable[Iterator[Message]], chunk_bytes: int, pack: bool
) -> Iterator[Message]:
    """One UpdateWeights call's messages: the header, each tensor's pieces (``pack``: packed into
    messages of up to ``chunk_bytes``, ``_pack``), the commit."""
    yield (pb.UpdateWeightsRequest(header=header).SerializeToString(),)
    count = 0

    def pieces() -> Iterator[Message]:
        nonlocal count
        for tensor in tensors:
            yield from tensor
            count += 1

    yield from _pack(pieces(), chunk_bytes) if pack else pieces()
    yield (pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(tensor_count=count)).SerializeToString(),)


def _check(version: int, chunk_bytes: int, streams: int = 1) -> None:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if version < 0:
        raise ValueError(f"version must be >= 0 (0: the live version + 1), got {version}")
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")


def tensor_nbytes(tensor: Any) -> int:
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


def _calls(
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]], streams: int, header: pb.UpdateWeightsHeader
) -> tuple[list[Iterable[tuple[str, Any]]], pb.UpdateWeightsHeader]:
    """The ``(name, tensor)`` pairs of each call of a push over at most ``streams`` calls (``split``;
    over one call, ``weights`` as given, read lazily), and ``header`` marked for that many calls."""
    groups: list[Iterable[tuple[str, Any]]] = [named_tensors(weights)]
    if streams > 1:
        named = list(groups[0])
        groups = [[named[i] for i in group] for group in split([tensor_nbytes(t) for _, t in named], streams)]
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
    _check(version, chunk_bytes, streams)
    groups, header = _calls(weights, streams, pb.UpdateWeightsHeader(model=model, version=version, partial=partial))
    return [
        _stream(
            header,
            (_dense_pieces(n, *read, chunk_bytes) for n, read in _ahead(group, _read, ahead=1)),
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
MAX_SPARSE_ELEMENTS = 2**32
# Elements per task of a delta's comparison or update: ~1M, so that even a layer's matrices
# split over the threads and each part's temporaries stay in cache.
PART_ELEMENTS = 1 << 20


# Tensors compared ahead of the one being sent: a model's many small tensors have too few parts
# each to keep the threads busy one tensor at a time.
LOOKAHEAD = 4


@functools.cache
def _parts_pool() -> concurrent.futures.ThreadPoolExecutor:
    # numpy compares, finds and moves elements without the GIL: threads go at the memory's speed.
    return concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="logprob-delta")


@functools.cache
def _tensors_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(LOOKAHEAD, thread_name_prefix="logprob-delta-tensor")


@functools.cache
def _held_pool() -> concurrent.futures.ThreadPoolExecutor:
    # One thread: torch's calls on several took turns at the interpreter, slower than one alone.
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logprob-delta-held")


def _ahead(items: Iterable[T], work: Callable[[T], R], ahead: int = LOOKAHEAD) -> Iterator[R]:
    """``work`` of each item, in order, done up to ``ahead`` items ahead on worker threads."""
    window: collections.deque[concurrent.futures.Future[R]] = collections.deque()
    for item in items:
        window.append(_tensors_pool().submit(work, item))
        if len(window) > ahead:
            yield window.popleft().result()
    while window:
        yield window.popleft().result()


def changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the flat arrays ``old`` and ``new`` (one size and dtype, at most ``MAX_SPARSE_ELEMENTS``)
    differ: the indices (ascending, uint32, as they travel) and ``new``'s values there, found in
    parallel parts."""

    def part(start: int) -> tuple[np.ndarray, np.ndarray]:
        piece = new[start : start + PART_ELEMENTS]
        where = np.flatnonzero(old[start : start + PART_ELEMENTS] != piece)
        return (where + start).astype(np.uint32), piece[where]

    parts = list(_parts_pool().map(part, range(0, new.size, PART_ELEMENTS)))
    if not parts:
        return np.empty(0, np.uint32), new[:0].copy()
    return np.concatenate([i for i, _ in parts]), np.concatenate([v for _, v in parts])


def set_elements(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """``target[indices] = values`` for the flat array ``target`` and distinct ``indices``, in parallel parts."""

    def part(start: int) -> None:
        target[indices[start : start + PART_ELEMENTS]] = values[start : start + PART_ELEMENTS]

    list(_parts_pool().map(part, range(0, indices.size, PART_ELEMENTS)))


@dataclass(frozen=True)
class _Compared:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    new: Any  # its raw bytes: host uint8, maybe the caller's memory; or on its device, as integers
    # The changed elements' indices (uint32); None: send it dense (nothing held to compare, or
    # sparse would not pay: ``WeightDeltas._dense_pays``).
    changed: np.ndarray | None
    values: np.ndarray | None  # their new values
    on_device: tuple[Any, Any] | None = None  # changed and values on the tensor's device (on_device)
    copied: Any = None  # a CUDA event: changed and values are in host memory once it has passed


@dataclass(frozen=True)
class _Member:
    """A held torch tensor that goes sparse: its held copy and its bits now (``_held_bits``), and
    how many of its elements changed."""

    name: str
    tensor: Any
    old: Any
    bits: Any
    count: int


# torch's integer dtype of each element size, to compare tensors bit for bit on their device.
_TORCH_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


# Elements compared at once to count a tensor's changes: count_nonzero sums an int64 of each (8
# bytes an element), so a 1.5B model's embedding counted whole took 1.74 GiB of the trainer's GPU,
# which a trainer beside a server may not have free.
COUNT_ELEMENTS = 1 << 24


def _changed_count(old: Any, bits: Any) -> Any:
    """How many elements of the flat tensors ``old`` and ``bits`` differ: a 0-d tensor where they
    lie, not read (counted ``COUNT_ELEMENTS`` at a time)."""
    import torch

    parts = [torch.count_nonzero(o != b) for o, b in zip(old.split(COUNT_ELEMENTS), bits.split(COUNT_ELEMENTS))]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


# Elements of held tensors counted and compared together (``_count_group``, ``_compare_group``): their
# held copies and bits are each joined into one tensor (a copy on their device), so that counting,
# finding, gathering and copying their changes is a few torch calls for them all. Called per tensor,
# a 1.5B model's 2% delta made ~3,700 calls, which took 0.25-0.35 s of the comparing thread during
# a push (H100), taking turns at the interpreter with the sending threads. Grouped, 0.027 s alone,
# and still 0.16-0.22 s during a push, for the same reason (benchmarks/RESULTS.md). The joined copies, the
# comparison's mask and the count's running sum take ~0.3 GiB of the device at most, in bf16. A
# tensor larger than this is a group of its own, not copied.
GROUP_ELEMENTS = 1 << 25


def _groups(items: list[T], bits: Callable[[T], Any]) -> list[list[T]]:
    """``items`` in their order, in groups of one device and element size (of their ``bits``), of
    at most ``GROUP_ELEMENTS`` elements (or one tensor)."""
    groups: list[list[T]] = []
    size, kind = 0, None
    for item in items:
        b = bits(item)
        if not groups or (b.device, b.dtype) != kind or size + b.numel() > GROUP_ELEMENTS:
            groups.append([])
            size, kind = 0, (b.device, b.dtype)
        groups[-1].append(item)
        size += b.numel()
    return groups


def _to_device(values: list[int], device: Any) -> Any:
    """``values`` as an int64 tensor on ``device``, without waiting: from page-locked memory on a
    GPU (a copy from pageable memory waits for the device's work queued before it)."""
    import torch

    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def _count_group(pairs: list[tuple[Any, Any]]) -> Any:
    """How many elements differ in each (held copy, bits) pair of one device and element size: a
    tensor of the counts where they lie, not read."""
    import torch

    if len(pairs) == 1:
        return _changed_count(*pairs[0]).view(1)
    old, new = torch.cat([o for o, _ in pairs]), torch.cat([b for _, b in pairs])
    ends = _to_device(list(itertools.accumulate(b.numel() for _, b in pairs)), new.device)
    differ = torch.cumsum(old != new, 0, dtype=torch.int32)[ends - 1]  # how many up to each tensor's end
    return torch.diff(differ, prepend=differ.new_zeros(1))


def _compare_group(members: list[_Member], indices: Any, values: Any) -> list[_Compared]:
    """The changes of ``members`` (one device and element size), found together: where their held
    copies and bits (joined, if more than one) differ, at their counted number (``nonzero_static``:
    no wait), each made an index into its own tensor; those and the new values gathered there are
    copied to ``indices`` (int32) and ``values`` in host memory, without waiting on a GPU (the
    sending waits for ``_Compared.copied``)."""
    import torch

    joined = len(members) > 1
    old = torch.cat([m.old for m in members]) if joined else members[0].old
    new = torch.cat([m.bits for m in members]) if joined else members[0].bits
    total = sum(m.count for m in members)
    changed = torch.nonzero_static(old != new, size=total).view(-1)
    changed_values = new[changed]
    if joined:  # each position less its tensor's start in the joined tensor
        starts = _to_device(list(itertools.accumulate((m.bits.numel() for m in members[:-1]), initial=0)), new.device)
        counts = _to_device([m.count for m in members], new.device)
        changed = changed - torch.repeat_interleave(starts, counts, output_size=total)
    # To the host as the uint32s they travel as (int32 wraps to the same bits): half the bytes.
    indices.copy_(changed.to(torch.int32), non_blocking=True)
    values.copy_(changed_values, non_blocking=True)
    copied = None
    if new.is_cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(new.device))
    host_indices, host_values = indices.numpy().view(np.uint32), values.numpy()
    compared, at = [], 0
    for m in members:
        part = slice(at, at + m.count)
        at += m.count
        compared.append(
            _Compared(
                m.name,
                str(m.tensor.dtype).removeprefix("torch."),
                tuple(m.tensor.shape),
                m.bits.nbytes,
                m.bits,
                host_indices[part],
                host_values[part],
                (changed[part], changed_values[part]),
                copied,
            )
        )
    return compared


def _warm_up(kinds: list[tuple[Any, Any]]) -> None:
    """Counts and compares tiny tensors of each (device, integer dtype) of ``kinds`` as a push
    would: CUDA loads a kernel's code at its first launch, and a process's first delta push, whose
    comparison launches kernels its dense pushes did not, took 0.06-0.26 s longer than the next
    ones (H100, benchmarks/RESULTS.md)."""
    import torch

    for device, dtype in kinds:
        old = torch.zeros(8, dtype=dtype, device=device)
        bits = old.clone()
        bits[3] = 1
        _count_group([(old, bits)]).tolist()  # one tensor: counted alone
        counts = _count_group([(old, bits), (old, bits)]).tolist()  # joined
        members = [_Member("warm-up", bits, old, bits, count) for count in counts]
        pinned = device.type == "cuda"
        indices = torch.empty(sum(counts), dtype=torch.int32, pin_memory=pinned)
        _compare_group(members, indices, torch.empty(sum(counts), dtype=dtype, pin_memory=pinned))
        if pinned:
            torch.cuda.synchronize(device)


def _unchanged_or_dense(name: str, tensor: Any, bits: Any, *, unchanged: bool) -> _Compared:
    """The ``_Compared`` of a torch tensor (``bits``: its ``_device_bits``) that does not go sparse."""
    dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
    return _Compared(name, dtype, shape, bits.nbytes, bits, np.empty(0, np.uint32) if unchanged else None, None)


def _device_bits(tensor: Any) -> Any:
    """A torch tensor's elements as flat integers of their size, where it lies (compared so, bit for bit)."""
    import torch

    flat = tensor.detach().reshape(-1).contiguous()
    return flat.view(getattr(torch, _TORCH_BITS[flat.element_size()]))


class WeightDeltas:
    """What the server holds of one model (host copies of the raw bytes last pushed, and their
    version), to push only what changed since: ``LogprobClient.update_weights(..., delta=True)``.

    Per tensor, the changed elements (compared bit for bit) go sparse, as uint32 indices and their
    values, when those bytes are at most ``sparse_below`` of the dense ones; else the tensor goes
    dense. Unchanged tensors are not sent. The first push (and one after ``reset``) is dense.

    Holds the model's size: in host memory, or with ``on_device``, each torch tensor's copy on that
    tensor's own device, where it is compared (a trainer's GPU compares a model in milliseconds and
    copies only the changes to the host; in host memory a push reads the model's size twice). That
    costs the trainer's GPU the model's size in memory, and the changes of a push are brought to
    one host buffer, page-locked when held on a GPU. Page-locking it took 0.2-0.35 s for a 1.5B
    model's 2% delta on an H100, so it is made ahead, on a thread of its own after each push (while
    the trainer steps), large enough for ``expect_changed`` of the held elements or 1.25x the last
    push's changes, whichever is more (for a 7B bf16 model at 2%: 0.84 GB of host memory); a push
    whose changes are larger makes a larger one then. A push's tensors must not change until it
    returns: those held on a device are counted, then compared again.
    """

    def __init__(self, sparse_below: float = 0.5, *, on_device: bool = False, expect_changed: float = 0.02) -> None:
        if not 0 <= sparse_below <= 1:
            raise ValueError(f"sparse_below must be in [0, 1], got {sparse_below}")
        if not 0 <= expect_changed <= 1:
            raise ValueError(f"expect_changed must be in [0, 1], got {expect_changed}")
        self.sparse_below = sparse_below
        self.on_device = on_device
        self.expect_changed = expect_changed
        # The host buffer the changes of held torch tensors land in, page-locked when they are
        # held on a GPU (made and used on the held pool's thread), and the bytes of it the last
        # push used.
        self._landing: Any = None
        self._landing_pinned = False
        self._landed = 0
        self._warmed: set[tuple[Any, Any]] = set()  # (device, dtype) of held copies, compared once ahead
        self.version: int | None = None  # the version the server made of the last push
        # name -> raw bytes as pushed: host uint8, or (on_device) a torch tensor of integers
        self._held: dict[str, Any] = {}
        # Of the stream in flight, what ``held`` becomes: a dense tensor's bytes, or a sparse one's
        # (changed indices, their new values), as ``held`` keeps them.
        self._pending: dict[str, Any] = {}
        self.last: dict[str, int] = {}  # of the last push built: tensors sent dense, sparse, unchanged
        # Of the push being built: held torch tensors' comparisons, made together (_compare_held)
        self._compared: dict[str, concurrent.futures.Future[_Compared]] = {}
        self._applying: concurrent.futures.Future[None] | None = None  # the last push's changes, going in
        self._lock = threading.Lock()  # a push's streams are read on threads of their own

    @property
    def held(self) -> dict[str, Any]:
        """What the server holds: each tensor's raw bytes as last pushed (uint8 arrays; with
        ``on_device``, a torch tensor's as a flat integer tensor on its device)."""
        self._applied()
        return self._held

    def reset(self) -> None:
        """Forget what the server holds: the next push is dense and full."""
        self._applied()
        self.version, self._held = None, {}

    def update_streams(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int,
        partial: bool,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        streams: int = 1,
        pack: bool = True,
    ) -> list[Iterator[Message]]:
        """The calls of the next push, as ``update_streams`` makes them (each read lazily, its
        tensors compared up to ``LOOKAHEAD`` ahead of the one it sends)."""
        _check(version, chunk_bytes, streams)
        self._applied()
        self._pending, self.last = {}, {"dense": 0, "sparse": 0, "unchanged": 0}
        header = pb.UpdateWeightsHeader(model=model, version=version, partial=partial)
        if self.version is not None:
            header.partial, header.base_version = True, self.version
        groups, header = _calls(weights, streams, header)
        self._compared = self._compare_held(groups) if self.on_device else {}
        return [
            _stream(
                header,
                filter(None, (self._pieces(c, chunk_bytes) for c in _ahead(group, self._compare))),
                chunk_bytes,
                pack,
            )
            for group in groups
        ]

    def _compare_held(self, groups: list[Iterable[tuple[str, Any]]]) -> dict[str, concurrent.futures.Future[_Compared]]:
        """The comparisons of the torch tensors the push holds a copy of (when its tensors are
        listed: over more than one call), queued on their devices together, on one thread of
        their own (``_compare_all``) while the calls start; each call's first tensors first."""
        listed = [group for group in groups if isinstance(group, list)]
        held: dict[str, tuple[Any, tuple[Any, Any]]] = {}  # name -> (tensor, (held copy, its bits now))
        for row in itertools.zip_longest(*listed):
            for name, tensor in filter(None, row):
                if name not in held and (pair := self._held_bits(name, tensor)) is not None:
                    held[name] = tensor, pair
        futures: dict[str, concurrent.futures.Future[_Compared]] = {name: concurrent.futures.Future() for name in held}
        if held:  # its own dict: the calls take theirs out of the one returned
            _held_pool().submit(self._compare_all, held, dict(futures))
        return futures

    def _compare_all(
        self, held: dict[str, tuple[Any, tuple[Any, Any]]], futures: dict[str, concurrent.futures.Future[_Compared]]
    ) -> None:
        """``_compare_held``'s work: first the count of each tensor's changed elements, read with
        one wait per device, then (at those counts: no wait) the changes of those that go sparse,
        in groups (``_compare_group``), copied into one page-locked host buffer without waiting.
        The sending waits for each group's copy (``_Compared.copied``)."""
        import torch

        try:
            counts = self._count_changes({name: pair for name, (_, pair) in held.items()})
            members = []
            for name, (tensor, (old, bits)) in held.items():
                count = counts[name]
                if count and not self._dense_pays(count, bits.element_size(), bits.nbytes):
                    members.append(_Member(name, tensor, old, bits, count))
                else:
                    futures[name].set_result(_unchanged_or_dense(name, tensor, bits, unchanged=not count))
            groups = _groups(members, lambda m: m.bits)
            # Each group's place in the buffer: its indices (int32), then its values, each at a
            # multiple of 8 bytes (a view of a dtype starts at a multiple of its size).
            places, end = [], 0
            for group in groups:
                count, itemsize = sum(m.count for m in group), group[0].bits.element_size()
                values_at = end + -(-4 * count // 8) * 8
                places.append((end, values_at, count))
                end = values_at + -(-count * itemsize // 8) * 8
            if not groups:
                return
            buffer = self._land(end, any(m.bits.is_cuda for m in members))
            for group, (indices_at, values_at, count) in zip(groups, places, strict=True):
                dtype = group[0].bits.dtype
                indices = buffer[indices_at : indices_at + 4 * count].view(torch.int32)
                values = buffer[values_at : values_at + count * group[0].bits.element_size()].view(dtype)
                for compared in _compare_group(group, indices, values):
                    futures[compared.name].set_result(compared)
        except BaseException as error:  # the calls waiting for these raise it
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)

    @staticmethod
    def _count_changes(held: dict[str, tuple[Any, Any]]) -> dict[str, int]:
        """How many elements of each tensor's held copy and bits (``_held_bits``) differ, counted
        on their devices in groups (``_count_group``), read with one wait per device."""
        import torch

        by_device: dict[Any, tuple[list[str], list[Any]]] = {}
        for group in _groups(list(held.items()), lambda item: item[1][1]):
            names, counts = by_device.setdefault(group[0][1][1].device, ([], []))
            names.extend(name for name, _ in group)
            counts.append(_count_group([pair for _, pair in group]))
        return {
            name: count
            for names, counts in by_device.values()
            for name, count in zip(names, torch.cat(counts).tolist(), strict=True)
        }

    def _land(self, nbytes: int, pinned: bool) -> Any:
        """``nbytes`` of the buffer a push's changes land in (on the held pool's thread): the one
        made ahead, if it is large enough."""
        self._landed = nbytes
        self._make_landing(nbytes, pinned)
        return self._landing[:nbytes]

    def _make_landing(self, nbytes: int, pinned: bool) -> None:
        """A landing buffer of at least ``nbytes``, page-locked if ``pinned`` (on the held pool's thread)."""
        import torch

        if self._landing is None or self._landing.numel() < nbytes or self._landing_pinned != pinned:
            self._landing = None  # the old one goes back first
            self._landing = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._landing_pinned = pinned

    def _land_ahead(self) -> None:
        """After a push, if some held copies are torch tensors, on the held pool's thread: the
        comparison's kernels run once on each device and element size not seen before
        (``_warm_up``), and the next push's landing buffer made (see the class's docstring)."""
        held = [t for t in self._held.values() if not isinstance(t, np.ndarray)]
        if not held:
            return
        if kinds := {(t.device, t.dtype) for t in held} - self._warmed:
            self._warmed |= kinds
            _held_pool().submit(_warm_up, sorted(kinds, key=str))
        expected = sum(
            math.ceil(self.expect_changed * t.numel()) * (4 + t.element_size()) + 16  # 16: each part's alignment
            for t in held
            if self._sparse_may_pay(t.nbytes, tuple(t.shape))
        )
        nbytes, pinned = max(expected, math.ceil(1.25 * self._landed)), any(t.is_cuda for t in held)
        if nbytes:
            _held_pool().submit(self._make_landing, nbytes, pinned)

    def _compare(self, named: tuple[str, Any]) -> _Compared:
        """A tensor's bytes, and what changed in them since the held copy (on a worker thread)."""
        name, tensor = named
        compared = self._compared.pop(name, None)
        if compared is not None:
            return compared.result()
        if self.on_device and type(tensor).__module__.startswith("torch"):
            return self._compare_on_device(name, tensor)
        dtype, shape, data = raw_bytes(tensor)
        new = np.frombuffer(data, dtype=np.uint8)
        old = self._held.get(name) if self.version is not None else None
        itemsize = new.nbytes // max(1, math.prod(shape))
        element = f"<u{itemsize}"  # compared bit for bit, one element at a time
        if not isinstance(old, np.ndarray) or old.nbytes != new.nbytes or not self._sparse_may_pay(new.nbytes, shape):
            return _Compared(name, dtype, shape, new.nbytes, new, None, None)
        indices, values = changes(old.view(element), new.view(element))
        if self._dense_pays(indices.size, itemsize, new.nbytes):
            return _Compared(name, dtype, shape, new.nbytes, new, None, None)
        return _Compared(name, dtype, shape, new.nbytes, new, indices, values)

    def _held_bits(self, name: str, tensor: Any) -> tuple[Any, Any] | None:
        """A torch tensor's held copy and its bits as they are now (flat integers of its element
        size), if it has a held copy of its dtype, size and device and sparse may pay; else None."""
        import torch

        old = self._held.get(name) if self.version is not None else None
        if not isinstance(old, torch.Tensor):
            return None
        bits = _device_bits(tensor)
        if (old.dtype, old.shape, old.device) != (bits.dtype, bits.shape, bits.device):
            return None
        return (old, bits) if self._sparse_may_pay(bits.nbytes, tuple(tensor.shape)) else None

    def _compare_on_device(self, name: str, tensor: Any) -> _Compared:
        """``_compare`` of a torch tensor not compared with the others (a lazy iterable's): counted
        alone (a wait), and its changes, if it goes sparse, copied to host memory of its own."""
        import torch

        held = self._held_bits(name, tensor)
        if held is None:
            return _unchanged_or_dense(name, tensor, _device_bits(tensor), unchanged=False)
        old, bits = held
        count = int(_changed_count(old, bits))
        if not count or self._dense_pays(count, bits.element_size(), bits.nbytes):
            return _unchanged_or_dense(name, tensor, bits, unchanged=not count)
        indices, values = torch.empty(count, dtype=torch.int32), torch.empty(count, dtype=bits.dtype)
        return _compare_group([_Member(name, tensor, old, bits, count)], indices, values)[0]

    @staticmethod
    def _sparse_may_pay(nbytes: int, shape: tuple[int, ...]) -> bool:
        return nbytes > 0 and math.prod(shape) <= MAX_SPARSE_ELEMENTS

    def _dense_pays(self, changed: int, itemsize: int, nbytes: int) -> bool:
        return (4 + itemsize) * changed > self.sparse_below * nbytes  # uint32 indices and the values

    def _pieces(self, c: _Compared, chunk_bytes: int) -> Iterator[Message] | None:
        """The pieces a tensor goes in: sparse, dense, or None when the server holds it already."""
        if c.changed is not None and not c.changed.size:
            self._count("unchanged")
            return None
        if c.changed is None:
            self._count("dense")
            # A copy: the caller may change its tensor after the push.
            self._pending[c.name] = new = c.new.copy() if isinstance(c.new, np.ndarray) else c.new.clone()
            data = new if isinstance(new, np.ndarray) else raw_bytes(new)[2]  # from the device
            return _dense_pieces(c.name, c.dtype, c.shape, memoryview(data).cast("B"), chunk_bytes)
        self._count("sparse")
        if c.copied is not None:
            c.copied.synchronize()
        # What the server will hold there: values are a copy (on the device too).
        self._pending[c.name] = c.on_device or (c.changed, c.values)
        return _sparse_pieces(c.name, c.dtype, c.shape, c.changed, c.values.view(np.uint8), chunk_bytes)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.last[kind] += 1

    def pushed(self, version: int) -> None:
        """The push went live as ``version``: the server now holds what it sent. The held copies
        of sparse tensors take their changes on a worker thread, after the push has returned;
        the next push (or ``reset``) waits for that first."""
        sparse = {name: sent for name, sent in self._pending.items() if isinstance(sent, tuple)}
        self._held.update((name, sent) for name, sent in self._pending.items() if not isinstance(sent, tuple))
        self.version, self._pending = version, {}
        self._applying = _tensors_pool().submit(self._apply, sparse)
        self._land_ahead()

    def _apply(self, sparse: dict[str, tuple[Any, Any]]) -> None:
        for name, (changed, values) in sparse.items():
            held = self._held[name]
            if isinstance(held, np.ndarray):
                set_elements(held.view(values.dtype), changed, values)
            else:
                held[changed] = values

    def _applied(self) -> None:
        """Waits until the last push's changes are in the held copies."""
        if self._applying is not None:
            self._applying.result()
            self._applying = None

    def stale(self, error: LogprobError) -> bool:
        """Whether ``error`` refused a push because the server no longer holds the base version (a
        restart, another pusher): then ``reset``, and push again dense."""
        return isinstance(error, FailedPrecondition) and error.message.startswith("header.base_version")
