"""Tiny random mixture-of-experts models (Qwen3-MoE, gpt-oss) for CPU tests, seeded.

The shapes follow ``tests.helpers.models.COMMON`` (vocab 517, hidden 64, 2 layers, 4/2 heads), with
8 experts of width 32, 2 routed per token, so a micro-batch of a few sequences sends rows to every
expert and some experts get one row. The router weights get a spread (std 1/sqrt(hidden) x 4) that
makes the top-k choice decided, not a coin toss between near-equal logits: float64 rounding cannot
flip it, so tests may compare expert ids exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.loading import to_serving_dtype
from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.helpers.models import COMMON

EXPERTS = 8
TOP_K = 2
EXPERT_WIDTH = 32
ROUTER_SPREAD = 4.0


def _qwen3_moe(max_positions: int) -> PreTrainedModel:
    config = Qwen3MoeConfig(
        **{**COMMON, "max_position_embeddings": max_positions},
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=EXPERT_WIDTH,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(config)


def _gpt_oss(max_positions: int) -> PreTrainedModel:
    common = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    config = GptOssConfig(
        **{**common, "max_position_embeddings": max_positions},
        head_dim=16,
        intermediate_size=EXPERT_WIDTH,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    return GptOssForCausalLM(config)


MOE_ARCHITECTURES: dict[str, Callable[[int], PreTrainedModel]] = {"qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss}


def make_moe_model(
    arch: str, *, seed: int, dtype: torch.dtype = torch.float32, max_positions: int = 256
) -> PreTrainedModel:
    """A random MoE model whose logits have a realistic spread, experts run by the model's own
    loop (``eager``; the service picks its implementation when it scores it)."""
    torch.manual_seed(seed)
    model = MOE_ARCHITECTURES[arch](max_positions)
    model.set_attn_implementation("eager" if arch == "gpt_oss" else "sdpa")  # sinks: eager only
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else None
            if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3 and arch == "gpt_oss":
                fan_in = p.shape[1]  # gpt-oss stores experts as [E, in, out]
            if fan_in is not None:
                p.normal_(0.0, 1.0 / fan_in**0.5)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.1)
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.mul_(ROUTER_SPREAD)
        model.get_output_embeddings().weight.mul_(2.0)  # logits std ~2, like a trained LM's
    return to_serving_dtype(model, dtype).eval()  # buffers (RoPE frequencies) as transformers keeps them


@torch.no_grad()
def hf_router_choices(model: torch.nn.Module, seq: TokenSequence) -> np.ndarray:
    """[C, MoE layers, top_k]: the experts transformers' own forward of the sequence alone routes
    the row predicting each completion token to (``output_router_logits``: each router's logits;
    its routers take the top-k of the logits, Qwen3-MoE's after a softmax, which keeps the order)."""
    ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids]))[None]
    logits = model(input_ids=ids, output_router_logits=True).router_logits  # per layer [L, experts]
    k = model.config.num_experts_per_tok
    chosen = torch.stack([layer.topk(k, dim=-1).indices for layer in logits], dim=1)  # [L, layers, k]
    p, c = len(seq.prompt_ids), len(seq.completion_ids)
    return chosen[p - 1 : p - 1 + c].numpy()
