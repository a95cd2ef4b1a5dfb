"""One model sharded over a tensor-parallel group: the body by its config's TP plan, the lm_head by vocabulary.

Each rank of the group (one process per GPU, ``worker.tensor_parallel``) builds the same model:

* the decoder layers are sharded Megatron-style with torch's DTensor styles, as the architecture's
  own ``base_model_tp_plan`` names them (transformers keeps one for Llama, Qwen2, Gemma 2, ...):
  q/k/v, gate and up projections ``colwise`` (each rank computes its heads and its slice of the
  MLP), o and down projections ``rowwise`` (partial sums, one all-reduce each). The attention
  kernels see each rank's heads only, packed rows and all; embeddings and norms are replicated.
  Transformers' own lm_head plan (``colwise_gather_output``) is not used: it gathers full logits.
* the lm_head is vocab-parallel: rank r holds the rows of a contiguous slice of the vocabulary
  (torch.chunk's split, as DTensor's ``Shard(0)``), the log-prob op runs on that slice, and one
  collective combines the ranks' per-token statistics (``ops.vocab_parallel``). A tied lm_head is
  the replicated input embedding, of which each rank uses its slice.

* a mixture-of-experts model's experts are split by expert (expert parallel): rank r holds experts
  [r E/N, (r+1) E/N) whole (their 3-D weights as DTensor ``Shard(0)``), the router is replicated,
  and each rank runs its own experts' grouped GEMMs (``models.loading``'s implementation) on the
  tokens routed to them, then one all-reduce of the layer's [T, hidden] output sums the ranks'
  partial outputs: the same collective as a row-parallel MLP's. Transformers' own TP plan for the
  experts (``packed_colwise``: each expert's width split) would make an already narrow expert
  (768 wide at Qwen3-30B-A3B) narrower; by expert, each expert's GEMM stays whole.
* a quantized checkpoint (``models.quantized``) is sharded in its own precision: an FP8 linear
  splits as a dense one does (colwise: its output rows, rowwise: its input columns), its scales
  split by block with it (a rank's share must be whole blocks, or one scale spans the dimension
  and every rank holds it: per-tensor scales, per-channel ones of a rowwise layer); FP8 and MXFP4
  expert banks split by expert, codes and scales alike. Each rank reads its shards' codes and
  scales as stored, and computes with them as one GPU does (``Fp8Linear``'s compute mode).
* gpt-oss, whose config plans only its embedding, gets ``OWN_PLANS``' plan for its attention, and
  its attention sinks (one logit per query head) split by head with the query projection.

The skeleton is built with its parameters on the meta device (buffers real: RoPE's frequencies are
computed, not loaded), sharded there, and then only each rank's shards are allocated and read, so
a model larger than one GPU (or than host memory) never exists whole anywhere.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from logprob_service.domain import ScoreOptions
from logprob_service.models.builtin import BUILTIN_PREFIX, build_builtin
from logprob_service.models.checkpoint import (
    SafetensorsSource,
    StateDictSource,
    TensorSource,
    copy_weight,
    materialize,
    owned_parameters,
    skeleton,
)
from logprob_service.models.loading import ModelLoadError, attention_implementation, expert_modules, to_serving_dtype
from logprob_service.models.quantized import (
    Fp8Compute,
    Fp8Linear,
    QuantizedExperts,
    WeightFormat,
    quantized_skeleton,
    weight_format,
)
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.fp8 import scale_grid, w8a8_supported
from logprob_service.ops.logprobs import IDENTITY, LogitTransform, TokenScores
from logprob_service.ops.vocab_parallel import vocab_parallel_logprobs

# The plan styles of transformers' base_model_tp_plan this module knows, as torch's DTensor styles.
STYLES: dict[str, Callable[[], ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# Styles of the plan left out: the input embedding stays whole on every rank (transformers 5.17
# plans a vocab-parallel one for tied models). It is one row gather per token; sharded, it would
# cost an all-reduce of [T, H] per forward to save V x H / N of memory per rank (1.2 GB at 72B).
REPLICATED_STYLES = frozenset({"embedding_rowwise", "replicated_with_grad_allreduce"})
# Plan entries under a layer's experts: served expert-parallel instead (``shard_experts``).
EXPERTS_PATTERN = ".experts"
# Plans for architectures whose config plans none of their layers (by ``model_type``), in the
# config's own form; the config's entries win where both name a module. gpt-oss's attention
# splits by head as Llama's does; its experts go expert-parallel as every MoE's.
OWN_PLANS: dict[str, dict[str, str]] = {
    "gpt_oss": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    },
}
# Attention parameters with one entry per query head (gpt-oss's sinks): split by head, as the
# query projection's output is.
HEAD_PARAMETERS = ("sinks",)
# Experts implementations of transformers' that leave out the rows of an expert id equal to the
# bank's expert count (``_is_expert_parallel``). Most models' own loops (``eager``) do too
# (``one_hot`` over one class more); ``SKIPLESS_LOOPS``' do not.
SKIPLESS_LOOPS = frozenset({"GptOssExperts"})


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``mesh`` is the group as a 1-D device mesh."""

    rank: int
    world: int
    mesh: DeviceMesh

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


def body_plan(config: PretrainedConfig, world: int) -> dict[str, str]:
    """The plan of the model's body (module pattern -> ``STYLES`` name); ModelLoadError when the
    architecture has none this module can apply, or when its heads or MLP width do not split
    evenly over ``world`` ranks."""
    name = type(config).__name__
    plan = {
        pattern: style
        for pattern, style in {
            **OWN_PLANS.get(getattr(config, "model_type", ""), {}),
            **(getattr(config, "base_model_tp_plan", None) or {}),
        }.items()
        if style not in REPLICATED_STYLES and EXPERTS_PATTERN not in pattern
    }
    if not plan:
        raise ModelLoadError(
            f"tensor parallel: {name} has no tensor-parallel plan (base_model_tp_plan) for its attention or MLPs"
        )
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ModelLoadError(f"tensor parallel: {name}'s plan uses styles {unknown}; supported: {sorted(STYLES)}")
    heads = config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
    }
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        sizes["num_experts"] = experts
    for field, size in sizes.items():
        if size % world:
            raise ModelLoadError(f"tensor parallel {world}: {name}.{field} = {size} does not split over {world} ranks")
    return plan


def sharded_skeleton(
    config: PretrainedConfig,
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
    quantized: tuple[WeightFormat, SafetensorsSource] | None = None,
) -> PreTrainedModel:
    """The model of ``config`` with this rank's shards allocated on ``device`` (values not set);
    ``quantized``: the checkpoint's format and tensors, whose quantized layers it holds as stored."""
    plan = body_plan(config, tp.world)
    attention = attention_implementation(config)
    model = (
        skeleton(config, dtype, attention)
        if quantized is None
        else quantized_skeleton(quantized[1], config, quantized[0], dtype, attention)
    )
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    shard_body(model.base_model, plan, tp)
    shard_experts(model, tp)
    if not config.tie_word_embeddings:
        # Only the weight's rows are sharded: the module's forward (full logits) is never called.
        parallelize_module(model.get_output_embeddings(), tp.mesh, ColwiseParallel())
    return materialize(model, buffers, device)


def _matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` is one ``pattern`` of a plan names, atom by atom as
    ``parallelize_module`` matches (``*`` stands for one atom: a layer's index)."""
    atoms, wanted = name.split("."), pattern.split(".")
    return len(atoms) == len(wanted) and all(fnmatch(atom, want) for atom, want in zip(atoms, wanted, strict=True))


def shard_body(body: nn.Module, plan: dict[str, str], tp: TensorParallel) -> None:
    """Shard the modules ``plan`` names: dense linears by torch's DTensor styles, FP8 ones
    (``shard_fp8_linear``) as they would be; and the per-head parameters (``HEAD_PARAMETERS``) of
    the modules whose query projection the plan splits."""
    for name, module in list(body.named_modules()):
        style = next((style for pattern, style in plan.items() if _matches(name, pattern)), None)
        if style is None:
            continue
        if isinstance(module, Fp8Linear):
            shard_fp8_linear(name, module, style, tp)
        else:
            parallelize_module(module, tp.mesh, STYLES[style]())
        owner, _, leaf = name.rpartition(".")
        if leaf == "q_proj" and style == "colwise":
            attention = body.get_submodule(owner)
            for param in HEAD_PARAMETERS:
                if getattr(attention, param, None) is not None:
                    _split(attention, param, 0, tp)


def _split(module: nn.Module, name: str, dim: int, tp: TensorParallel) -> None:
    """Make ``module``'s parameter ``name`` a DTensor split along ``dim`` over the group (torch.chunk's
    split, on the meta device like the rest of the skeleton)."""
    sharded = distribute_tensor(module._parameters[name], tp.mesh, [Shard(dim)])
    module.register_parameter(name, nn.Parameter(sharded, requires_grad=False))


def fp8_split(name: str, layer: Fp8Linear, style: str, world: int) -> tuple[int, bool]:
    """How FP8 linear ``name`` splits over ``world`` ranks under plan style ``style``: the weight's
    dimension (0: its output rows, colwise; 1: its input columns, rowwise), and whether its scales
    split along it by block (True: each rank's share of the weight is whole blocks) or are whole on
    every rank (False: one scale spans the dimension, as per-tensor scales and a rowwise layer's
    per-channel ones do). ModelLoadError, naming the layer, the size, the block and the group, when
    a rank's share would begin or end inside a block, or when the compute mode cannot run a shard."""
    dim = 0 if style == "colwise" else 1
    shape, block = (layer.out_features, layer.in_features), layer.block
    size, step = shape[dim], block[dim]
    split = scale_grid(shape, block)[dim] > 1
    if split and (size % world or (size // world) % step):
        what = "output rows" if dim == 0 else "input columns"
        raise ModelLoadError(
            f"tensor parallel {world}: FP8 layer {name}: its {size} {what} over {world} ranks are {size / world:g} "
            f"each, not whole blocks of {step} (its scales are per {block[0]}x{block[1]} block); "
            "serve it over a group that splits it into whole blocks"
        )
    if split and layer.scale.dim() != 2:
        raise ModelLoadError(f"FP8 layer {name}: scales stored as {list(layer.scale.shape)} do not split by block")
    local = (shape[0] // world, shape[1]) if dim == 0 else (shape[0], shape[1] // world)
    if layer.compute == "w8a8" and (why := w8a8_supported(local, layer.format.block(local))):
        raise ModelLoadError(
            f"tensor parallel {world}: FP8 layer {name}: fp8_compute 'w8a8' cannot run a rank's "
            f"{local[0]} x {local[1]} shard ({why}); use 'weights-only'"
        )
    return dim, split


def shard_fp8_linear(name: str, layer: Fp8Linear, style: str, tp: TensorParallel) -> None:
    """Split an FP8 linear as ``style`` splits a dense one, in its own precision (``fp8_split``):
    colwise its output rows and its bias, rowwise its input columns (its bias whole: added once,
    after the all-reduce); its scales by block with the weight, or whole."""
    dim, scales_split = fp8_split(name, layer, style, tp.world)
    _split(layer, "weight", dim, tp)
    if scales_split:
        _split(layer, layer.scale_name, dim, tp)
    if dim == 0 and layer.bias is not None:
        _split(layer, "bias", 0, tp)


@torch.no_grad()
def fill_shards_(model: PreTrainedModel, source: TensorSource, tp: TensorParallel) -> PreTrainedModel:
    """Copy each parameter's slice of ``source`` into this rank's shard of it."""
    missing = sorted(set(owned_parameters(model)) - source.names())
    if missing:
        raise ModelLoadError(f"tensor parallel: the weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    for name, param in owned_parameters(model).items():
        placement = param.placements[0] if isinstance(param, DTensor) else None
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(placement, Shard):
            # torch.chunk's split: every rank but the last holds ceil(size / world) rows.
            step = -(-param.shape[placement.dim] // tp.world)
            start = step * tp.rank
            copy_weight(local, source.read(name, placement.dim, start, start + local.shape[placement.dim]), name)
        else:  # whole on every rank (a rowwise layer's bias is a replicated DTensor)
            copy_weight(local, source.read(name, None, 0, 0), name)
    return model


def run_locally_(model: PreTrainedModel, tp: TensorParallel) -> PreTrainedModel:
    """Make the sharded modules compute on their local shards with plain torch calls.

    DTensor's own forward dispatches every op through sharding propagation in Python: measured on
    the CPU test models, 0.2-0.8 s of overhead per forward where the whole model computes in
    10-70 ms, and more for each new micro-batch length. So the DTensor parameters stay (they hold
    the shards, and digests and any later redistribution read them), but each sharded module
    forgets the hooks that wrap its input and output in DTensors and runs a copy of itself holding
    the local shards (``_local_shards``), as Megatron's layers do: a colwise linear (dense or FP8)
    is a local matmul (its output: this rank's heads or MLP slice), a rowwise one a local matmul of
    this rank's slice of the input, then an all-reduce of the partial sums; an expert bank runs its
    own experts (``run_experts_locally``); any other module with sharded parameters (an attention
    with its heads' sinks) runs its copy."""
    for module in model.base_model.modules():
        if isinstance(module, (nn.Linear, Fp8Linear)) and isinstance(module.weight, DTensor):
            (placement,) = module.weight.placements
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
            local = _local_shards(module)
            if placement == Shard(0):
                module.forward = local.forward
            else:
                bias, local.bias = local.bias, None
                module.forward = functools.partial(_rowwise, linear=local.forward, bias=bias, group=tp.group)
    for experts in expert_modules(model.base_model):
        run_experts_locally(experts, tp)
    for module in model.base_model.modules():
        if "forward" not in vars(module) and any(isinstance(p, DTensor) for p in module._parameters.values()):
            module.forward = _local_shards(module).forward
    return model


def _local_shards(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own parameters are this rank's shards of its DTensor ones
    (as plain tensors: the same storage); its submodules are ``module``'s."""
    local = copy.copy(module)
    local._parameters = {
        name: nn.Parameter(p.to_local(), requires_grad=False) if isinstance(p, DTensor) else p
        for name, p in module._parameters.items()
    }
    return local


def shard_experts(model: PreTrainedModel, tp: TensorParallel) -> None:
    """Make each expert bank's per-expert weights (first dimension: the experts; an FP8 or MXFP4
    bank's codes and scales alike) DTensors split by expert over the group."""
    for experts in expert_modules(model.base_model):
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] == experts.num_experts:
                _split(experts, name, 0, tp)


def run_experts_locally(experts: nn.Module, tp: TensorParallel) -> None:
    """Make a sharded expert bank run its own experts on the tokens routed to them, and sum the
    ranks' outputs. The bank keeps its DTensor parameters (state dict, digests); a copy holding
    their local shards (``_expert_parallel_bank``) computes, given the other ranks' experts as its
    skip id (``_skip_id``)."""
    local = _expert_parallel_bank(experts, experts.num_experts // tp.world)
    experts.forward = functools.partial(
        _expert_parallel, local=local, first=local.num_experts * tp.rank, skip=_skip_id(experts), group=tp.group
    )


def _expert_parallel_bank(experts: nn.Module, count: int) -> nn.Module:
    """``experts`` with its local shards, told it holds ``count`` experts and is expert-parallel:
    transformers' implementations then leave out the rows of expert id ``count``. A quantized bank
    runs transformers' bank with its dequantized shards: that bank is told so too."""
    local = _local_shards(experts)
    local.num_experts = count
    local._is_expert_parallel = True
    if isinstance(experts, QuantizedExperts):
        object.__setattr__(local, "bank", _expert_parallel_bank(experts.bank, count))
    return local


def _skip_id(experts: nn.Module) -> Callable[[nn.Module], int]:
    """What the other ranks' slots of ``experts``' routing become, as a function of the local bank
    (the implementation is chosen after loading): its expert count, which its implementation
    leaves out; for a model's own loop that takes no such id (``SKIPLESS_LOOPS``), 0: the rank's
    first expert, with a routing weight of 0, which adds an exact 0."""
    bank = experts.bank if isinstance(experts, QuantizedExperts) else experts
    skipless = type(bank).__name__ in SKIPLESS_LOOPS

    def skip(local: nn.Module) -> int:
        eager = getattr(local.config, "_experts_implementation", None) in (None, "eager")
        return 0 if skipless and eager else local.num_experts

    return skip


def _expert_parallel(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    local: nn.Module,
    first: int,
    skip: Callable[[nn.Module], int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    ids = top_k_index - first  # [T, top_k]: this rank's experts are 0..count-1
    mine = (ids >= 0) & (ids < local.num_experts)
    out = local(hidden, torch.where(mine, ids, skip(local)), torch.where(mine, top_k_weights, 0))
    dist.all_reduce(out, group=group)
    return out


def _rowwise(
    x: torch.Tensor,
    *,
    linear: Callable[[torch.Tensor], torch.Tensor],
    bias: torch.Tensor | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    partial = linear(x)
    dist.all_reduce(partial, group=group)
    return partial if bias is None else partial + bias


def load_sharded_causal_lm(
    source: str,
    tp: TensorParallel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    fp8_compute: Fp8Compute = "weights-only",
) -> PreTrainedModel:
    """``models.loading.load_causal_lm`` for one rank of a tensor-parallel group: a builtin model or
    a local checkpoint directory (download a hub model first: every rank reads the same files).
    A quantized checkpoint's quantized layers are read and served in their own precision."""
    quantized = None
    try:
        if source.startswith(BUILTIN_PREFIX):
            whole = build_builtin(source.removeprefix(BUILTIN_PREFIX))
            config, weights = whole.config, StateDictSource(to_serving_dtype(whole, dtype).state_dict())
        else:
            directory = Path(source).expanduser()
            if not directory.is_dir():
                raise ModelLoadError(
                    f"tensor parallel: {source!r} is not a local checkpoint directory; every rank reads the "
                    "same files, so download a hub model first (e.g. `hf download ID --local-dir DIR`)"
                )
            config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
            fmt = weight_format(config, f"{source}/config.json", fp8_compute)
            weights = SafetensorsSource(directory)
            quantized = None if fmt is None else (fmt, weights)
        model = sharded_skeleton(config, tp, device, dtype, quantized)
        return run_locally_(fill_shards_(model, weights, tp), tp)
    except ModelLoadError:
        raise
    except Exception as err:
        raise ModelLoadError(f"could not load model from {source!r} over {tp.world} ranks: {err}") from err


def head_shard(model: PreTrainedModel, tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """This rank's lm_head rows (and bias), and the first vocabulary id they score."""
    head = model.get_output_embeddings()
    weight = head.weight
    vocab = weight.shape[0]
    step = -(-vocab // tp.world)
    start, stop = min(step * tp.rank, vocab), min(step * (tp.rank + 1), vocab)
    if stop <= start:  # only a toy vocabulary: fewer than (world - 1) x ceil(vocab / world) ids
        raise ModelLoadError(f"tensor parallel {tp.world}: a vocabulary of {vocab} leaves rank {tp.rank} no ids")
    rows = weight.to_local() if isinstance(weight, DTensor) else weight[start:stop]
    bias = getattr(head, "bias", None)
    if bias is not None:
        bias = bias.to_local() if isinstance(bias, DTensor) else bias[start:stop]
    return rows, bias, start


@dataclass(frozen=True)
class VocabParallelOp:
    """The log-prob op over this rank's vocabulary slice, combined over the group: called as a
    ``LogprobOp`` with this rank's lm_head rows, the same result on every rank."""

    op: LogprobOp
    tp: TensorParallel
    vocab_start: int

    @property
    def kernel(self) -> str:
        return self.op.kernel

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        options: ScoreOptions,
        *,
        bias: torch.Tensor | None = None,
        transform: LogitTransform = IDENTITY,
        candidates: torch.Tensor | None = None,
    ) -> TokenScores:
        return vocab_parallel_logprobs(
            hidden,
            weight,
            targets,
            options,
            vocab_start=self.vocab_start,
            group=self.tp.group,
            op=self.op,
            bias_shard=bias,
            transform=transform,
            candidates=candidates,
        )
