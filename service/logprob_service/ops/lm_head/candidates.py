"""Candidate ids' log-probs: the logit of candidate c of row i as one fp32 dot h_i . W_c (+ b_c),
transformed as the fused pass transforms its tiles, minus the row's log-sum-exp from the combine.

N Kc H work with W's rows gathered, no [N, V]; each candidate's dot is reduced in the same order
whatever the other candidates and rows, so its log-prob is batch-invariant bit for bit
(docs/how-it-works.md, "Candidates and ranks").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logprob_service.ops.lm_head.tiles import to_log2_units


@triton.jit(do_not_specialize=["Kc"])  # the batch's widest candidate row (fused_logprobs.BATCH_SIZES)
def _candidates_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    b_ptr,  # [V] fp32 or dummy
    c_ptr,  # [N, Kc] int64 candidate ids
    lse_ptr,  # [N] fp32: each row's log-sum-exp (natural units)
    out_ptr,  # [N, Kc] fp32 out: log-probs of the candidates
    Kc,
    H,
    stride_h,
    stride_w,
    pre,
    post,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cs < Kc
    ids = tl.load(c_ptr + row * Kc + cs, mask=c_ok, other=0)
    w_rows = w_ptr + ids.to(tl.int64)[:, None] * stride_w
    ks = tl.arange(0, BLOCK_K)
    x = tl.zeros([BLOCK_C], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + ks) < H
        a = tl.load(h_ptr + row * stride_h + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        b = tl.load(w_rows + (k0 + ks)[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x += tl.sum(a[None, :] * b, axis=1)
    if HAS_BIAS:
        x += tl.load(b_ptr + ids, mask=c_ok, other=0.0)
    z = to_log2_units(x, pre, post, SOFTCAP)
    lse = tl.load(lse_ptr + row)
    tl.store(out_ptr + row * Kc + cs, z * 0.6931471805599453 - lse, mask=c_ok)


def candidate_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    candidates: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    pre: float,
    post: float,
    softcap: bool,
) -> None:
    """Write the log-probs of ``candidates`` ([N, Kc] int64 ids) to ``out`` ([N, Kc] float32):
    hidden [N, H] and weight [V, H] as the partials kernel gets them, bias fp32 or None, ``lse``
    [N] each row's log-sum-exp (natural units); (pre, post, softcap): ``to_log2_units``' constants."""
    n, hdim = hidden.shape
    kc = candidates.shape[1]
    if not (n and kc):
        return
    block_c = 16
    _candidates_kernel[(n, triton.cdiv(kc, block_c))](
        hidden, weight, bias if bias is not None else out, candidates, lse, out,
        kc, hdim, hidden.stride(0), weight.stride(0), pre, post,
        HAS_BIAS=bias is not None, SOFTCAP=softcap,
        BLOCK_C=block_c, BLOCK_K=min(128, triton.next_power_of_2(hdim)), num_warps=4,
    )  # fmt: skip
