"""The digest of a tensor's bytes, computed on the device that holds them.

Every weight that goes live is digested (its fingerprint, ``models.weights``). Hashing on the host
costs a device-to-host copy and a CPU hash of every byte (blake2b runs at 0.5-1 GB/s a thread):
seconds per push of a 1.5B model, tens of seconds for a 7B one, whatever the transport. This
digest is exact integer arithmetic that a GPU does in one pass over the bytes (``digest_kernel``)
and a CPU does as a float64 matrix product (``_block_dots_host``), with the same result, so a
weight has one digest wherever it is computed.

Maths. The bytes, zero-padded, are little-endian 16-bit halves x_k, cut into blocks of
T = 2^16 halves (block b holds k = b T + t, 0 <= t < T). With the prime P = 2^31 - 1, lane l of
four is

    D_l = sum_b s_l(b) * (sum_t x_{bT+t} r_l(t) mod P)   (mod P)

with fixed pseudo-random multipliers r_l(t) in [1, 2^20) (a table of T per lane) and s_l(b) in
[1, P). A block's inner sum is an integer below 2^16 * 2^20 * 2^16 = 2^52: exact in int64 on a
GPU and in float64 (every partial sum is an integer below 2^53) in a CPU's matrix product,
whatever the order of the additions. Changing any half by d (0 < |d| < 2^16 < P) moves every
lane by d r s, never 0 mod P; unstructured changes leave a lane equal about once in 2^31. Not a
cryptographic hash: it tells which bytes went live, as the fingerprint needs, and would not stop
an adversary who crafts collisions (who could push any weights anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

P = 2**31 - 1
T = 1 << 16  # halves per block
LANES = 4
SEED = 0x6C6F6770  # fixed forever: changing it (or the formulas below) changes every fingerprint
HOST_BLOCKS = 256  # blocks per float64 product on the host (256 x 64 Ki halves: 128 MiB of float64)
DEVICE_BLOCKS = 1 << 11  # blocks per kernel launch (256 MiB of bytes, brought to the GPU at once)


def _mix(m: torch.Tensor, lane: int) -> torch.Tensor:
    """A pseudo-random value in [0, P) of each int64 ``m`` in [0, P): a quadratic map mod P."""
    a, c = (SEED * (2 * lane + 3)) % P, (SEED * (lane + 7) + 12_345) % P
    x = (a * m + c) % P
    return (x * x + lane + 1) % P


@functools.cache
def multipliers(device: torch.device) -> torch.Tensor:
    """r_l(t): [LANES, T] int64 in [1, 2^20)."""
    t = torch.arange(T, dtype=torch.int64, device=device)
    return torch.stack([_mix(t, lane) % (2**20 - 1) + 1 for lane in range(LANES)])


@functools.lru_cache(maxsize=256)
def _block_factors(first_block: int, blocks: int, device: torch.device) -> torch.Tensor:
    """s_l(b) for b in [first_block, first_block + blocks): [blocks, LANES] int64 in [1, P).

    Cached: a model's tensors come in few sizes, and these ~50 small kernels per tensor were most
    of a small tensor's digest (a 7B model has ~340 tensors per update)."""
    b = torch.arange(first_block, first_block + blocks, dtype=torch.int64, device=device) % P
    factors = torch.stack([_mix((b + T) % P, lane) % (P - 1) + 1 for lane in range(LANES)], dim=1)
    if factors.is_cuda:
        # Other threads read it on their own streams: it is complete before it is cached.
        torch.cuda.current_stream(device).synchronize()
    return factors


def _block_dots_host(halves: torch.Tensor) -> torch.Tensor:
    """The same inner sums on the CPU: a float64 matrix product, exact (see the module's maths)."""
    n = halves.numel()
    blocks = -(-n // T)
    x = np.empty((blocks, T), dtype=np.float64)
    flat = x.reshape(-1)
    flat[:n] = halves.numpy().view(np.uint16)
    flat[n:] = 0
    return torch.from_numpy((x @ _host_multipliers()).astype(np.int64))


@functools.cache
def _host_multipliers() -> np.ndarray:
    """r_l(t) as float64 [T, LANES] (exact: below 2^20)."""
    return multipliers(torch.device("cpu")).T.contiguous().numpy().astype(np.float64)


def _halves(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as int16 halves, zero-padded to a whole number of halves."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if raw.numel() == 0:
        return torch.empty(0, dtype=torch.int16, device=raw.device)
    if raw.numel() % 2 or raw.storage_offset() % 2:
        padded = torch.zeros(raw.numel() + raw.numel() % 2, dtype=torch.uint8, device=raw.device)
        padded[: raw.numel()] = raw
        raw = padded
    return raw.view(torch.int16)


def digest_lanes(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The four lanes D_l of ``tensor``'s raw bytes: int64 [LANES], where they were computed and
    not yet read back, so that many tensors' digests cost one wait (``lanes_hex``).

    On a CUDA tensor, the kernel on the current stream. With ``device`` a GPU and ``tensor`` on the
    host, its bytes go to the GPU a piece at a time to be digested there. Otherwise on the CPU."""
    halves = _halves(tensor)
    gpu = None  # where the kernel runs; None: the host path
    if halves.device.type == "cuda":
        gpu = halves.device
    elif device is not None and device.type == "cuda":
        gpu = device
    step = (DEVICE_BLOCKS if gpu is not None else HOST_BLOCKS) * T
    total = torch.zeros(LANES, dtype=torch.int64, device=gpu or "cpu")
    for start in range(0, halves.numel(), step):
        piece = halves[start : start + step]
        if gpu is None:
            dots = _block_dots_host(piece)
        else:
            from logprob_service.ops.digest_kernel import block_dots  # Triton: GPU servers only

            piece = piece.to(gpu, non_blocking=True)
            dots = block_dots(piece, multipliers(piece.device))
        factors = _block_factors(start // T, dots.shape[0], dots.device)
        # Each term is below P after its % P; a sum of fewer than 2^32 of them fits int64.
        total += ((dots % P) * factors % P).sum(dim=0)
    return total % P


# Bytes per block: tensors packed for ``packed_lanes`` each start at a multiple of this.
BLOCK_BYTES = 2 * T


def packed_lanes(packed: torch.Tensor, nbytes: Sequence[int]) -> torch.Tensor:
    """``digest_lanes`` of many tensors at once: [len(nbytes), LANES] int64, not read back.
    ``packed`` (flat uint8) holds them back to back, each of ``nbytes`` padded with zeros to a
    multiple of ``BLOCK_BYTES``, so that every block is one tensor's, at its place in that tensor
    (the zeros are the padding ``digest_lanes`` assumes). A few calls for all of them, on the
    GPU (the kernel) or the CPU, where ``packed`` lies: one by one, a tensor's digest took ~8
    calls, ~0.23 ms of torch on a GPU (77 ms for a 1.5B model's 338 tensors, H100)."""
    counts = [-(-n // BLOCK_BYTES) for n in nbytes]
    if packed.numel() != sum(counts) * BLOCK_BYTES:
        raise ValueError(f"{packed.numel()} bytes packed, {sum(counts) * BLOCK_BYTES} expected")
    device = packed.device
    halves = packed.view(torch.int16)
    step = (DEVICE_BLOCKS if device.type == "cuda" else HOST_BLOCKS) * T
    if device.type == "cuda":
        from logprob_service.ops.digest_kernel import block_dots  # Triton: GPU servers only

        r = multipliers(device)
        pieces = [block_dots(halves[start : start + step], r) for start in range(0, halves.numel(), step)]
    else:
        pieces = [_block_dots_host(halves[start : start + step]) for start in range(0, halves.numel(), step)]
    lanes = torch.zeros((len(nbytes), LANES), dtype=torch.int64, device=device)
    if not pieces:
        return lanes
    dots = torch.cat(pieces)
    per_tensor = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
    tensor = torch.repeat_interleave(torch.arange(len(counts), device=device), per_tensor, output_size=dots.shape[0])
    first = torch.cumsum(per_tensor, 0) - per_tensor  # each tensor's first block in ``dots``
    local = torch.arange(dots.shape[0], device=device) - first[tensor]  # a block's index in its tensor
    factors = _block_factors(0, max(counts), device)[local]
    # Each term is below P after its % P; a sum of fewer than 2^32 of them fits int64.
    return lanes.index_add_(0, tensor, (dots % P) * factors % P) % P


def lanes_hex(lanes: Sequence[torch.Tensor]) -> list[str]:
    """The digests (32 hex digits: the four lanes) of ``digest_lanes`` results, read back with one
    copy per device, which waits for the current stream there."""
    by_device: dict[torch.device, list[int]] = {}
    for i, one in enumerate(lanes):
        by_device.setdefault(one.device, []).append(i)
    digests = [""] * len(lanes)
    for indices in by_device.values():
        for i, row in zip(indices, torch.stack([lanes[i] for i in indices]).tolist(), strict=True):
            digests[i] = "".join(f"{lane:08x}" for lane in row)
    return digests


def byte_digest(tensor: torch.Tensor, device: torch.device | None = None) -> str:
    """The digest of ``tensor``'s raw bytes, 32 hex digits (``digest_lanes``, read back at once)."""
    return lanes_hex([digest_lanes(tensor, device)])[0]
