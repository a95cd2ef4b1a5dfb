"""Layer-major, token-chunked execution of a model body, for sequences too long to run whole.

Run whole, a decoder layer at T tokens holds its MLP's [T, I] activations (I, the MLP width, is
~5x the hidden size) and its attention's [T, H*D] queries and outputs: at a million tokens of a 7B
model, tens of GiB for one layer. Instead the body runs as usual (embeddings, rotary positions,
the layers in order, the final norm: the model's own code), but each decoder layer goes over the
row in chunks of ``chunk_tokens`` tokens, in order:

    for chunk [a, b):
        x[a:b] = layer(x[a:b])       # norms, projections, MLP: chunk rows only
                                     # attention: the chunk's keys/values are written into the
                                     # layer's K/V buffers at rows [a, b) (ops.attention.KVChunk);
                                     # its queries attend to keys [0, b), causal aligned bottom-right

A chunk's output overwrites its own input rows in place: later chunks of the same layer need only
their own inputs and the K/V buffers, and the next layer starts once this one has done every
chunk. The final norm goes by row slices too. What stays alive beyond the weights: the residual
stream [T, hidden] (and, at the end, the final norm's output), the rotary tables [T, head_dim],
one layer's K and V [T, KV heads, head_dim], and one chunk's intermediates. So memory grows
linearly in T with a small constant and never with the MLP width. The arithmetic is the unchunked
one (each query sees exactly its causal keys), up to the summation order of the kernels at other
shapes.

Packed rows of one sequence only (positions 0..T-1): the scheduler scores a sequence longer than
its micro-batch budget alone, and only such a sequence is chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from logprob_service.ops.attention import HOST_BOUNDS, KV_CHUNK, VARLEN_KWARGS, KVChunk

CHUNK_KWARG = "logprob_chunk_tokens"
"""The body's keyword argument that turns chunking on for one call: the tokens of a chunk."""


@dataclass
class _LayerChunking:
    """A decoder layer's ``forward``: its original one, chunked when the call asks for it."""

    original: Callable[..., Any]

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        chunk_tokens = kwargs.pop(CHUNK_KWARG, None)
        if chunk_tokens is None:
            return self.original(hidden_states, *args, **kwargs)
        if args:
            raise TypeError("chunked decoder layers take their inputs by keyword after hidden_states")
        return self._chunked(hidden_states, int(chunk_tokens), kwargs)

    def _chunked(self, x: torch.Tensor, chunk_tokens: int, kwargs: dict[str, Any]) -> torch.Tensor:
        # x: [1, T, hidden], one sequence; position_embeddings: (cos, sin) [1, T, head_dim] each, or
        # one tensor [1, T, ...] (Llama 4's complex rotary factors).
        total = x.shape[1]
        rotary = kwargs.pop("position_embeddings")
        position_ids = kwargs.pop("position_ids", None)
        for name in (*VARLEN_KWARGS, HOST_BOUNDS):
            kwargs.pop(name, None)  # a chunk's attention reads its extent from its KVChunk instead
        buffers: dict[str, torch.Tensor] = {}
        for start in range(0, total, chunk_tokens):
            end = min(total, start + chunk_tokens)
            out = self.original(
                x[:, start:end],
                position_embeddings=_rows(rotary, start, end),
                position_ids=None if position_ids is None else position_ids[:, start:end],
                **kwargs,
                **{KV_CHUNK: KVChunk(buffers, start, end, total)},
            )
            x[:, start:end] = out if isinstance(out, torch.Tensor) else out[0]
        return x


def _rows(rotary: torch.Tensor | tuple[torch.Tensor, ...], start: int, end: int) -> Any:
    """Rows [start, end) of a layer's rotary inputs: a tensor [1, T, ...] or a tuple of them."""
    if isinstance(rotary, torch.Tensor):
        return rotary[:, start:end]
    return tuple(t[:, start:end] for t in rotary)


NORM_ROWS = 32768
"""Rows of one slice of the final norm (its float32 temporaries: 2 x rows x hidden x 4 bytes)."""


@dataclass
class _RowSlices:
    """A row-wise module's ``forward`` (the final RMSNorm) over slices of at most ``rows`` rows.

    Run on a whole long row, an RMSNorm holds two float32 copies of its [T, hidden] input (the
    upcast and its square): at a million tokens of a 7B model, 29 GiB. By slices, only one slice's;
    each row's values are the same."""

    original: Callable[..., Any]
    rows: int = NORM_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= self.rows:
            return self.original(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[-2], self.rows):
            out[..., start : start + self.rows, :] = self.original(x[..., start : start + self.rows, :])
        return out


def install_chunking(body: nn.Module) -> None:
    """Let every decoder layer of ``body`` run chunked when the body is called with
    ``CHUNK_KWARG=n``, and its final norm go by row slices (idempotent; short rows run as before)."""
    for layer in body.layers:
        if not isinstance(layer.forward, _LayerChunking):
            layer.forward = _LayerChunking(layer.forward)  # an instance attribute: names and weights stay
    if not isinstance(body.norm.forward, _RowSlices):
        body.norm.forward = _RowSlices(body.norm.forward)
