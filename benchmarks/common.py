"""Helpers shared by the benchmark scripts (bench_logprobs.py, bench_batching.py).

The scripts run as ``PYTHONPATH=service:client python3 benchmarks/bench_X.py``, so this folder is
``sys.path[0]`` and ``from common import ...`` finds this module (benchmarks/ is not a package).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import shlex
import sys
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from logprob_service.api.server import Service, create_server
from logprob_service.config import Settings
from logprob_service.engine.registry import ModelRegistry
from logprob_service.worker import gpu_memory
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 decoder's shape; ``name`` labels it in reports."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    """A Qwen2ForCausalLM of ``shape`` with seeded random weights, in eval mode, SDPA attention."""
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.02,  # weights ~ normal(0, 0.02), as transformers initializes them
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model = model.to(dtype).eval().requires_grad_(False)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "embeddings must be tied"
    assert getattr(model.get_output_embeddings(), "bias", None) is None, "the fp64 reference assumes no lm_head bias"
    return model


# ----------------------------------------------------------------------------- TRL's log-probs


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` (huggingface/trl, trl/trainer/utils.py), reproduced as is.

    logits: [B, C, V]; index: [B, C] -> [B, C] in the logits' dtype. For bf16/fp16 logits TRL
    loops over rows and takes ``log_softmax`` in the logits' own dtype (its comment: the
    logsumexp approach is unstable in bf16), so the log-probs are rounded to bf16.
    """
    if logits.dtype in (torch.float32, torch.float64):
        selected_logits = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])  # loop: lower peak memory
        return selected_logits - logsumexp_values
    per_token_logps = []
    for row_logits, row_labels in zip(logits, index, strict=True):  # loop to reduce peak memory
        row_logps = F.log_softmax(row_logits, dim=-1)  # [C, V] in bf16
        per_token_logps.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(per_token_logps)


# ----------------------------------------------------------------------------- the service on loopback


class LoopbackServer:
    """The real grpc.aio server of this service, on an asyncio loop in a background thread.

    The model and the device are shared with the rest of this process, so the device's memory
    statistics cover the server's work too. ``with LoopbackServer(...) as target: ...``
    """

    def __init__(self, settings: Settings, registry: ModelRegistry) -> None:
        self._settings = settings
        self._registry = registry
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-grpc-loop", daemon=True)
        self._service: Service | None = None
        self._server: Any = None

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self) -> int:
        self._service = Service.create(self._settings, self._registry)
        self._server, port = await create_server(self._service, f"{self._settings.host}:0")
        await self._service.warm_up()  # health SERVING only after a real scoring pass
        return port

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
        if self._service is not None:
            await self._service.close()

    def __enter__(self) -> str:
        self._thread.start()
        port = self._call(self._start())
        return f"{self._settings.host}:{port}"

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


# ----------------------------------------------------------------------------- device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Synchronize, then return the caching allocator's free blocks to the device (CUDA only)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    """Start a peak-memory measurement (CUDA only). Through ``gpu_memory``, not torch directly: a
    server in this process resets torch's peak counter at every micro-batch to measure each one."""
    if device.type == "cuda":
        gpu_memory.reset_peak(device)


def peak_allocated(device: torch.device) -> int:
    """Highest bytes allocated on ``device`` since ``reset_peak``, across the server's own resets."""
    return gpu_memory.peak_allocated(device)


def run_environment(device: torch.device) -> list[str]:
    """Report lines: the device, the library versions, the date (UTC) and the command that ran."""
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    command = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} {Path(sys.executable).name} {shlex.join(sys.argv)}"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return [
        f"device: {device_name}",
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
        f"date: {now}",
        f"command: {command}",
    ]


def publish(report: str, name: str) -> None:
    """Print ``report`` (the run's last output) and, when ``OUT`` is set, write it to ``$OUT/name``."""
    print(report)
    if out_dir := os.environ.get("OUT"):
        path = Path(out_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report)
        print(f"written: {path}", file=sys.stderr)
