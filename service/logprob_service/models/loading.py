"""Load a causal LM from a model SOURCE onto a device, in a dtype.

SOURCE is ``builtin:<name>`` (embedded, made locally), a local Hugging Face checkpoint
directory, or a hub id (downloaded by transformers; needs network or a warm HF cache). A
checkpoint's ``quantization_config`` is read before any weight: a quantized one is served in its
own precision (``models.quantized``) or refused, never cast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from huggingface_hub import constants as hub_constants
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from logprob_service.domain import DTYPE_BYTES
from logprob_service.models.builtin import BUILTIN_PREFIX, build_builtin
from logprob_service.models.checkpoint import ModelLoadError
from logprob_service.models.cuda_check import why_cuda_unusable
from logprob_service.models.quantized import Fp8Compute, load_quantized_causal_lm, weight_format
from logprob_service.models.routed_llama4 import llama4_blocks, route_llama4_experts

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}
# How long the hub may take to answer before a hub id is looked up in the local cache alone.
HUB_ANSWER_TIMEOUT_S = 10.0

# huggingface_hub gives its logger a stderr handler of its own and lets records propagate as well,
# so that beside the server's handler each of its warnings would print twice: the server's alone prints them.
logging.getLogger("huggingface_hub").handlers.clear()
log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU (with a warning saying why)."""
    if device == "auto":
        return _gpus_or_cpu(1)[0]
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA cannot start here: {why_cuda_unusable()}")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _gpus_or_cpu(count: int | None = None) -> list[torch.device]:
    """``auto``: the first ``count`` GPUs (None: every visible one), or the CPU where CUDA cannot
    start, with a WARNING naming the reason (``--device cuda``, the image's setting, fails instead)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible:
        return [torch.device("cuda", i) for i in range(visible if count is None else min(count, visible))]
    log.warning(
        "device auto: serving on the CPU at float32, no GPU: %s (--device cpu says so and silences this; "
        "--device cuda fails instead)",
        why_cuda_unusable(),
    )
    return [torch.device("cpu")]


def resolve_devices(devices: str, tensor_parallel: int = 1) -> list[torch.device]:
    """The devices a server holds a replica of each model on (data parallel): ``auto`` is every
    visible GPU (the CPU where there is none, with a warning); ``cuda`` is every visible GPU too,
    refused where CUDA cannot start, saying why; else a comma-separated list (``cuda:0,cuda:1``),
    each as ``resolve_device``. A GPU named twice is refused; the CPU may be (tests, a CPU host).

    With ``tensor_parallel`` N > 1, the N devices of the group, rank by rank: ``auto`` and
    ``cuda`` are the first N GPUs, ``cpu`` is the CPU N times (gloo: tests), a list must name N devices."""
    if devices == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device 'cuda' asked for, but CUDA cannot start here: {why_cuda_unusable()}")
    if devices == "auto" and tensor_parallel > 1 and _gpus_or_cpu(1)[0].type == "cpu":
        devices = "cpu"
    if tensor_parallel > 1:
        if devices == "cpu":
            return [torch.device("cpu")] * tensor_parallel
        if devices in ("auto", "cuda"):
            found = torch.cuda.device_count()
            if found < tensor_parallel:
                raise ModelLoadError(f"tensor_parallel {tensor_parallel} needs {tensor_parallel} GPUs; {found} visible")
            return [torch.device("cuda", i) for i in range(tensor_parallel)]
    if devices == "auto":
        return _gpus_or_cpu()
    if devices == "cuda":
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
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
    attention softcaps its logits (Gemma 2), which SDPA cannot express, and models whose class
    transformers does not let run SDPA (gpt-oss: its attention sinks; asking for it raises).
    Scoring replaces it with the packed implementation (``ops.attention``) either way."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # a config transformers does not map (remote code): its own class decides later
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


# How a mixture-of-experts model's experts run (transformers' ``experts_implementation``), by
# device type. CUDA: torch's grouped GEMM (transformers' "grouped_mm": the packed row's
# (token, expert) pairs sorted by expert, then one CUTLASS grouped-GEMM launch per projection over
# all experts, each expert's rows only: no per-expert Python loop, no padding to a capacity), for
# bfloat16 weights, the dtype torch documents it for on CUDA. CPU, and other dtypes: the model's
# own per-expert loop ("eager"), the exact reference: torch's CPU grouped_mm takes no float64 and
# wants 16-byte-aligned strides, which small test shapes lack.
EXPERTS_IMPLEMENTATIONS: dict[str, str] = {"cuda": "grouped_mm", "cpu": "eager"}
GROUPED_MM_DTYPES = frozenset({torch.bfloat16})


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The model's expert banks: modules whose forward transformers dispatches by
    ``experts_implementation`` (its ``use_experts_implementation`` decorator gives them these
    attributes, in every 5.x release that has it: 5.17 lacks the ``_is_expert_parallel`` that 5.24
    adds). None for a dense model."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated")]


def use_experts_implementation(model: PreTrainedModel, device: torch.device) -> str | None:
    """Run ``model``'s experts as ``EXPERTS_IMPLEMENTATIONS`` says for ``device`` and their dtype;
    returns the choice, or None for a model without experts. Llama 4's blocks, whose experts are
    not of transformers' kind, run on their routed rows the same way (``routed_llama4``)."""
    blocks = llama4_blocks(model)
    experts = [block.experts for block in blocks] or expert_modules(model)
    if not experts:
        return None
    choice = EXPERTS_IMPLEMENTATIONS.get(device.type, "eager")
    # The dtype the bank computes in: its floating weights' (a quantized bank's biases).
    if next(p.dtype for p in experts[0].parameters() if p.is_floating_point()) not in GROUPED_MM_DTYPES:
        choice = "eager"
    if blocks:
        route_llama4_experts(blocks, grouped=choice == "grouped_mm")
        return f"{choice} (routed rows)"
    model.set_experts_implementation(choice)
    return choice


def load_causal_lm(
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    fp8_compute: Fp8Compute = "weights-only",
) -> PreTrainedModel:
    """Load ``source`` in eval mode on ``device`` in ``dtype`` (a quantized checkpoint's quantized
    layers in their own precision, computing as ``fp8_compute`` says)."""
    try:
        if source.startswith(BUILTIN_PREFIX):
            model = build_builtin(source.removeprefix(BUILTIN_PREFIX))
        else:
            local = Path(source).expanduser()
            if local.exists() and not local.is_dir():
                raise ModelLoadError(f"{source!r} is a file; a checkpoint directory is expected")
            hub = {} if local.is_dir() else _hub_access(source)
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **hub)
            fmt = weight_format(config, f"{source}/config.json", fp8_compute)
            if fmt is not None:
                directory = local if local.is_dir() else Path(huggingface_hub.snapshot_download(source, **hub))
                model = load_quantized_causal_lm(
                    directory,
                    config,
                    fmt,
                    device=device,
                    dtype=dtype,
                    attn_implementation=attention_implementation(config),
                )
                use_experts_implementation(model, device)
                return model
            model = AutoModelForCausalLM.from_pretrained(
                source,
                config=config,
                dtype=dtype,
                attn_implementation=attention_implementation(config),
                trust_remote_code=trust_remote_code,
                # Its look for a PEFT adapter in the repository takes only these (transformers 5).
                adapter_kwargs=dict(hub),
                **hub,
            )
    except ModelLoadError:
        raise
    except Exception as err:  # transformers raises OSError/ValueError/... with useful text
        raise ModelLoadError(f"could not load model from {source!r}: {err}") from err
    model = to_serving_dtype(model.to(device=device), dtype).eval()
    use_experts_implementation(model, device)  # transformers' default, grouped_mm, fails on the CPU in float64
    return model


def to_serving_dtype(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """``model``'s floating parameters in ``dtype``; its buffers as the model made them. A plain
    ``model.to(dtype)`` also casts the rotary embeddings' float32 ``inv_freq``: in bfloat16 each
    frequency is off by up to 2^-9, and the angle (position x frequency) by radians past a
    thousand positions (seen: log-probs off by 0.96 against an fp32 forward at position 1,658 of
    a Qwen2.5-1.5B shape, where transformers' own bf16 model was off by 0.10)."""
    buffers = {name: buffer for name, buffer in model.named_buffers() if buffer.is_floating_point()}
    model = model.to(dtype=dtype)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buffer)
    return model


def _hub_access(source: str) -> dict[str, Any]:
    """How transformers may fetch hub id ``source``: from the hub as usual when it answers, else
    from the local cache alone (``local_files_only``), and ModelLoadError at once when the cache
    lacks it. Offline, transformers retried each file for about 30 s before looking there."""
    if huggingface_hub.is_offline_mode():
        unreachable = "HF_HUB_OFFLINE is set"
    else:
        try:
            huggingface_hub.get_session().head(hub_constants.ENDPOINT, timeout=HUB_ANSWER_TIMEOUT_S)
            return {}
        except Exception as err:  # no answer at all: DNS, refused, timed out, a proxy's error
            unreachable = f"no answer from {hub_constants.ENDPOINT}: {type(err).__name__}: {err}"
    try:
        cached = huggingface_hub.try_to_load_from_cache(source, "config.json")
    except ValueError as err:  # HFValidationError: not a name the hub could have
        raise ModelLoadError(f"{source!r} is neither a local directory nor a hub id: {err}") from None
    if not isinstance(cached, str):
        raise ModelLoadError(
            f"{source!r} is not a local directory, and as a hub id it is neither in the local cache "
            f"({hub_constants.HF_HUB_CACHE}) nor can it be downloaded ({unreachable})"
        )
    return {"local_files_only": True}
