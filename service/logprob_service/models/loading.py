"""Load a causal LM from a model SOURCE onto a device, in a dtype.

SOURCE is ``builtin:<name>`` (embedded, made locally), a local Hugging Face checkpoint
directory, or a hub id (downloaded by transformers; needs network or a warm HF cache).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from logprob_service.domain import DTYPE_BYTES
from logprob_service.models.builtin import BUILTIN_PREFIX, build_builtin

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}


class ModelLoadError(RuntimeError):
    """A model SOURCE could not be loaded; the message names the source and the cause."""


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available here")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_devices(devices: str, tensor_parallel: int = 1) -> list[torch.device]:
    """The devices a server holds a replica of each model on (data parallel): ``auto`` is every
    visible GPU (the CPU where there is none); else a comma-separated list (``cuda:0,cuda:1``),
    each as ``resolve_device``. A GPU named twice is refused; the CPU may be (tests, a CPU host).

    With ``tensor_parallel`` N > 1, the N devices of the group, rank by rank: ``auto`` is the
    first N GPUs, ``cpu`` is the CPU N times (gloo: tests), a list must name N devices."""
    if tensor_parallel > 1:
        if devices == "cpu" or (devices == "auto" and not torch.cuda.is_available()):
            return [torch.device("cpu")] * tensor_parallel
        if devices == "auto":
            found = torch.cuda.device_count()
            if found < tensor_parallel:
                raise ModelLoadError(f"tensor_parallel {tensor_parallel} needs {tensor_parallel} GPUs; {found} visible")
            return [torch.device("cuda", i) for i in range(tensor_parallel)]
    if devices == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    resolved = [resolve_device(name.strip()) for name in devices.split(",")]
    gpus = [d for d in resolved if d.type == "cuda"]
    if len(set(gpus)) < len(gpus):
        raise ModelLoadError(f"device {devices!r} names a GPU twice: one replica per GPU")
    if tensor_parallel > 1 and len(resolved) != tensor_parallel:
        raise ModelLoadError(
            f"tensor_parallel {tensor_parallel} shards each model over {tensor_parallel} devices; "
            f"device {devices!r} names {len(resolved)}"
        )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}") from None


def attention_implementation(config: PretrainedConfig) -> str:
    """The exact stock implementation for direct calls of the model: SDPA, except for models whose
    attention softcaps its logits (Gemma 2), which SDPA cannot express. Scoring replaces it with
    the packed implementation (``ops.attention``) either way."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) is not None else "sdpa"


def load_causal_lm(
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load ``source`` in eval mode on ``device`` in ``dtype``."""
    try:
        if source.startswith(BUILTIN_PREFIX):
            model = build_builtin(source.removeprefix(BUILTIN_PREFIX))
        else:
            local = Path(source).expanduser()
            if local.exists() and not local.is_dir():
                raise ModelLoadError(f"{source!r} is a file; a checkpoint directory is expected")
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                source,
                config=config,
                dtype=dtype,
                attn_implementation=attention_implementation(config),
                trust_remote_code=trust_remote_code,
            )
    except ModelLoadError:
        raise
    except Exception as err:  # transformers raises OSError/ValueError/... with useful text
        raise ModelLoadError(f"could not load model from {source!r}: {err}") from err
    return model.to(device=device, dtype=dtype).eval()
