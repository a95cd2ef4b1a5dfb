"""The models a server holds, by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import metrics
from ..errors import ModelNotFound
from ..ops.dispatch import LogprobOp
from .loading import load_causal_lm
from .scorer import CausalLMScorer, weights_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    architecture: str
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_positions: int | None  # longest prompt + completion; None when the config sets none
    dtype: str
    device: str
    version: int
    fingerprint: str


@dataclass(frozen=True)
class ServedModel:
    info: ModelInfo
    scorer: CausalLMScorer


def serve_model(name: str, source: str, scorer: CausalLMScorer, version: int = 0) -> ServedModel:
    """Describe a loaded model for the registry."""
    model = scorer.model
    config = model.config
    vocab = min(model.get_input_embeddings().weight.shape[0], scorer.head_weight.shape[0])
    max_positions = getattr(config, "max_position_embeddings", None)
    info = ModelInfo(
        name=name,
        source=source,
        architecture=(config.architectures or [type(model).__name__])[0],
        vocab_size=int(vocab),
        max_positions=int(max_positions) if max_positions else None,
        dtype=str(scorer.head_weight.dtype).removeprefix("torch."),
        device=str(scorer.device),
        version=version,
        fingerprint=weights_fingerprint(model),
    )
    return ServedModel(info=info, scorer=scorer)


def load_served_model(
    name: str,
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    logprob_op: LogprobOp,
    max_batch_tokens: int,
    max_batch_sequences: int,
    trust_remote_code: bool = False,
) -> ServedModel:
    log.info("loading model %r from %s on %s as %s", name, source, device, dtype)
    model = load_causal_lm(source, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    scorer = CausalLMScorer(
        model,
        logprob_op=logprob_op,
        max_batch_tokens=max_batch_tokens,
        max_batch_sequences=max_batch_sequences,
    )
    served = serve_model(name, source, scorer)
    log.info("model %r ready (lm_head: %s): %s", name, logprob_op.kernel, served.info)
    return served


class ModelRegistry:
    """Name -> served model. Filled before the server reports SERVING; read by the RPC layer."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def add(self, served: ServedModel) -> None:
        self._models[served.info.name] = served
        metrics.observe_model(served.info)

    def get(self, name: str) -> ServedModel:
        try:
            return self._models[name]
        except KeyError:
            served = ", ".join(sorted(self._models)) or "none"
            raise ModelNotFound(f"model: {name!r} is not served here; served models: {served}") from None

    def __iter__(self):
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)
