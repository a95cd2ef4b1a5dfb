"""The UpdateWeights framing both sides use: how a push's messages are laid out on the wire.

The client writes tensor pieces with it (``dense_parts``, ``sparse_parts``, ``packed``); the
server's gRPC edge reads them back with it (``logprob_service.api.tensor_pieces``), so the layout
rules (field tags, varints, sparse indices as little-endian uint32) are written once.

Wire format (protobuf): a message is a sequence of fields, each a varint tag ``number << 3 |
wire type`` and a value: a varint (type 0), 8 bytes (1), a varint length and that many bytes (2),
or 4 bytes (5). An UpdateWeightsRequest holding a tensor is the one field 2 (type 2) whose bytes
are a TensorChunk; its ``data`` is field 5 and its ``indices`` field 7 (both type 2). One holding
several pieces is the one field 4 (type 2), a TensorChunks whose fields are all its field 1 (type
2), each a TensorChunk. Where a field comes more than once, the last one counts, as protobuf reads
it.

Messages are serialized here in parts (``Message``): a dense piece is the framing protobuf would
write around a view of the tensor's bytes (``dense_parts``). Joined (gRPC's request serializer on
the client's own calls), that is one copy of the bytes into the message, where protobuf would make
two (into the message object, then out of it); the client's push processes copy the parts into
shared memory instead, and join them in another process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from . import logprob_pb2 as pb

# Sparse pieces name elements with uint32 indices.
MAX_SPARSE_ELEMENTS = 2**32
# One UpdateWeightsRequest, serialized, in parts: joined, they are the bytes protobuf writes for it.
Message = tuple[bytes | memoryview, ...]

TENSOR_TAG = 2 << 3 | 2  # UpdateWeightsRequest.tensor: field 2, length-delimited
TENSORS_TAG = 4 << 3 | 2  # UpdateWeightsRequest.tensors (TensorChunks): field 4, length-delimited
CHUNK_TAG = 1 << 3 | 2  # TensorChunks.chunks: field 1, length-delimited
DATA_FIELD = 5  # TensorChunk.data, length-delimited
CHANGED_FIELD = 6  # TensorChunk.changed, varint
INDICES_FIELD = 7  # TensorChunk.indices, length-delimited
_TENSOR = bytes((TENSOR_TAG,))
_TENSORS = bytes((TENSORS_TAG,))
_CHUNK = bytes((CHUNK_TAG,))
_DATA = bytes((DATA_FIELD << 3 | 2,))
_CHANGED = bytes((CHANGED_FIELD << 3,))
_INDICES = bytes((INDICES_FIELD << 3 | 2,))


def join(message: Message) -> bytes:
    """A message's bytes (``Message``): its parts copied into one ``bytes``."""
    return b"".join(message)


def varint(value: int) -> bytes:
    """protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``raw[pos]`` and the position after it; IndexError past the end."""
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")


def dense_parts(name: str, dtype: str, shape: tuple[int, ...], offset: int, data: memoryview) -> Message:
    """A dense piece's UpdateWeightsRequest as protobuf writes it (fields in number order, ``data``
    last, and left out when empty), in parts: ``data`` is one of them, not copied."""
    fields = pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset).SerializeToString()
    data_head = _DATA + varint(len(data)) if len(data) else b""
    return _TENSOR, varint(len(fields) + len(data_head) + len(data)), fields, data_head, data


def dense_piece(name: str, dtype: str, shape: tuple[int, ...], offset: int, data: memoryview) -> bytes:
    """``dense_parts`` joined: the piece's bytes, made with one copy of ``data``."""
    return join(dense_parts(name, dtype, shape, offset, data))


def dense_pieces(
    name: str, dtype: str, shape: tuple[int, ...], data: memoryview, chunk_bytes: int
) -> Iterator[Message]:
    """A tensor's raw bytes as dense pieces of ``chunk_bytes`` each, the last smaller."""
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
        *((_DATA, varint(len(values)), values) if len(values) else ()),
        *((_CHANGED, varint(changed)) if changed else ()),
        *((_INDICES, varint(len(indices)), indices) if len(indices) else ()),
    ]
    return _TENSOR, varint(sum(len(p) for p in parts)), *parts


def sparse_piece(
    name: str, dtype: str, shape: tuple[int, ...], offset: int, changed: int, indices: memoryview, values: memoryview
) -> bytes:
    """``sparse_parts`` joined: the piece's bytes, made with one copy of ``indices`` and ``values``."""
    return join(sparse_parts(name, dtype, shape, offset, changed, indices, values))


def sparse_pieces(
    name: str, dtype: str, shape: tuple[int, ...], indices: np.ndarray, values: np.ndarray, chunk_bytes: int
) -> Iterator[Message]:
    """A tensor's changed elements as sparse pieces of about ``chunk_bytes`` each; ``indices``:
    uint32 (sent little-endian); ``values``: their raw bytes (uint8)."""
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
    parts = [part for piece in pieces for part in (_CHUNK, *piece[1:])]
    return _TENSORS, varint(sum(len(p) for p in parts)), *parts


def pack_pieces(pieces: Iterable[Message], most_bytes: int) -> Iterator[Message]:
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
