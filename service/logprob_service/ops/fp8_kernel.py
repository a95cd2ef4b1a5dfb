"""The FP8 weights' dequantization on the GPU (``ops.fp8.dequantize``): one Triton kernel.

Registered as a torch custom op, so that a compiled layer (``models.compiled``) calls it as one
opaque step rather than tracing the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A tile of [TILE_N, TILE_K] elements a program: 8 KiB of FP8 read, 16 KiB of bf16 written.
TILE_N, TILE_K = 32, 256


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, n, k, q_stride, s_stride_n, s_stride_k, bn, bk, TILE_N: tl.constexpr, TILE_K: tl.constexpr
):
    # out[r, c] = float32(Q[r, c]) * S[r // bn, c // bk] in float32, then the output's dtype.
    rows = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    mask = (rows[:, None] < n) & (cols[None, :] < k)
    q = tl.load(q_ptr + rows[:, None] * q_stride + cols[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + (rows // bn)[:, None] * s_stride_n + (cols // bk)[None, :] * s_stride_k, mask=mask, other=0.0)
    out = (q.to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * k + cols[None, :], out, mask=mask)


@torch.library.custom_op("logprob::dequantize_fp8_blocks", mutates_args=())
def _dequantize(weight: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype: torch.dtype) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    grid = (triton.cdiv(n, TILE_N), triton.cdiv(k, TILE_K))
    _dequantize_kernel[grid](
        weight,
        scale,
        out,
        n,
        k,
        weight.stride(0),
        scale.stride(0),
        scale.stride(1),
        bn,
        bk,
        TILE_N=TILE_N,
        TILE_K=TILE_K,
    )
    return out


@_dequantize.register_fake
def _(weight: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype: torch.dtype) -> torch.Tensor:
    return weight.new_empty(weight.shape, dtype=dtype)


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``ops.fp8.dequantize`` on the GPU: ``weight`` [N, K] row-major e4m3, ``scale`` the float32 grid."""
    return _dequantize(weight.contiguous(), scale.float(), block[0], block[1], dtype)
