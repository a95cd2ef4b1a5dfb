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

Features that only some models have are brought to every backend, so none of them forces the
exact path by itself (``packed_attention``):

* Attention sinks (gpt-oss): each backend also returns its log-sum-exp, and the output is scaled by
  ``sigmoid(lse - sink)`` (``common.apply_sinks``), exactly the eager softmax with the sink's column.
* Chunked attention (Llama 4's chunked layers: a query sees the causal keys of its own chunk of
  ``attention_chunk_size`` positions only): each sequence's queries are cut at the chunk borders into
  segments, each with its chunk's keys (``chunk_segments``), which is plain causal attention over
  more, shorter segments. The cut is made on the host, from the boundaries the scorer passes as host
  ints (no sync; a caller without them pays one copy back per chunked layer).
* Value heads narrower than query/key heads (DeepSeek-V3's MLA: 192 against 128): the values are
  zero-padded to the query's head dim for the flash kernels and the output sliced back, exactly
  (the padding columns are zeros); the exact backend takes them as they are.

Preferences (the ``attention_backend`` setting): ``auto`` tries them in that order; ``cudnn``,
``flash`` and ``exact`` start at that backend (``sdpa-cudnn`` belongs to ``auto`` alone), each
falling back to the later ones when it cannot run a call. One implementation name is registered
per preference (``attention_implementation_name``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Literal

import torch

from logprob_service.ops.attention import cudnn, exact, flash, sdpa_cudnn
from logprob_service.ops.attention.common import FLASH_DTYPES, apply_sinks, varlen_window_size

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
    value_head_dim: int | None = None,
    sliding_window: int | None = None,
    sinks: bool = False,
    attention_chunk: int | None = None,
) -> str:
    """Which backend serves each kind of row of a model, and why not faster: full-attention layers,
    and sliding-window layers where the model has a window; then how the model's particular
    features (sinks, chunked attention, narrower value heads) reach the backends."""
    q = torch.empty(2, heads, head_dim, dtype=dtype, device=device)
    k = torch.empty(2, kv_heads, head_dim, dtype=dtype, device=device)
    v = _padded_values(q, torch.empty(2, kv_heads, value_head_dim or head_dim, dtype=dtype, device=device))
    plan, why = [], {}
    layers = [("", None)] + ([(f"window {sliding_window} layers, ", sliding_window)] if sliding_window else [])
    for kind, window in layers:
        for rows, one_sequence in (("packed rows", False), ("one sequence (or its chunks)", True)):
            backend, reasons = choose_backend(
                preference, q, k, v, one_sequence=one_sequence, sliding_window=window, softcap=softcap
            )
            plan.append(f"{kind}{rows}: {backend}")
            why.update(dict.fromkeys(reason.split(": ", 1)[1] for reason in reasons))
    text = ", ".join(plan) + (f" (faster ones cannot: {'; '.join(why)})" if why else "")
    features = []
    if sinks:
        features.append("attention sinks applied from each kernel's log-sum-exp")
    if attention_chunk:
        features.append(
            f"chunked attention ({attention_chunk} positions) as one causal segment per chunk, cut on the host "
            "from the batch's boundaries"
        )
    if value_head_dim and value_head_dim != head_dim:
        padded = v.shape[-1] != value_head_dim
        features.append(
            f"value heads of {value_head_dim} (queries/keys {head_dim})"
            + (f" zero-padded to {head_dim} for the flash kernels" if padded else "")
        )
    return text + "".join(f"; {feature}" for feature in features)


def _padded_values(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``v`` zero-padded to q's head dim where a flash kernel could then take it (CUDA, narrower
    value heads): attention's output over padded values is the output padded, exactly."""
    pad = q.shape[-1] - v.shape[-1]
    if pad <= 0 or q.device.type != "cuda" or q.dtype not in FLASH_DTYPES:
        return v
    return torch.nn.functional.pad(v, (0, pad))


def _host_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """cu_q and cu_k as host lists: a host sync on a GPU."""
    bounds_q = cu_q.tolist()
    return bounds_q, bounds_q if cu_k is cu_q else cu_k.tolist()


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ints on ``device``, asynchronously on CUDA (from pinned memory: a pageable copy waits)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def chunk_segments(
    cu_q: torch.Tensor, cu_k: torch.Tensor, chunk: int, bounds: tuple[list[int], list[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None, tuple[list[int], list[int]]]:
    """Chunked attention as causal attention over segments: each sequence's queries (its last Lq
    of Lk positions) cut at multiples of ``chunk``, each part with the keys of its own chunk.

    Returns (cu_q', cu_k', max_q', max_k', index, bounds'): query segment s' is rows
    cu_q'[s']:cu_q'[s'+1] of the same query rows (they stay in order); its keys are rows
    cu_k'[s']:cu_k'[s'+1] of the keys gathered by ``index`` (int64, on cu_q's device), or of the
    keys themselves when ``index`` is None (the segments' keys then tile them: self-attention);
    bounds' = (cu_q', cu_k') as host lists. A query at position p sees keys j with
    p // chunk == j // chunk and j <= p, as transformers' ``chunked_overlay`` allows. The cut is
    made on the host, from ``bounds`` (cu_q and cu_k as host ints) when given, else from a copy of
    cu_q and cu_k (a host sync)."""
    if chunk < 1:
        raise ValueError(f"attention chunk must be at least 1, got {chunk}")
    bounds_q, bounds_k = bounds if bounds is not None else _host_bounds(cu_q, cu_k)
    seg_q, seg_k, key_rows = [0], [0], []
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(bounds_q), itertools.pairwise(bounds_k)):
        queries, keys = qe - qs, ke - ks
        first = keys - queries  # position of the sequence's first query
        for c in range(first // chunk, -(-keys // chunk)) if queries else ():
            start, end = c * chunk, min((c + 1) * chunk, keys)  # the chunk's positions
            seg_q.append(seg_q[-1] + end - max(start, first))
            seg_k.append(seg_k[-1] + end - start)
            key_rows.append((ks + start, ks + end))
    if len(seg_q) == 1:  # no queries at all
        seg_q.append(0)
        seg_k.append(0)
    tiled = all(a[1] == b[0] for a, b in itertools.pairwise(key_rows)) and (
        not key_rows or (key_rows[0][0] == 0 and key_rows[-1][1] == bounds_k[-1])
    )
    device = cu_q.device
    index = None
    if not tiled:
        rows = [row for a, b in key_rows for row in range(a, b)]
        index = _to_device(rows, torch.int64, device)
    lengths_q = [b - a for a, b in itertools.pairwise(seg_q)]
    lengths_k = [b - a for a, b in itertools.pairwise(seg_k)]
    new_q = _to_device(seg_q, torch.int32, device)
    new_k = new_q if tiled and seg_k == seg_q else _to_device(seg_k, torch.int32, device)
    return new_q, new_k, max(lengths_q), max(lengths_k), index, (seg_q, seg_k)


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
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    bounds: tuple[list[int], list[int]] | None = None,
    preference: AttentionBackend = "auto",
) -> torch.Tensor:
    """Causal attention of each packed sequence's queries over its keys, aligned bottom-right.

    q: [Tq, H, D]; k: [Tk, KV, D]; v: [Tk, KV, Dv]; cu_q, cu_k: int32 [n+1] on q's device (sequence
    s: query rows [cu_q[s], cu_q[s+1]), key rows [cu_k[s], cu_k[s+1]), Lq <= Lk) -> [Tq, H, Dv].
    ``sinks``: [H] attention-sink logits; ``attention_chunk``: a query sees only the keys of its
    own chunk of that many positions (the module docstring says how each reaches the backends).
    ``bounds``: cu_q and cu_k as host ints, where the caller has them (else they are copied back
    where a path needs them on the host: a sync)."""
    if attention_chunk is not None:
        if sliding_window is not None:
            raise NotImplementedError("attention with both a sliding window and attention chunks")
        cu_q, cu_k, max_q, max_k, index, bounds = chunk_segments(cu_q, cu_k, attention_chunk, bounds)
        if index is not None:
            k, v = k.index_select(0, index), v.index_select(0, index)
    value_dim = v.shape[-1]
    v = _padded_values(q, v)
    one_sequence = cu_q.numel() == 2
    backend, reasons = choose_backend(
        preference, q, k, v, one_sequence=one_sequence, sliding_window=sliding_window, softcap=softcap
    )
    if reasons and q.device.type == "cuda":
        _warn_once(backend, reasons)
    lse = sinks is not None  # the sinks are applied from the kernel's log-sum-exp
    if backend == "sdpa-cudnn":
        out = sdpa_cudnn.sdpa_cudnn_attention(q, k, v, scale=scale, return_lse=lse)
    elif backend == "cudnn":
        out = cudnn.cudnn_varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k,
            scale=scale, window_size=varlen_window_size(sliding_window), return_lse=lse,
        )  # fmt: skip
    elif backend == "flash":
        out = flash.varlen_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
            scale=scale, window_size=varlen_window_size(sliding_window), return_lse=lse,
        )  # fmt: skip
    else:
        bounds_q, bounds_k = bounds if bounds is not None else _host_bounds(cu_q, cu_k)
        return exact.exact_packed_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds_q, bounds_k,
            scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        )[..., :value_dim]  # fmt: skip
    if sinks is not None:
        out = apply_sinks(*out, sinks)
    return out if out.shape[-1] == value_dim else out[..., :value_dim]


def _warn_once(backend: str, reasons: list[str]) -> None:
    """Say once per cause why a call on CUDA runs on a slower backend than the preference's first."""
    key = (backend, *reasons)
    if key not in _warned:
        _warned.add(key)
        log.warning("packed attention runs on %s (slower) because of %s", backend, "; ".join(reasons))
