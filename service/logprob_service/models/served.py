"""A loaded model as served: its description, its scorer, its weights' digests; loading one."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from logprob_service.domain import ModelInfo
from logprob_service.errors import FailedPrecondition
from logprob_service.models.loading import ModelLoadError, load_causal_lm
from logprob_service.models.lora import AdapterHost
from logprob_service.models.quantized import Fp8Compute, dense_conversions, describe_weights, quantized_layers
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.tensor_parallel import TensorParallel, load_sharded_causal_lm
from logprob_service.models.weights import TensorDigest, UpdatableWeights, fingerprint, model_digests, tensor_digests
from logprob_service.ops.dispatch import LogprobOp

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ServedModel:
    """A model as served: its description, its scorer and its weights' digests.

    ``info`` (version, fingerprint) and the weights change only together, in a weight swap, which
    the scheduler runs between micro-batches. A LoRA model shares its base's scorer and
    ``adapters`` host, and scores with its ``adapter`` active.
    """

    info: ModelInfo
    scorer: CausalLMScorer
    digests: dict[str, TensorDigest] = field(repr=False)
    adapters: AdapterHost | None = None
    adapter: str | None = None

    @property
    def device(self) -> torch.device:
        return self.scorer.device

    def activate(self) -> None:
        """Make the shared model score as this one (device thread, before each launch)."""
        if self.adapters is not None:
            self.adapters.activate(self.adapter)

    def updatable(self) -> UpdatableWeights:
        """What an update of this model may replace: the state dict, or a LoRA model's adapter."""
        if self.scorer.tensor_parallel is not None:
            raise FailedPrecondition(
                f"model {self.info.name!r} is served tensor-parallel: its weights cannot be updated (only loaded)"
            )
        if self.adapter is not None:
            return UpdatableWeights(self.adapters.adapter_weights(self.adapter))  # type: ignore[union-attr]
        return UpdatableWeights(self.scorer.model.state_dict(), dense_conversions(self.scorer.model))

    def updated(self, version: int, digests: dict[str, TensorDigest]) -> None:
        """Record a swap: the new version, and the digests of the tensors it replaced (of the served
        weights: a quantized weight's dense name, which is no served tensor, is left out)."""
        self.digests = {**self.digests, **{name: d for name, d in digests.items() if name in self.digests}}
        self.info = dataclasses.replace(self.info, version=version, fingerprint=fingerprint(self.digests))


def context_length(config: PretrainedConfig) -> int | None:
    """The longest sequence the model is made for: ``max_position_embeddings``, or, with a RoPE
    scaling that stretches an original context by a factor (YaRN, linear, dynamic, LongRoPE), that
    product when it is longer. None when the config sets none."""
    base = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    candidates = [base or 0]
    for params in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
        factor = params.get("factor")
        if factor and params.get("rope_type", params.get("type")) in STRETCHING_ROPE:
            candidates.append(int(float(factor) * (params.get("original_max_position_embeddings") or base or 0)))
    return max(candidates) or None


STRETCHING_ROPE = frozenset({"yarn", "linear", "dynamic", "longrope"})


def serve_model(name: str, source: str, scorer: CausalLMScorer) -> ServedModel:
    """Describe a loaded model for the registry."""
    model = scorer.model
    config = model.config
    vocab = min(model.get_input_embeddings().weight.shape[0], scorer.vocab_size)
    max_positions = context_length(config)
    digests = model_digests(model)
    info = ModelInfo(
        name=name,
        source=source,
        architecture=(config.architectures or [type(model).__name__])[0],
        vocab_size=int(vocab),
        max_positions=int(max_positions) if max_positions else None,
        dtype=str(scorer.head_weight.dtype).removeprefix("torch."),
        device=str(scorer.device) + (f" (tensor parallel, {tp.world} ranks)" if (tp := scorer.tensor_parallel) else ""),
        version=0,
        fingerprint=fingerprint(digests),
        attention=scorer.attention_plan(),
        determinism=scorer.determinism(),
        num_experts=scorer.num_experts,
        weight_format=describe_weights(model, scorer.head_weight.dtype),
    )
    return ServedModel(info=info, scorer=scorer, digests=digests)


def serve_lora_model(name: str, base: ServedModel, adapter_dir: str) -> ServedModel:
    """A LoRA model on ``base``: its adapter is injected into the base's model (one copy of the base)."""
    if quantized_layers(base.scorer.model):
        raise ModelLoadError(
            f"LoRA model {name!r}: its base {base.info.name!r} is served quantized ({base.info.weight_format}); "
            "LoRA adapters are served on dense bases only"
        )
    if base.adapters is None:
        base.scorer.run_layers_eagerly("PEFT's adapter layers switch between micro-batches")
        base.adapters = AdapterHost(base.scorer.model, model_dtype=base.scorer.options.deterministic)
    base.adapters.add(name, adapter_dir)
    digests = {**base.digests, **tensor_digests(base.adapters.adapter_weights(name))}
    info = dataclasses.replace(
        base.info,
        name=name,
        source=f"{base.info.name}+{adapter_dir}",
        version=0,
        fingerprint=fingerprint(digests),
        base_model=base.info.name,
    )
    served = ServedModel(info=info, scorer=base.scorer, digests=digests, adapters=base.adapters, adapter=name)
    log.info("LoRA model %r ready on base %r: %s", name, base.info.name, info)
    return served


def load_served_model(
    name: str,
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    logprob_op: LogprobOp,
    options: ScoringOptions | None = None,
    trust_remote_code: bool = False,
    tensor_parallel: TensorParallel | None = None,
    fp8_compute: Fp8Compute = "weights-only",
) -> ServedModel:
    """``tensor_parallel``: this rank's shards of the model (every rank of the group loads it)."""
    log.info("loading model %r from %s on %s as %s", name, source, device, dtype)
    if tensor_parallel is None:
        model = load_causal_lm(
            source, device=device, dtype=dtype, trust_remote_code=trust_remote_code, fp8_compute=fp8_compute
        )
    else:
        model = load_sharded_causal_lm(
            source,
            tensor_parallel,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            fp8_compute=fp8_compute,
        )
    scorer = CausalLMScorer(model, logprob_op=logprob_op, options=options, tensor_parallel=tensor_parallel)
    served = serve_model(name, source, scorer)
    layers = "norms and MLPs compiled" if served.scorer.layers_compiled else "eager"
    log.info("model %r ready (lm_head: %s, layers: %s): %s", name, logprob_op.kernel, layers, served.info)
    return served
