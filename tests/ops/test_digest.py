"""The weights' byte digest (ops.digest): one answer whichever way it is computed, and a change of
any byte changes it.

The reference is the module's formula evaluated in Python integers, one half at a time, on small
inputs. The kernel runs on the GPU, or in Triton's CPU interpreter without one (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.ops import digest, digest_kernel
from logprob_service.ops.digest import LANES, P, T, byte_digest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def formula(data: bytes) -> str:
    """D_l = sum_b s_l(b) (sum_t x_{bT+t} r_l(t) mod P) mod P, in Python integers."""
    data += b"\0" * (len(data) % 2)
    halves = np.frombuffer(data, dtype="<u2").astype(object)
    r = digest.multipliers(torch.device("cpu")).tolist()
    blocks = -(-len(halves) // T)
    s = digest._block_factors(0, blocks, torch.device("cpu")).tolist()
    lanes = []
    for lane in range(LANES):
        total = 0
        for b in range(blocks):
            block = halves[b * T : (b + 1) * T]
            total += s[b][lane] * (sum(int(x) * r[lane][t] for t, x in enumerate(block)) % P)
        lanes.append(total % P)
    return "".join(f"{v:08x}" for v in lanes)


def random_bytes(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 2 * T, 2 * T + 3, 5 * T + 1])
def test_the_host_path_is_the_formula(n, rng):
    data = random_bytes(rng, n)
    assert byte_digest(data) == formula(data.numpy().tobytes())


@pytest.mark.parametrize("n", [1, 6, 2 * T - 2, 3 * T + 5])
def test_the_kernel_gives_the_host_path_s_block_sums(n, rng):
    halves = digest._halves(random_bytes(rng, n))
    want = digest._block_dots_host(halves)
    got = digest_kernel.block_dots(halves.to(DEVICE), digest.multipliers(torch.device(DEVICE))).cpu()
    assert torch.equal(got, want)


def test_any_dtype_shape_and_offset_is_digested_by_its_bytes(rng):
    x = torch.from_numpy(rng.standard_normal((33, 17)).astype(np.float32))
    assert byte_digest(x) == formula(x.numpy().tobytes())
    view = x.to(torch.bfloat16)[1:, 3:]  # not contiguous, odd offset: its own bytes, compacted
    assert byte_digest(view) == formula(view.contiguous().view(torch.int16).numpy().tobytes())
    assert byte_digest(x.view(torch.int32)) == byte_digest(x)  # the bytes alone (dtype is digested beside)


def test_changing_any_one_byte_changes_every_lane(rng):
    data = random_bytes(rng, 3 * T + 11)
    base = byte_digest(data)
    for i in rng.choice(data.numel(), 40, replace=False):
        changed = data.clone()
        changed[i] ^= int(rng.integers(1, 256))
        other = byte_digest(changed)
        assert all(base[j : j + 8] != other[j : j + 8] for j in range(0, 32, 8)), (i, base, other)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_and_brought_to_it_the_digest_is_the_host_s(rng):
    x = torch.from_numpy(rng.standard_normal(digest.DEVICE_BLOCKS * T + 12345).astype(np.float32))
    host = byte_digest(x)
    assert byte_digest(x.cuda()) == host
    assert byte_digest(x, torch.device("cuda")) == host


@pytest.mark.parametrize("host_blocks", [digest.HOST_BLOCKS, 3], ids=["one-product", "several-products"])
def test_tensors_packed_together_have_each_its_own_digest(rng, host_blocks, monkeypatch):
    # Sizes across block edges, an odd size (padded to whole halves), an empty tensor, a tensor of
    # several blocks; with a small HOST_BLOCKS, products that end mid-tensor.
    monkeypatch.setattr(digest, "HOST_BLOCKS", host_blocks)
    sizes = [7, 2 * T, 0, 2 * T + 3, 5 * T + 1, 64, 2 * T * 3]
    tensors = [random_bytes(rng, n) for n in sizes]
    packed = torch.cat([torch.cat([t, torch.zeros(-len(t) % digest.BLOCK_BYTES, dtype=torch.uint8)]) for t in tensors])
    lanes = digest.packed_lanes(packed, sizes)
    assert digest.lanes_hex(list(lanes)) == [byte_digest(t) for t in tensors]
    assert lanes.shape == (len(sizes), LANES)


def test_packed_bytes_of_another_length_are_refused():
    with pytest.raises(ValueError, match="bytes packed"):
        digest.packed_lanes(torch.zeros(digest.BLOCK_BYTES, dtype=torch.uint8), [digest.BLOCK_BYTES + 1])
