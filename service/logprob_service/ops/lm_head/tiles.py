"""What every lm_head kernel shares: a tile of logits from tensor-core dots (``tile_logits``), the
model's transform in base-2 units (``to_log2_units`` and its constants, ``transform_constants``),
and the cut of a tile along the accumulator's register bits (``split_columns``).

The kernels work in z = x' log2(e), x' the transformed logit, because exp2 and log2 are the GPU's
native instructions (docs/how-it-works.md, "The plain pass").
"""

from __future__ import annotations

import triton
import triton.language as tl

from logprob_service.ops.logprobs import LogitTransform

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def to_log2_units(x, pre, post, SOFTCAP: tl.constexpr):
    """z = x' log2(e), x' the transformed logit. With softcap, pre = scale / c and post =
    c log2(e) / T; else pre = scale log2(e) / T."""
    if SOFTCAP:
        u = x * pre
        # tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) <= 1: never overflows.
        e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(u))
        th = (1.0 - e) / (1.0 + e)
        return tl.where(u < 0, -th, th) * post
    return x * pre


@triton.jit
def tile_logits(
    h_in,
    w_in,
    row0,
    rows,
    row_ok,
    c0,
    n_cols,
    row_step,
    H,
    stride_h,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """x = h[rows] . W[(c0 + j) row_step]^T for the columns j < BLOCK_V with c0 + j < n_cols, a
    [BLOCK_N, BLOCK_V] tile in fp32 registers: a K-loop of tensor-core dots. With USE_TMA,
    ``h_in`` and ``w_in`` are TMA descriptors read at [row0, k] and [c0, k] (``w_in``'s rows
    already every row_step-th of W; out-of-bounds rows, columns and k zero-filled by the TMA
    unit); else the tensors, masked. IEEE: fp32 operands, an exact fp32 dot rather than TF32.
    (The fused pass's partials kernel and the threshold's sample kernel.)"""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for ki in range(0, tl.cdiv(H, BLOCK_K)):
        k0 = ki * BLOCK_K
        if USE_TMA:
            a = h_in.load([row0, k0])
            b = w_in.load([c0, k0]).T
        else:
            k_ok = (k0 + ks) < H
            cols = c0 + tl.arange(0, BLOCK_V)
            a_ptrs = h_in + rows.to(tl.int64)[:, None] * stride_h + (k0 + ks)[None, :]
            b_ptrs = w_in + (cols.to(tl.int64) * row_step)[None, :] * stride_w + (k0 + ks)[:, None]
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols < n_cols)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


def transform_constants(transform: LogitTransform) -> tuple[float, float]:
    """(pre, post) of ``to_log2_units`` for a transform."""
    if transform.softcap is not None:
        return transform.scale / transform.softcap, transform.softcap * LOG2E / transform.temperature
    return transform.scale * LOG2E / transform.temperature, 1.0


@triton.jit
def split_columns(x, STEP: tl.constexpr):
    """x [R, V] -> the columns whose index has the bit of value STEP clear, and those where it is set
    (each [R, V / 2], in order). For STEP 1 on a tile and STEP 4 on either half, that bit is a
    register bit of the tensor-core accumulator layouts (a thread holds both columns): no data moves."""
    R: tl.constexpr = x.shape[0]
    V: tl.constexpr = x.shape[1]
    clear, set_ = tl.split(tl.permute(tl.reshape(x, [R, V // (2 * STEP), 2, STEP]), (0, 1, 3, 2)))
    return tl.reshape(clear, [R, V // 2]), tl.reshape(set_, [R, V // 2])
