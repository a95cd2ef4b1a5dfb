"""UpdateWeights requests read with their tensor bytes as views of the received message.

gRPC hands each received message to the method's deserializer as one ``bytes`` object. protobuf's
parser would copy a dense piece's ``data`` (up to the whole message) into a new ``bytes``; here the
wire format of such a piece is walked by hand instead, and its ``data`` stays a ``memoryview`` of
the message, which the update writes straight to where the tensor is staged. Only the piece's few
other fields go through protobuf. Any message that is not a dense piece written the usual way
(``data`` last, as protobuf and ``logprob_client`` write it) is parsed by protobuf as before, so
the results, and the errors of malformed messages (``api.malformed``), are the same either way.

Wire format (protobuf): a message is a sequence of fields, each a varint tag ``number << 3 |
wire type`` and a value: a varint (type 0), 8 bytes (1), a varint length and that many bytes (2),
or 4 bytes (5). An UpdateWeightsRequest holding a tensor is the one field 2 (type 2) whose bytes
are a TensorChunk; its ``data`` is field 5 (type 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from logprob_proto import logprob_pb2 as pb

from logprob_service.api import handlers

_TENSOR_TAG = 2 << 3 | 2  # UpdateWeightsRequest.tensor
_DATA_FIELD = 5  # TensorChunk.data
_SPARSE_FIELDS = (6, 7)  # TensorChunk.changed, TensorChunk.indices
# Smaller messages are parsed by protobuf: a copy of a few KiB costs less than walking the fields.
MIN_VIEWED_BYTES = 64 << 10


@dataclass(frozen=True)
class DensePiece:
    """A dense piece of a tensor: its fields but ``data`` (a TensorChunk), and ``data`` as a view."""

    chunk: pb.TensorChunk
    data: memoryview


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
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


def _dense_piece(raw: bytes) -> DensePiece | None:
    """``raw`` as a dense piece whose ``data`` is its last field, or None for any other message."""
    if len(raw) < MIN_VIEWED_BYTES or raw[0] != _TENSOR_TAG:
        return None
    try:
        length, start = _varint(raw, 1)
        if start + length != len(raw):
            return None
        pos = start
        while pos < len(raw):
            field_start = pos
            tag, pos = _varint(raw, pos)
            number, wire_type = tag >> 3, tag & 7
            if number in _SPARSE_FIELDS:
                return None
            if wire_type == 0:
                _, pos = _varint(raw, pos)
            elif wire_type == 2:
                size, pos = _varint(raw, pos)
                if number == _DATA_FIELD and pos + size == len(raw):
                    view = memoryview(raw)
                    return DensePiece(pb.TensorChunk.FromString(view[start:field_start]), view[pos:])
                pos += size
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            else:
                return None
    except IndexError:
        return None
    return None  # no data field, or not last: protobuf reads it


def read_update_request(raw: bytes) -> pb.UpdateWeightsRequest | DensePiece:
    """The UpdateWeights method's request deserializer."""
    return _dense_piece(raw) or pb.UpdateWeightsRequest.FromString(raw)


class TensorPieceViews(handlers.ServiceInterceptor):
    """Reads UpdateWeights requests with ``read_update_request``. It must come after
    ``MalformedMessageInterceptor`` in the server's list, which then catches its errors."""

    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if rpc != "UpdateWeights":
            return handler
        return handlers.rebuild(handler, handlers.behaviour_of(handler), read_update_request)
