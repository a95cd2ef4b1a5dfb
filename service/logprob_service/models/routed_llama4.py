"""Llama 4's mixture-of-experts blocks run on their routed rows only.

transformers' ``Llama4TextMoe`` runs every expert on every token. Its router's scores are 0 for the
experts a token was not routed to (sigmoid of -inf), the input is repeated once per expert and
scaled by those scores, and ``Llama4TextExperts`` multiplies all of it (one bmm over [experts,
tokens, hidden]). Llama-4-Scout has 16 experts and routes each token to 1: 16 times the expert
FLOPs that the routed rows need. Its experts are not of transformers' ``experts_implementation``
kind (``loading.expert_modules``), so grouped GEMMs never reach them.

``route_llama4_experts`` gives each such block a forward that does the same maths on the routed
(token, expert) pairs only:

- the router itself, unchanged (its logits are the model's, and ``output_router_logits`` records
  them as before);
- each token's experts, ``torch.topk`` of the router's logits as the router takes them (the same
  choice), in expert order;
- the input scaled by its router score, as transformers scales it;
- the experts: with ``grouped`` (CUDA, bfloat16: ``loading`` decides, as for the other
  families), one grouped GEMM per projection (``torch.nn.functional.grouped_mm``, the rows sorted
  by expert, transformers' own call for experts of this weight layout); else one matmul pair per
  expert that got rows (exact in float64: the reference);
- each token's expert outputs summed in expert order, as transformers sums over all experts (the
  others add exact zeros), and added to the shared expert's output.

A token's output depends on its own row only, so batch invariance holds as for the other MoE
families (docs/moe.md). Tensor-parallel ranks (experts split across GPUs) keep transformers'
forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _is_llama4_moe(module: nn.Module) -> bool:
    return type(module).__name__ == "Llama4TextMoe"


def llama4_blocks(model: nn.Module) -> list[nn.Module]:
    """``model``'s Llama 4 MoE blocks whose experts are whole (not split over tensor-parallel ranks)."""
    return [m for m in model.modules() if _is_llama4_moe(m) and not isinstance(m.experts.gate_up_proj, DTensor)]


def route_llama4_experts(blocks: list[nn.Module], grouped: bool) -> None:
    """Give each block the routed forward, its experts as grouped GEMMs or the exact loop."""
    for block in blocks:
        block.forward = functools.partial(routed_forward, block, grouped)


def routed_forward(self: Any, grouped: bool, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe.forward`` on the routed (token, expert) pairs only (module doc)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)  # [T, E]; scores 0 where not routed
    experts = torch.topk(router_logits, self.top_k, dim=1).indices.sort(dim=1).values  # [T, k], ascending
    routed_in = hidden_states.repeat_interleave(self.top_k, dim=0) * router_scores.gather(1, experts).reshape(-1, 1)
    flat = experts.reshape(-1)  # pair p = token p // k, its (p % k)-th expert
    order = torch.argsort(flat, stable=True)  # the pairs by expert
    sorted_out = _experts(self.experts, routed_in[order], torch.bincount(flat, minlength=self.num_experts), grouped)
    routed_out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    out = self.shared_expert(hidden_states)
    out.add_(routed_out.reshape(-1, self.top_k, routed_out.shape[-1]).sum(dim=1))
    return out, router_logits


def _experts(bank: Any, rows: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """``Llama4TextExperts``' maths on ``rows`` sorted by expert, ``counts`` [E] rows each."""
    gate_up, down = bank.gate_up_proj, bank.down_proj  # [E, H, 2I], [E, I, H]
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # each expert's last row + 1
        gate, up = torch.nn.functional.grouped_mm(rows, gate_up, offs=offsets).chunk(2, dim=-1)
        return torch.nn.functional.grouped_mm(up * bank.act_fn(gate), down, offs=offsets)
    out = rows.new_empty(rows.shape[0], down.shape[-1])
    start = 0
    for expert, count in enumerate(counts.tolist()):  # the exact reference (a host sync: not on CUDA bf16)
        if count:
            part = slice(start, start + count)
            gate, up = (rows[part] @ gate_up[expert]).chunk(2, dim=-1)
            out[part] = (up * bank.act_fn(gate)) @ down[expert]
            start += count
    return out
