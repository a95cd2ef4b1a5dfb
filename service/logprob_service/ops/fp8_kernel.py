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


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, m, k, min_amax, fp8_max, ROWS: tl.constexpr, GROUP: tl.constexpr):
    # One program: ROWS rows of one group of GROUP columns. s = max(max|x|, min_amax) / 448 and
    # q = x / s (rounded to nearest), as ops.fp8.quantize_activations computes them.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    live = rows < m
    x = tl.load(x_ptr + rows[:, None] * k + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch's: Triton's ``/`` on float32 is an approximate one, which
    # put scales one ulp off torch's (seen on an H200).
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), min_amax), fp8_max)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -fp8_max, fp8_max)
    tl.store(q_ptr + rows[:, None] * k + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(s_ptr + rows * (k // GROUP) + tl.program_id(1), scale, mask=live)


@torch.library.custom_op("logprob::quantize_fp8_groups", mutates_args=())
def _quantize_groups(x: torch.Tensor, group: int, min_amax: float, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    rows = 32
    _quantize_groups_kernel[(triton.cdiv(m, rows), k // group)](
        x, q, scales, m, k, min_amax, fp8_max, ROWS=rows, GROUP=group
    )
    return q, scales


@_quantize_groups.register_fake
def _(x: torch.Tensor, group: int, min_amax: float, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=torch.float8_e4m3fn), x.new_empty((m, k // group), dtype=torch.float32)


def quantize_groups(x: torch.Tensor, group: int, min_amax: float, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.fp8.quantize_activations`` on the GPU in one pass: x [M, K] row-major, ``group`` a
    power of two dividing K."""
    return _quantize_groups(x.contiguous(), group, min_amax, fp8_max)
