"""What the benchmark scripts share besides timing (``harness.py``): model shapes, TRL's baseline
log-probs, and the real server on loopback.

The scripts run as ``PYTHONPATH=service:client python3 benchmarks/bench_X.py``, so this folder is
``sys.path[0]`` and ``from common import ...`` finds this module (benchmarks/ is not a package).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from logprob_service import host_malloc
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.loading import to_serving_dtype
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.settings.model import Settings
from logprob_service.startup import Service
from logprob_service.worker.tensor_parallel import Build
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
    tied: bool = True  # the lm_head is the input embedding (Qwen2.5 up to 3B)


# The shapes the benchmarks run: Qwen2.5's (random weights: speed and memory depend on shapes only).
SHAPES = {
    "0.5b": ModelShape("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, 32768),
    "1.5b": ModelShape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, 131072),
    "7b": ModelShape("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, 1 << 21),
    "14b": ModelShape("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, 131072, tied=False),
    "72b": ModelShape("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 152064, 131072, tied=False),
}
TINY = ModelShape("tiny Qwen2", 64, 128, 2, 4, 2, 1000, 256)


def shape_config(shape: ModelShape) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=shape.tied,
        initializer_range=0.02,  # weights ~ normal(0, 0.02), as transformers initializes them
    )


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    """A Qwen2ForCausalLM of ``shape`` with seeded random weights, in eval mode, SDPA attention."""
    config = shape_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model = to_serving_dtype(model, dtype).eval().requires_grad_(False)  # RoPE frequencies in fp32
    assert shape.tied == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    assert getattr(model.get_output_embeddings(), "bias", None) is None, "the fp64 reference assumes no lm_head bias"
    return model


class RandomWeights:
    """Seeded random weights of a ``shape`` model by name, each made whole on ``device`` from a
    generator seeded by its name (``models.tensor_parallel.TensorSource``): a tensor-parallel rank
    takes its slice, a single-GPU model all of it, and both hold the same values. Norm scales
    are 1, biases 0, matrices ~ N(0, 0.02) (transformers' initialization)."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        with torch.device("meta"):
            skeleton = Qwen2ForCausalLM(shape_config(shape))
        self._shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        self._device, self._dtype, self._seed = device, dtype, seed

    def names(self) -> set[str]:
        return set(self._shapes)

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        shape = self._shapes[name]
        if len(shape) == 1:
            fill = 1.0 if name.endswith("norm.weight") else 0.0
            whole = torch.full(shape, fill, device=self._device, dtype=self._dtype)
        else:
            generator = torch.Generator(self._device).manual_seed(self._seed * 1_000_003 + stable_hash(name))
            whole = torch.randn(shape, generator=generator, device=self._device, dtype=self._dtype).mul_(0.02)
        return whole if dim is None else whole.narrow(dim, start, stop - start)

    @torch.no_grad()
    def fill_(self, model: PreTrainedModel) -> PreTrainedModel:
        """Set every parameter of a whole (unsharded) ``shape`` model."""
        for name, param in model.named_parameters():
            param.copy_(self.read(name, None, 0, 0))
        return model


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


# ----------------------------------------------------------------------------- TRL's log-probs


def add_scoring_arguments(parser: argparse.ArgumentParser) -> None:
    """The service's body settings a benchmark can change (the server settings of the same names)."""
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cudnn", "flash", "exact"])
    parser.add_argument(
        "--compile-layers", default="auto", choices=["auto", "on", "off"], help="torch.compile norms and MLPs"
    )


def scoring_options(args: argparse.Namespace, **settings: Any) -> ScoringOptions:
    return ScoringOptions(attention_backend=args.attention_backend, compile_layers=args.compile_layers, **settings)


def layers_label(scorer: CausalLMScorer) -> str:
    """How a scorer's decoder layers run, as the reports say it."""
    return "norms + MLPs compiled" if scorer.layers_compiled else "layers eager"


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
    statistics cover the server's work too, and this process takes the server's process-wide
    allocator setting (``host_malloc``) as ``serve`` would. ``with LoopbackServer(...) as target: ...``
    """

    def __init__(self, settings: Settings, registry: ModelRegistry, build: Build | None = None) -> None:
        """``build``: with ``settings.tensor_parallel`` > 1, what loads each rank's models (the
        registry starts empty: the server fills it)."""
        self._settings = settings
        self._registry = registry
        self._build = build
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-grpc-loop", daemon=True)
        self._service: Service | None = None
        self._server: Any = None

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self) -> int:
        host_malloc.apply(self._settings.keep_freed_host_memory)
        self._service = Service.create(self._settings, self._registry, self._build)
        if self._build is not None:
            await self._service.load_models()
        self._server, port = await self._service.start_grpc(f"{self._settings.host}:0")
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
