"""Scoring in this process, without gRPC, through the served path.

``OfflineScorer`` drives the very queue, scheduler loop and device worker the server runs
(``engine.batch_queue``, ``engine.scheduler``, ``worker.executor``): balanced micro-batches under
the token budget, two in flight, results in order. Tests and benchmarks use it, so what they
check and time is what the server does, less the wire.

    scorer = OfflineScorer(model, max_batch_tokens=32768)
    scores = scorer.score(sequences, temperature=0.9, return_entropy=True)   # list[SequenceScores]
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from transformers import PreTrainedModel

from logprob_service.domain import ScoreJob, SequenceScores, TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import ServedModel, serve_model
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.stats import NO_STATS, StatsSink
from logprob_service.worker.executor import DeviceExecutor


class OfflineScorer:
    """Scores sequences with one model, in this process; ``close()`` (or ``with``) ends its threads."""

    def __init__(
        self,
        model: PreTrainedModel | ServedModel,
        *,
        logprob_op: LogprobOp | None = None,
        options: ScoringOptions | None = None,
        max_batch_tokens: int = 32768,
        max_batch_sequences: int = 256,
        stats: StatsSink = NO_STATS,
    ) -> None:
        if isinstance(model, ServedModel):
            self.served = model
        else:
            scorer = CausalLMScorer(model, logprob_op=logprob_op, options=options)
            self.served = serve_model("offline", "in-process", scorer)
        self.registry = ModelRegistry()
        self.registry.add(self.served)
        self.executor = DeviceExecutor(stats)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences
        self._stats = stats

    @property
    def scorer(self) -> CausalLMScorer:
        return self.served.scorer

    def score(
        self, sequences: Sequence[TokenSequence], *, temperature: float = 1.0, return_entropy: bool = False
    ) -> list[SequenceScores]:
        """Log-probs (and entropies) of every completion token, one ``SequenceScores`` per sequence, in order."""
        job = ScoreJob(
            request_id=f"offline-{uuid.uuid4()}",
            model=self.served.info.name,
            sequences=list(sequences),
            temperature=temperature,
            return_entropy=return_entropy,
        )
        return asyncio.run(self._score(job))

    async def _score(self, job: ScoreJob) -> list[SequenceScores]:
        # A scheduler per call: its asyncio primitives belong to this call's event loop.
        scheduler = Scheduler(
            self.registry,
            self.executor,
            max_queued_tokens=max(job.num_tokens, 1),
            max_queued_tokens_per_client=max(job.num_tokens, 1),
            max_batch_tokens=self.max_batch_tokens,
            max_batch_sequences=self.max_batch_sequences,
            max_wait_ms=0,  # the whole job is queued before the loop looks: nothing more will come
            stats=self._stats,
        )
        scheduler.start()
        try:
            return (await scheduler.submit(job)).scores
        finally:
            await scheduler.close()

    def close(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> OfflineScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
