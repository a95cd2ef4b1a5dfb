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

The skeleton is built with its parameters on the meta device (buffers real: RoPE's frequencies are
computed, not loaded), sharded there, and then only each rank's shards are allocated and read, so
a model larger than one GPU (or than host memory) never exists whole anywhere.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
from logprob_service.models.quantized import weight_format
from logprob_service.ops.dispatch import LogprobOp
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


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``mesh`` is the group as a 1-D device mesh."""

    rank: int
    world: int
    mesh: DeviceMesh

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


def body_plan(config: PretrainedConfig, world: int) -> dict[str, ParallelStyle]:
    """The DTensor plan of the model's body; ModelLoadError when the architecture has none this
    module can apply, or when its heads or MLP width do not split evenly over ``world`` ranks."""
    name = type(config).__name__
    plan = {
        pattern: style
        for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items()
        if style not in REPLICATED_STYLES and EXPERTS_PATTERN not in pattern
    }
    if not plan:  # gpt-oss's names only its embedding: nothing of its layers would be sharded
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
    return {pattern: STYLES[style]() for pattern, style in plan.items()}


def sharded_skeleton(
    config: PretrainedConfig, tp: TensorParallel, device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """The model of ``config`` with this rank's shards allocated on ``device`` (values not set)."""
    plan = body_plan(config, tp.world)
    model = skeleton(config, dtype, attention_implementation(config))
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    parallelize_module(model.base_model, tp.mesh, plan)
    shard_experts(model, tp)
    if not config.tie_word_embeddings:
        # Only the weight's rows are sharded: the module's forward (full logits) is never called.
        parallelize_module(model.get_output_embeddings(), tp.mesh, ColwiseParallel())
    return materialize(model, buffers, device)


@torch.no_grad()
def fill_shards_(model: PreTrainedModel, source: TensorSource, tp: TensorParallel) -> PreTrainedModel:
    """Copy each parameter's slice of ``source`` into this rank's shard of it."""
    missing = sorted(set(owned_parameters(model)) - source.names())
    if missing:
        raise ModelLoadError(f"tensor parallel: the weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    for name, param in owned_parameters(model).items():
        if isinstance(param, DTensor):
            (placement,) = param.placements
            assert isinstance(placement, Shard)
            local = param.to_local()
            # torch.chunk's split: every rank but the last holds ceil(size / world) rows.
            step = -(-param.shape[placement.dim] // tp.world)
            start = step * tp.rank
            copy_weight(local, source.read(name, placement.dim, start, start + local.shape[placement.dim]), name)
        else:
            copy_weight(param, source.read(name, None, 0, 0), name)
    return model


def run_locally_(model: PreTrainedModel, tp: TensorParallel) -> PreTrainedModel:
    """Make the sharded linears compute on their local shards with plain torch calls.

    DTensor's own forward dispatches every op through sharding propagation in Python: measured on
    the CPU test models, 0.2-0.8 s of overhead per forward where the whole model computes in
    10-70 ms, and more for each new micro-batch length. So the DTensor parameters stay (they hold
    the shards, and digests and any later redistribution read them), but each sharded linear
    forgets the hooks that wrap its input and output in DTensors and runs as Megatron's layers do:
    a colwise one is a local matmul (its output: this rank's heads or MLP slice), a rowwise one a
    local matmul of this rank's slice of the input, then an all-reduce of the partial sums."""
    for module in model.base_model.modules():
        if isinstance(module, nn.Linear) and isinstance(module.weight, DTensor):
            (placement,) = module.weight.placements
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
            weight = module.weight.to_local()
            bias = module.bias.to_local() if isinstance(module.bias, DTensor) else module.bias
            if placement == Shard(0):
                module.forward = functools.partial(F.linear, weight=weight, bias=bias)
            else:
                module.forward = functools.partial(_rowwise, weight=weight, bias=bias, group=tp.group)
    for experts in expert_modules(model.base_model):
        run_experts_locally(experts, tp)
    return model


def shard_experts(model: PreTrainedModel, tp: TensorParallel) -> None:
    """Make each expert bank's per-expert weights (first dimension: the experts) DTensors split by
    expert over the group, on the meta device like the rest of the skeleton."""
    for experts in expert_modules(model.base_model):
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] == experts.num_experts:
                sharded = distribute_tensor(param, tp.mesh, [Shard(0)])
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=False))


def run_experts_locally(experts: nn.Module, tp: TensorParallel) -> None:
    """Make a sharded expert bank run its own experts on the tokens routed to them, and sum the
    ranks' outputs. The bank keeps its DTensor parameters (state dict, digests); a shallow copy
    holding their local shards, told it holds ``E / N`` experts and is expert-parallel, computes:
    transformers' experts implementations skip an expert id equal to their expert count (the
    grouped GEMM sorts such rows last and leaves them out of its groups; the loop skips them)."""
    local = copy.copy(experts)
    local._parameters = {
        name: nn.Parameter(p.to_local(), requires_grad=False) if isinstance(p, DTensor) else p
        for name, p in experts._parameters.items()
    }
    local.num_experts = experts.num_experts // tp.world
    local._is_expert_parallel = True
    experts.forward = functools.partial(
        _expert_parallel, local=local, first=local.num_experts * tp.rank, group=tp.group
    )


def _expert_parallel(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    local: nn.Module,
    first: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    ids = top_k_index - first  # [T, top_k]: this rank's experts are 0..count-1
    mine = (ids >= 0) & (ids < local.num_experts)
    out = local(hidden, torch.where(mine, ids, local.num_experts), torch.where(mine, top_k_weights, 0))
    dist.all_reduce(out, group=group)
    return out


def _rowwise(
    x: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor:
    partial = F.linear(x, weight)
    dist.all_reduce(partial, group=group)
    return partial if bias is None else partial + bias


def load_sharded_causal_lm(
    source: str,
    tp: TensorParallel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """``models.loading.load_causal_lm`` for one rank of a tensor-parallel group: a builtin model or
    a local checkpoint directory (download a hub model first: every rank reads the same files)."""
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
            if (fmt := weight_format(config, f"{source}/config.json")) is not None:
                raise ModelLoadError(
                    f"tensor parallel: {source!r} is quantized ({fmt.describe()}); served on one GPU only"
                )
            weights = SafetensorsSource(directory)
        return run_locally_(fill_shards_(sharded_skeleton(config, tp, device, dtype), weights, tp), tp)
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
