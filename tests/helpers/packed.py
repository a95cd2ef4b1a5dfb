"""Hidden states of a model on a packed row and on each sequence alone (attention tests, CPU and GPU)."""

from __future__ import annotations

import torch
from logprob_service.models.scorer import model_body
from logprob_service.ops.attention import packed_forward_kwargs
from transformers import PreTrainedModel


@torch.no_grad()
def packed_hidden(model: PreTrainedModel, packed: dict[str, torch.Tensor], max_len: int) -> torch.Tensor:
    out = model_body(model)(
        input_ids=packed["input_ids"],
        position_ids=packed["position_ids"],
        use_cache=False,
        **packed_forward_kwargs(packed["cu_seqlens"], max_len),
    )
    return out.last_hidden_state[0]  # [T, H]


@torch.no_grad()
def own_hidden(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return model_body(model)(input_ids=ids[None], use_cache=False).last_hidden_state[0]  # [L, H]
