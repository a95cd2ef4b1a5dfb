"""Quantized checkpoints made in the tests, in the layouts the real ones ship, and their reference.

``write_mxfp4_checkpoint`` does the same for gpt-oss's MXFP4 expert banks.

``write_checkpoint`` quantizes a dense model's decoder-layer linear weights (``ops.fp8.quantize``:
max|W_block| / 448 scales, as DeepSeek's and transformers' quantizers compute them) and writes a
checkpoint directory as the format stores it: ``config.json`` with its ``quantization_config``
(the keys transformers' ``FineGrainedFP8Config`` and llm-compressor's compressed-tensors configs
write), FP8 weights and their scales under the format's names in ``model.safetensors``. It returns
the reference: the same model in float64 with every quantized weight replaced by Q * S, exact.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from logprob_service.ops.fp8 import dequantize, quantize
from logprob_service.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

# Widths that are multiples of the 128 x 128 block (the real layouts), heads of 64.
FP8_DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Widths the block-scaled FP8 GEMM takes (K a multiple of 512: ops.fp8.SCALE_ROW_INPUTS).
W8A8_DIMS = dict(hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)

# layout -> (quantization_config, scale name, the block a scale covers: None = whole rows / tensor)
_CT_WEIGHTS = dict(num_bits=8, type="float", symmetric=True, dynamic=False, group_size=None, actorder=None)
_CT_TOKENS = dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token", block_structure=None)


def _compressed_tensors(strategy: str, block: list[int] | None) -> dict:
    weights = {**_CT_WEIGHTS, "strategy": strategy, "block_structure": block}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": _CT_TOKENS}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


LAYOUTS = {
    "fp8-blocks": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "weight_scale_inv",
        (128, 128),
    ),
    "fp8-tensor": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}, "weight_scale_inv", None),
    "ct-channel": (_compressed_tensors("channel", None), "weight_scale", "channel"),
    "ct-tensor": (_compressed_tensors("tensor", None), "weight_scale", None),
    "ct-block": (_compressed_tensors("block", [128, 128]), "weight_scale", (128, 128)),
}


def _block(kind, shape: tuple[int, int]) -> tuple[int, int]:
    if kind == "channel":
        return (1, shape[1])
    return shape if kind is None else kind


def quantized_linears(model: PreTrainedModel) -> list[str]:
    """The names of the linear layers a checkpoint quantizes: every one in the decoder layers."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]


def expert_banks(model: PreTrainedModel) -> list[str]:
    """The names of a mixture-of-experts model's expert banks (stacked [E, out, in] weights)."""
    return [name for name, m in model.named_modules() if name.endswith(".experts") and hasattr(m, "gate_up_proj")]


def _write_experts(state: dict, reference: PreTrainedModel, bank: str, kind, scale_name: str) -> None:
    """A bank's experts as FP8 checkpoints keep them: each expert's gate, up and down projections
    apart (``experts.{e}.gate_proj.weight`` and its scale), the stacked tensors gone."""
    gate_up, down = state.pop(f"{bank}.gate_up_proj"), state.pop(f"{bank}.down_proj")  # [E, 2I, H], [E, H, I]
    deq_gate_up, deq_down = [], []
    for e in range(gate_up.shape[0]):
        parts = {"gate_proj": gate_up[e].chunk(2)[0], "up_proj": gate_up[e].chunk(2)[1], "down_proj": down[e]}
        exact = {}
        for part, weight in parts.items():
            block = _block(kind, tuple(weight.shape))
            q, s = quantize(weight.contiguous(), block)
            state[f"{bank}.{e}.{part}.weight"], state[f"{bank}.{e}.{part}.{scale_name}"] = q, s
            exact[part] = dequantize(q, s, block, torch.float64)
        deq_gate_up.append(torch.cat([exact["gate_proj"], exact["up_proj"]]))
        deq_down.append(exact["down_proj"])
    with torch.no_grad():
        reference.get_submodule(bank).gate_up_proj.copy_(torch.stack(deq_gate_up))
        reference.get_submodule(bank).down_proj.copy_(torch.stack(deq_down))


def write_checkpoint(directory: Path, model: PreTrainedModel, layout: str) -> PreTrainedModel:
    """``model``'s checkpoint in ``layout`` under ``directory``; returns the float64 reference."""
    spec, scale_name, kind = LAYOUTS[layout]
    reference = copy.deepcopy(model).to(torch.float64)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # saved once, as the embedding
    for bank in expert_banks(model):
        _write_experts(state, reference, bank, kind, scale_name)
    for name in quantized_linears(model):
        weight = state[f"{name}.weight"]
        block = _block(kind, tuple(weight.shape))
        q, s = quantize(weight, block)
        state[f"{name}.weight"] = q
        if kind is None:  # one scale, as each format stores it: [] (fp8) or [1] (compressed-tensors)
            s = s.reshape([] if spec["quant_method"] == "fp8" else [1])
        state[f"{name}.{scale_name}"] = s
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(dequantize(q, s, block, torch.float64))
    _save(directory, model, state, spec)
    return reference.eval()


MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def write_mxfp4_checkpoint(directory: Path, model: PreTrainedModel) -> PreTrainedModel:
    """A gpt-oss ``model``'s checkpoint as gpt-oss ships it: each expert bank's ``gate_up_proj``
    and ``down_proj`` as ``*_blocks`` [E, out, in / 32, 16] and ``*_scales`` [E, out, in / 32]
    (``ops.mxfp4.quantize_mxfp4``), the rest dense; returns the float64 reference (the banks' weights
    dequantized, exact)."""
    reference = copy.deepcopy(model).to(torch.float64)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    banks = [name for name, m in model.named_modules() if name.endswith(".experts")]
    for name in banks:
        for proj in ("gate_up_proj", "down_proj"):
            weight = state.pop(f"{name}.{proj}")  # [E, in, out]: gpt-oss's banks are transposed
            blocks, scales = quantize_mxfp4(weight.transpose(1, 2))
            state[f"{name}.{proj}_blocks"], state[f"{name}.{proj}_scales"] = blocks, scales
            with torch.no_grad():
                exact = dequantize_mxfp4(blocks, scales, torch.float64).transpose(1, 2)
                getattr(reference.get_submodule(name), proj).copy_(exact)
    _save(directory, model, state, MXFP4_CONFIG)
    return reference.eval()


def _save(directory: Path, model: PreTrainedModel, state: dict, spec: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": spec}, indent=2))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
