"""The one way models are built from settings: every model the settings name, on one device.

A server calls ``build_models`` once per device (a replica of each model on each: data
parallel); a tensor-parallel group calls it on every rank with that rank's share of the group
(``build_rank``, the ``worker.tensor_parallel.Build`` of a server), so every rank loads the same
models in the same order. LoRA models (``BASE+ADAPTER_DIR``) are made on this device's replica of
their base.
"""

from __future__ import annotations

import functools

import torch

from logprob_service.models.loading import ModelLoadError, resolve_dtype
from logprob_service.models.lora import split_lora_source
from logprob_service.models.scorer import scoring_options
from logprob_service.models.served import ServedModel, load_served_model, serve_lora_model
from logprob_service.models.tensor_parallel import TensorParallel
from logprob_service.ops.dispatch import LogprobOp, select_logprob_op
from logprob_service.settings.model import Settings


def logprob_op(settings: Settings, device: torch.device) -> LogprobOp:
    """The lm_head + log-sum-exp op the settings ask for on ``device``; ``ModelLoadError`` for a
    forced kernel this host cannot run (found before any weight is loaded)."""
    try:
        return select_logprob_op(
            settings.logprob_kernel, device, settings.lm_head_chunk_bytes, invariant=settings.deterministic
        )
    except ValueError as err:
        raise ModelLoadError(str(err)) from None


def build_models(
    settings: Settings, device: torch.device, tensor_parallel: TensorParallel | None = None
) -> dict[str, ServedModel]:
    """Every model of ``settings.models`` on ``device`` (this rank's shards with
    ``tensor_parallel``): the plain ones in the settings' order, then the LoRA ones."""
    names = set(settings.models)
    lora = {name: split_lora_source(source, names - {name}) for name, source in settings.models.items()}
    if tensor_parallel is not None and (adapters := [name for name, spec in lora.items() if spec is not None]):
        raise ModelLoadError(f"tensor parallel: LoRA models ({', '.join(adapters)}) are not supported")
    load = functools.partial(
        load_served_model,
        device=device,
        dtype=resolve_dtype(settings.dtype, device),
        logprob_op=logprob_op(settings, device),
        options=scoring_options(settings),
        trust_remote_code=settings.trust_remote_code,
        tensor_parallel=tensor_parallel,
        fp8_compute=settings.fp8_compute,
    )
    built = {name: load(name, source) for name, source in settings.models.items() if lora[name] is None}
    for name, spec in lora.items():
        if spec is not None:
            base, adapter_dir = spec
            if lora[base] is not None:
                raise ModelLoadError(f"LoRA model {name!r}: its base {base!r} is itself a LoRA model")
            built[name] = serve_lora_model(name, built[base], adapter_dir)
    return built


def build_rank(settings: Settings, tensor_parallel: TensorParallel, device: torch.device) -> dict[str, ServedModel]:
    """A tensor-parallel rank's models (module-level, so that ``functools.partial(build_rank,
    settings)`` pickles to the group's other processes)."""
    return build_models(settings, device, tensor_parallel)
