"""Which implementation runs the log-prob stage, chosen once per model at load time.

* ``triton``: the fused kernels (``lm_head``): logits stay in registers; CUDA only (or
  Triton's CPU interpreter, ``TRITON_INTERPRET=1``, which tests use).
* ``eager``: fp32 logit slabs in row chunks under ``chunk_bytes`` (``logprobs``); any device.
* ``auto``: ``triton`` on CUDA when the triton package imports, else ``eager``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch

from logprob_service.domain import DEFAULT_OPTIONS, ScoreOptions
from logprob_service.ops.logprobs import (
    DEFAULT_LM_HEAD_CHUNK_BYTES,
    IDENTITY,
    LogitTransform,
    TokenScores,
    chunked_token_logprobs,
)

log = logging.getLogger(__name__)

LogprobKernel = Literal["auto", "triton", "eager"]


# Whether top-k (``top_k`` > 0) runs in the fused kernels (``lm_head``: a threshold from a strided
# sample of the vocabulary, survivors compacted to [N, CAP] slots, then the K largest of those). On
# an H200 (benchmarks/RESULTS.md, "the top-k's stage 1 as chunks") it takes 1.09-1.19x the plain
# kernel at K 20 and 1.35-1.52x at K 256, several times faster than the eager chunks (``logprobs``,
# [chunk, V] fp32 slabs) and in far less memory. Off, the eager chunks serve top-k on CUDA too.
# Candidate ids are fused either way (1.28-1.39x the plain kernel).
FUSED_TOP_K = True


@dataclass(frozen=True)
class LogprobOp:
    """The log-prob stage with its implementation fixed: ``op(hidden, weight, targets, options, ...)``."""

    kernel: Literal["triton", "eager"]
    chunk_bytes: int = DEFAULT_LM_HEAD_CHUNK_BYTES  # eager only
    # triton: a row's result does not depend on the other rows (lm_head.plans.invariant_plan).
    # eager: rows go in chunks of a size fixed by V, but the CPU's matmul picks its kernels by the
    # chunk's rows, so only CUDA with split-K off (ops.determinism) is invariant there.
    invariant: bool = False

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        options: ScoreOptions = DEFAULT_OPTIONS,
        *,
        bias: torch.Tensor | None = None,
        transform: LogitTransform = IDENTITY,
        candidates: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> TokenScores:
        """hidden: [N, H]; weight: [V, H]; targets: [N] -> float32 [N] log-probs, and the outputs
        ``options`` ask for (entropies, top-k, ranks); bias: [V] or None; ``transform``: the model's
        scale and softcap and the request's temperature (the caller folds ``options.temperature`` in);
        candidates: [N, Kc] ids whose log-probs to return; ``return_lse``: each row's log-sum-exp
        (``logprobs.chunked_token_logprobs``)."""
        if self.kernel == "triton" and not (options.top_k and not FUSED_TOP_K):
            from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs

            return fused_token_logprobs(
                hidden,
                weight,
                targets,
                options,
                bias=bias,
                transform=transform,
                candidates=candidates,
                return_lse=return_lse,
                invariant=self.invariant,
            )
        return chunked_token_logprobs(
            hidden,
            weight,
            targets,
            options,
            bias=bias,
            transform=transform,
            candidates=candidates,
            return_lse=return_lse,
            chunk_bytes=self.chunk_bytes,
        )


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
