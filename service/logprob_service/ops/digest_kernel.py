"""The GPU side of ``ops.digest``: a block's inner sums sum_t x_{bT+t} r_l(t) in one Triton pass.

Imported only where a digest runs on a GPU: Triton is a GPU-only dependency, and the server runs
without it on the CPU. The digest's parameters (T, the lanes, the multipliers r) live in
``ops.digest`` alone and arrive here as the multiplier table, so this module imports nothing of it.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _block_dots_kernel(halves_ptr, n, r_ptr, out_ptr, T: tl.constexpr, TILE: tl.constexpr):
    """Program b: sum_t x_{bT+t} r_l(t) for the 4 lanes (exact int64), over the ``n`` halves."""
    b = tl.program_id(0).to(tl.int64)
    zero = tl.sum(tl.zeros((TILE,), dtype=tl.int64), axis=0)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero
    for start in range(0, T, TILE):
        t = start + tl.arange(0, TILE)
        k = b * T + t
        x = tl.load(halves_ptr + k, mask=k < n, other=0).to(tl.int64) & 0xFFFF
        acc0 += tl.sum(x * tl.load(r_ptr + t), axis=0)
        acc1 += tl.sum(x * tl.load(r_ptr + T + t), axis=0)
        acc2 += tl.sum(x * tl.load(r_ptr + 2 * T + t), axis=0)
        acc3 += tl.sum(x * tl.load(r_ptr + 3 * T + t), axis=0)
    tl.store(out_ptr + b * 4 + 0, acc0)
    tl.store(out_ptr + b * 4 + 1, acc1)
    tl.store(out_ptr + b * 4 + 2, acc2)
    tl.store(out_ptr + b * 4 + 3, acc3)


def block_dots(halves: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """[blocks, 4] int64 inner sums of ``halves`` (int16, on a GPU, or on the CPU under
    ``TRITON_INTERPRET=1``), in blocks of T halves, by the kernel. ``r``: the multipliers r_l(t),
    int64 [4, T] on the same device (``digest.multipliers``; the kernel sums 4 lanes)."""
    t = r.shape[1]
    blocks = triton.cdiv(halves.numel(), t)
    out = torch.empty((blocks, 4), dtype=torch.int64, device=halves.device)
    # Triton launches on the current device: the tensor's, whichever thread calls (one per GPU).
    with torch.cuda.device(halves.device) if halves.is_cuda else contextlib.nullcontext():
        _block_dots_kernel[(blocks,)](halves, halves.numel(), r, out, T=t, TILE=2048)
    return out
