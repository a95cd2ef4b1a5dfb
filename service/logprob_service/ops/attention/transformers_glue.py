"""What transformers sees of packed attention: the attention function it calls, registered once
per backend preference, and the keyword arguments that carry a packed row's sequence boundaries.

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

What a layer's attention needs beyond q, k, v, read where transformers keeps it:

* Attention sinks (gpt-oss): the ``s_aux`` argument, [H] logits.
* Chunked attention (Llama 4): transformers tells it only through the mask it builds for the layer's
  type (``create_chunked_causal_mask``), which a maskless implementation never gets; so the layer's
  type is read from ``config.layer_types[module.layer_idx]`` and the chunk from
  ``config.attention_chunk_size``. A layer type this module does not know is refused, not run as
  plain causal attention.
* Llama 4's NoPE layers scale their queries by position (``attn_temperature_tuning``), computing the
  position as the row's index in ``hidden_states``: right for one unpadded sequence, wrong for a
  packed row or a chunk. The queries are rescaled here to each row's position in its own sequence
  (``_nope_positions_rescaled``).

Chunks of a long sequence (``models.chunked``): a layer called with a ``KVChunk`` writes the
chunk's keys and values into the layer's K/V buffers and attends the chunk's queries to every key
so far, causal aligned bottom-right: query i of a chunk of Lq queries over Lk keys sees keys
j <= i + Lk - Lq, as in one pass over the whole sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from logprob_service.ops.attention.choice import ORDER, AttentionBackend, packed_attention

PACKED_ATTENTION = "logprob_packed"
"""Name of the attention implementation: ``model.set_attn_implementation(PACKED_ATTENTION)``."""

VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The sequence boundaries transformers hands through: a chunk's call drops them (``models.chunked``)."""


# --------------------------------------------------------------------------- registration


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


HOST_BOUNDS = "logprob_host_bounds"
"""The keyword argument with the row's query and key boundaries as host ints, where the caller has
them (the scorer: from the batch's numpy arrays): the paths that cut or loop on the host (attention
chunks, the exact backend) read them there instead of copying ``cu_seq_lens_*`` back, a host sync
per layer."""


def packed_forward_kwargs(
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    keys: tuple[torch.Tensor, int, torch.Tensor] | None = None,
    host_bounds: tuple[Sequence[int], Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``model.base_model(input_ids=..., position_ids=..., use_cache=False, **kwargs)``
    on a packed row.

    ``cu_seqlens``: [n+1] cumulative segment lengths (0 first, T last), on the model's device;
    ``max_len``: the longest segment's length. Without ``keys``, self-attention without a cache:
    each segment is a sequence, and queries and keys share the boundaries. With ``keys`` =
    (cu_seqlens_k [n+1], max_len_k, index [Tk]), segment s's keys and values are rows
    ``index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`` of the row's, its queries the last positions of
    those keys (a completion sharing its prompt with others: the prompt's rows, then its own).
    ``host_bounds``: (cu_seqlens, cu_seqlens_k) as host ints, the same values (``HOST_BOUNDS``).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    max_len = int(max_len)
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    cu = cu_seqlens.to(torch.int32)  # flash attention's varlen kernels index with int32
    host = {}
    if host_bounds is not None:
        bounds_q, bounds_k = ([int(x) for x in bounds] for bounds in host_bounds)
        if len(bounds_q) != cu_seqlens.numel() or len(bounds_k) != len(bounds_q):
            raise ValueError(f"host_bounds: {len(bounds_q)} and {len(bounds_k)} entries for {cu_seqlens.numel()}")
        host = {HOST_BOUNDS: (bounds_q, bounds_k)}
    if keys is None:
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len, **host}
    cu_k, max_k, index = keys
    if cu_k.shape != cu_seqlens.shape:
        raise ValueError(f"keys: {cu_k.numel() - 1} key segments for {cu_seqlens.numel() - 1} query segments")
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu_k.to(torch.int32),
        "max_length_q": max_len,
        "max_length_k": int(max_k),
        KV_INDEX: index,
        **host,
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
    if kwargs.get(KV_CHUNK) is None and all(kwargs.get(name) is None for name in VARLEN_KWARGS):
        return _unpacked_attention(
            module, query, key, value, attention_mask, scaling, dropout, softcap, preference=preference, **kwargs
        )
    _check_supported(module, query, key, attention_mask, dropout, kwargs)
    return _packed_row_attention(
        module, query, key, value, scaling, softcap, preference=preference, rows_are_positions=False, **kwargs
    )


def _packed_row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    *,
    preference: AttentionBackend,
    rows_are_positions: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``packed_attention_forward`` once the call is known to be one packed row or chunk.
    ``rows_are_positions``: each sequence starts at row 0 of its own batch row (an unpacked call)."""
    chunk: KVChunk | None = kwargs.get(KV_CHUNK)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    # Models pass the window per layer as an argument (None on full-attention layers); the module
    # attribute only stands in for a model that does not pass the argument at all.
    sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    attention_chunk = _attention_chunk(module)
    q = query[0].transpose(0, 1)  # [T, H, D], a view: backends copy what they need
    if chunk is not None:
        k, v = chunk.write(key[0].transpose(0, 1), value[0].transpose(0, 1))  # [end, KV, D]: all keys so far
        lengths = torch.tensor([0, q.shape[0], 0, k.shape[0]], dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k = lengths[:2], lengths[2:], q.shape[0], k.shape[0]
        bounds = ([0, q.shape[0]], [0, k.shape[0]])
    else:
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KV, D]
        index = kwargs.get(KV_INDEX)
        if index is not None:  # segments sharing a prompt: each gets its own copy of the prompt's keys
            k, v = k.index_select(0, index), v.index_select(0, index)  # [Tk, KV, D]
        cu_q, cu_k, max_q, max_k = _varlen_kwargs(kwargs, query.device)
        bounds = kwargs.get(HOST_BOUNDS)
    if not rows_are_positions and _nope_temperature(module):
        q = _nope_positions_rescaled(module, q, cu_q, cu_k)
    out = packed_attention(
        q, k, v, cu_q, cu_k, max_q, max_k,
        scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=kwargs.get("s_aux"),
        attention_chunk=attention_chunk, bounds=bounds, preference=preference,
    )  # fmt: skip
    return out.unsqueeze(0), None  # [1, Tq, H, D]


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer types (``config.layer_types``) whose attention this module computes: each is causal, the
window coming as the ``sliding_window`` argument and the chunk from the config."""


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of the module's layer (Llama 4's chunked layers), None for other layers."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if not layer_types or layer is None or layer >= len(layer_types):
        return None  # untyped layers (as transformers builds them: one causal mask for all)
    layer_type = layer_types[layer]
    if layer_type not in LAYER_TYPES:
        raise NotImplementedError(
            f"{PACKED_ATTENTION!r} attention: layer {layer} is of type {layer_type!r}, whose mask it does not "
            f"know (it computes {', '.join(LAYER_TYPES)})"
        )
    if layer_type != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _nope_temperature(module: torch.nn.Module) -> bool:
    """Whether the layer scaled its queries by row index (Llama 4's NoPE layers with temperature tuning)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _nope_positions_rescaled(
    module: torch.nn.Module, q: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> torch.Tensor:
    """Queries [T, H, D] that Llama 4 scaled by ``1 + attn_scale * log1p(floor((r + 1) / floor_scale))``
    of their row index r, rescaled to that of their position in their sequence: row r of segment s
    sits at position r - cu_q[s] + (Lk_s - Lq_s) (the queries are their keys' last positions). On
    the device, no host sync. Scales computed in float32, as transformers does."""
    rows = torch.arange(q.shape[0], device=q.device)
    segment = torch.searchsorted(cu_q, rows.to(cu_q.dtype), right=True) - 1  # [T]
    offset = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1]) - cu_q[:-1]  # [n]: position of row 0 - cu_q[s]
    positions = rows + offset[segment]

    def temperature(pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    ratio = (temperature(positions) / temperature(rows))[:, None, None]  # [T, 1, 1], 1 where they agree
    return (q.float() * ratio).to(q.dtype) if q.dtype != torch.float64 else q * ratio.double()


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
    _check_supported(module, one_row(query), one_row(key), attention_mask, dropout, kwargs)
    out, _ = _packed_row_attention(
        module, one_row(query), one_row(key), one_row(value), scaling, softcap,
        preference=preference, rows_are_positions=True, **kwargs,
        **packed_forward_kwargs(cu_seqlens, t, host_bounds=(range(0, (b + 1) * t, t),) * 2),
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
