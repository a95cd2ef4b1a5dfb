"""Causal attention of one sequence (whole, or a chunk: its last queries against every key so
far) on torch's cuDNN flash kernel, GQA read natively: the fastest backend measured for long
single rows and for the chunks of a long sequence (``benchmarks/bench_attention.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from logprob_service.ops.attention.common import FLASH_DTYPES, merge_attention


def _cudnn_lse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's cuDNN flash attention op with its log-sum-exp, GQA read natively.

    q: [Lq, H, D]; k, v: [Lk, KV, D] -> (out [Lq, H, D], lse [Lq, H] float32, natural log over the
    allowed keys of scale * q.k). ``causal`` aligns the mask top-left: only for Lq = Lk. (A private
    op: the public SDPA returns no log-sum-exp; ``_sdpa_cudnn_refused`` checks it once.)"""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        None, True, 0.0, causal, False, scale=scale,
    )[:2]  # fmt: skip  # [1, H, Lq, D], [1, H, Lq]
    return out[0].transpose(0, 1), lse.reshape(q.shape[1], -1).transpose(0, 1)


@functools.cache
def _sdpa_cudnn_refused(device: torch.device, dtype: torch.dtype, head_dim: int, groups: int) -> str | None:
    """Whether torch's cuDNN attention refuses this kind of call (SDPA, and the log-sum-exp op the
    split of a chunk needs): asked once, on a tiny one."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "torch's cuDNN SDPA backend switched off"
    q = torch.zeros(8, groups, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(8, 1, head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], kv.transpose(0, 1)[None], kv.transpose(0, 1)[None],
                is_causal=True, enable_gqa=groups > 1,
            )  # fmt: skip
        _cudnn_lse_attention(q, kv, kv, causal=False, scale=1.0)
    except (RuntimeError, AttributeError) as err:
        return f"torch's cuDNN attention refused it ({str(err).splitlines()[0][:100]})"
    return None


def sdpa_cudnn_blocker(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sliding_window: int | None, softcap: float | None
) -> str | None:
    """None when ``sdpa_cudnn_attention`` computes this call (one sequence) exactly.
    q: [Lq, H, D]; k, v: [Lk, KV, D]."""
    if q.device.type != "cuda":
        return "a device other than CUDA"
    if softcap is not None or sliding_window is not None:
        return "attention softcapping or a sliding window"
    if q.dtype not in FLASH_DTYPES:
        return f"dtype {q.dtype}"
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1] or q.shape[-2] % k.shape[-2]:
        return "head dims or head counts it does not take"
    return _sdpa_cudnn_refused(q.device, q.dtype, q.shape[-1], q.shape[-2] // k.shape[-2])


def sdpa_cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one sequence on torch's cuDNN flash kernel. q: [Lq, H, D]; k, v: [Lk, KV, D].
    With ``return_lse`` also the log-sum-exp [Lq, H] float32 (for attention sinks: ``common.apply_sinks``).

    Lq = Lk: SDPA, causal. Lq < Lk (a chunk: the sequence's last Lq positions): SDPA's causal mask
    is aligned top-left, so the keys split in two, each on the mask-free or the square kernel
    (faster than one ragged bottom-right call: 590 against 536 TFLOP/s at 16K x 131K keys on an
    H200): the Lk - Lq keys before the chunk, all visible (no mask), and the chunk's own Lq keys,
    causal; the two are merged by log-sum-exp (``common.merge_attention``), exactly."""
    prefix = k.shape[0] - q.shape[0]
    if prefix == 0 and return_lse:
        return _cudnn_lse_attention(q, k, v, causal=True, scale=scale)
    if prefix == 0:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip  # [1, H, T, D]
        return out[0].transpose(0, 1)  # [T, H, D]
    before = _cudnn_lse_attention(q, k[:prefix], v[:prefix], causal=False, scale=scale)
    own = _cudnn_lse_attention(q, k[prefix:], v[prefix:], causal=True, scale=scale)
    out, lse = merge_attention(*before, *own)
    return (out, lse) if return_lse else out
