"""Scoring in this process, without gRPC, through the served path.

``OfflineScorer`` calls the very engine the server runs (``LogprobEngine``, built by the builder:
``builder.in_process``): the same checks, queue, scheduler loop and device worker; balanced
micro-batches under the token budget, two in flight, results in order. Tests and benchmarks use it, so what they
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

from logprob_service.builder import (
    CausalLMScorer,
    InProcessModel,
    LogprobOp,
    ScoringOptions,
    in_process_engine,
    serve_in_process,
)
from logprob_service.domain import ScoreJob, ScoreOptions, SequenceScores, TokenSequence
from logprob_service.engine import LogprobEngine
from logprob_service.settings.model import DEFAULT_MAX_BATCH_SEQUENCES, DEFAULT_MAX_BATCH_TOKENS
from logprob_service.stats import NO_STATS, StatsSink

T = TypeVar("T")


class OfflineScorer:
    """Scores sequences with one model, in this process; ``close()`` (or ``with``) ends its threads."""

    def __init__(
        self,
        model: InProcessModel,
        *,
        logprob_op: LogprobOp | None = None,
        options: ScoringOptions | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_batch_sequences: int = DEFAULT_MAX_BATCH_SEQUENCES,
        stats: StatsSink = NO_STATS,
    ) -> None:
        self.served = serve_in_process(model, logprob_op=logprob_op, options=options)
        # One event loop on a thread of its own, with one engine, for the scorer's life: a call
        # costs a hand-over to it, and works from any thread, a coroutine's included.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logprob-offline", daemon=True)
        self._thread.start()
        self.engine = self._run(self._start(max_batch_tokens, max_batch_sequences, stats))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, max_batch_tokens: int, max_batch_sequences: int, stats: StatsSink) -> LogprobEngine:
        engine = in_process_engine(
            self.served, max_batch_tokens=max_batch_tokens, max_batch_sequences=max_batch_sequences, stats=stats
        )
        engine.start()
        await engine.serving()
        return engine

    @property
    def scorer(self) -> CausalLMScorer:
        return self.served.scorer

    @property
    def max_batch_tokens(self) -> int:
        return self.engine.config.max_batch_tokens

    @property
    def max_batch_sequences(self) -> int:
        return self.engine.config.max_batch_sequences

    def score(
        self,
        sequences: Sequence[TokenSequence],
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
        top_k: int = 0,
    ) -> list[SequenceScores]:
        """Log-probs (and entropies) of every completion token, one ``SequenceScores`` per sequence, in
        order (with ``top_k``, and sequences' ``candidate_ids``, their top-k and candidates' log-probs
        too). Sequences are checked as the server checks a request (``InvalidArgument`` naming the
        sequence), without its per-request limits."""
        job = ScoreJob(
            request_id=f"offline-{uuid.uuid4()}",
            model=self.served.info.name,
            sequences=list(sequences),
            options=ScoreOptions(temperature=temperature, return_entropy=return_entropy, top_k=top_k),
        )
        return self._run(self.engine.score(job)).scores

    def close(self) -> None:
        self._run(self.engine.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> OfflineScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
