"""UpdateWeights requests read with a piece's bytes as views of the received message, one piece
or several to a message (``api.tensor_pieces.read_update_request``): the same fields as
protobuf's parse, the bytes not copied, every other message parsed by protobuf, and malformed
bytes refused as protobuf refuses them (``DecodeError``, which ``api.malformed`` turns into
INVALID_ARGUMENT)."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from logprob_proto import logprob_pb2 as pb
from logprob_proto.framing import dense_parts, dense_piece, join, packed, sparse_parts, sparse_piece
from logprob_service.api.tensor_pieces import MIN_VIEWED_BYTES, PieceView, read_update_request


def varint(value: int) -> bytes:
    """protobuf's base-128 varint (written here, not taken from the code under test)."""
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def framed(chunk: bytes) -> bytes:
    """An UpdateWeightsRequest whose tensor field holds ``chunk`` (a TensorChunk's bytes), by hand."""
    return b"\x12" + varint(len(chunk)) + chunk


def as_chunk(view: PieceView) -> pb.TensorChunk:
    chunk = pb.TensorChunk()
    chunk.CopyFrom(view.chunk)
    chunk.data, chunk.indices = bytes(view.data), bytes(view.indices)
    return chunk


def as_request(read: pb.UpdateWeightsRequest | PieceView | tuple[PieceView, ...]) -> pb.UpdateWeightsRequest:
    """What ``read_update_request`` returned, as the message protobuf's parse would be."""
    if isinstance(read, pb.UpdateWeightsRequest):
        return read
    if isinstance(read, tuple):
        return pb.UpdateWeightsRequest(tensors=pb.TensorChunks(chunks=[as_chunk(v) for v in read]))
    return pb.UpdateWeightsRequest(tensor=as_chunk(read))


def random_bytes(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize(
    ("name", "shape", "offset", "nbytes"),
    [
        ("model.embed_tokens.weight", (517, 64), 0, MIN_VIEWED_BYTES),  # the message just over the line
        ("model.layers.0.self_attn.q_proj.weight", (4096, 4096), 12_345_678, 2 * 1024**2),
        ("w" * 300, (1 << 40,), (1 << 40) - 100_000, 100_000),
        ("lm_head.weight", (3, 5, 7, 11, 13), 0, MIN_VIEWED_BYTES - 20),  # the message over, the data under
    ],
)
def test_a_large_dense_piece_is_read_as_a_view_of_the_message(name, shape, offset, nbytes, rng):
    data = random_bytes(rng, nbytes)
    raw = dense_piece(name, "bfloat16", shape, offset, memoryview(data))
    assert len(raw) >= MIN_VIEWED_BYTES
    read = read_update_request(raw)
    assert isinstance(read, PieceView)
    expected = pb.UpdateWeightsRequest.FromString(raw)
    assert read.chunk.name == name and read.chunk.dtype == "bfloat16"
    assert tuple(read.chunk.shape) == shape and read.chunk.offset == offset
    assert not read.chunk.changed and not read.indices
    assert isinstance(read.data, memoryview) and read.data.obj is raw, "a view of the received bytes, not a copy"
    assert read.data.nbytes == nbytes and read.data == data
    assert as_request(read) == expected
    assert not read.chunk.data  # the data is not in the chunk as well (no copy there either)


def test_a_dense_piece_written_by_protobuf_is_read_as_a_view(rng):
    data = random_bytes(rng, 80_000)
    chunk = pb.TensorChunk(name="w", dtype="float32", shape=[20_000], offset=4, data=data)
    raw = pb.UpdateWeightsRequest(tensor=chunk).SerializeToString()
    read = read_update_request(raw)
    assert isinstance(read, PieceView) and read.data.obj is raw and read.data == data
    assert as_request(read) == pb.UpdateWeightsRequest.FromString(raw)


def test_a_large_sparse_piece_is_read_with_views_of_the_message(rng):
    values = random_bytes(rng, 2 * 40_000)
    indices = np.sort(rng.choice(1 << 24, 40_000, replace=False)).astype("<u4")
    raw = sparse_piece("w", "bfloat16", (1 << 24,), 40_000, 90_000, memoryview(indices).cast("B"), memoryview(values))
    read = read_update_request(raw)
    assert isinstance(read, PieceView)
    assert (read.chunk.name, read.chunk.offset, read.chunk.changed) == ("w", 40_000, 90_000)
    assert read.data.obj is raw and read.indices.obj is raw, "views of the received bytes, not copies"
    assert read.data == values and read.indices == indices.tobytes()
    assert not read.chunk.data and not read.chunk.indices
    assert as_request(read) == pb.UpdateWeightsRequest.FromString(raw)


def small_and_other_messages(rng: np.random.Generator) -> dict[str, bytes]:
    """Messages that protobuf must parse (under MIN_VIEWED_BYTES, not one tensor piece, or one
    without data or indices) and tensor pieces written otherwise than by protobuf or the client."""
    header = pb.UpdateWeightsHeader(model="policy", version=3, partial=True, base_version=2, streams=3, update_id="x")
    big_data = random_bytes(rng, 100_000)
    name = b"\x0a\x01w"  # TensorChunk.name = "w"
    dtype = b"\x12\x07float32"
    shape = b"\x1a\x03" + varint(25_000)  # packed [25000]
    data_field = b"\x2a" + varint(len(big_data)) + big_data

    sparse_values = random_bytes(rng, 40_000)
    sparse_indices = np.sort(rng.choice(1 << 20, 10_000, replace=False)).astype("<u4").tobytes()
    sparse = pb.TensorChunk(
        name="w", dtype="float32", shape=[1 << 20], offset=7, changed=10_007, indices=sparse_indices, data=sparse_values
    )
    # The sparse piece with its data written last by hand (protobuf writes indices, field 7, last).
    sparse_data_last = framed(
        b"".join(
            [
                name,
                dtype,
                b"\x1a\x03" + varint(1 << 20),  # shape
                b"\x20\x07",  # offset 7
                b"\x30" + varint(10_007),  # changed
                b"\x3a" + varint(len(sparse_indices)) + sparse_indices,
                b"\x2a" + varint(len(sparse_values)) + sparse_values,
            ]
        )
    )
    return {
        "small-dense": dense_piece("w", "float32", (100,), 0, memoryview(random_bytes(rng, 400))),
        "dense-just-under": dense_piece("w", "float32", (1 << 20,), 0, memoryview(random_bytes(rng, 65_000))),
        "header": pb.UpdateWeightsRequest(header=header).SerializeToString(),
        "header-large": pb.UpdateWeightsRequest(
            header=pb.UpdateWeightsHeader(model="m" * 70_000, streams=2, update_id="y" * 10)
        ).SerializeToString(),
        "commit": pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(tensor_count=12)).SerializeToString(),
        "empty": b"",
        "sparse-small": pb.UpdateWeightsRequest(
            tensor=pb.TensorChunk(
                name="w", dtype="float32", shape=[64], changed=2, indices=b"\1\0\0\0\5\0\0\0", data=b"12345678"
            )
        ).SerializeToString(),
        "sparse-large": pb.UpdateWeightsRequest(tensor=sparse).SerializeToString(),
        "sparse-data-last": sparse_data_last,
        "data-first": framed(data_field + name + dtype + shape),
        "data-then-unknown-field": framed(name + dtype + shape + data_field + b"\x78\x01"),  # field 15 after
        "data-twice": framed(name + b"\x2a\x03abc" + dtype + shape + data_field),  # the last data wins
        "no-data": framed(name * 10_000 + dtype + shape),
        "tensor-then-commit": framed(name + dtype + shape + data_field) + b"\x1a\x02\x08\x01",
        "header-then-tensor": pb.UpdateWeightsRequest(header=header).SerializeToString()
        + framed(name + dtype + shape + data_field),  # a oneof: the last field wins
    }


@pytest.mark.parametrize(
    "kind",
    [
        "small-dense",
        "dense-just-under",
        "header",
        "header-large",
        "commit",
        "empty",
        "sparse-small",
        "no-data",
        "tensor-then-commit",
    ],
)
def test_other_messages_are_parsed_by_protobuf(kind, rng):
    raw = small_and_other_messages(rng)[kind]
    read = read_update_request(raw)
    assert isinstance(read, pb.UpdateWeightsRequest), type(read)
    assert read == pb.UpdateWeightsRequest.FromString(raw)
    if kind.startswith("sparse"):
        assert read.tensor.changed > 0 and read.tensor.indices


VIEWED = ["sparse-large", "sparse-data-last", "data-first", "data-then-unknown-field", "data-twice"]


@pytest.mark.parametrize("kind", [*VIEWED, "header-then-tensor"])
def test_messages_read_either_way_are_what_protobuf_reads(kind, rng):
    """Where a piece is read with views although it is not quite protobuf's own writing (fields
    in another order, one twice, an unknown one), it still reads as protobuf reads it."""
    raw = small_and_other_messages(rng)[kind]
    read = read_update_request(raw)
    assert isinstance(read, PieceView) == (kind in VIEWED), type(read)
    assert as_request(read) == pb.UpdateWeightsRequest.FromString(raw)


def outcome(read, raw: bytes):
    """What reading ``raw`` with ``read`` comes to: the message, or that it raised DecodeError
    (any other exception propagates, and fails the test)."""
    try:
        return as_request(read(raw)).SerializeToString(deterministic=True)
    except DecodeError:
        return DecodeError


def test_truncated_large_dense_pieces_raise_decode_error(rng):
    data = random_bytes(rng, 70_000)
    raw = dense_piece("model.norm.weight", "float32", (1 << 20,), 4096, memoryview(data))
    head = len(raw) - len(data)
    cuts = [len(raw) - 1, len(raw) - 1000, head, head - 1, *range(1, head), *rng.integers(head, len(raw), 20).tolist()]
    for cut in cuts:
        with pytest.raises(DecodeError):
            pb.UpdateWeightsRequest.FromString(raw[:cut])  # protobuf refuses it ...
        with pytest.raises(DecodeError):
            read_update_request(raw[:cut])  # ... and so does the reader, with the same exception


def corruptions(rng: np.random.Generator, raw: bytes, head: int, n: int):
    """``n`` corruptions of ``raw`` in its first ``head`` bytes (where the fields are) or its end:
    a byte changed, removed, inserted, or appended."""
    for _ in range(n):
        b = bytearray(raw)
        where = int(rng.integers(0, head)) if rng.random() < 0.85 else len(b) - 1 - int(rng.integers(0, 4))
        what = int(rng.integers(0, 4))
        if what == 0:
            b[where] = int(rng.integers(0, 256))
        elif what == 1:
            del b[where]
        elif what == 2:
            b.insert(where, int(rng.integers(0, 256)))
        else:
            b += bytes(rng.integers(0, 256, int(rng.integers(1, 4)), dtype=np.uint8))
        yield bytes(b)


def test_corrupt_messages_read_as_protobuf_reads_them(rng):
    """Each corrupt message: both readers raise DecodeError, or both read the same message; never
    another exception."""
    data = random_bytes(rng, 70_000)
    messages = [
        (dense_piece("model.layers.0.mlp.down_proj.weight", "float32", (64, 96), 0, memoryview(data)), len(data)),
        (dense_piece("x", "bfloat16", (1 << 30,), (1 << 33) + 17, memoryview(data)), len(data)),
        (dense_piece("w", "float16", (40,), 0, memoryview(data[:80])), 80),  # a small one: protobuf reads it
        # A sparse piece: its indices last (the values, before them, are among the corrupted bytes).
        (
            sparse_piece("s", "bfloat16", (1 << 20,), 3, 12_003, memoryview(data[:48_000]), memoryview(data[:24_000])),
            48_000,
        ),
    ]
    decode_errors = views = 0
    for raw, ndata in messages:
        head = len(raw) - ndata + 4  # the fields, the data's tag and length, and its first bytes
        for bad in corruptions(rng, raw, head, 300):
            want = outcome(pb.UpdateWeightsRequest.FromString, bad)
            assert outcome(read_update_request, bad) == want, bad[:head].hex()
            decode_errors += want is DecodeError
            views += want is not DecodeError and isinstance(read_update_request(bad), PieceView)
    assert decode_errors > 100 and views > 30, (decode_errors, views)  # both kinds of outcome were tried


def data_field(n: int) -> bytes:
    return b"\x2a" + varint(n) + bytes(range(256)) * (n // 256) + bytes(n % 256)


MALFORMED = {
    "long-length": b"\x12" + b"\xff" * 10 + b"\x01" + bytes(MIN_VIEWED_BYTES),  # a varint of 11 bytes
    "long-tag": framed(b"\xff" * 12 + b"\x01" + data_field(MIN_VIEWED_BYTES)),
    "group": framed(b"\x0b" + data_field(MIN_VIEWED_BYTES)),  # wire type 3: a group's start, never ended
    "wire-type-7": framed(b"\x0f" + data_field(MIN_VIEWED_BYTES)),
    "field-0": framed(b"\x02\x00" + data_field(MIN_VIEWED_BYTES)),  # field number 0, before a data field last
    "bad-utf8": framed(b"\x0a\x02\xc3\x28" + data_field(MIN_VIEWED_BYTES)),  # the name is not UTF-8
    "length-past-end": framed(b"\x0a\x01w" + data_field(MIN_VIEWED_BYTES))[:-1],
    "data-past-end": b"\x12"
    + varint(MIN_VIEWED_BYTES + 10)
    + b"\x2a"
    + varint(MIN_VIEWED_BYTES + 20)
    + bytes(MIN_VIEWED_BYTES),
    "fixed64-past-end": framed(data_field(MIN_VIEWED_BYTES) + b"\x79\x00\x00"),  # field 15, 8 bytes: 2 come
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_large_messages_raise_decode_error_as_protobuf_does(kind):
    raw = MALFORMED[kind]
    assert len(raw) >= MIN_VIEWED_BYTES
    with pytest.raises(DecodeError):
        pb.UpdateWeightsRequest.FromString(raw)
    with pytest.raises(DecodeError):
        read_update_request(raw)


def several_pieces(rng: np.random.Generator) -> tuple[list[pb.TensorChunk], bytes]:
    """Dense and sparse pieces, large and small (an empty one too), and one message holding them
    all as the client packs them."""
    big, small = random_bytes(rng, 70_000), random_bytes(rng, 40)
    indices = np.sort(rng.choice(1 << 20, 5_000, replace=False)).astype("<u4")
    values = random_bytes(rng, 2 * 5_000)
    parts = [
        dense_parts("model.norm.weight", "float32", (10,), 0, memoryview(small)),
        dense_parts("w", "bfloat16", (1 << 20,), 4096, memoryview(big)),
        sparse_parts("s", "bfloat16", (1 << 20,), 7, 5_007, memoryview(indices).cast("B"), memoryview(values)),
        dense_parts("empty", "float32", (0, 4), 0, memoryview(b"")),
        sparse_parts("t", "float16", (64,), 0, 1, memoryview(b"\x05\0\0\0"), memoryview(b"ab")),
    ]
    chunks = [pb.UpdateWeightsRequest.FromString(join(p)).tensor for p in parts]
    return chunks, join(packed(parts))


def test_a_message_of_several_pieces_is_protobufs_serialization_and_read_with_views(rng):
    chunks, raw = several_pieces(rng)
    assert len(raw) >= MIN_VIEWED_BYTES
    assert raw == pb.UpdateWeightsRequest(tensors=pb.TensorChunks(chunks=chunks)).SerializeToString()
    read = read_update_request(raw)
    assert isinstance(read, tuple) and len(read) == len(chunks)
    assert [as_chunk(view) for view in read] == chunks
    for view, chunk in zip(read, chunks, strict=True):
        for got, want in ((view.data, chunk.data), (view.indices, chunk.indices)):
            assert isinstance(got, memoryview) and got == want
            assert not got or got.obj is raw, "a view of the received bytes, not a copy"
        assert not view.chunk.data and not view.chunk.indices
    assert as_request(read) == pb.UpdateWeightsRequest.FromString(raw)


def test_a_small_message_of_several_pieces_is_parsed_by_protobuf(rng):
    parts = [dense_parts(f"n{i}", "float32", (10,), 0, memoryview(random_bytes(rng, 40))) for i in range(3)]
    raw = join(packed(parts))
    read = read_update_request(raw)
    assert isinstance(read, pb.UpdateWeightsRequest) and read.WhichOneof("kind") == "tensors"
    assert [c.name for c in read.tensors.chunks] == ["n0", "n1", "n2"]


def test_messages_of_several_pieces_written_otherwise_read_as_protobuf_reads_them(rng):
    chunks, raw = several_pieces(rng)
    body = pb.TensorChunks(chunks=chunks).SerializeToString()
    other_field = b"\x12\x03abc"  # TensorChunks field 2, unknown: protobuf skips it
    written = {
        "an unknown field between pieces": body[: len(body) // 2] + other_field + body[len(body) // 2 :],
        "an unknown field after them": body + other_field,
        "no piece but an unknown field": other_field + bytes(MIN_VIEWED_BYTES),
    }
    for what, inner in written.items():
        message = b"\x22" + varint(len(inner)) + inner
        want = outcome(pb.UpdateWeightsRequest.FromString, message)
        assert outcome(read_update_request, message) == want, what
    two_fields = raw + b"\x22" + varint(len(pb.TensorChunks(chunks=chunks[:1]).SerializeToString()))
    two_fields += pb.TensorChunks(chunks=chunks[:1]).SerializeToString()  # protobuf merges the two
    read = read_update_request(two_fields)
    assert isinstance(read, pb.UpdateWeightsRequest) and len(read.tensors.chunks) == len(chunks) + 1


def test_corrupt_messages_of_several_pieces_read_as_protobuf_reads_them(rng):
    _, raw = several_pieces(rng)
    decode_errors = views = 0
    # The corrupted bytes: the first 200 (the framing of the first pieces), or the last few.
    for bad in corruptions(rng, raw, 200, 400):
        want = outcome(pb.UpdateWeightsRequest.FromString, bad)
        assert outcome(read_update_request, bad) == want, bad[:200].hex()
        decode_errors += want is DecodeError
        views += want is not DecodeError and isinstance(read_update_request(bad), tuple)
    assert decode_errors > 150 and views > 30, (decode_errors, views)  # both kinds of outcome were tried
