"""Which backend computes a packed attention call, and the call.

Backends, chosen per call (``choose_backend``): the first of the preference's order that can
compute the call exactly, so a model whose layers differ (Gemma 2's softcap) falls back layer by
layer and says why once:

* ``sdpa-cudnn``: one sequence in the row (known from ``cu_seqlens``' length, no host sync):
  torch's cuDNN flash kernel, causal, GQA read natively; the fastest measured for long single
  rows and for the chunks of a long sequence (``benchmarks/bench_attention.py``).
* ``cudnn``: cuDNN's fused flash attention on the ragged packed row (module ``cudnn``,
  the optional ``nvidia-cudnn-frontend`` package): GQA native, causal aligned bottom-right,
  sliding windows; 1.6-2.1x FlashAttention-2's varlen kernel on an H200.
* ``flash``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen), K/V heads
  repeated where this torch's kernel has no GQA.
* ``exact``: a loop over the sequences that computes each one as the eager implementation does,
  in blocks of query rows so that one block's scores stay under ``exact.FALLBACK_SCORE_BYTES``
  (memory O(block x L), not O(L^2)): the CPU, float32, softcapped attention.

Preferences (the ``attention_backend`` setting): ``auto`` tries them in that order; ``cudnn``,
``flash`` and ``exact`` start at that backend (``sdpa-cudnn`` belongs to ``auto`` alone), each
falling back to the later ones when it cannot run a call. One implementation name is registered
per preference (``attention_implementation_name``).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from logprob_service.ops.attention import cudnn, exact, flash, sdpa_cudnn
from logprob_service.ops.attention.common import varlen_window_size

# The package's name, not this module's: the one logger to filter on for attention.
log = logging.getLogger(__package__)

_warned: set[tuple[str, ...]] = set()

AttentionBackend = Literal["auto", "cudnn", "flash", "exact"]
ORDER: dict[str, tuple[str, ...]] = {
    "auto": ("sdpa-cudnn", "cudnn", "flash", "exact"),
    "cudnn": ("cudnn", "flash", "exact"),
    "flash": ("flash", "exact"),
    "exact": ("exact",),
}


def choose_backend(
    preference: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    one_sequence: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[str, list[str]]:
    """The backend that computes this call, and why each one before it in the order could not.

    q: [Tq, H, D]; k, v: [Tk, KV, D] (any strides). ``one_sequence``: the row holds one sequence
    (whole, or a chunk: its last queries against every key so far)."""
    window = varlen_window_size(sliding_window)
    reasons = []
    for backend in ORDER[preference]:
        if backend == "sdpa-cudnn":
            if not one_sequence:
                continue  # not a slower choice: SDPA's causal mask has no place for several sequences
            reason = sdpa_cudnn.sdpa_cudnn_blocker(q, k, v, sliding_window=sliding_window, softcap=softcap)
        elif backend == "cudnn":
            reason = cudnn.cudnn_blocker(q, k, v, window_size=window, softcap=softcap)
        elif backend == "flash":
            reason = flash.fast_path_blocker(q, k, v, softcap=softcap)
        else:
            return backend, reasons
        if reason is None:
            return backend, reasons
        reasons.append(f"{backend}: {reason}")
    raise AssertionError("every order ends with the exact backend")


def describe_backends(
    preference: AttentionBackend,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    softcap: float | None,
) -> str:
    """Which backend serves each kind of row of a model (full-attention layers), and why not faster."""
    q = torch.empty(2, heads, head_dim, dtype=dtype, device=device)
    k = torch.empty(2, kv_heads, head_dim, dtype=dtype, device=device)
    plan, why = [], {}
    for rows, one_sequence in (("packed rows", False), ("one sequence (or its chunks)", True)):
        backend, reasons = choose_backend(
            preference, q, k, k, one_sequence=one_sequence, sliding_window=None, softcap=softcap
        )
        plan.append(f"{rows}: {backend}")
        why.update(dict.fromkeys(reason.split(": ", 1)[1] for reason in reasons))
    return ", ".join(plan) + (f" (faster ones cannot: {'; '.join(why)})" if why else "")


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    preference: AttentionBackend = "auto",
) -> torch.Tensor:
    """Causal attention of each packed sequence's queries over its keys, aligned bottom-right.

    q: [Tq, H, D]; k, v: [Tk, KV, D]; cu_q, cu_k: int32 [n+1] on q's device (sequence s: query
    rows [cu_q[s], cu_q[s+1]), key rows [cu_k[s], cu_k[s+1]), Lq <= Lk) -> [Tq, H, D]."""
    one_sequence = cu_q.numel() == 2
    backend, reasons = choose_backend(
        preference, q, k, v, one_sequence=one_sequence, sliding_window=sliding_window, softcap=softcap
    )
    if reasons and q.device.type == "cuda":
        _warn_once(backend, reasons)
    if backend == "sdpa-cudnn":
        return sdpa_cudnn.sdpa_cudnn_attention(q, k, v, scale=scale)
    if backend == "cudnn":
        return cudnn.cudnn_varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=varlen_window_size(sliding_window)
        )
    if backend == "flash":
        return flash.varlen_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
            scale=scale, window_size=varlen_window_size(sliding_window),
        )  # fmt: skip
    bounds_q = cu_q.tolist()  # one host sync per layer: the exact path loops on the host anyway
    bounds_k = bounds_q if cu_k is cu_q else cu_k.tolist()
    return exact.exact_packed_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds_q, bounds_k,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
    )  # fmt: skip


def _warn_once(backend: str, reasons: list[str]) -> None:
    """Say once per cause why a call on CUDA runs on a slower backend than the preference's first."""
    key = (backend, *reasons)
    if key not in _warned:
        _warned.add(key)
        log.warning("packed attention runs on %s (slower) because of %s", backend, "; ".join(reasons))
