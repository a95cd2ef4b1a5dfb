"""Checkpoints read tensor by tensor into a model skeleton: where weights come from, the skeleton.

A model is built with its parameters on the meta device (no memory, no initialization), changed
where the loader needs (sharded over a tensor-parallel group, quantized layers in place of dense
ones), then given real tensors on its device and filled from a ``TensorSource``: only the bytes
each parameter needs are read, so no copy of the whole model exists in another dtype or on
another device on the way.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


class ModelLoadError(RuntimeError):
    """A model SOURCE could not be loaded; the message names the source and the cause."""


class TensorSource(Protocol):
    """Where a sharded model's weights come from: a slice of the full tensor ``name``."""

    def names(self) -> set[str]: ...

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) along ``dim`` of the full tensor (all of it when ``dim`` is None)."""
        ...


class StateDictSource:
    """Slices of tensors held whole in memory (a builtin model, made on the CPU; tests)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def names(self) -> set[str]:
        return set(self._state)

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        tensor = self._state[name]
        return tensor if dim is None else tensor.narrow(dim, start, stop - start)


# A checkpoint keeps each expert's matrices apart (Qwen2/Qwen3-MoE, DeepSeek: ``experts.{e}.gate_proj.weight``);
# the model holds them stacked by expert, gate and up concatenated (transformers' conversion mapping).
# An FP8 checkpoint keeps each expert's scales beside its weight (``.weight_scale_inv``, or
# compressed-tensors' ``.weight_scale``): stacked the same way, as ``gate_up_proj_scale_inv`` (the
# names of transformers' FP8 expert banks).
CHECKPOINT_EXPERT = re.compile(
    r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|weight_scale)"
)
STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class SafetensorsSource:
    """Slices read from a checkpoint directory's ``*.safetensors`` files: only a rank's own bytes
    are read (``safe_open(...).get_slice``), never a whole tensor another rank shares. A stacked
    expert weight is assembled from its experts' own tensors, a rank's experts only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
            self._files = {name: directory / file for name, file in files.items()}
        else:
            self._files = {}
            for file in sorted(directory.glob("*.safetensors")):
                with safe_open(file, "pt") as f:
                    self._files.update(dict.fromkeys(f.keys(), file))
        if not self._files:
            raise ModelLoadError(f"no *.safetensors weights in {str(directory)!r}")
        # stacked name -> (prefix, parts, each part's tensor, experts)
        self._experts: dict[str, tuple[str, tuple[str, ...], str, int]] = {}
        for name in self._files:
            if match := CHECKPOINT_EXPERT.fullmatch(name):
                prefix, index, part, tensor = match.groups()
                for stacked, parts in STACKED_EXPERTS.items():
                    if part in parts:
                        key = f"{prefix}.{stacked}{tensor.removeprefix('weight')}"
                        count = self._experts.get(key, (prefix, parts, tensor, 0))[3]
                        self._experts[key] = (prefix, parts, tensor, max(count, int(index) + 1))

    def names(self) -> set[str]:
        return set(self._files) | set(self._experts)

    def stored(self, name: str) -> torch.Tensor:
        """A meta tensor of the dtype and shape a (not stacked) tensor is stored in; none of its bytes read."""
        with safe_open(self._files[name], "pt") as f:
            part = f.get_slice(name)
            shape = part.get_shape()
            # An empty slice (or a 0-d tensor's one value) gives the dtype.
            dtype = part[(slice(0, 0),) * len(shape)].dtype if shape else part[...].dtype
        return torch.empty(shape, dtype=dtype, device="meta")

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name in self._experts:
            prefix, parts, tensor, count = self._experts[name]
            if dim not in (None, 0):
                raise ModelLoadError(f"tensor parallel: {name} is split by expert only, not along dimension {dim}")
            experts = range(count) if dim is None else range(start, stop)
            return torch.stack(
                [torch.cat([self.read(f"{prefix}.{e}.{part}.{tensor}", None, 0, 0) for part in parts]) for e in experts]
            )
        with safe_open(self._files[name], "pt") as f:
            if dim is None:
                return f.get_tensor(name)
            return f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules made in this context get their parameters on the meta device (no memory, no
    initialization cost) and their buffers for real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """The model of ``config`` with its parameters on the meta device in ``dtype`` and its buffers
    real (RoPE's frequencies are computed, not loaded)."""
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


def materialize(model: PreTrainedModel, buffers: dict[str, torch.Tensor], device: torch.device) -> PreTrainedModel:
    """``model``'s parameters as new (unset) tensors on ``device``, and ``buffers`` (taken before
    any change to the skeleton) put back as the model made them, in eval mode."""
    model.to_empty(device=device)  # new tensors, module by module: a tied lm_head comes apart ...
    model.tie_weights()  # ... and is tied to the embedding again
    for name, buffer in buffers.items():
        owner, _, attr = name.rpartition(".")
        # As the model made them (RoPE's frequencies in float32), as a whole model keeps them
        # (models.loading.to_serving_dtype).
        module = model.get_submodule(owner)
        module.register_buffer(attr, buffer.to(device), persistent=attr not in module._non_persistent_buffers_set)
    return model.eval()


def copy_weight(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """``param.copy_(tensor)``, refusing a quantized (8-bit float) checkpoint tensor for a dense
    parameter: a cast would keep its unscaled values and serve the model silently wrong."""
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point and param.dtype != tensor.dtype:
        raise ModelLoadError(
            f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')} in the checkpoint, but the model "
            f"holds it as {str(param.dtype).removeprefix('torch.')}: its quantization is not served on this path"
        )
    if tensor.shape != param.shape:
        raise ModelLoadError(
            f"tensor {name!r} is {list(tensor.shape)} in the checkpoint; the model holds {list(param.shape)}"
        )
    param.copy_(tensor)


def owned_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by state-dict name, each once (a tied lm_head is the embedding's)."""
    owned: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            owned[name] = param
    return owned
