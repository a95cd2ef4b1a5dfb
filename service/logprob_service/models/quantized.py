"""Quantized checkpoints: their format read from ``quantization_config``, served exactly or refused.

A checkpoint's ``config.json`` says how its weights are stored. The service reads it before any
weight, and either serves the format exactly or refuses the model at start-up, naming the format,
the file and what is served. Served:

* ``fp8`` (transformers' fine-grained FP8: DeepSeek-V3/R1, Qwen3-*-FP8, Kimi-K2): float8_e4m3fn
  weights, a float32 ``weight_scale_inv`` per ``weight_block_size`` block (or one per tensor);
* ``compressed-tensors`` in its ``float-quantized`` format with 8-bit float weights (llm-compressor's
  FP8 and FP8_DYNAMIC schemes): float8_e4m3fn weights, a float32 ``weight_scale`` per tensor, per
  output channel or per block;
* ``mxfp4`` (gpt-oss): each expert bank's ``gate_up_proj`` and ``down_proj`` as ``*_blocks`` (e2m1
  codes, two a byte) and ``*_scales`` (e8m0, one per 32 values), everything else dense.

A served MXFP4 model keeps its experts in MXFP4 (``Mxfp4Experts``: 4.25 bits a weight) and
dequantizes each bank, exactly, into the serving dtype inside its forward, where the model's own
experts implementation (grouped GEMMs on CUDA) computes with it: the dequantized model's scores.

A served FP8 model keeps its linear layers' weights in FP8 on its device (``Fp8Linear``: one byte a
weight, plus the scales) and computes as ``compute`` says (``ops.fp8``): ``weights-only`` (the
default) dequantizes each weight inside its layer and equals the dequantized model, which is what a
trainer that loads the checkpoint computes; ``w8a8`` quantizes the activations too and runs the FP8
tensor cores. Everything the checkpoint keeps dense (embeddings, norms, the lm_head) stays in the
serving dtype, and the fused lm_head is unchanged.

A mixture-of-experts model's FP8 experts (each expert's projections apart in the checkpoint, with
their scales) are stacked into FP8 banks (``Fp8Experts``), dequantized per bank inside its forward
as MXFP4 banks are; they compute weights-only in either mode.

Which layers are quantized is read from the checkpoint itself: a linear layer whose weight has a
scale beside it, an expert bank whose experts' weights do. A checkpoint tensor stored in 8 bits
that no quantized layer takes (one the skeleton holds dense) is refused by
``checkpoint.copy_weight``, never cast.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from logprob_service.models.checkpoint import (
    ModelLoadError,
    SafetensorsSource,
    copy_weight,
    materialize,
    owned_parameters,
    skeleton,
)
from logprob_service.models.weights import DenseConversion
from logprob_service.ops.fp8 import (
    FP8,
    dequantize,
    quantize,
    scale_grid,
    w8a8_linear,
    w8a8_supported,
    weights_only_linear,
)
from logprob_service.ops.mxfp4 import GROUP as MXFP4_GROUP
from logprob_service.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4

Fp8Compute = Literal["weights-only", "w8a8"]
Strategy = Literal["block", "channel", "tensor", "mxfp4"]
SERVED_FORMATS = (
    "fp8 (float8_e4m3fn weights, float32 weight_scale_inv per block or per tensor)",
    "compressed-tensors float-quantized with 8-bit float weights (per tensor, channel or block)",
    "mxfp4 experts (gpt-oss: *_blocks and *_scales)",
)


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint's quantized linear weights are stored, and how they are computed."""

    method: str  # the config's quant_method
    scale_name: str  # the scale's name beside each quantized weight
    strategy: Strategy
    block_size: tuple[int, int] | None  # strategy "block" only
    compute: Fp8Compute = "weights-only"

    def block(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The block of elements one scale covers in a weight of ``shape``."""
        if self.strategy == "block":
            assert self.block_size is not None
            return self.block_size
        n, k = shape
        return (1, k) if self.strategy == "channel" else (n, k)

    def describe(self) -> str:
        """As ListModels, the logs and the metrics name it."""
        if self.strategy == "mxfp4":
            return "mxfp4: experts e2m1 with e8m0 scales per 32 values, dequantized in the experts' GEMMs"
        scales = {
            "block": f"blocks {self.block_size[0]}x{self.block_size[1]}" if self.block_size else "",
            "channel": "per channel",
            "tensor": "per tensor",
        }[self.strategy]
        return f"{self.method}: fp8 e4m3, {scales}, {self.compute}"


def weight_format(config: PretrainedConfig, where: str, compute: Fp8Compute = "weights-only") -> WeightFormat | None:
    """The format ``config``'s ``quantization_config`` declares (None for a dense checkpoint);
    ModelLoadError naming the format, ``where`` it is declared and what is served, for any other."""
    declared = getattr(config, "quantization_config", None)
    if declared is None:
        return None
    spec: dict[str, Any] = declared if isinstance(declared, dict) else declared.to_dict()
    method = str(spec.get("quant_method", "")).lower()
    refuse = _refusal(method, where)
    if method == "fp8":
        if spec.get("fmt", "e4m3") != "e4m3":
            raise refuse(f"fmt {spec.get('fmt')!r} (only e4m3 is served)")
        block = spec.get("weight_block_size")
        if block is None:
            return WeightFormat(method, "weight_scale_inv", "tensor", None, compute)
        if len(block) != 2 or min(block) < 1:
            raise refuse(f"weight_block_size {block!r} is not two positive sizes")
        return WeightFormat(method, "weight_scale_inv", "block", (int(block[0]), int(block[1])), compute)
    if method == "compressed-tensors":
        return _compressed_tensors_format(spec, refuse, compute)
    if method == "mxfp4":
        return WeightFormat(method, "scales", "mxfp4", None)
    raise refuse("this quantization method is not served")


def _refusal(method: str, where: str) -> Callable[[str], ModelLoadError]:
    """The error that refuses ``method`` declared in ``where``, for a reason."""

    def refuse(reason: str) -> ModelLoadError:
        return ModelLoadError(
            f"{where}: quantization_config.quant_method {method!r}: {reason}. Served: "
            + "; ".join(SERVED_FORMATS)
            + ". A dense (bf16) copy of the checkpoint is served as any other model."
        )

    return refuse


def _compressed_tensors_format(
    spec: dict[str, Any], refuse: Callable[[str], ModelLoadError], compute: Fp8Compute
) -> WeightFormat:
    """compressed-tensors' float-quantized 8-bit weights, one strategy (and block) for all groups."""
    if spec.get("format") != "float-quantized":
        raise refuse(f"format {spec.get('format')!r} (only float-quantized is served)")
    groups = spec.get("config_groups") or {}
    strategies = set()
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise refuse(f"config_groups.{name}.weights is {weights.get('num_bits')}-bit {weights.get('type')}")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise refuse(f"config_groups.{name}.weights.strategy {strategy!r}")
        strategies.add(strategy)
        if strategy == "block":
            blocks.add(tuple(weights.get("block_structure") or ()))
    if len(strategies) != 1 or len(blocks) > 1:
        raise refuse(f"config_groups mix weight strategies {sorted(strategies)} or blocks {sorted(blocks)}")
    (strategy,) = strategies
    block = blocks.pop() if blocks else None
    if strategy == "block" and (block is None or len(block) != 2):
        raise refuse(f"block_structure {block!r} is not two sizes")
    return WeightFormat("compressed-tensors", "weight_scale", strategy, block, compute)  # type: ignore[arg-type]


class Fp8Linear(nn.Module):
    """A linear layer whose weight is served in FP8 with its scales (the checkpoint's names:
    ``weight`` and ``fmt.scale_name``), computing as ``fmt.compute`` says (``ops.fp8``)."""

    def __init__(self, linear: nn.Linear, scale: torch.Tensor, fmt: WeightFormat) -> None:
        super().__init__()
        self.out_features, self.in_features = shape = (linear.out_features, linear.in_features)
        self.format = fmt
        self.scale_name = fmt.scale_name
        self.compute = fmt.compute
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty(shape, dtype=FP8, device=device), requires_grad=False)
        self.register_parameter(
            fmt.scale_name,
            nn.Parameter(torch.empty(scale.shape, dtype=torch.float32, device=device), requires_grad=False),
        )
        self.bias = linear.bias

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    @property
    def block(self) -> tuple[int, int]:
        """The block of weight elements one scale covers: of the weight this module holds (a
        tensor-parallel rank's shard computes with its own shard's, ``models.tensor_parallel``)."""
        return self.format.block(tuple(self.weight.shape))  # type: ignore[arg-type]

    def take_dense(self, weight: torch.Tensor) -> None:
        """Serve ``weight`` [out, in] from now on, quantized as the checkpoint is (``ops.fp8.quantize``)."""
        q, s = quantize(weight.to(self.weight.device), self.block)
        self.weight.copy_(q)
        self.scale.copy_(s.reshape(self.scale.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = w8a8_linear if self.compute == "w8a8" else weights_only_linear
        return linear(x, self.weight, self.scale, self.block, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block}, {self.compute}"


class QuantizedExperts(nn.Module):
    """An expert bank whose ``gate_up_proj`` and ``down_proj`` are stored quantized, under the
    checkpoint's names, with their dense biases. Each forward dequantizes both projections into the
    activations' dtype and runs the bank transformers made (``bank``, kept outside the module tree:
    its own weights never exist) with them, through its experts implementation (grouped GEMMs on
    CUDA): the dequantized model's arithmetic, one bank's dense weights in memory at a time."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, bank: nn.Module, fmt: WeightFormat) -> None:
        super().__init__()
        self.format = fmt
        self.transposed = bool(getattr(bank, "is_transposed", False))  # the bank's weights [E, in, out]
        self.dense_shapes = {proj: tuple(getattr(bank, proj).shape) for proj in self.PROJECTIONS}
        for proj in self.PROJECTIONS:
            if (bias := getattr(bank, f"{proj}_bias", None)) is not None:
                self.register_parameter(f"{proj}_bias", bias)
        object.__setattr__(self, "bank", bank)
        # What models.loading and models.compiled read of an expert bank, as the bank has them.
        self.config, self.num_experts = bank.config, bank.num_experts
        self.has_gate, self.is_concatenated = bank.has_gate, bank.is_concatenated

    def rows(self, proj: str) -> tuple[int, int, int]:
        """(experts, outputs, inputs) of ``proj``."""
        shape = self.dense_shapes[proj]
        return (shape[0], shape[2], shape[1]) if self.transposed else shape  # type: ignore[return-value]

    def dequantized(self, proj: str, dtype: torch.dtype) -> torch.Tensor:
        """``proj`` as [E, out, in] in ``dtype``."""
        raise NotImplementedError

    def quantize_into(self, proj: str, rows: torch.Tensor) -> None:
        """Store ``rows`` [E, out, in] as ``proj`` from now on, quantized as the checkpoint is."""
        raise NotImplementedError

    def take_dense(self, proj: str, weight: torch.Tensor) -> None:
        """Serve ``weight`` (the bank's dense ``proj``, as transformers holds it) from now on."""
        self.quantize_into(proj, weight.transpose(1, 2) if self.transposed else weight)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        weights: dict[str, torch.Tensor] = {}
        for proj in self.PROJECTIONS:
            whole = self.dequantized(proj, hidden_states.dtype)
            weights[proj] = whole.transpose(1, 2) if self.transposed else whole
            if hasattr(self, f"{proj}_bias"):
                weights[f"{proj}_bias"] = getattr(self, f"{proj}_bias")
        return torch.func.functional_call(self.bank, weights, (hidden_states, top_k_index, top_k_weights))


class Mxfp4Experts(QuantizedExperts):
    """An expert bank served in MXFP4 (gpt-oss): ``{proj}_blocks`` [E, out, in / 32, 16] and
    ``{proj}_scales`` [E, out, in / 32], uint8, the checkpoint's names and layout; dequantized
    exactly (``ops.mxfp4``)."""

    def __init__(self, bank: nn.Module, fmt: WeightFormat) -> None:
        super().__init__(bank, fmt)
        device = bank.gate_up_proj.device
        for proj in self.PROJECTIONS:
            experts, outputs, inputs = self.rows(proj)
            if inputs % MXFP4_GROUP:
                raise ModelLoadError(f"{proj}: {inputs} inputs are not a multiple of {MXFP4_GROUP} (mxfp4)")
            groups = inputs // MXFP4_GROUP
            packed = torch.empty(experts, outputs, groups, MXFP4_GROUP // 2, dtype=torch.uint8, device=device)
            scales = torch.empty(experts, outputs, groups, dtype=torch.uint8, device=device)
            self.register_parameter(f"{proj}_blocks", nn.Parameter(packed, requires_grad=False))
            self.register_parameter(f"{proj}_scales", nn.Parameter(scales, requires_grad=False))

    def dequantized(self, proj: str, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mxfp4(getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"), dtype)

    def quantize_into(self, proj: str, rows: torch.Tensor) -> None:
        blocks, scales = quantize_mxfp4(rows.to(getattr(self, f"{proj}_blocks").device))
        getattr(self, f"{proj}_blocks").copy_(blocks)
        getattr(self, f"{proj}_scales").copy_(scales)


class Fp8Experts(QuantizedExperts):
    """An expert bank served in FP8 (Qwen3-MoE-FP8, DeepSeek-V3): ``{proj}`` [E, out, in] e4m3 and
    its scales ``{proj}{suffix}`` [E, out / bn, in / bk] (``_scale_inv``, or compressed-tensors'
    ``_scale``: the names of transformers' FP8 expert banks), stacked from the checkpoint's
    per-expert tensors (``checkpoint.SafetensorsSource``). Dequantized per bank (``ops.fp8``: one
    scale grid over the E x out rows, so an expert's rows must fill whole blocks); the weights-only
    arithmetic in either compute mode."""

    def __init__(self, bank: nn.Module, fmt: WeightFormat) -> None:
        super().__init__(bank, fmt)
        if self.transposed:
            raise ModelLoadError(f"{type(bank).__name__}: FP8 expert banks stored [E, in, out] are not served")
        if fmt.strategy not in ("block", "channel"):
            raise ModelLoadError(f"FP8 expert banks with {fmt.strategy} scales are not served (blocks or channels are)")
        device = bank.gate_up_proj.device
        self.scale_names = {proj: proj + fmt.scale_name.removeprefix("weight") for proj in self.PROJECTIONS}
        self.blocks: dict[str, tuple[int, int]] = {}
        for proj in self.PROJECTIONS:
            experts, outputs, inputs = self.rows(proj)
            block = self.blocks[proj] = fmt.block((outputs, inputs))
            if outputs % block[0]:
                raise ModelLoadError(f"{proj}: {outputs} outputs an expert do not fill blocks of {block[0]} rows")
            grid = scale_grid((outputs, inputs), block)
            weight = torch.empty(experts, outputs, inputs, dtype=FP8, device=device)
            scale = torch.empty(experts, *grid, dtype=torch.float32, device=device)
            self.register_parameter(proj, nn.Parameter(weight, requires_grad=False))
            self.register_parameter(self.scale_names[proj], nn.Parameter(scale, requires_grad=False))

    def dequantized(self, proj: str, dtype: torch.dtype) -> torch.Tensor:
        weight, scale = getattr(self, proj), getattr(self, self.scale_names[proj])
        rows = weight.flatten(0, 1)  # [E * out, in]: each expert's rows fill whole blocks
        return dequantize(rows, scale.flatten(0, 1), self.blocks[proj], dtype).view(weight.shape)

    def quantize_into(self, proj: str, rows: torch.Tensor) -> None:
        weight, scale = getattr(self, proj), getattr(self, self.scale_names[proj])
        q, s = quantize(rows.to(weight.device).flatten(0, 1), self.blocks[proj])
        weight.copy_(q.view(weight.shape))
        scale.copy_(s.view(scale.shape))


def _quantized_module(
    name: str, module: nn.Module, fmt: WeightFormat, source: SafetensorsSource, names: set[str]
) -> nn.Module | None:
    """The quantized module that serves ``module`` as the checkpoint stores it, or None (dense)."""
    if fmt.strategy == "mxfp4":
        return Mxfp4Experts(module, fmt) if f"{name}.gate_up_proj_blocks" in names else None
    if f"{name}.gate_up_proj{fmt.scale_name.removeprefix('weight')}" in names:
        return Fp8Experts(module, fmt)
    scale_name = f"{name}.{fmt.scale_name}"
    if type(module) is not nn.Linear or scale_name not in names:
        return None
    scale = source.stored(scale_name)
    shape = (module.out_features, module.in_features)
    block = fmt.block(shape)
    if not scale.dtype.is_floating_point or scale.dtype.itemsize < 2:
        raise ModelLoadError(f"{scale_name}: scales stored as {scale.dtype} are not served (float32 is)")
    if scale.numel() != scale_grid(shape, block)[0] * scale_grid(shape, block)[1]:
        raise ModelLoadError(
            f"{scale_name}: {list(scale.shape)} scales do not fit a {shape[0]} x {shape[1]} weight in "
            f"blocks of {block[0]} x {block[1]} ({fmt.describe()})"
        )
    if fmt.compute == "w8a8" and (why := w8a8_supported(shape, block)):
        raise ModelLoadError(f"{name}: fp8_compute 'w8a8' cannot run this layer ({why}); use 'weights-only'")
    return Fp8Linear(module, scale, fmt)


def quantized_skeleton(
    source: SafetensorsSource, config: PretrainedConfig, fmt: WeightFormat, dtype: torch.dtype, attn_implementation: str
) -> PreTrainedModel:
    """The model of ``config`` on the meta device (``checkpoint.skeleton``) with the layers the
    checkpoint in ``source`` stores quantized in place: ``Fp8Linear``, ``Fp8Experts``,
    ``Mxfp4Experts``; every other parameter in ``dtype``."""
    dense = copy.deepcopy(config)
    if hasattr(dense, "quantization_config"):
        del dense.quantization_config
    model = skeleton(dense, dtype, attn_implementation)
    names = source.names()
    quantized = 0
    for name, module in list(model.named_modules()):
        if (replacement := _quantized_module(name, module, fmt, source, names)) is not None:
            model.set_submodule(name, replacement)
            quantized += 1
    if not quantized:
        raise ModelLoadError(
            f"{source.directory}: {fmt.describe()} is declared, but no weight of the model is stored so"
        )
    return model


def load_quantized_causal_lm(
    directory: Path,
    config: PretrainedConfig,
    fmt: WeightFormat,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
) -> PreTrainedModel:
    """The checkpoint in ``directory`` on ``device``: its quantized layers as ``quantized_skeleton``
    makes them (FP8 weights and float32 scales, MXFP4 blocks and scales, as stored), every other
    weight in ``dtype``."""
    source = SafetensorsSource(directory)
    model = quantized_skeleton(source, config, fmt, dtype, attn_implementation)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    materialize(model, buffers, device)
    params = owned_parameters(model)
    missing = sorted(set(params) - source.names())
    if missing:
        raise ModelLoadError(f"{directory}: the weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            copy_weight(param, source.read(name, None, 0, 0), name)
    return model


def quantized_layers(model: nn.Module) -> list[Fp8Linear | QuantizedExperts]:
    return [m for m in model.modules() if isinstance(m, (Fp8Linear, QuantizedExperts))]


def dense_conversions(model: nn.Module) -> dict[str, DenseConversion]:
    """What each quantized weight of ``model`` takes in its dense form (``models.weights``), by its
    dense name: an FP8 layer's ``weight``, an MXFP4 bank's ``gate_up_proj`` and ``down_proj``."""
    conversions: dict[str, DenseConversion] = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            writes = (f"{name}.weight", f"{name}.{module.scale_name}")
            shape = (module.out_features, module.in_features)
            conversions[f"{name}.weight"] = DenseConversion(shape, writes, module.take_dense, module.format.describe())
        elif isinstance(module, QuantizedExperts):
            for proj in module.PROJECTIONS:
                writes = tuple(
                    f"{name}.{p}" for p, _ in module.named_parameters() if p.startswith(proj) and "bias" not in p
                )
                take = functools.partial(module.take_dense, proj)
                shape = module.dense_shapes[proj]
                conversions[f"{name}.{proj}"] = DenseConversion(shape, writes, take, module.format.describe())
    return conversions


def describe_weights(model: nn.Module, dtype: torch.dtype) -> str:
    """The model's weight format as ListModels names it: the dense dtype, or the quantization."""
    layers = quantized_layers(model)
    dense = str(dtype).removeprefix("torch.")
    return f"{layers[0].format.describe()} ({len(layers)} layers; the rest {dense})" if layers else dense
