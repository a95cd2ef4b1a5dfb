"""The engine facade (``engine.engine.LogprobEngine``), the one way in for every edge, with fake
devices: it refuses work unless serving, checks a job before it queues it (and resolves its
temperature), describes its models, tells its phase to listeners, and ends its lanes on close."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from logprob_service.domain import ModelInfo, ScoreJob, ScoreOptions, SequenceScores, TokenSequence, UpdateHeader
from logprob_service.engine.engine import EngineConfig, LogprobEngine, Phase
from logprob_service.engine.registry import ModelRegistry
from logprob_service.errors import InvalidArgument, ModelNotFound, Unavailable


@dataclass
class Served:
    info: ModelInfo
    device: str = "fake"

    def updatable(self):  # only weight updates ask, and these tests make none
        raise NotImplementedError


@dataclass
class LaunchGroup:
    indices: list[int]
    launched: list[SequenceScores]
    error: Exception | None = None


@dataclass
class FakeLane:
    """Scores every completion token log p = -temperature (what the engine passed down shows)."""

    launched: list[tuple[int, float]] = field(default_factory=list)  # (sequences, temperature)
    shut: bool = False

    async def launch(self, served, sequences, options):
        self.launched.append((len(sequences), options.temperature))
        scores = [SequenceScores(np.full(len(s.completion_ids), -options.temperature, np.float32)) for s in sequences]
        return [LaunchGroup(list(range(len(sequences))), scores)]

    async def fetch(self, launched):
        return launched

    async def run(self, fn):
        return fn()

    def shutdown(self) -> None:
        self.shut = True


class Staging:  # the updater's, never reached here
    pass


def engine_of(lane: FakeLane, **config) -> LogprobEngine:
    registry = ModelRegistry()
    registry.add(Served(ModelInfo("m", "fake", "fake", 50, 16, "float32", "fake", 0, "fp")))
    return LogprobEngine(registry, [lane], EngineConfig(**config), staging=Staging())


def job(rng: np.random.Generator, *, model: str = "m", temperature: float = 0.0, completion_ids=None) -> ScoreJob:
    completion = rng.integers(0, 50, 3) if completion_ids is None else np.asarray(completion_ids)
    sequences = [TokenSequence(rng.integers(0, 50, 4), completion)]
    return ScoreJob("r", model, sequences, ScoreOptions(temperature=temperature))


async def serving(lane: FakeLane, **config) -> LogprobEngine:
    engine = engine_of(lane, **config)
    engine.start()
    await engine.serving()
    return engine


async def test_work_is_refused_unless_serving(rng):
    engine = engine_of(FakeLane())
    engine.start()
    with pytest.raises(Unavailable, match="starting"):
        await engine.score(job(rng))
    with pytest.raises(Unavailable, match="starting"):
        await engine.load(UpdateHeader("m", 0, False), "/nowhere")
    await engine.serving()
    assert (await engine.score(job(rng))).scores[0].logprobs.tolist() == [-1.0] * 3
    await engine.draining()
    with pytest.raises(Unavailable, match="draining"):
        await engine.score(job(rng))
    await engine.close()


async def test_a_job_is_checked_before_it_is_queued_and_its_temperature_resolved(rng):
    lane = FakeLane()
    engine = await serving(lane, max_sequences_per_request=4)
    with pytest.raises(InvalidArgument, match=r"sequences\[0\]\.completion_ids\[1\]: token id 50 is outside \[0, 50\)"):
        await engine.score(job(rng, completion_ids=[3, 50]))
    with pytest.raises(InvalidArgument, match="temperature"):
        await engine.score(job(rng, temperature=-1.0))
    with pytest.raises(ModelNotFound, match="'other'"):
        await engine.score(job(rng, model="other"))
    assert lane.launched == []  # nothing refused reached a device
    await engine.score(job(rng))  # temperature 0: unset, the default 1.0
    await engine.score(job(rng, temperature=0.5))
    assert lane.launched == [(1, 1.0), (1, 0.5)]
    await engine.close()


async def test_models_are_described_and_phases_told_to_listeners(rng):
    lane = FakeLane()
    engine = engine_of(lane)
    told: list[Phase] = []

    async def listen(phase: Phase) -> None:
        told.append(phase)

    engine.on_phase(listen)
    engine.start()
    assert [info.name for info in await engine.list_models()] == ["m"]
    await engine.serving()
    await engine.draining()
    assert told == [Phase.SERVING, Phase.DRAINING]
    await engine.close()
    assert lane.shut  # the engine owns its lanes


async def test_update_headers_refuse_negative_versions():
    with pytest.raises(InvalidArgument, match="version: -1 must be >= 0"):
        UpdateHeader("m", -1, False)
    with pytest.raises(InvalidArgument, match="base_version: -2 must be >= 0"):
        UpdateHeader("m", 0, True, base_version=-2)


def test_engine_config_takes_the_settings_it_names():
    from logprob_service.settings.model import Settings

    settings = Settings.model_validate({"max_batch_tokens": 1234, "share_prompts": True, "max_wait_ms": 7.0})
    config = EngineConfig.from_settings(settings)
    assert (config.max_batch_tokens, config.share_prompts, config.max_wait_ms) == (1234, True, 7.0)
    assert config.limits.max_tokens_per_request == settings.max_tokens_per_request
