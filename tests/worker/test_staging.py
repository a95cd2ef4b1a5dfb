"""The device side of weight updates (``worker.staging``), on the CPU: staged tensors, their
digests and finiteness checks, tensors received in pieces, sparse changes, and safetensors files.

The GPU's paths (the staging stream, page-locked slots, room on the device, the changes applied
together) are tested in ``tests/gpu/test_weight_updates_cuda.py`` and ``test_finite_weights_cuda.py``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import subprocess
import time

import numpy as np
import pytest
import torch
from logprob_service.domain import SparseChanges
from logprob_service.errors import InvalidArgument
from logprob_service.models.weights import dtype_name, tensor_digests
from logprob_service.worker.staging import DeviceStager, Staging
from safetensors.torch import save_file

CPU = torch.device("cpu")
# A FIFO's blocking open would hold the interpreter lock until a writer came; the bound only has to
# tell "at once" from "blocked until the writer" on a loaded 2-core machine.
PROMPT_S = 10.0


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


def digest_of(tensor: torch.Tensor) -> str:
    return tensor_digests({"t": tensor})["t"].digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_staged_tensor_is_the_update_s_own_or_a_copy_and_its_digest_is_of_its_bytes(rng, dtype):
    stager = Staging(reserve_bytes=0).stager(CPU)
    tensor = random_tensor(rng, (7, 5), dtype)
    own, pending = stager.stage(tensor)
    copied, pending_copy = stager.stage(tensor, copy=True)
    assert own.data_ptr() == tensor.data_ptr()  # the update's own tensor, not copied again
    assert copied.data_ptr() != tensor.data_ptr() and torch.equal(copied, tensor)
    _, undigested = stager.stage(tensor, digest=False)
    assert undigested is None
    digests = stager.finish([pending, pending_copy], ["a", "b"])
    assert [d.digest for d in digests] == [digest_of(tensor)] * 2
    assert digests[0].dtype == dtype_name(dtype) and digests[0].shape == (7, 5)
    assert stager.places == {"cpu"}


def test_finish_names_every_tensor_holding_nan_or_infinity_and_only_those(rng):
    stager = Staging(reserve_bytes=0).stager(CPU)
    names = [f"layers.{i}.w" for i in range(9)]
    tensors = [random_tensor(rng, (4, 3), torch.bfloat16) for _ in names]
    bad = sorted(int(i) for i in rng.choice(len(names), size=8, replace=False))
    for k, i in enumerate(bad):
        tensors[i].view(-1)[int(rng.integers(0, 12))] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    pending = [stager.stage(t)[1] for t in tensors]
    with pytest.raises(InvalidArgument) as refused:
        stager.finish(pending, names)
    message = str(refused.value)
    assert message.startswith(f"tensor {names[bad[0]]!r}: holds NaN or infinite values (as do 7 more: ")
    assert all(repr(names[i]) in message for i in bad[1:6]) and message.count("', '") == 4
    assert message.endswith("...); nothing applied (this server refuses non-finite weights: check_finite_weights)")
    good = next(i for i in range(len(names)) if i not in bad)
    assert repr(names[good]) not in message


def test_without_the_finiteness_check_non_finite_tensors_are_staged(rng):
    stager = Staging(reserve_bytes=0, check_finite=False).stager(CPU)
    tensor = random_tensor(rng, (6,), torch.float32)
    tensor[2] = float("nan")
    _, pending = stager.stage(tensor)
    assert stager.finish([pending], ["w"])[0].digest == digest_of(tensor)


def test_a_tensor_received_in_pieces_from_threads_in_any_order_is_its_bytes_with_a_copy_per_replica(rng):
    staging = Staging(reserve_bytes=0)
    stager, replicas = staging.stager(CPU), [staging.stager(CPU), staging.stager(CPU)]
    tensor = random_tensor(rng, (33, 17), torch.bfloat16)
    data = tensor.view(torch.uint8).reshape(-1).numpy().tobytes()
    cuts = sorted({0, len(data), *(int(c) for c in rng.integers(1, len(data), 12))})
    pieces = [(a, data[a:b]) for a, b in itertools.pairwise(cuts)]
    rng.shuffle(pieces)
    received = stager.receive("bfloat16", (33, 17), replicas)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda piece: received.write(*piece), pieces))
    copies, pending = received.finish()
    assert len(copies) == 3 and all(torch.equal(c, tensor) and c.dtype == torch.bfloat16 for c in copies)
    assert len({c.data_ptr() for c in copies}) == 3  # each replica has its own memory
    assert stager.finish([pending], ["w"])[0].digest == digest_of(tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_changes_stage_bit_for_bit_the_dense_update_and_leave_the_live_weight(rng, dtype):
    stager = Staging(reserve_bytes=0).stager(CPU)
    lives = [random_tensor(rng, shape, dtype) for shape in [(9, 11), (40,), (3, 4, 5)]]
    before = [live.clone() for live in lives]
    changes, dense = [], []
    for live in lives:
        n = live.numel()
        indices = np.sort(rng.choice(n, size=int(rng.integers(1, n // 2)), replace=False)).astype(np.uint32)
        new = random_tensor(rng, (indices.size,), dtype)
        expected = live.clone()
        expected.view(-1)[torch.from_numpy(indices.astype(np.int64))] = new
        dense.append(expected)
        changes.append(SparseChanges(live, indices, new.view(torch.uint8).numpy(), dtype_name(dtype)))
    staged = stager.stage_changes(changes)
    digests = stager.finish([p for _, p in staged], ["a", "b", "c"])
    for (copy, _), expected, live, old in zip(staged, dense, lives, before, strict=True):
        assert torch.equal(copy.view(torch.uint8), expected.view(torch.uint8)) and copy.shape == expected.shape
        assert torch.equal(live, old)  # the live weight is untouched until the swap
    assert [d.digest for d in digests] == [digest_of(t) for t in dense]


def test_a_safetensors_file_is_read_by_name_dtype_and_shape(tmp_path, rng):
    tensors = {"a.weight": random_tensor(rng, (3, 2), torch.bfloat16), "b": random_tensor(rng, (5,), torch.float32)}
    save_file(tensors, tmp_path / "w.safetensors")
    read = {name: (dtype, shape, t) for name, dtype, shape, t in Staging.read_file(tmp_path / "w.safetensors")}
    assert set(read) == set(tensors)
    for name, tensor in tensors.items():
        dtype, shape, t = read[name]
        assert dtype == dtype_name(tensor.dtype) and shape == tuple(tensor.shape) and torch.equal(t, tensor)


def test_a_file_that_is_not_safetensors_or_cannot_be_opened_is_an_invalid_argument_naming_path(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(InvalidArgument, match=r"^path: '.*junk\.safetensors' is not a readable safetensors file"):
        Staging.read_file(tmp_path / "junk.safetensors")
    with pytest.raises(InvalidArgument, match=r"^path: '.*missing\.safetensors' cannot be opened on the server"):
        Staging.read_file(tmp_path / "missing.safetensors")


def test_a_file_changed_after_its_check_is_refused_not_followed(tmp_path):
    """``read_file`` opens the checked path without blocking and reads it only if what it opened
    is a regular file at that very path: a FIFO put in the file's place after the check is not
    waited on, and a symlink put there is not followed."""
    real = tmp_path / "real.safetensors"
    save_file({"w": torch.ones(3)}, real)
    assert [name for name, *_ in Staging.read_file(real)] == ["w"]
    fifo = tmp_path / "swapped.safetensors"
    os.mkfifo(fifo)
    # A writer of another process comes after a while, so that a blocking open fails the test
    # instead of hanging it.
    writer = subprocess.Popen(["sh", "-c", f"sleep {PROMPT_S:g}; : > '{fifo}'"])
    try:
        start = time.monotonic()
        with pytest.raises(InvalidArgument, match="changed while it was being opened"):
            Staging.read_file(fifo)
        assert time.monotonic() - start < PROMPT_S
    finally:
        writer.kill()
        writer.wait()
    (tmp_path / "link.safetensors").symlink_to(real)
    with pytest.raises(InvalidArgument, match=r"changed while it was being opened \(it is now '.*real\.safetensors'"):
        Staging.read_file(tmp_path / "link.safetensors")


def test_a_stager_on_the_cpu_never_asks_for_device_room():
    stager = DeviceStager(CPU, reserve_bytes=1 << 40)  # a reserve no device has: the CPU path must not look
    staged, _ = stager.stage(torch.arange(4.0), copy=True)
    assert torch.equal(staged, torch.arange(4.0)) and stager.stream is None
