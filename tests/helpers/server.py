"""A real server in the test's event loop, on loopback (Service.start_grpc on port 0, CPU, float32),
and what tests need to reach it and check its models."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
from logprob_client import AsyncLogprobClient
from logprob_service.settings.model import Settings
from logprob_service.startup import Service

from tests.helpers.models import assert_scores_close


def test_settings(gemma_checkpoint: Path, **overrides) -> Settings:
    values = dict(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models={"default": "builtin:tiny-llama", "gemma": str(gemma_checkpoint)},
        device="cpu",
        max_sequences_per_request=16,
        max_tokens_per_request=4000,
        max_batch_tokens=512,
        grace_period_s=5.0,
        # Many servers start in one test process: what one froze would outlive it (gc_freeze's own test).
        gc_freeze=False,
        # Tests send many refused calls on purpose, from one address: none is held
        # (tests/integration/limits/test_refusal_holds.py turns the hold on).
        refusals_per_s=0,
    )
    values.update(overrides)
    return Settings(**values)


class Running:
    """A started server and what tests need to reach it."""

    def __init__(self, service: Service, server: grpc.aio.Server, port: int) -> None:
        self.service = service
        self.server = server
        self.port = port
        self.target = f"127.0.0.1:{port}"

    def scorer(self, name: str):
        return self.service.device_side.registry.get(name).scorer


async def start(settings: Settings, *, warm: bool = True) -> Running:
    service = Service.create(settings)
    server, port = await service.start_grpc(f"{settings.host}:{settings.port}")
    await service.load_models()
    if warm:
        await service.warm_up()
    return Running(service, server, port)


async def stop(running: Running) -> None:
    await running.server.stop(None)
    await running.service.close()


test_settings.__test__ = False  # a helper, not a test


def new_seed(rng: np.random.Generator) -> int:
    """A seed for a random model, drawn from the test's generator."""
    return int(rng.integers(1 << 30))


def settings(models: dict[str, str], **overrides) -> Settings:
    values = dict(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models=models,
        device="cpu",
        max_batch_tokens=256,
        grace_period_s=5,
        gc_freeze=False,
        refusals_per_s=0,  # as test_settings: refused calls are answered at once
    )
    return Settings(**(values | overrides))


def as_lists(sequences) -> tuple[list[list[int]], list[list[int]]]:
    return [s.prompt_ids.tolist() for s in sequences], [s.completion_ids.tolist() for s in sequences]


def assert_scores_match(model, sequences, logprobs) -> None:
    assert_scores_close(model, sequences, logprobs)


async def live(client: AsyncLogprobClient, name: str):
    return next(m for m in await client.list_models() if m.name == name)
