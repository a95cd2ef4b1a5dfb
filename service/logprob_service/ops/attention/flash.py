"""FlashAttention-2's varlen kernel over the packed row, through torch
(``torch.nn.attention.varlen.varlen_attn``), with K/V heads repeated where this torch's kernel
has no GQA.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from logprob_service.ops.attention.common import FLASH_DTYPES

_FLASH_MAX_HEAD_DIM = 256


@functools.cache
def _varlen_attn() -> Callable[..., torch.Tensor] | None:
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch has none (imported
    lazily: CPU builds and older torch lack it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _accepts_enable_gqa(fn: Callable[..., torch.Tensor]) -> bool:
    """Whether ``fn`` takes ``enable_gqa`` (torch 2.13's varlen_attn does; older ones may not)."""
    try:
        return "enable_gqa" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fast_path_blocker(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, softcap: float | None
) -> str | None:
    """None when ``varlen_attention`` computes this layer exactly as the model means it, else the
    reason it cannot (named in the slow-path warning). query: [1, H, T, D]."""
    if query.device.type != "cuda":
        return "a device other than CUDA"
    if softcap is not None:
        return "attention softcapping"  # flash attention through torch has no softcap argument
    if _varlen_attn() is None:
        return f"torch {torch.__version__} lacking torch.nn.attention.varlen"
    if query.dtype not in FLASH_DTYPES:
        return f"dtype {query.dtype} (varlen flash attention runs float16/bfloat16 only)"
    head_dim = query.shape[-1]
    if value.shape[-1] != head_dim or key.shape[-1] != head_dim:
        return "value/key head dims differing from the query's"
    if head_dim > _FLASH_MAX_HEAD_DIM or head_dim % 8 != 0:
        return f"head dim {head_dim} (flash attention needs a multiple of 8, at most {_FLASH_MAX_HEAD_DIM})"
    if _compute_capability(query.device) < (8, 0):
        return "a GPU older than compute capability 8.0"
    return None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    window_size: tuple[int, int],
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention varlen over the packed row. q: [T, H, D]; k, v: [T, KV, D] -> [T, H, D], and
    with ``return_lse`` the log-sum-exp [T, H] float32 (torch's ``AuxRequest(lse=True)``)."""
    fn = _varlen_attn()
    assert fn is not None, "fast_path_blocker lets no call through without varlen_attn"
    groups = q.shape[1] // k.shape[1]
    extra: dict[str, Any] = {}
    if groups > 1:
        if _accepts_enable_gqa(fn):
            extra["enable_gqa"] = True
        else:
            # An older varlen_attn without enable_gqa (2.11's, by its documented signature): give
            # it H key/value heads, head j of KV serving query heads j*G .. j*G+G-1 as in
            # transformers' repeat_kv. Costs 2 * (G-1) * T * KV * D extra elements per layer,
            # transient (freed after the call).
            k = k.repeat_interleave(groups, dim=1)  # [T, H, D]
            v = v.repeat_interleave(groups, dim=1)  # [T, H, D]
    if return_lse:
        from torch.nn.attention.varlen import AuxRequest  # where varlen_attn is, so is its AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    result = fn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size, **extra)
    if not return_lse:
        return result
    out, lse = result
    if lse.shape == (q.shape[1], q.shape[0]):
        # FlashAttention-2's varlen layout [H, T] (torch's fake kernel for the op says so; its
        # docstring says [T, H]): as [T, H], the layout the other backends return.
        lse = lse.transpose(0, 1)
    return out, lse
