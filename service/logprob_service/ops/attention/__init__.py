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

One module a job:

* ``transformers_glue``: what transformers sees: the attention function registered per
  preference (``register_packed_attention``), the packed forward's keyword arguments
  (``packed_forward_kwargs``), the chunks of a long sequence (``KVChunk``).
* ``choice``: which backend computes a call, and why not a faster one (``choose_backend``), and the
  call itself (``packed_attention``).
* One module per backend, fastest first: ``sdpa_cudnn`` (torch's cuDNN SDPA, one sequence),
  ``cudnn`` (cuDNN's ragged kernel, through the cuDNN frontend), ``flash`` (FlashAttention-2
  varlen, ``torch.nn.attention.varlen``), ``exact`` (each sequence as the eager implementation
  computes it).
* ``common``: what the backends share: flash attention's dtypes and window convention, and the
  merge of two key sets' results by log-sum-exp.
"""

from logprob_service.ops.attention.choice import AttentionBackend, describe_backends
from logprob_service.ops.attention.common import varlen_window_size
from logprob_service.ops.attention.exact import exact_packed_attention, sequence_attention
from logprob_service.ops.attention.transformers_glue import (
    HOST_BOUNDS,
    KV_CHUNK,
    PACKED_ATTENTION,
    VARLEN_KWARGS,
    KVChunk,
    attention_implementation_name,
    packed_attention_forward,
    packed_forward_kwargs,
    register_packed_attention,
)

__all__ = [
    "HOST_BOUNDS",
    "KV_CHUNK",
    "PACKED_ATTENTION",
    "VARLEN_KWARGS",
    "AttentionBackend",
    "KVChunk",
    "attention_implementation_name",
    "describe_backends",
    "exact_packed_attention",
    "packed_attention_forward",
    "packed_forward_kwargs",
    "register_packed_attention",
    "sequence_attention",
    "varlen_window_size",
]
