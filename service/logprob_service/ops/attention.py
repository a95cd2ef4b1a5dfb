"""Attention over one packed row of several sequences, for Hugging Face transformers models.

Padding-free packing puts a micro-batch of n sequences in ONE row: ``input_ids`` [1, T] is the
sequences concatenated, ``position_ids`` [1, T] restarts at 0 for each, and ``cu_seqlens``
(int32 [n+1], 0 = c_0 < c_1 < ... < c_n = T) delimits them. Sequence s owns rows [c_s, c_{s+1}).

For a query row i and a key row j of the same sequence (only), attention is exactly what the
model's eager implementation computes on that sequence alone::

    x_ij = (q_i . k_j) * scaling                  # scaling: the module's (1/sqrt(d), Granite's multiplier, ...)
    x_ij = c * tanh(x_ij / c)                     # attention-logit softcapping (Gemma 2), when c is set
    allowed(i, j) = j <= i                        # causal, within the sequence
                    and j > i - w                 # sliding window w: the last w positions, self included
    p_i = softmax_j(x_ij over allowed j)          # in float32, then cast back to the model dtype
    o_i = sum_j p_ij v_j                          # with GQA, query head h reads key/value head h // (H / KV)

Conventions, checked against transformers 5 (5.17 and 5.23 agree):

* Sliding window: ``masking_utils.sliding_window_overlay`` keeps ``kv_idx > q_idx - sliding_window``,
  i.e. a token sees at most ``w`` positions *including itself*. Flash attention's window is
  inclusive on both sides (key j is seen iff ``i - left <= j <= i + right``), so ``w`` becomes
  ``window_size=(w - 1, 0)``, exactly as transformers' own flash integration passes
  ``(sliding_window - 1, ...)`` (``modeling_flash_attention_utils._process_flash_attention_kwargs``).
  Models pass the window per layer as the ``sliding_window`` argument (``None`` on full layers).
* Sequence boundaries travel as the flash-attention varlen kwargs ``cu_seq_lens_q``,
  ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` (``TransformersKwargs``): the model's
  ``forward(**kwargs)`` hands them through each decoder layer to the attention function.
* No [T, T] mask: no mask function is registered for our implementation, so transformers'
  ``create_causal_mask`` / ``create_sliding_window_causal_mask`` return None at once, with no
  host sync (``_preprocess_mask_arguments``' early exit for implementations without one), and
  the attention function gets ``attention_mask=None``. The price: a 2-D padding mask given to the
  model is dropped by transformers before it reaches us. Nothing here pads, and a packed row has
  no padding to mask.
* An unpacked call (no ``cu_seq_lens_*``, e.g. ``model(input_ids)`` for a reference) treats each
  batch row as one whole sequence, so a model switched to this implementation still answers
  ordinary unpadded calls exactly.

Backends, chosen per call (``choose_backend``): the first of the preference's order that can
compute the call exactly, so a model whose layers differ (Gemma 2's softcap) falls back layer by
layer and says why once:

* ``sdpa-cudnn``: one sequence in the row (known from ``cu_seqlens``' length, no host sync):
  torch's cuDNN flash kernel, causal, GQA read natively; the fastest measured for long single
  rows and for the chunks of a long sequence (``benchmarks/bench_attention.py``).
* ``cudnn``: cuDNN's fused flash attention on the ragged packed row (``ops.cudnn_attention``,
  the optional ``nvidia-cudnn-frontend`` package): GQA native, causal aligned bottom-right,
  sliding windows; 1.6-2.1x FlashAttention-2's varlen kernel on an H200.
* ``flash``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen), K/V heads
  repeated where this torch's kernel has no GQA.
* ``exact``: a loop over the sequences that computes each one as the eager implementation does,
  in blocks of query rows so that one block's scores stay under ``FALLBACK_SCORE_BYTES``
  (memory O(block x L), not O(L^2)): the CPU, float32, softcapped attention.

Preferences (the ``attention_backend`` setting): ``auto`` tries them in that order; ``cudnn``,
``flash`` and ``exact`` start at that backend (``sdpa-cudnn`` belongs to ``auto`` alone), each
falling back to the later ones when it cannot run a call. One implementation name is registered
per preference (``attention_implementation_name``).

Chunks of a long sequence (``models.chunked``): a layer called with a ``KVChunk`` writes the
chunk's keys and values into the layer's K/V buffers and attends the chunk's queries to every key
so far, causal aligned bottom-right: query i of a chunk of Lq queries over Lk keys sees keys
j <= i + Lk - Lq, as in one pass over the whole sequence.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from logprob_service.ops import cudnn_attention

log = logging.getLogger(__name__)

PACKED_ATTENTION = "logprob_packed"
"""Name of the attention implementation: ``model.set_attn_implementation(PACKED_ATTENTION)``."""

VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

FALLBACK_SCORE_BYTES = 256 * 1024**2
"""Budget for one block of float32 attention scores in the exact fallback."""

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256

_warned: set[tuple[str, ...]] = set()


# --------------------------------------------------------------------------- registration


AttentionBackend = Literal["auto", "cudnn", "flash", "exact"]
ORDER: dict[str, tuple[str, ...]] = {
    "auto": ("sdpa-cudnn", "cudnn", "flash", "exact"),
    "cudnn": ("cudnn", "flash", "exact"),
    "flash": ("flash", "exact"),
    "exact": ("exact",),
}


# transformers takes any implementation name with "flash" in it for a FlashAttention build it must
# import, so the names avoid the word.
_NAME_SUFFIX = {"auto": "", "cudnn": "_cudnn", "flash": "_fa2varlen", "exact": "_exact"}


def attention_implementation_name(preference: AttentionBackend = "auto") -> str:
    """The transformers attention implementation of ``preference``: ``model.set_attn_implementation(name)``."""
    return PACKED_ATTENTION + _NAME_SUFFIX[preference]


def register_packed_attention() -> None:
    """Register one implementation per preference with transformers' ``AttentionInterface``
    (class-wide, idempotent).

    Deliberately no mask function (see the module docstring): with one, transformers would scan
    ``position_ids`` for packed sequences before every forward, a host sync per mask kind.
    """
    from transformers import AttentionInterface

    for preference in ORDER:
        AttentionInterface.register(
            attention_implementation_name(preference),
            functools.partial(packed_attention_forward, preference=preference),
        )


KV_INDEX = "logprob_kv_index"
"""The keyword argument that gathers each query segment's keys/values from the packed row's."""


def packed_forward_kwargs(
    cu_seqlens: torch.Tensor, max_len: int, *, keys: tuple[torch.Tensor, int, torch.Tensor] | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``model.base_model(input_ids=..., position_ids=..., use_cache=False, **kwargs)``
    on a packed row.

    ``cu_seqlens``: [n+1] cumulative segment lengths (0 first, T last), on the model's device;
    ``max_len``: the longest segment's length. Without ``keys``, self-attention without a cache:
    each segment is a sequence, and queries and keys share the boundaries. With ``keys`` =
    (cu_seqlens_k [n+1], max_len_k, index [Tk]), segment s's keys and values are rows
    ``index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`` of the row's, its queries the last positions of
    those keys (a completion sharing its prompt with others: the prompt's rows, then its own).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    max_len = int(max_len)
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    cu = cu_seqlens.to(torch.int32)  # flash attention's varlen kernels index with int32
    if keys is None:
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    cu_k, max_k, index = keys
    if cu_k.shape != cu_seqlens.shape:
        raise ValueError(f"keys: {cu_k.numel() - 1} key segments for {cu_seqlens.numel() - 1} query segments")
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu_k.to(torch.int32),
        "max_length_q": max_len,
        "max_length_k": int(max_k),
        KV_INDEX: index,
    }


# --------------------------------------------------------------------------- attention function


@dataclass
class KVChunk:
    """One chunk of a long sequence in its layer (``models.chunked``): rows [start, end) of ``total``.

    The chunk's attention allocates the layer's K/V buffers at its first chunk (it knows the key
    heads, head dim and dtype), writes its rotated keys and values there, and attends to rows [0, end)."""

    buffers: dict[str, torch.Tensor]  # "key", "value": [total, KV, D], shared by the layer's chunks
    start: int
    end: int
    total: int

    def write(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's key/value ([Lq, KV, D]) and return the keys/values of rows [0, end)."""
        if not self.buffers:
            for name, t in (("key", key), ("value", value)):
                self.buffers[name] = t.new_empty(self.total, *t.shape[1:])
        self.buffers["key"][self.start : self.end] = key
        self.buffers["value"][self.start : self.end] = value
        return self.buffers["key"][: self.end], self.buffers["value"][: self.end]


KV_CHUNK = "logprob_kv_chunk"
"""The keyword argument a chunk's attention call gets: its ``KVChunk``."""


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    *,
    preference: AttentionBackend = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for one packed row.

    query: [1, H, T, D]; key, value: [1, KV, T, D] (H a multiple of KV). Returns
    (attn_output [1, T, H, D], None): no attention weights are ever materialized.
    Without the varlen kwargs, query is [B, H, T, D] and each row is one sequence; with a
    ``KV_CHUNK``, the row is a chunk of one long sequence (see the module docstring).
    """
    chunk: KVChunk | None = kwargs.get(KV_CHUNK)
    if chunk is None and all(kwargs.get(name) is None for name in VARLEN_KWARGS):
        return _unpacked_attention(
            module, query, key, value, attention_mask, scaling, dropout, softcap, preference=preference, **kwargs
        )
    _check_supported(module, query, key, attention_mask, dropout, kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    # Models pass the window per layer as an argument (None on full-attention layers); the module
    # attribute only stands in for a model that does not pass the argument at all.
    sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    q = query[0].transpose(0, 1)  # [T, H, D], a view: backends copy what they need
    if chunk is not None:
        k, v = chunk.write(key[0].transpose(0, 1), value[0].transpose(0, 1))  # [end, KV, D]: all keys so far
        lengths = torch.tensor([0, q.shape[0], 0, k.shape[0]], dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k = lengths[:2], lengths[2:], q.shape[0], k.shape[0]
    else:
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KV, D]
        index = kwargs.get(KV_INDEX)
        if index is not None:  # segments sharing a prompt: each gets its own copy of the prompt's keys
            k, v = k.index_select(0, index), v.index_select(0, index)  # [Tk, KV, D]
        cu_q, cu_k, max_q, max_k = _varlen_kwargs(kwargs, query.device)
    out = packed_attention(
        q, k, v, cu_q, cu_k, max_q, max_k,
        scale=scale, sliding_window=sliding_window, softcap=softcap, preference=preference,
    )  # fmt: skip
    return out.unsqueeze(0), None  # [1, Tq, H, D]


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
            reason = sdpa_cudnn_blocker(q, k, v, sliding_window=sliding_window, softcap=softcap)
        elif backend == "cudnn":
            reason = cudnn_attention.cudnn_blocker(q, k, v, window_size=window, softcap=softcap)
        elif backend == "flash":
            reason = fast_path_blocker(q, k, v, softcap=softcap)
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
        return sdpa_cudnn_attention(q, k, v, scale=scale)
    if backend == "cudnn":
        return cudnn_attention.cudnn_varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=varlen_window_size(sliding_window)
        )
    if backend == "flash":
        return varlen_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
            scale=scale, window_size=varlen_window_size(sliding_window),
        )  # fmt: skip
    bounds_q = cu_q.tolist()  # one host sync per layer: the exact path loops on the host anyway
    bounds_k = bounds_q if cu_k is cu_q else cu_k.tolist()
    return exact_packed_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds_q, bounds_k,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
    )  # fmt: skip


def _unpacked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    softcap: float | None,
    *,
    preference: AttentionBackend,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """B rows of T tokens, each row one sequence: the same as a packed row of B sequences."""
    b, h, t, _ = query.shape

    def one_row(x: torch.Tensor) -> torch.Tensor:  # [B, heads, T, d] -> [1, heads, B*T, d]
        return x.transpose(0, 1).reshape(x.shape[1], b * t, x.shape[-1])[None]

    cu_seqlens = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=query.device)
    out, _ = packed_attention_forward(
        module, one_row(query), one_row(key), one_row(value), attention_mask, scaling, dropout, softcap,
        preference=preference, **kwargs, **packed_forward_kwargs(cu_seqlens, t),
    )  # fmt: skip
    return out.reshape(b, t, h, value.shape[-1]), None


def _check_supported(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    """Refuse what this implementation would otherwise compute wrongly, naming it."""
    if attention_mask is not None:
        raise ValueError(
            f"{PACKED_ATTENTION!r} attention got an attention_mask of shape {tuple(attention_mask.shape)}; "
            "packed rows carry none (sequence boundaries come from cu_seq_lens_q/cu_seq_lens_k)"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"{PACKED_ATTENTION!r} attention expects one packed row [1, H, T, D], got {tuple(query.shape)}"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{PACKED_ATTENTION!r} attention is self-attention without a cache: "
            f"{query.shape[2]} query rows but {key.shape[2]} key rows (pass use_cache=False)"
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError(f"{PACKED_ATTENTION!r} attention is causal only; this layer is bidirectional")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{PACKED_ATTENTION!r} attention does not support attention sinks (s_aux)")
    if dropout and module.training:
        raise NotImplementedError(f"{PACKED_ATTENTION!r} attention is for inference: attention dropout is not applied")


def _varlen_kwargs(kwargs: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The sequence boundaries, as int32 tensors on ``device`` and host ints."""
    missing = [name for name in VARLEN_KWARGS if kwargs.get(name) is None]
    if missing:
        raise ValueError(
            f"{PACKED_ATTENTION!r} attention needs the sequence boundaries of the packed row, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: call the model with "
            "**packed_forward_kwargs(cu_seqlens, max_len)"
        )
    cu_q = kwargs["cu_seq_lens_q"].to(device=device, dtype=torch.int32)  # no-op when already so
    cu_k = kwargs["cu_seq_lens_k"]
    cu_k = cu_q if cu_k is kwargs["cu_seq_lens_q"] else cu_k.to(device=device, dtype=torch.int32)
    return cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"])


def _warn_once(backend: str, reasons: list[str]) -> None:
    """Say once per cause why a call on CUDA runs on a slower backend than the preference's first."""
    key = (backend, *reasons)
    if key not in _warned:
        _warned.add(key)
        log.warning("packed attention runs on %s (slower) because of %s", backend, "; ".join(reasons))


# --------------------------------------------------------------------------- fast path


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
    if q.dtype not in _FLASH_DTYPES:
        return f"dtype {q.dtype}"
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1] or q.shape[-2] % k.shape[-2]:
        return "head dims or head counts it does not take"
    return _sdpa_cudnn_refused(q.device, q.dtype, q.shape[-1], q.shape[-2] // k.shape[-2])


def sdpa_cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal attention of one sequence on torch's cuDNN flash kernel. q: [Lq, H, D]; k, v: [Lk, KV, D].

    Lq = Lk: SDPA, causal. Lq < Lk (a chunk: the sequence's last Lq positions): SDPA's causal mask
    is aligned top-left, so the keys split in two, each on the mask-free or the square kernel
    (faster than one ragged bottom-right call: 590 against 536 TFLOP/s at 16K x 131K keys on an
    H200): the Lk - Lq keys before the chunk, all visible (no mask), and the chunk's own Lq keys,
    causal; the two are merged by log-sum-exp (``cudnn_attention.merge_attention``), exactly."""
    prefix = k.shape[0] - q.shape[0]
    if prefix == 0:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip  # [1, H, T, D]
        return out[0].transpose(0, 1)  # [T, H, D]
    before = _cudnn_lse_attention(q, k[:prefix], v[:prefix], causal=False, scale=scale)
    own = _cudnn_lse_attention(q, k[prefix:], v[prefix:], causal=True, scale=scale)
    return cudnn_attention.merge_attention(*before, *own)[0]


def varlen_window_size(sliding_window: int | None) -> tuple[int, int]:
    """transformers' causal window of ``w`` positions (self included) as flash attention's
    inclusive (left, right) window: (w - 1, 0); plain causal is (-1, 0)."""
    if sliding_window is None:
        return (-1, 0)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return (int(sliding_window) - 1, 0)


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
    if query.dtype not in _FLASH_DTYPES:
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
) -> torch.Tensor:
    """Flash-attention varlen over the packed row. q: [T, H, D]; k, v: [T, KV, D] -> [T, H, D]."""
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
    return fn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size, **extra)


# --------------------------------------------------------------------------- exact fallback


def exact_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int] | None = None,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    score_bytes: int | None = None,
) -> torch.Tensor:
    """Eager-exact attention of each sequence of a packed row, on its own.

    q: [H, Tq, D]; k: [KV, Tk, D]; v: [KV, Tk, Dv]; ``cu_q`` / ``cu_k``: host lists [n+1] of query
    and key boundaries (``cu_k`` defaults to ``cu_q``: self-attention) -> [Tq, H, Dv]. A sequence
    with fewer queries than keys holds its last queries (aligned bottom-right).
    """
    cu_k = cu_q if cu_k is None else cu_k
    heads, total, _ = q.shape
    for name, bounds, end in (("cu_q", cu_q, total), ("cu_k", cu_k, k.shape[1])):
        if bounds[0] != 0 or bounds[-1] != end or any(a > b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{name} must rise from 0 to T={end}, got {bounds[:4]}...{bounds[-2:]}")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_q and cu_k must delimit as many sequences, got {len(cu_q) - 1} and {len(cu_k) - 1}")
    out = q.new_empty(total, heads, v.shape[-1])  # [Tq, H, Dv]
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        if qe > qs:
            out[qs:qe] = sequence_attention(
                q[:, qs:qe], k[:, ks:ke], v[:, ks:ke],
                scale=scale, sliding_window=sliding_window, softcap=softcap, score_bytes=score_bytes,
            )  # fmt: skip
    return out


def sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    score_bytes: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence, as transformers' eager implementation computes it.

    q: [H, Lq, D]; k: [KV, Lk, D]; v: [KV, Lk, Dv] -> [Lq, H, Dv], Lq <= Lk: the queries are the
    sequence's last Lq positions (query i sits at position i + Lk - Lq). Query rows go in blocks
    whose float32 scores fit ``score_bytes`` (default ``FALLBACK_SCORE_BYTES``); each block reads
    only the keys it can see (causal, and the window), so a row's result does not depend on the
    blocking.
    """
    heads, length, _ = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    if length > keys:
        raise ValueError(f"{length} queries but only {keys} keys: queries are the last positions of the keys")
    offset = keys - length  # position of query row 0
    groups = heads // kv_heads
    qg = q.unflatten(0, (kv_heads, groups))  # [KV, G, Lq, D]: query head h reads kv head h // G
    budget = FALLBACK_SCORE_BYTES if score_bytes is None else score_bytes  # read at call time
    rows = max(1, budget // (4 * heads * keys))  # float32 scores of one query row: heads x <= Lk keys
    out = q.new_empty(length, heads, v.shape[-1])  # [Lq, H, Dv]
    for q0 in range(0, length, rows):
        q1 = min(length, q0 + rows)
        p0, p1 = q0 + offset, q1 + offset  # the block's positions
        k0 = 0 if sliding_window is None else max(0, p0 - sliding_window + 1)  # first key the block's rows see
        scores = qg[:, :, q0:q1] @ k[:, None, k0:p1].transpose(-1, -2)  # [KV, G, Lq, Lk], model dtype
        scores = scores * scale  # after the matmul, as eager does
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = _allowed(p0, p1, k0, sliding_window, q.device)  # [Lq, Lk]
        # -inf instead of eager's additive finfo.min: both give exactly 0 after the softmax, and
        # every row keeps at least itself, so no row is all -inf.
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = probs @ v[:, None, k0:p1]  # [KV, G, Lq, Dv]
        out[q0:q1] = o.flatten(0, 1).transpose(0, 1)  # [Lq, H, Dv]
    return out


def _allowed(q0: int, q1: int, k0: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[Lq, Lk] bool: the query at position i in [q0, q1) may see the key at position j in [k0, q1).

    Same predicate as transformers' ``causal_mask_function`` and ``sliding_window_overlay``:
    j <= i, and j > i - w when a window w is set.
    """
    i = torch.arange(q0, q1, device=device)[:, None]
    j = torch.arange(k0, q1, device=device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= j > i - sliding_window
    return allowed
