"""A push spread over several UpdateWeights calls, without a server: ``dense_piece`` frames a piece
byte for byte as protobuf would, ``split`` deals tensors to calls of about equal size, and the
calls of ``update_streams`` (dense) and ``WeightDeltas.update_streams`` (deltas) carry every tensor
exactly once, each call with the update's one header and a commit counting its own tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from logprob_client import LogprobClient, compare
from logprob_client import deltas as delta_pushes
from logprob_client.weights import WeightDeltas, dense_piece, join, sparse_piece, split, update_streams
from logprob_proto import framing
from logprob_proto import logprob_pb2 as pb

from tests.helpers.calls import parsed, unpacked


def protobuf_piece(name: str, dtype: str, shape: tuple[int, ...], offset: int, data: bytes) -> bytes:
    chunk = pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset, data=data)
    return pb.UpdateWeightsRequest(tensor=chunk).SerializeToString()


# (name, dtype, shape, offset, data bytes): lengths around the varints' 1/2/3-byte steps (128, 16384)
# for data, and so for the whole chunk; offsets of 0 (not written), 1, 2 and 3 varint bytes, and 8.
PIECES = [
    ("w", "float32", (1,), 0, 4),
    ("model.layers.0.mlp.up_proj.weight", "bfloat16", (96, 64), 128, 100),
    ("model.norm.weight", "float32", (64,), 0, 127),
    ("a", "float16", (64,), 2, 128),
    ("model.embed_tokens.weight", "float32", (517, 64), 16_384, 16_383),
    ("b", "bfloat16", (3, 5, 7, 11), 1_000_000, 16_384),
    ("c" * 200, "float32", (1 << 20,), (1 << 40) + 3, 16_385),  # a name of 200 bytes: a 2-byte length
    ("lm_head.weight", "float32", (517, 64), 517 * 64 * 4 - 70_000, 70_000),
    ("big", "float32", (1 << 22,), 0, (1 << 21) + 1),  # data of a 3-byte length, the chunk's too
]


@pytest.mark.parametrize(("name", "dtype", "shape", "offset", "nbytes"), PIECES, ids=[str(p[4]) for p in PIECES])
def test_dense_piece_is_protobufs_serialization(name, dtype, shape, offset, nbytes, rng):
    data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    framed = dense_piece(name, dtype, shape, offset, memoryview(data))
    assert framed == protobuf_piece(name, dtype, shape, offset, data)
    message = pb.UpdateWeightsRequest.FromString(framed)
    assert message.tensor.data == data and message.tensor.offset == offset and tuple(message.tensor.shape) == shape


@pytest.mark.parametrize(("name", "dtype", "shape", "offset", "nbytes"), PIECES, ids=[str(p[4]) for p in PIECES])
def test_sparse_piece_is_protobufs_serialization(name, dtype, shape, offset, nbytes, rng):
    """The same lengths for the values (``data``), and as many uint32 indices after them."""
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    count = max(1, nbytes // itemsize)
    values = rng.integers(0, 256, count * itemsize, dtype=np.uint8)
    indices = np.sort(rng.choice(1 << 24, count, replace=False)).astype("<u4")
    changed = offset + count
    framed = sparse_piece(name, dtype, shape, offset, changed, memoryview(indices).cast("B"), memoryview(values))
    chunk = pb.TensorChunk(
        name=name,
        dtype=dtype,
        shape=shape,
        offset=offset,
        changed=changed,
        indices=indices.tobytes(),
        data=values.tobytes(),
    )
    assert framed == pb.UpdateWeightsRequest(tensor=chunk).SerializeToString()


def test_dense_piece_of_a_view_into_a_larger_buffer(rng):
    """The client hands it slices of a tensor's bytes: only the slice is framed."""
    whole = rng.integers(0, 256, 50_000, dtype=np.uint8)
    view = memoryview(whole)[12_345:40_000]
    framed = dense_piece("w", "float32", (12_500,), 12_345, view)
    assert framed == protobuf_piece("w", "float32", (12_500,), 12_345, whole[12_345:40_000].tobytes())


def test_dense_piece_of_empty_data_is_protobufs_serialization():
    """An empty tensor is sent as one piece of no bytes. proto3 writes no empty ``bytes`` field
    (``data`` has no presence): protobuf's serialization ends after ``shape``/``offset``."""
    framed = dense_piece("empty", "float32", (0, 4), 0, memoryview(b""))
    assert pb.UpdateWeightsRequest.FromString(framed) == pb.UpdateWeightsRequest.FromString(
        protobuf_piece("empty", "float32", (0, 4), 0, b"")
    )  # read back alike ...
    assert framed == protobuf_piece("empty", "float32", (0, 4), 0, b"")  # ... and written alike


def check_split(sizes: list[int], streams: int, groups: list[list[int]]) -> None:
    """The contract of ``split``, stated independently of how it deals."""
    assert len(groups) == max(1, min(streams, len(sizes)))
    assert sorted(i for group in groups for i in group) == list(range(len(sizes))), "every index exactly once"
    assert all(group == sorted(group) for group in groups), "each group in the order given"
    if sizes and min(sizes) > 0:
        assert all(groups), "no empty group while there are tensors of some bytes to deal"
    if sizes:
        totals = [sum(sizes[i] for i in group) for group in groups]
        assert max(totals) - min(totals) <= max(sizes), (totals, sizes)


@pytest.mark.parametrize("trial", range(30))
def test_split_random_sizes(trial, rng):
    sizes = rng.integers(0, 1 << int(rng.integers(1, 30)), int(rng.integers(1, 60))).tolist()
    streams = int(rng.integers(1, 9))
    check_split(sizes, streams, split(sizes, streams))


def test_split_a_model_like_list_of_sizes():
    # An embedding and head, and many small and middling layers: the big two go to different groups.
    sizes = [517 * 64 * 4] + [64 * 4, 64 * 96 * 4, 64 * 96 * 4, 96 * 64 * 4, 64 * 64 * 4] * 6 + [517 * 64 * 4]
    for streams in (1, 2, 3, 4, 8):
        groups = split(sizes, streams)
        check_split(sizes, streams, groups)
        if streams > 1:
            assert not any({0, len(sizes) - 1} <= set(group) for group in groups)


def test_split_fewer_sizes_than_streams_gives_fewer_groups():
    assert split([5, 7], 4) == [[1], [0]]
    assert split([3], 2) == [[0]]
    assert len(split([0, 0, 0], 8)) == 3
    assert split([], 3) == [[]]  # one call: a header and a commit of nothing
    check_split([9, 1, 1], 1, split([9, 1, 1], 1))
    assert split([9, 1, 1], 1) == [[0, 1, 2]]


def test_split_of_empty_tensors_may_leave_groups_empty():
    """Sizes of 0 all go to the first group with the least (0): the other groups get nothing, and
    their calls carry a header and a commit of no tensors. Allowed; checked so that a change shows."""
    groups = split([0, 0, 0], 3)
    check_split([0, 0, 0], 3, groups)
    assert sum(map(len, groups)) == 3


def test_split_equal_sizes_keep_their_order():
    groups = split([4] * 10, 3)
    check_split([4] * 10, 3, groups)
    assert sorted(len(group) for group in groups) == [3, 3, 4]


def tensor_bytes(tensor) -> bytes:
    """A tensor's or array's raw little-endian bytes in C order, as the server must get them."""
    if isinstance(tensor, torch.Tensor):
        return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return np.ascontiguousarray(tensor).tobytes()


def reassemble(calls: list[list[pb.UpdateWeightsRequest]]) -> dict[str, tuple[int, str, tuple[int, ...], bytes]]:
    """name -> (the call it came on, dtype, shape, bytes), checking each tensor's pieces come in
    order on one call, and that each tensor comes on one call only."""
    tensors: dict[str, tuple[int, str, tuple[int, ...], bytearray]] = {}
    for c, messages in enumerate(calls):
        for m in messages[1:-1]:
            assert m.WhichOneof("kind") == "tensor"
            t = m.tensor
            if t.name not in tensors:
                assert t.offset == 0, f"{t.name}: its first piece starts at {t.offset}"
                tensors[t.name] = (c, t.dtype, tuple(t.shape), bytearray())
            call, dtype, shape, data = tensors[t.name]
            assert call == c, f"{t.name}: came on calls {call} and {c}"
            assert (t.dtype, tuple(t.shape), t.offset) == (dtype, shape, len(data))
            assert not t.changed and not t.indices
            data += t.data
    return {name: (c, dtype, shape, bytes(data)) for name, (c, dtype, shape, data) in tensors.items()}


def weights_of_every_kind(rng: np.random.Generator) -> dict[str, object]:
    return {
        "bf16": torch.from_numpy(rng.standard_normal((33, 17)).astype(np.float32)).to(torch.bfloat16),
        "f32": torch.from_numpy(rng.standard_normal((40, 9)).astype(np.float32)),
        "numpy-f32": rng.standard_normal((5, 7)).astype(np.float32),
        "numpy-f16": rng.standard_normal(300).astype(np.float16),
        "strided": torch.from_numpy(rng.standard_normal((10, 12)).astype(np.float32)).t(),  # not contiguous
        "empty": torch.empty(0, 4),
        "one": torch.from_numpy(rng.standard_normal(1).astype(np.float32)),
        "scalar": torch.tensor(float(rng.standard_normal()), dtype=torch.bfloat16),  # 0-d
    }


def test_update_streams_carry_every_tensor_once_with_its_bytes(rng):
    weights = weights_of_every_kind(rng)
    assert not weights["strided"].is_contiguous()
    calls = update_streams("m", weights, version=7, partial=True, chunk_bytes=100, streams=3)
    assert len(calls) == 3
    messages = [unpacked(parsed(call)) for call in calls]

    headers = [m[0] for m in messages]
    assert all(h.WhichOneof("kind") == "header" for h in headers)
    assert headers[0].header.streams == 3 and headers[0].header.update_id
    assert all(h == headers[0] for h in headers), "every call sends the update's one header"
    h = headers[0].header
    assert (h.model, h.version, h.partial, h.HasField("base_version")) == ("m", 7, True, False)

    got = reassemble(messages)
    assert set(got) == set(weights)
    for name, tensor in weights.items():
        _, dtype, shape, data = got[name]
        assert shape == tuple(tensor.shape) and data == tensor_bytes(tensor), name
        assert dtype == (
            str(tensor.dtype).removeprefix("torch.") if isinstance(tensor, torch.Tensor) else tensor.dtype.name
        )
    assert got["empty"][3] == b""
    for c, call in enumerate(messages):
        assert call[-1].WhichOneof("kind") == "commit"
        assert call[-1].commit.tensor_count == sum(1 for came_on, *_ in got.values() if came_on == c) > 0
        assert max(len(m.tensor.data) for m in call[1:-1]) <= 100


def test_update_streams_of_two_pushes_have_different_ids(rng):
    weights = weights_of_every_kind(rng)
    first, second = (parsed(update_streams("m", weights, version=0, partial=False, streams=2)[0])[0] for _ in range(2))
    assert first.header.update_id and second.header.update_id and first.header.update_id != second.header.update_id


def test_update_streams_from_pairs_and_fewer_tensors_than_streams(rng):
    pairs = [("a", rng.standard_normal(100).astype(np.float32)), ("b", rng.standard_normal(7).astype(np.float32))]
    calls = [unpacked(parsed(call)) for call in update_streams("m", iter(pairs), version=0, partial=True, streams=5)]
    assert len(calls) == 2
    assert all(
        call[0].header.streams == 2 and call[0].header.update_id == calls[0][0].header.update_id for call in calls
    )
    got = reassemble(calls)
    assert {name: data for name, (_, _, _, data) in got.items()} == {n: a.tobytes() for n, a in pairs}
    assert [call[-1].commit.tensor_count for call in calls] == [1, 1]


def test_one_stream_sets_no_streams_or_id(rng):
    weights = weights_of_every_kind(rng)
    (call,) = update_streams("m", weights, version=0, partial=False, chunk_bytes=64, streams=1)
    messages = unpacked(parsed(call))
    assert messages[0].header.streams == 0 and messages[0].header.update_id == ""
    assert (
        messages[0].SerializeToString()
        == pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(model="m")).SerializeToString()
    )
    assert messages[-1].commit.tensor_count == len(weights)
    got = reassemble([messages])
    assert {name: data for name, (_, _, _, data) in got.items()} == {n: tensor_bytes(t) for n, t in weights.items()}
    # A single tensor over several streams is one call too, and says nothing of streams.
    (alone,) = update_streams("m", {"w": weights["f32"]}, version=0, partial=True, streams=4)
    assert parsed(alone)[0].header.streams == 0


@pytest.mark.parametrize("bad", [dict(streams=0), dict(chunk_bytes=0), dict(version=-1)])
def test_update_streams_refuses_bad_arguments(bad):
    with pytest.raises(ValueError, match=">= "):
        update_streams("m", {}, **(dict(version=0, partial=True) | bad))


@pytest.mark.parametrize("bad", [dict(sparse_below=1.5), dict(expect_changed=-0.1), dict(expect_changed=2)])
def test_weight_deltas_refuse_fractions_out_of_range(bad):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        WeightDeltas(**bad)


def apply_sparse(held: bytes, pieces: list[pb.TensorChunk], itemsize: int) -> bytes:
    out = np.frombuffer(held, dtype=np.uint8).copy()
    for t in pieces:
        for i, where in enumerate(np.frombuffer(t.indices, dtype="<u4")):
            out[where * itemsize : (where + 1) * itemsize] = np.frombuffer(
                t.data[i * itemsize : (i + 1) * itemsize], np.uint8
            )
    return out.tobytes()


def held_bytes(held) -> bytes:
    return held.tobytes() if isinstance(held, np.ndarray) else held.numpy().tobytes()


# on_device: torch tensors' copies are held, and compared, as torch tensors on their device (here
# the CPU); arrays still on the host.
@pytest.mark.parametrize("on_device", [False, True])
def test_weight_deltas_over_two_streams(rng, on_device):
    names = [f"layer{i}" for i in range(8)]
    start = {n: rng.standard_normal((16, 16)).astype(np.float32) for n in names}
    start["big"] = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32)).to(torch.bfloat16)
    start["small"] = torch.from_numpy(rng.standard_normal((8, 24)).astype(np.float32)).to(torch.bfloat16)
    deltas = WeightDeltas(on_device=on_device)

    first = [unpacked(parsed(call)) for call in deltas.update_streams("m", start, version=0, partial=False, streams=2)]
    assert len(first) == 2 and deltas.last == {"dense": len(start), "sparse": 0, "unchanged": 0}
    assert all(call[0] == first[0][0] for call in first) and first[0][0].header.streams == 2
    assert not first[0][0].header.partial and not first[0][0].header.HasField("base_version")
    got = reassemble(first)
    assert {n: d for n, (_, _, _, d) in got.items()} == {n: tensor_bytes(t) for n, t in start.items()}
    deltas.pushed(5)

    # Two tensors unchanged, two with a few elements changed (sparse), the rest rewritten (dense).
    step = {n: a.copy() if isinstance(a, np.ndarray) else a.clone() for n, a in start.items()}
    unchanged, sparse = ["layer0", "layer5"], ["layer1", "layer6", "small"]
    for n in sparse:
        flat = step[n].reshape(-1)
        where = rng.choice(flat.shape[0], 5, replace=False)
        flat[where] += torch.from_numpy(1.0 + rng.random(5)).to(flat.dtype) if n == "small" else 1.0 + rng.random(5)
    dense = [n for n in step if n not in unchanged + sparse]
    for n in dense:
        step[n] = step[n] + 1 if isinstance(step[n], torch.Tensor) else step[n] + np.float32(1)

    second = [unpacked(parsed(call)) for call in deltas.update_streams("m", step, version=0, partial=False, streams=2)]
    assert deltas.last == {"dense": len(dense), "sparse": len(sparse), "unchanged": len(unchanged)}
    header = second[0][0].header
    assert all(call[0] == second[0][0] for call in second)
    assert (header.streams, header.partial, header.base_version) == (2, True, 5)
    assert header.update_id and header.update_id != first[0][0].header.update_id

    came = {}  # name -> (call, pieces)
    for c, call in enumerate(second):
        for m in call[1:-1]:
            assert came.setdefault(m.tensor.name, (c, []))[0] == c, f"{m.tensor.name} came on two calls"
            came[m.tensor.name][1].append(m.tensor)
        assert call[-1].commit.tensor_count == sum(1 for on, _ in came.values() if on == c)
    assert set(came) == set(dense + sparse), "unchanged tensors are not sent"
    for n in sparse:
        pieces = came[n][1]
        assert all(t.changed == 5 for t in pieces)
        assert apply_sparse(tensor_bytes(start[n]), pieces, 2 if n == "small" else 4) == tensor_bytes(step[n])
    for n in dense:
        pieces = came[n][1]
        assert all(not t.changed for t in pieces)
        assert b"".join(t.data for t in pieces) == tensor_bytes(step[n])
    deltas.pushed(6)
    assert all(held_bytes(deltas.held[n]) == tensor_bytes(step[n]) for n in step)
    assert isinstance(deltas.held["small"], torch.Tensor) == on_device


@pytest.mark.parametrize("count_elements", [compare.COUNT_ELEMENTS, 100], ids=["whole", "in-parts"])
@pytest.mark.parametrize("group_elements", [compare.GROUP_ELEMENTS, 2000, 1], ids=["one-group", "by-2", "alone"])
def test_device_held_deltas_counted_together_or_one_by_one_send_the_same(
    rng, count_elements, group_elements, monkeypatch
):
    # Over more than one call, the changed elements of every held torch tensor are counted at once
    # (one wait), and found in groups of tensors; over one call from a lazy iterable, tensor by
    # tensor. Both send the same pieces. Counted whole, or (a smaller COUNT_ELEMENTS) in parts of
    # each tensor; the 4 sparse tensors in one group, in groups of 2 (2000 elements: 2 tensors of
    # 768), or each alone.
    monkeypatch.setattr(compare, "COUNT_ELEMENTS", count_elements)
    monkeypatch.setattr(compare, "GROUP_ELEMENTS", group_elements)
    start = {f"w{i}": torch.from_numpy(rng.standard_normal((48, 16)).astype(np.float32)) for i in range(6)}
    step = {n: t.clone() for n, t in start.items()}
    for i, n in enumerate(["w1", "w2", "w3", "w4"]):
        step[n].view(-1)[torch.from_numpy(rng.choice(step[n].numel(), 3 + i, replace=False))] += 1.0
    step["w5"] += 1.0  # every element: dense

    def chunks(calls) -> dict[str, list[bytes]]:
        came: dict[str, list[bytes]] = {}
        for call in calls:
            for m in unpacked(parsed(call))[1:-1]:
                came.setdefault(m.tensor.name, []).append(m.tensor.SerializeToString())
        return came

    sent = {}
    for streams in (1, 3):
        deltas = WeightDeltas(on_device=True)
        chunks(deltas.update_streams("m", start, version=0, partial=False, streams=streams))
        deltas.pushed(1)
        weights = iter(step.items()) if streams == 1 else step
        sent[streams] = chunks(deltas.update_streams("m", weights, version=0, partial=False, streams=streams))
        assert deltas.last == {"dense": 1, "sparse": 4, "unchanged": 1}
        deltas.pushed(2)
        assert all(held_bytes(deltas.held[n]) == tensor_bytes(step[n]) for n in step)
    assert sent[1] == sent[3] and set(sent[1]) == {"w1", "w2", "w3", "w4", "w5"}


def held_pool_idle() -> None:
    compare.held_pool().submit(lambda: None).result()


def test_device_held_changes_land_in_a_buffer_made_ahead(rng, monkeypatch):
    # After a push, the buffer the next push's changes land in is made on the held pool's thread,
    # for expect_changed of the held elements (uint32 index and value each, 16 bytes of alignment
    # per tensor); a delta whose changes fit uses it, and the next is made for 1.25x its changes
    # if that is more. After the first, the comparison's kernels run once per device and element size.
    warmed, warm_up = [], delta_pushes.warm_up

    def warming(kinds):
        warmed.append(kinds)
        warm_up(kinds)

    monkeypatch.setattr(delta_pushes, "warm_up", warming)
    start = {f"w{i}": torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32)) for i in range(4)}
    start["half"] = torch.from_numpy(rng.standard_normal(1000).astype(np.float32)).to(torch.bfloat16)
    deltas = WeightDeltas(on_device=True, expect_changed=0.05)
    [parsed(call) for call in deltas.update_streams("m", start, version=0, partial=False, streams=2)]
    deltas.pushed(1)
    held_pool_idle()
    cpu = torch.device("cpu")
    assert sorted(map(str, warmed[0])) == sorted(map(str, [(cpu, torch.int16), (cpu, torch.int32)]))
    expected = 4 * (math.ceil(0.05 * 64 * 32) * 8 + 16) + math.ceil(0.05 * 1000) * 6 + 16
    made = deltas._landing
    assert made.numel() == expected and not deltas._landing_pinned

    step = {n: t.clone() for n, t in start.items()}
    for t in step.values():
        t.view(-1)[torch.from_numpy(rng.choice(t.numel(), 20, replace=False))] += 1.0
    sent = [unpacked(parsed(call)) for call in deltas.update_streams("m", step, version=0, partial=False, streams=2)]
    assert deltas.last == {"dense": 0, "sparse": len(step), "unchanged": 0}
    assert sum(m.tensor.changed > 0 for call in sent for m in call[1:-1]) == len(step)
    assert deltas._landing is made and deltas._landed < expected  # no buffer made during the push
    deltas.pushed(2)
    assert all(held_bytes(deltas.held[n]) == tensor_bytes(step[n]) for n in step)

    # Changes larger than the buffer: a larger one is made for that push, and 1.25x it after.
    for t in step.values():
        t.view(-1)[: t.numel() // 10] += 1.0
    [parsed(call) for call in deltas.update_streams("m", step, version=0, partial=False, streams=2)]
    assert deltas.last["sparse"] == len(step) and deltas._landed > expected
    assert deltas._landing.numel() == deltas._landed
    deltas.pushed(3)
    held_pool_idle()
    assert deltas._landing.numel() == math.ceil(1.25 * deltas._landed)
    assert len(warmed) == 1, "warmed up once"
    assert all(held_bytes(deltas.held[n]) == tensor_bytes(step[n]) for n in step)


@pytest.mark.parametrize("failing", ["count_group", "compare_group"])
def test_a_failure_comparing_held_tensors_fails_every_call_with_it(rng, failing, monkeypatch):
    start = {f"w{i}": torch.from_numpy(rng.standard_normal(64).astype(np.float32)) for i in range(6)}
    deltas = WeightDeltas(on_device=True)
    [parsed(call) for call in deltas.update_streams("m", start, version=0, partial=False, streams=3)]
    deltas.pushed(1)
    step = {n: t.clone() for n, t in start.items()}
    for t in step.values():
        t[:3] += 1.0  # sparse: 3 of 64 changed

    def fail(*args):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(delta_pushes, failing, fail)
    for call in deltas.update_streams("m", step, version=0, partial=False, streams=3):
        with pytest.raises(RuntimeError, match="a stand-in"):
            parsed(call)


@pytest.mark.parametrize(
    ("target", "ports", "streams", "expected"),
    [
        ("localhost:7000", [], None, ["localhost:7000"] * 4),  # no receivers: 4 calls to the target
        ("localhost:7000", [7001, 7002], None, ["localhost:7001", "localhost:7002"] * 2),
        # 2 calls per receiver when that is more than 4
        ("localhost:7000", [7001, 7002, 7003, 7004], None, [f"localhost:{p}" for p in range(7001, 7005)] * 2),
        ("localhost:7000", [7001, 7002, 7003], 2, ["localhost:7001", "localhost:7002"]),  # as asked
        ("dns:///service:7000", [7001], None, ["dns:///service:7000"] * 4),  # a name of replicas: the target
    ],
)
def test_a_pushs_calls_spread_over_the_receivers_the_server_announces(rng, target, ports, streams, expected):
    weights = {f"w{i}": torch.from_numpy(rng.standard_normal(64).astype(np.float32)) for i in range(12)}
    with LogprobClient(target) as client:
        update = client.update("m", weights, ports, streams=streams)
    assert update.targets == expected
    assert len(update.calls) == len(expected)


def test_a_legacy_wire_push_goes_over_one_call(rng):
    with LogprobClient("localhost:7000", legacy_wire=True) as client:
        update = client.update("m", {"w": torch.ones(4)}, [7001, 7002])
    assert update.targets == ["localhost:7000"] and len(update.calls) == 1


def many_small_and_a_few_large(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A model's shape in small: large matrices among many norms and biases."""
    weights = {}
    for layer in range(6):
        weights[f"l{layer}.norm"] = rng.standard_normal(16).astype(np.float32)
        # At least 4 elements: one changed element of a float32 tensor goes sparse (8 bytes against
        # half its 16 or more), as every tensor of the delta test below must.
        weights[f"l{layer}.bias"] = rng.standard_normal(int(rng.integers(4, 40))).astype(np.float32)
        weights[f"l{layer}.proj"] = rng.standard_normal((40, int(rng.integers(20, 60)))).astype(np.float32)
    return weights


@pytest.mark.parametrize("streams", [1, 3])
def test_small_pieces_go_several_to_a_message_of_at_most_chunk_bytes(rng, streams):
    weights = many_small_and_a_few_large(rng)
    chunk_bytes = 2000
    plain = [
        parsed(call)
        for call in update_streams(
            "m", weights, version=0, partial=False, chunk_bytes=chunk_bytes, streams=streams, pack=False
        )
    ]
    calls = update_streams("m", weights, version=0, partial=False, chunk_bytes=chunk_bytes, streams=streams)
    packed = [[join(m) for m in call] for call in calls]
    assert all(m.WhichOneof("kind") != "tensors" for call in plain for m in call)
    several = []
    for call, alone in zip(packed, plain, strict=True):
        messages = parsed(call)
        # The same pieces in the same order, in as many messages or fewer (the update ids differ).
        assert [m.tensor for m in unpacked(messages)[1:-1]] == [m.tensor for m in alone[1:-1]]
        assert messages[-1] == alone[-1] and len(messages) <= len(alone)
        several += [raw for raw, m in zip(call, messages) if m.WhichOneof("kind") == "tensors"]
        # A piece that fills a message goes alone, as it was.
        assert all(m in messages for m in alone[1:-1] if len(m.SerializeToString()) >= chunk_bytes)
    assert sum(map(len, packed)) < sum(map(len, plain))
    assert several and all(len(raw) <= chunk_bytes + 6 for raw in several)  # + the message's own tag and length
    got = reassemble([unpacked(parsed(call)) for call in packed])
    assert {n: d for n, (_, _, _, d) in got.items()} == {n: a.tobytes() for n, a in weights.items()}


def test_packing_sends_a_full_message_without_waiting_for_the_next_piece():
    pieces_made = []

    def pieces(sizes):
        for i, n in enumerate(sizes):
            pieces_made.append(i)
            yield framing.dense_parts(f"t{i}", "float32", (n // 4,), 0, memoryview(bytes(n)))

    packing = framing.pack_pieces(pieces([40, 40, 5000, 40, 3000, 3000]), most_bytes=4096)
    first = parsed([next(packing)])[0]
    assert [c.name for c in first.tensors.chunks] == ["t0", "t1"] and pieces_made == [0, 1, 2]
    assert parsed([next(packing)])[0].tensor.name == "t2" and pieces_made == [0, 1, 2], "not held for t3"
    third = parsed([next(packing)])[0]
    assert [c.name for c in third.tensors.chunks] == ["t3", "t4"] and pieces_made == [0, 1, 2, 3, 4, 5]
    assert parsed([next(packing)])[0].tensor.name == "t5"
    assert next(packing, None) is None


def test_a_deltas_small_sparse_tensors_go_several_to_a_message(rng):
    start = many_small_and_a_few_large(rng)
    deltas = WeightDeltas()
    [parsed(call) for call in deltas.update_streams("m", start, version=0, partial=False, chunk_bytes=4096)]
    deltas.pushed(1)
    step = {n: a.copy() for n, a in start.items()}
    for a in step.values():
        a.reshape(-1)[: max(1, a.size // 50)] += np.float32(1)  # 2% changed: every tensor sparse
    (call,) = deltas.update_streams("m", step, version=0, partial=False, chunk_bytes=4096)
    messages = parsed(call)
    assert deltas.last == {"dense": 0, "sparse": len(step), "unchanged": 0}
    assert len(messages) - 2 < len(step) // 4, "several tensors' changes to a message"
    came: dict[str, list[pb.TensorChunk]] = {}
    for m in unpacked(messages)[1:-1]:
        came.setdefault(m.tensor.name, []).append(m.tensor)
    for n, a in start.items():
        assert apply_sparse(a.tobytes(), came[n], 4) == step[n].tobytes()
