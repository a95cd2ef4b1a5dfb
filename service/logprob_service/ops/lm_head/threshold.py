"""The top-k's thresholds, taken before the fused pass from a strided sample of the vocabulary.

For each row, the logits of every stride-th column (``plans.sample_stride``), transformed as the
kernel transforms its tiles, go in G interleaved groups; the R-th and K-th largest of the groups'
maxima (``plans.sample_rank``), less a margin that bounds how far the kernel's rounding of a dot
may lie from this one's (``threshold_margin``), give stage 1's threshold key and the row's
fallback. Up to K 128 and H 2,048 one kernel takes the sample's dots and keeps each group's
maximum (``sample_maxima``); above, an fp32 matmul writes the sample's logits. One kernel bisects
each row's maxima (``sample_ranks``).

The answer never rests on the threshold: a row it misses runs again (``repair``). The derivation
of the margin and of R: docs/how-it-works.md, "The threshold".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from logprob_service.ops.lm_head.keys import ABOVE_NEG_INF, TAKEN, ordered_bits
from logprob_service.ops.lm_head.plans import sample_rank, sample_stride
from logprob_service.ops.lm_head.tiles import tile_logits, to_log2_units
from logprob_service.ops.logprobs import logits_fp32, ordered_words


def sample_thresholds(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    pre: float,
    post: float,
    softcap: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's [n] int64 threshold keys (from the R-th largest of the sample's group maxima, R the
    ``sample_rank``) and the fallbacks of the rows they miss (from its K-th largest: each below
    its row's K-th largest key in the kernel); how-it-works, "The threshold".

    hidden [n, H] and weight [V, H] as the kernel gets them; bias fp32 or None; (pre, post,
    softcap): ``to_log2_units``' constants."""
    vocab = weight.shape[0]
    stride = sample_stride(vocab, k)
    sampled = weight[::stride]  # a strided view: no copy
    groups = sample_groups(sampled.shape[0], k)
    if groups <= SAMPLE_GROUPS and (hidden.shape[1] <= SAMPLE_KERNEL_MAX_H or not hidden.is_cuda):
        # One kernel takes the sample's dots and their group maxima: no [n, S] logits in memory.
        maxima = sample_maxima(hidden, weight, bias, stride, groups, pre, post, softcap)
        s = sample_ranks(maxima, sample_rank(vocab, k), k, pre, post, softcap, maxima=True).double()
    else:
        if not hidden.is_cuda:
            sampled = sampled.float()  # the CPU has no 16-bit matmul with an fp32 output
        x = logits_fp32(hidden, sampled, bias[::stride] if bias is not None else None)  # [n, S] fp32
        # the R-th and K-th largest group maxima of z, transformed as the kernel does
        s = sample_ranks(x, sample_rank(vocab, k), k, pre, post, softcap).double()
    margin = threshold_margin(hidden, sampled, s.abs().amax(dim=1), pre, post, weight.dtype == torch.float32)
    ordered = ordered_words((s - margin[:, None]).float()).to(torch.int64) - 1  # one float down
    # Stage 1's at -FLT_MAX at least: no z = -inf passes it (the kernel's masked columns; a row with
    # fewer than K finite logits gets its fallback, which is not raised)
    ordered[:, 0].clamp_(min=ABOVE_NEG_INF)
    keys = ordered << 32  # low word 0: every id of a z >= t is above
    return keys[:, 0].contiguous(), keys[:, 1].contiguous()


# The sample's columns go in at least this many groups (and 2 K), whose maxima the thresholds come from.
SAMPLE_GROUPS = 256
# ``sample_maxima`` takes the sample up to this hidden size; above it, cuBLAS's fp32-output matmul
# and ``sample_ranks``, which measured faster at H 3,584 and 4,096 and slower at H 896 on an H100
# (benchmarks/RESULTS.md; the crossover between was not measured). The interpreter always takes
# the kernel: the tests run it.
SAMPLE_KERNEL_MAX_H = 2048


def sample_groups(width: int, k: int) -> int:
    """G, a power of 2: max(256, 2 K) rounded up, at most ``width`` rounded up (groups past the
    sample's width are empty)."""
    return min(triton.next_power_of_2(max(SAMPLE_GROUPS, 2 * k)), triton.next_power_of_2(width))


@triton.jit
def _sample_ranks_kernel(
    x_ptr,  # [n, S] fp32: the sample's logits x; with MAXIMA, [n, G] int32: its group maxima's ordered bits
    out_ptr,  # [n, 2] fp32 out: the R-th and K-th largest of the row's G group maxima of z
    S,
    R,
    K,
    pre,
    post,
    SOFTCAP: tl.constexpr,
    G: tl.constexpr,
    MAXIMA: tl.constexpr,
):
    """One row: z = ``to_log2_units`` of its logits (the kernel's own transform), the maxima of its G
    interleaved groups of columns (group g: g, g + G, g + 2 G, ...; a group past S is empty, below
    every value), then their R-th and K-th largest by bisection over
    ``ordered_bits`` (the floats' order): the largest t such that at least R maxima have bits >= t
    is the R-th largest's bits. The row is read once (coalesced, G columns a step); the 32 passes of
    the bisection are over G values in registers. With MAXIMA, the row is the maxima already
    (``_sample_maxima_kernel``)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, G)
    if MAXIMA:
        maxima = tl.load(x_ptr + row * G + offs)
    else:
        at = x_ptr + row * S
        maxima = tl.full([G], TAKEN, tl.int32)
        for c0 in range(0, S, G):
            inside = (c0 + offs) < S
            z = to_log2_units(tl.load(at + c0 + offs, mask=inside, other=0.0), pre, post, SOFTCAP)
            maxima = tl.maximum(maxima, tl.where(inside, ordered_bits(z), TAKEN))
    lo_r = tl.full([], -(2**31), tl.int64)  # every value's bits are >= the smallest int32
    hi_r = tl.full([], 2**31 - 1, tl.int64)
    lo_k, hi_k = lo_r, hi_r
    for _ in range(32):
        mid_r = (lo_r + hi_r + 1) >> 1  # int64: no overflow
        mid_k = (lo_k + hi_k + 1) >> 1
        n_r = tl.sum((maxima >= mid_r.to(tl.int32)).to(tl.int32), axis=0)
        n_k = tl.sum((maxima >= mid_k.to(tl.int32)).to(tl.int32), axis=0)
        lo_r, hi_r = tl.where(n_r >= R, mid_r, lo_r), tl.where(n_r >= R, hi_r, mid_r - 1)
        lo_k, hi_k = tl.where(n_k >= K, mid_k, lo_k), tl.where(n_k >= K, hi_k, mid_k - 1)
    # ordered_bits is its own inverse
    tl.store(out_ptr + row * 2, ordered_bits(lo_r.to(tl.int32)).to(tl.float32, bitcast=True))
    tl.store(out_ptr + row * 2 + 1, ordered_bits(lo_k.to(tl.int32)).to(tl.float32, bitcast=True))


def sample_ranks(
    x: torch.Tensor, r: int, k: int, pre: float, post: float, softcap: bool, *, maxima: bool = False
) -> torch.Tensor:
    """[n, 2] float32: the ``r``-th and ``k``-th largest (r <= k <= S) of the ``sample_groups`` group
    maxima of each row's z, ``to_log2_units`` of ``x`` [n, S] float32 logits (``_sample_ranks_kernel``;
    how-it-works, "The threshold"). With ``maxima``, ``x`` is [n, G] int32, the maxima's
    ``ordered_bits`` (``sample_maxima``)."""
    n, width = x.shape
    out = torch.empty((n, 2), dtype=torch.float32, device=x.device)
    if n:
        groups = width if maxima else sample_groups(width, k)
        _sample_ranks_kernel[(n,)](
            x.contiguous(), out, width, r, k, pre, post, SOFTCAP=softcap, G=groups, MAXIMA=maxima, num_warps=1
        )
    return out


@triton.jit
def _sample_maxima_kernel(
    h_in,  # [n, H]: a TMA descriptor with [BLOCK_M, BLOCK_K] blocks when USE_TMA, else the tensor
    w_in,  # the sample's [S, H] rows of W (every stride-th): a TMA descriptor with [G, BLOCK_K] blocks, or W
    b_ptr,  # [V] fp32, or a dummy when HAS_BIAS is false
    out_ptr,  # [n, G] int32 out: each group's largest z, as ``ordered_bits``
    N,
    S,
    H,
    stride_h,
    stride_w,  # W's row stride
    stride,  # the sample's: column c of the sample is token c stride
    pre,
    post,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_M rows: the sample's logits a tile of G columns at a time (a K-loop of tensor-core dots,
    as the partials kernel's), transformed to z, and the elementwise max over the tiles: column c
    goes to group c mod G, the interleaved groups ``sample_ranks`` takes the maxima of."""
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    maxima = tl.full([BLOCK_M, G], TAKEN, tl.int32)
    for c0 in range(0, S, G):
        acc = tile_logits(
            h_in, w_in, row0, rows, row_ok, c0, S, stride, H, stride_h, stride_w,
            BLOCK_N=BLOCK_M, BLOCK_V=G, BLOCK_K=BLOCK_K, IEEE=IEEE, USE_TMA=USE_TMA,
        )  # fmt: skip
        cols = c0 + tl.arange(0, G)
        col_ok = cols < S
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols.to(tl.int64) * stride, mask=col_ok, other=0.0)[None, :]
        z = to_log2_units(acc, pre, post, SOFTCAP)
        maxima = tl.maximum(maxima, tl.where(col_ok[None, :], ordered_bits(z), TAKEN))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :], maxima, mask=row_ok[:, None])


def sample_maxima(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int,
    groups: int,
    pre: float,
    post: float,
    softcap: bool,
) -> torch.Tensor:
    """[n, G] int32: the ``ordered_bits`` of the largest z of each of the G interleaved groups of the
    sample's columns (token ids 0, stride, 2 stride, ...), by ``_sample_maxima_kernel``; hidden [n, H]
    and weight [V, H] as the partials kernel gets them, bias fp32 or None."""
    n, hdim = hidden.shape
    width = triton.cdiv(weight.shape[0], stride)
    out = torch.empty((n, groups), dtype=torch.int32, device=hidden.device)
    if not n:
        return out
    fp32 = weight.dtype == torch.float32
    block_m, block_k = 64, 32 if fp32 else 64
    row_bytes = hdim * weight.element_size()
    use_tma = row_bytes % 16 == 0 and hidden.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    h_in, w_in = hidden, weight
    if use_tma:
        h_in = TensorDescriptor.from_tensor(hidden, [block_m, block_k])
        w_in = TensorDescriptor(weight, [width, hdim], [stride * weight.stride(0), 1], [groups, block_k])
    _sample_maxima_kernel[(triton.cdiv(n, block_m),)](
        h_in, w_in, bias if bias is not None else out, out, n, width, hdim, hidden.stride(0), weight.stride(0),
        stride, pre, post, HAS_BIAS=bias is not None, SOFTCAP=softcap, IEEE=fp32, USE_TMA=use_tma,
        BLOCK_M=block_m, G=groups, BLOCK_K=block_k, num_warps=8, num_stages=3,
    )  # fmt: skip
    return out


def threshold_margin(
    hidden: torch.Tensor, sampled: torch.Tensor, s: torch.Tensor, pre: float, post: float, fp32: bool
) -> torch.Tensor:
    """[n] float64: how far the kernel's z of a sampled column may lie below torch's (how-it-works,
    "The threshold"): H 2^-22 ||h|| max ||W_c|| bounds the two dots' difference (2^-9 more for TF32 with fp32
    operands), times |pre post|; plus 2^-16 (|z| + |post|) for the transform's own roundings."""
    eps = hidden.shape[1] * 2.0**-22 + (2.0**-9 if fp32 else 0.0)
    h_norm = torch.linalg.vector_norm(hidden, dim=1, dtype=torch.float32).double()
    w_norm = torch.linalg.vector_norm(sampled, dim=1, dtype=torch.float32).max().double()
    # (1 + 2^-8): the norms' own fp32 rounding
    return eps * abs(pre * post) * h_norm * w_norm * (1 + 2.0**-8) + 2.0**-16 * (s.abs() + abs(post))
