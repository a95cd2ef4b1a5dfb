"""Batch invariance of the model body's matmuls: what ``--deterministic`` sets on the device.

A sequence's scores depend on its micro-batch wherever a reduction's order follows the batch's
size. In the body that is cuBLAS: it picks a GEMM algorithm by the problem's shape, and for a short
M (few tokens in the micro-batch) it may split a row's K reduction across thread blocks (split-K)
and sum the parts in another order. torch (2.10 and later) can forbid split-K, through
``allow_bf16_reduced_precision_reduction = (allow_reduced_precision, allow_splitk)`` and its fp16
twin, in cuBLASLt GEMMs only: torch refuses a plain cuBLAS GEMM under ``allow_splitk=False``
("requires the cuBLASLt backend", at the first matmul, not at the setting), so the pin routes every
GEMM to cuBLASLt first (``preferred_blas_library``). Without split-K, every output element is one
thread block's in-order sum over K whatever M, and the body's other reductions (norms, softmax
rows, attention per query) are per row already. The lm_head stage's own plan is made invariant in
``lm_head.plans.invariant_plan``, attention by one kernel for every row (``models.scorer``).
tests/gpu/test_batch_invariance_cuda.py checks the whole on each GPU; nothing here can prove it for
a cuBLAS release it has not run on.

On the CPU, oneDNN and MKL choose kernels by the matrix sizes and offer no such switch: results
are reproducible run to run, but a sequence's scores may move with its micro-batch.
"""

from __future__ import annotations

import torch


def pin_matmul_reductions() -> str | None:
    """Forbid split-K and reduced-precision reductions in this process's bf16 and fp16 cuBLAS GEMMs
    (a process-wide setting: every model of a server shares it). Returns why not, if this torch
    cannot."""
    matmul = torch.backends.cuda.matmul
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        matmul.allow_fp16_reduced_precision_reduction = (False, False)
    except (TypeError, ValueError, RuntimeError) as err:  # a torch without the split-K switch
        return f"torch {torch.__version__} cannot turn cuBLAS split-K off ({err})"
    return None
