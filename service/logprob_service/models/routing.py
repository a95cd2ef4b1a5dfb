"""The expert ids a mixture-of-experts model's routers choose, captured while it scores.

Router replay (verl's ``routed_experts``) needs, for each completion token, the experts each MoE
layer routed to. transformers 5 gives every MoE family a router module of its own class, named in
the model's ``_can_record_outputs["router_logits"]`` (that is how ``output_router_logits``
collects its logits), and the families of the ``use_experts_implementation`` kind (Qwen3-MoE,
gpt-oss, Mixtral, Qwen2-MoE, ...) have it return ``(logits, weights, top_k_ids)``; Llama 4's returns
``(scores, logits)`` and its ids are the top-k of those logits, as its forward takes them. A forward hook
on each router keeps its ``top_k_ids``: the choice the model itself made, on the packed row, not a
recomputation from the logits. A chunked long sequence (``models.chunked``) calls each router once
a chunk, in row order, so a router's calls concatenate to the whole row.

The ids are kept on the device ([T, top_k] per MoE layer) until the row's completion rows are
selected; only [N, layers, top_k] go to the host.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

ROUTER_OUTPUT = "router_logits"
"""The key of ``_can_record_outputs`` whose recorder names the model's router class."""
IDS_INDEX = 2
"""Where a router's output tuple holds its top-k expert ids: (logits, weights, ids)."""


class RoutingUnsupported(ValueError):
    """The model has no router whose top-k ids can be captured (dense, or another router kind)."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order; ``RoutingUnsupported`` when it has none. The router
    class is named by the model's ``_can_record_outputs``, or its body's (Llama 4's causal LM
    class names none; its text model does)."""
    targets = {
        target
        for module in model.modules()
        if (
            target := getattr(
                (getattr(module, "_can_record_outputs", None) or {}).get(ROUTER_OUTPUT), "target_class", None
            )
        )
    }
    found = [m for m in model.modules() if isinstance(m, tuple(targets))]
    if not found:
        raise RoutingUnsupported(f"{type(model).__name__} has no mixture-of-experts router to report routed experts of")
    return found


def _ids(router: nn.Module, output: Any) -> torch.Tensor | None:
    """A router call's top-k expert ids (``IDS_INDEX`` of its output), or None when it returns none.
    Llama 4's router returns (scores, logits): its ids are ``torch.topk`` of the logits, the very
    call its forward makes on them (the same choice, highest first)."""
    if type(router).__name__ == "Llama4Router" and isinstance(output, tuple) and len(output) == 2:
        return torch.topk(output[1], router.top_k, dim=-1).indices
    ids = output[IDS_INDEX] if isinstance(output, tuple) and len(output) > IDS_INDEX else None
    return None if ids is None or ids.is_floating_point() else ids


def expert_count(model: nn.Module) -> int:
    """Experts per MoE layer whose choices ``RoutedExperts`` can capture (a router's weight is
    [experts, hidden]); 0 for a model without routers, or whose router returns no ids (Llama 4's
    returns scores and logits): one router, called once on a zero row, tells."""
    try:
        found = routers(model)
    except RoutingUnsupported:
        return 0
    weight = found[0].weight
    try:
        with torch.inference_mode():
            output = found[0](torch.zeros(1, weight.shape[-1], dtype=weight.dtype, device=weight.device))
    except Exception as err:  # a router this probe cannot call: serve the model, without routed experts
        log.warning("%s: routed experts unavailable, its router failed a probe: %r", type(found[0]).__name__, err)
        return 0
    return max(int(router.weight.shape[0]) for router in found) if _ids(found[0], output) is not None else 0


class RoutedExperts:
    """Within ``with``, every router call's top-k expert ids are kept; ``ids(rows)`` gives them at
    rows of the packed row, [len(rows), layers, top_k]."""

    def __init__(self, model: nn.Module) -> None:
        self._routers = routers(model)
        self._calls: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RoutedExperts:
        for calls, router in zip(self._calls, self._routers):
            calls.clear()
            self._handles.append(router.register_forward_hook(self._keeper(calls, router)))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def _keeper(calls: list[torch.Tensor], router: nn.Module) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            ids = _ids(module, output)
            if ids is None:
                raise RoutingUnsupported(
                    f"{type(router).__name__} does not return its top-k expert ids (logits, weights, ids)"
                )
            calls.append(ids.reshape(-1, ids.shape[-1]))  # [tokens of this call, top_k]

        return keep

    def ids(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), layers, top_k] int32: the experts each MoE layer routed row ``rows[i]`` to."""
        per_layer = [torch.cat(calls).index_select(0, rows) for calls in self._calls]
        return torch.stack(per_layer, dim=1).to(torch.int32)
