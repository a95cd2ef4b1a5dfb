"""Which implementation runs the log-prob stage, chosen once per model at load time.

* ``triton``: the fused kernel (``fused_logprobs``): logits stay in registers; CUDA only (or
  Triton's CPU interpreter, ``TRITON_INTERPRET=1``, which tests use).
* ``eager``: fp32 logit slabs in row chunks under ``chunk_bytes`` (``logprobs``); any device.
* ``auto``: ``triton`` on CUDA when the triton package imports, else ``eager``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal, TypedDict, Unpack

import torch

from logprob_service.ops.logprobs import (
    DEFAULT_LM_HEAD_CHUNK_BYTES,
    LogitTransform,
    TokenScores,
    chunked_token_logprobs,
)

log = logging.getLogger(__name__)

LogprobKernel = Literal["auto", "triton", "eager"]


class OpOptions(TypedDict, total=False):
    """What every implementation of the op takes beside its three tensors."""

    bias: torch.Tensor | None  # [V], or None
    transform: LogitTransform  # scale, softcap, temperature (default: none)
    return_entropy: bool
    return_lse: bool  # each row's log-sum-exp too (TokenScores.lse)
    top_k: int  # each row's K most likely ids and their log-probs (TokenScores.top_ids, .top_logprobs)
    candidates: torch.Tensor | None  # [N, Kc] ids whose log-probs to return (TokenScores.candidate_logprobs)
    return_ranks: bool  # each target's vocabulary rank (TokenScores.ranks)


# Whether top-k (``top_k`` > 0) runs in the fused kernel (``fused_topk``: a threshold from a strided
# sample of the vocabulary, survivors compacted to [N, CAP] slots, then ``torch.topk``). On an H200
# (2026-11-26, benchmarks/RESULTS.md) it took 1.5-1.6x the plain kernel at K 20 and 1.9-2.7x at
# K 256 for H 3,584-4,096 (2.8x and 4.6x at H 896), against 5.8-23x for the eager chunks
# (``logprobs``, [chunk, V] fp32 slabs), which it replaces on CUDA: 2.3-8.1x faster, less memory.
# Issue 43's goals (K 20 <= 1.25x, K 256 <= 2.0x) are not all met yet. Off, the eager chunks serve
# top-k on CUDA too. Candidate ids are fused either way (1.22-1.31x the plain kernel).
FUSED_TOP_K = True


@dataclass(frozen=True)
class LogprobOp:
    """The log-prob stage with its implementation fixed: ``op(hidden, weight, targets, ...)``."""

    kernel: Literal["triton", "eager"]
    chunk_bytes: int = DEFAULT_LM_HEAD_CHUNK_BYTES  # eager only
    # triton: a row's result does not depend on the other rows (fused_logprobs.invariant_plan).
    # eager: rows go in chunks of a size fixed by V, but the CPU's matmul picks its kernels by the
    # chunk's rows, so only CUDA with split-K off (ops.determinism) is invariant there.
    invariant: bool = False

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, **options: Unpack[OpOptions]
    ) -> TokenScores:
        """hidden: [N, H]; weight: [V, H]; targets: [N] -> float32 [N] log-probs (and entropies);
        ``options``: ``bias``, ``transform``, ``return_entropy``, ``top_k``, ``candidates``
        (``logprobs.chunked_token_logprobs``)."""
        if self.kernel == "triton" and not (options.get("top_k") and not FUSED_TOP_K):
            from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs

            return fused_token_logprobs(hidden, weight, targets, invariant=self.invariant, **options)
        return chunked_token_logprobs(hidden, weight, targets, chunk_bytes=self.chunk_bytes, **options)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_logprob_op(
    kernel: LogprobKernel,
    device: torch.device,
    chunk_bytes: int = DEFAULT_LM_HEAD_CHUNK_BYTES,
    *,
    invariant: bool = False,
) -> LogprobOp:
    """Resolve ``kernel`` for ``device``; a forced ``triton`` that cannot run raises ValueError."""
    if kernel == "auto":
        if device.type != "cuda":
            return LogprobOp("eager", chunk_bytes, invariant)
        if not _triton_importable():
            log.warning("the triton package does not import: the lm_head runs in eager chunks (slower)")
            return LogprobOp("eager", chunk_bytes, invariant)
        return LogprobOp("triton", chunk_bytes, invariant)
    if kernel == "triton":
        if not _triton_importable():
            raise ValueError("logprob_kernel: 'triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"logprob_kernel: 'triton' needs a CUDA device, and the device is {device}; "
                "use 'auto' or 'eager' (or set TRITON_INTERPRET=1 to run the kernel in Triton's slow interpreter)"
            )
    return LogprobOp(kernel, chunk_bytes, invariant)
