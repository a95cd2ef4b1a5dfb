"""The decoder layers' norms and MLPs compiled by ``torch.compile``, to fuse their elementwise work.

Why: on packed rows of a small model the matmuls and attention are only part of a layer's time.
The rest is memory-bound elementwise kernels that eager PyTorch runs one by one, each reading
and writing a [T, width] tensor: an RMSNorm is an upcast to float32, a square, a mean, an rsqrt,
two multiplies and a downcast; a gated MLP adds its activation and the gate product on
[T, intermediate]. Inductor fuses each such chain into one kernel, so each norm and each MLP's
middle reads its input once.

Only modules whose class name ends in ``RMSNorm`` or ``MLP`` are compiled (every decoder
architecture of transformers names them so): each takes a tensor and returns one, has no
data-dependent control flow, and sees shapes that vary in the token count only, so one dynamic
graph per class serves every micro-batch (``dynamic=True``; no recompiles as T changes).
A mixture-of-experts block (gpt-oss's ``GptOssMLP`` ends in ``MLP`` too) is not compiled whole:
its router stays eager, so its choices are transformers' own ops' and ``models.routing``'s hooks
on it see every call (dynamo does not re-check hooks added after a module is compiled). Its expert
bank is compiled where it runs as grouped GEMMs (``grouped_mm``, on CUDA): the sort by expert,
the gather of each (token, expert) pair's row, the activation, the routing weights and the sum of
each token's top-k outputs are elementwise and gather kernels over [T x top_k, width] between the
two grouped GEMMs, and they took 72% of a Qwen3-30B-A3B block's time eager (H200, T = 65,536:
25.3 ms, of which 7.2 ms grouped GEMMs); compiled, 13.8 ms. Its shapes are static in T (the
counts per expert are values, offsets of the grouped GEMM), so one dynamic graph serves every
micro-batch. The exact loop (``eager``, the CPU's) has data-dependent shapes and stays eager.
Attention stays outside any graph, on ``ops.attention``'s kernels, and so do the decoder layers'
own ``forward`` (``models.chunked`` wraps those). The compiled function is set as the module's
``forward`` instance attribute: parameter names, weights (updated in place by weight swaps) and
``state_dict`` stay as they were, and deleting the attribute restores eager execution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from logprob_service.models.loading import expert_modules

FUSED_CLASS_SUFFIXES = ("RMSNorm", "MLP")
BACKEND = "inductor"


# The experts implementation whose expert banks are compiled: shapes static in the token count.
COMPILED_EXPERTS = "grouped_mm"


def fusable_modules(body: nn.Module) -> list[nn.Module]:
    """The norms and MLPs inside ``body.layers`` (not the final norm: once a pass, and row-sliced
    by ``models.chunked``), less mixture-of-experts blocks, and the expert banks that run as
    ``COMPILED_EXPERTS``; none for a module without decoder layers."""
    modules = [m for layer in getattr(body, "layers", ()) for m in layer.modules()]
    dense = [m for m in modules if type(m).__name__.endswith(FUSED_CLASS_SUFFIXES) and not expert_modules(m)]
    banks = {id(m) for m in expert_modules(body)}
    experts = [
        m for m in modules if id(m) in banks and getattr(m.config, "_experts_implementation", None) == COMPILED_EXPERTS
    ]
    return dense + experts


def compile_layers(body: nn.Module) -> None:
    """Compile every fusable module's ``forward`` with ``BACKEND`` (lazily: the first call of each
    class compiles)."""
    for module in fusable_modules(body):
        if "forward" not in vars(module):
            module.forward = torch.compile(module.forward, dynamic=True, backend=BACKEND)


def uncompile_layers(body: nn.Module) -> None:
    """Run every fusable module eagerly again (undoes ``compile_layers``)."""
    for module in fusable_modules(body):
        vars(module).pop("forward", None)


def layers_compiled(body: nn.Module) -> bool:
    return any("forward" in vars(m) for m in fusable_modules(body))


@contextlib.contextmanager
def eager_layers(body: nn.Module) -> Iterator[None]:
    """Within the block, ``body`` runs as stock transformers runs it (for baselines, references and
    copies: ``copy.deepcopy`` of a compiled module would keep a forward bound to the original)."""
    saved = {m: vars(m).pop("forward") for m in fusable_modules(body) if "forward" in vars(m)}
    try:
        yield
    finally:
        for module, forward in saved.items():
            module.forward = forward
