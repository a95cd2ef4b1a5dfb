"""UpdateWeights requests read with their tensor bytes as views of the received message.

gRPC hands each received message to the method's deserializer as one ``bytes`` object. protobuf's
parser would copy a tensor piece's ``data`` (and a sparse piece's ``indices``), up to the whole
message, into new ``bytes``; here the wire format of such a piece is walked by hand instead, and
those two fields stay ``memoryview``s of the message, which the update writes straight to where
the tensor is staged (or, sparse, assembles). Only the piece's few other fields go through
protobuf, so the results, and the errors of malformed messages (``api.malformed``), are the same
either way; any message that is not one or several tensor pieces is parsed by protobuf as before.

The wire format, and the tags and field numbers read here, are ``logprob_proto.framing``'s, the
framing the client writes with.
"""

from __future__ import annotations

from dataclasses import dataclass

from logprob_proto import logprob_pb2 as pb
from logprob_proto.framing import CHUNK_TAG, DATA_FIELD, INDICES_FIELD, TENSOR_TAG, TENSORS_TAG, read_varint

_VIEWED = (DATA_FIELD, INDICES_FIELD)
# Smaller messages are parsed by protobuf: a copy of a few KiB costs less than walking the fields.
MIN_VIEWED_BYTES = 64 << 10
_EMPTY = memoryview(b"")


@dataclass(frozen=True)
class PieceView:
    """A tensor piece: its fields but ``data`` and ``indices`` (a TensorChunk), and those two as
    views of the received message (empty where the piece has none)."""

    chunk: pb.TensorChunk
    data: memoryview
    indices: memoryview


def _chunk_view(raw: bytes, view: memoryview, pos: int, end: int) -> PieceView | None:
    """The TensorChunk in ``raw[pos:end]`` with ``data`` and ``indices`` as views, or None where its
    fields do not end exactly at ``end`` (protobuf then reads the message, and refuses it)."""
    viewed: dict[int, memoryview] = {}  # field number -> its bytes, the last of that number
    others: list[memoryview] = []  # every other field, as written
    while pos < end:
        field_start = pos
        tag, pos = read_varint(raw, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = read_varint(raw, pos)
        elif wire_type == 2:
            size, pos = read_varint(raw, pos)
            if number in _VIEWED and pos + size <= end:
                viewed[number] = view[pos : pos + size]
                pos += size
                continue
            pos += size
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            return None
        others.append(view[field_start:pos])
    if pos != end:  # a field past the end
        return None
    chunk = pb.TensorChunk.FromString(b"".join(others))
    return PieceView(chunk, viewed.get(DATA_FIELD, _EMPTY), viewed.get(INDICES_FIELD, _EMPTY))


def _chunks_view(raw: bytes, view: memoryview, pos: int, end: int) -> tuple[PieceView, ...] | None:
    """The TensorChunks in ``raw[pos:end]``, each piece as ``_chunk_view`` reads it; None where
    one is not a piece so read, or another field comes between them."""
    pieces = []
    while pos < end:
        tag, pos = read_varint(raw, pos)
        if tag != CHUNK_TAG:
            return None
        size, pos = read_varint(raw, pos)
        if pos + size > end or (piece := _chunk_view(raw, view, pos, pos + size)) is None:
            return None
        pieces.append(piece)
        pos += size
    return tuple(pieces) or None


def _views(raw: bytes) -> PieceView | tuple[PieceView, ...] | None:
    """``raw`` as one tensor piece with ``data`` or ``indices``, or as several pieces, or None for
    any other message (or one protobuf would refuse: it reads it, and raises)."""
    if len(raw) < MIN_VIEWED_BYTES or raw[0] not in (TENSOR_TAG, TENSORS_TAG):
        return None
    view = memoryview(raw)
    try:
        length, pos = read_varint(raw, 1)
        if pos + length != len(raw):  # not the message's one field
            return None
        if raw[0] == TENSORS_TAG:
            return _chunks_view(raw, view, pos, len(raw))
        piece = _chunk_view(raw, view, pos, len(raw))
    except IndexError:
        return None
    return piece if piece is not None and (piece.data or piece.indices) else None


def read_update_request(raw: bytes) -> pb.UpdateWeightsRequest | PieceView | tuple[PieceView, ...]:
    """The UpdateWeights method's request deserializer: a piece, the pieces of a message holding
    several (``tensors``), or any other message as protobuf parses it."""
    return _views(raw) or pb.UpdateWeightsRequest.FromString(raw)
