"""In-process models: what ``OfflineScorer`` serves, on the engine the server runs.

``serve_in_process`` makes a transformers model a served model (a ``CausalLMScorer`` over it,
named "offline"), and ``in_process_engine`` an engine serving that model alone on its device
(``engine.engine_on``), so that what tests and benchmarks check and time is the server's path
less the wire.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from logprob_service.builder.engine import engine_on
from logprob_service.engine import EngineConfig, LogprobEngine, ModelRegistry
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import ServedModel, serve_model
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.stats import StatsSink

# A transformers model (scored by a CausalLMScorer made for it), or a model served already.
InProcessModel = PreTrainedModel | ServedModel


def serve_in_process(
    model: InProcessModel, *, logprob_op: LogprobOp | None = None, options: ScoringOptions | None = None
) -> ServedModel:
    """``model`` as the engine serves it; ``logprob_op`` and ``options`` are its scorer's (the
    device's default op, the default options), for a transformers model only."""
    if isinstance(model, ServedModel):
        return model
    return serve_model("offline", "in-process", CausalLMScorer(model, logprob_op=logprob_op, options=options))


def in_process_engine(
    served: ServedModel, *, max_batch_tokens: int, max_batch_sequences: int, stats: StatsSink
) -> LogprobEngine:
    """An engine serving ``served`` alone, on its device."""
    registry = ModelRegistry()
    registry.add(served)
    # One caller: no queue limit, and nothing held back for more work (a call's whole job is
    # queued before the loop looks).
    config = EngineConfig(
        max_batch_tokens=max_batch_tokens,
        max_batch_sequences=max_batch_sequences,
        share_prompts=served.scorer.options.share_prompts,
    )
    return engine_on(registry, [served.device], config, stats=stats)
