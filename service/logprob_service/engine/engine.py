"""The engine facade: the one way into scoring and weight updates for every edge.

Every edge (the gRPC servicer, the weight receivers, the HTTP routes and ``OfflineScorer``) turns
its input into domain objects and calls a ``LogprobEngine``: ``score(job)`` checks the job against
its model and the limits and queues it, ``list_models()`` describes what is served, the
weight-update calls check and stage tensors and swap them in. None of them builds a scheduler or
an updater, validates a job or loads a model itself.

The engine owns the registry, the scheduler (one lane per device executor) and the weight
updater, and the serving phase (starting -> serving -> draining), which edges mirror (the gRPC
health service) and which every call checks first. It imports no torch: the builder
(``logprob_service.builder``) loads the models and makes the device workers, and hands them in.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from logprob_service.domain import (
    GroupSpec,
    ModelInfo,
    ScoreJob,
    ScoreResult,
    SharedTensor,
    TensorSpec,
    TokenSequence,
    UpdateChecked,
    UpdateHeader,
    UpdateMessage,
    UpdateOutcome,
)
from logprob_service.engine.interfaces import Executor, JoinGroup, Staging, WeightGroup
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.validation import UNLIMITED, RequestCounts, RequestLimits, check_counts, validate_job
from logprob_service.engine.weights.updater import WeightUpdater
from logprob_service.errors import Unavailable
from logprob_service.settings.model import DEFAULT_MAX_BATCH_SEQUENCES, DEFAULT_MAX_BATCH_TOKENS, Settings
from logprob_service.settings.weight_updates import DEFAULT_MAX_GROUP_TIMEOUT_S, DEFAULT_UPDATE_IDLE_TIMEOUT_S
from logprob_service.stats import NO_STATS, MemorySnapshot, StatsSink

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting: models are loading and warming up"
    SERVING = "serving"
    DRAINING = "draining: the server is shutting down"


@dataclass(frozen=True)
class EngineConfig:
    """What the engine takes of the settings: the request limits, the queue and batching, updates.

    ``from_settings`` for a server; the defaults are ``OfflineScorer``'s (one caller: no queue
    limit, nothing held back waiting for more work)."""

    max_sequences_per_request: int = UNLIMITED
    max_tokens_per_request: int = UNLIMITED
    max_answer_bytes: int = UNLIMITED
    max_queued_tokens: int = UNLIMITED
    max_queued_tokens_per_client: int = UNLIMITED
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_batch_sequences: int = DEFAULT_MAX_BATCH_SEQUENCES
    max_wait_ms: float = 0.0  # a call's whole job is queued before the loop looks
    max_wait_quiet_ms: float | None = None
    max_version_wait_s: float = 300.0
    share_prompts: bool = False
    update_yield_to_launches: bool = False
    update_idle_timeout_s: float = DEFAULT_UPDATE_IDLE_TIMEOUT_S
    max_group_timeout_s: float = DEFAULT_MAX_GROUP_TIMEOUT_S
    load_weights_roots: tuple[Path, ...] = ()  # empty: LoadWeights reads any regular file it checked

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_sequences_per_request=self.max_sequences_per_request,
            max_tokens_per_request=self.max_tokens_per_request,
            max_answer_bytes=self.max_answer_bytes,
            max_queued_tokens=self.max_queued_tokens,
            max_queued_tokens_per_client=self.max_queued_tokens_per_client,
        )


PhaseListener = Callable[[Phase], Awaitable[None]]


class LogprobEngine:
    """Scoring and weight updates of the models in ``registry``, on ``lanes`` (one device worker
    each, holding a replica of every model). Owned by one event loop; ``close()`` ends its threads
    and the lanes'."""

    def __init__(
        self,
        registry: ModelRegistry,
        lanes: Sequence[Executor],
        config: EngineConfig,
        *,
        staging: Staging,
        join_group: JoinGroup | None = None,
        stats: StatsSink = NO_STATS,
        device_memory: Callable[[], dict[str, MemorySnapshot]] = dict,
    ) -> None:
        """``device_memory``: the memory of the lanes' GPUs by device name, read when asked (the
        metrics' scrape: the engine is the ``stats.ServerView`` they track)."""
        self.registry = registry
        self._device_memory = device_memory
        self.config = config
        self.limits = config.limits
        self.lanes = list(lanes)  # one device worker each
        self.scheduler = Scheduler(
            registry,
            self.lanes,
            max_queued_tokens=config.max_queued_tokens,
            max_queued_tokens_per_client=config.max_queued_tokens_per_client,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_sequences=config.max_batch_sequences,
            max_wait_ms=config.max_wait_ms,
            max_wait_quiet_ms=config.max_wait_quiet_ms,
            max_version_wait_s=config.max_version_wait_s,
            share_prompts=config.share_prompts,
            stats=stats,
        )
        self.updater = WeightUpdater(
            registry,
            self.scheduler,
            staging,
            join_group=join_group,
            yield_to_launches=config.update_yield_to_launches,
            load_roots=config.load_weights_roots,
            idle_timeout_s=config.update_idle_timeout_s,
            max_group_timeout_s=config.max_group_timeout_s,
            stats=stats,
        )
        self.phase = Phase.STARTING
        self._listeners: list[PhaseListener] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler's loop (in the running event loop)."""
        self.scheduler.start()

    def on_phase(self, listener: PhaseListener) -> None:
        """Call ``listener`` with every phase the engine enters from now on (the edges' health)."""
        self._listeners.append(listener)

    async def _enter(self, phase: Phase) -> None:
        self.phase = phase
        for listener in self._listeners:
            await listener(phase)

    def check_accepting(self) -> None:
        """Raise ``Unavailable`` unless the engine is serving (edges call it before any work)."""
        if self.phase is not Phase.SERVING:
            raise Unavailable(f"server is {self.phase.value}; retry on another replica or later")

    async def warm_up(self) -> None:
        """Score one short random sequence with every model through the real path (``RuntimeError``
        for non-finite log-probs); the caller then calls ``serving``."""
        rng = np.random.default_rng()
        for served in self.registry:
            vocab = served.info.vocab_size
            job = ScoreJob(
                request_id=f"warm-up-{served.info.name}",
                model=served.info.name,
                sequences=[TokenSequence(rng.integers(0, vocab, 8), rng.integers(0, vocab, 8))],
            )
            result = await self.scheduler.submit(job)
            if not np.isfinite(result.scores[0].logprobs).all():
                raise RuntimeError(f"warm-up of model {served.info.name!r} produced non-finite log-probs")
            log.info("model %r warmed up in %.1f ms", served.info.name, result.timings.total_ns / 1e6)

    async def serving(self) -> None:
        await self._enter(Phase.SERVING)

    async def draining(self) -> None:
        """Refuse new work from now on; what was admitted finishes, but joins of trainers' groups
        in progress are abandoned (a trainer that does not answer would hold the drain)."""
        self.updater.abandon_joins()
        await self._enter(Phase.DRAINING)

    async def close(self) -> None:
        """End the scheduler (queued work fails), the updater's threads and the lanes."""
        await self.scheduler.close()
        self.updater.close()
        for lane in self.lanes:
            lane.shutdown()

    # -- scoring -------------------------------------------------------------------------------

    def check_counts(self, counts: RequestCounts, limits: RequestLimits | None = None, *, client: str) -> None:
        """Refuse a request by its counts before an edge builds any of it: ``InvalidArgument`` naming
        the limit it passes (``limits``: an edge's own, tighter ones; default: the engine's), or
        ``Overloaded`` as admission refuses it when its tokens would pass the queue's budget or
        ``client``'s fair share as the queue holds now. Advisory for the queue: what passes here
        is admitted, or not, by its planned cost when it is scored."""
        check_counts(counts, limits or self.limits)
        tokens = counts.tokens
        self.scheduler.admission.check_room(client, tokens, lambda: f"{tokens} tokens (counted before it was read)")

    async def score(self, job: ScoreJob) -> ScoreResult:
        """``job``'s log-probs: checked against its model and the limits (``InvalidArgument`` naming
        the field), admitted (``Overloaded``), batched and scored."""
        self.check_accepting()
        return await self.scheduler.submit(validate_job(job, self.registry.get(job.model).info, self.limits))

    async def list_models(self) -> list[ModelInfo]:
        """The served models, once every weight update whose commit came before has gone live or
        failed: a caller whose push was cancelled or timed out after its commit learns its fate here."""
        await self.updater.settled()
        return self.models()

    # What the metrics read at scrape time (``stats.ServerView``): the models as they are now.
    def models(self) -> list[ModelInfo]:
        """Each model's info, its ``device`` naming every replica's (``cuda:0,cuda:1``)."""
        infos = []
        for served in self.registry:
            devices = ",".join(r.info.device for r in self.registry.replicas(served.info.name))
            infos.append(served.info if devices == served.info.device else replace(served.info, device=devices))
        return infos

    def device_memory(self) -> dict[str, MemorySnapshot]:
        return self._device_memory()

    # -- weight updates ------------------------------------------------------------------------

    async def update(self, messages: AsyncIterator[UpdateMessage]) -> UpdateOutcome:
        """An UpdateWeights stream: header, tensor pieces, commit."""
        self.check_accepting()
        return await self.updater.update(messages)

    async def load(self, header: UpdateHeader, path: str) -> UpdateOutcome:
        """LoadWeights: the safetensors files at ``path`` on this host."""
        self.check_accepting()
        return await self.updater.load(header, path)

    async def update_from_ipc(self, header: UpdateHeader, boot_id: str, tensors: list[SharedTensor]) -> UpdateOutcome:
        self.check_accepting()
        return await self.updater.update_from_ipc(header, boot_id, tensors)

    async def join_group(self, spec: GroupSpec) -> WeightGroup:
        self.check_accepting()
        return await self.updater.join_group(spec)

    async def leave_group(self, name: str) -> None:
        await self.updater.leave_group(name)

    def update_from_group(
        self, header: UpdateHeader, group_name: str, tensors: list[TensorSpec]
    ) -> AsyncIterator[UpdateChecked | UpdateOutcome]:
        self.check_accepting()
        return self.updater.update_from_group(header, group_name, tensors)
