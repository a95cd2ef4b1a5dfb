"""Scoring in this process, without gRPC, through the served path.

``OfflineScorer`` drives the very queue, scheduler loop and device worker the server runs
(``engine.batch_queue``, ``engine.scheduler``, ``worker.executor``): balanced micro-batches under
the token budget, two in flight, results in order. Tests and benchmarks use it, so what they
check and time is what the server does, less the wire.

    scorer = OfflineScorer(model)
    scores = scorer.score(sequences, temperature=0.9, return_entropy=True)   # list[SequenceScores]
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from transformers import PreTrainedModel

from logprob_service.config import DEFAULT_MAX_BATCH_SEQUENCES, DEFAULT_MAX_BATCH_TOKENS
from logprob_service.domain import ScoreJob, SequenceScores, TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.validation import RequestLimits, validate_job
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import ServedModel, serve_model
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.stats import NO_STATS, StatsSink
from logprob_service.worker.executor import DeviceExecutor

T = TypeVar("T")
UNLIMITED = 2**62


class OfflineScorer:
    """Scores sequences with one model, in this process; ``close()`` (or ``with``) ends its threads."""

    def __init__(
        self,
        model: PreTrainedModel | ServedModel,
        *,
        logprob_op: LogprobOp | None = None,
        options: ScoringOptions | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_batch_sequences: int = DEFAULT_MAX_BATCH_SEQUENCES,
        stats: StatsSink = NO_STATS,
    ) -> None:
        if isinstance(model, ServedModel):
            self.served = model
        else:
            scorer = CausalLMScorer(model, logprob_op=logprob_op, options=options)
            self.served = serve_model("offline", "in-process", scorer)
        self.registry = ModelRegistry()
        self.registry.add(self.served)
        self.executor = DeviceExecutor(stats, self.served.device)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences
        # One event loop on a thread of its own, with one scheduler, for the scorer's life: a call
        # costs a hand-over to it, and works from any thread, a coroutine's included.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logprob-offline", daemon=True)
        self._thread.start()
        self._scheduler = self._run(self._start(stats))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, stats: StatsSink) -> Scheduler:
        scheduler = Scheduler(
            self.registry,
            [self.executor],
            max_queued_tokens=UNLIMITED,  # one caller: nothing to share or to refuse
            max_queued_tokens_per_client=UNLIMITED,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_sequences=self.max_batch_sequences,
            max_wait_ms=0,  # a call's whole job is queued before the loop looks: nothing more will come
            share_prompts=self.served.scorer.options.share_prompts,
            stats=stats,
        )
        scheduler.start()
        return scheduler

    @property
    def scorer(self) -> CausalLMScorer:
        return self.served.scorer

    def score(
        self, sequences: Sequence[TokenSequence], *, temperature: float = 1.0, return_entropy: bool = False
    ) -> list[SequenceScores]:
        """Log-probs (and entropies) of every completion token, one ``SequenceScores`` per sequence, in
        order. Sequences are checked as the server checks a request (``InvalidArgument`` naming the
        sequence), without its per-request limits."""
        job = ScoreJob(
            request_id=f"offline-{uuid.uuid4()}",
            model=self.served.info.name,
            sequences=list(sequences),
            temperature=temperature,
            return_entropy=return_entropy,
        )
        validate_job(job, self.served.info, RequestLimits(UNLIMITED, UNLIMITED))
        return self._run(self._scheduler.submit(job)).scores

    def close(self) -> None:
        self._run(self._scheduler.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self.executor.shutdown()

    def __enter__(self) -> OfflineScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
