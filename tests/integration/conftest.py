"""A real server on loopback: create_server on port 0, CPU, float32.

Two models: ``default`` (builtin:tiny-llama) and ``gemma`` (a small random Gemma 2 saved as a
Hugging Face checkpoint directory and loaded from it, the way users serve their own models).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from logprob_service.api.server import Service, create_server
from logprob_service.config import Settings
from logprob_service.observability.metrics import start_metrics_server

from tests.conftest import session_seed
from tests.models import make_model


@pytest.fixture(scope="session")
def gemma_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma2-checkpoint")
    make_model("gemma2", tied=True, seed=session_seed("gemma2-checkpoint")).save_pretrained(path)
    return path


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
    )
    values.update(overrides)
    return Settings(**values)


test_settings.__test__ = False  # a helper, not a test


class Running:
    """A started server and what tests need to reach it."""

    def __init__(self, service: Service, server: grpc.aio.Server, port: int) -> None:
        self.service = service
        self.server = server
        self.port = port
        self.target = f"127.0.0.1:{port}"

    def scorer(self, name: str):
        return self.service.registry.get(name).scorer


async def start(settings: Settings, *, warm: bool = True) -> Running:
    service = Service.create(settings)
    server, port = await create_server(service, f"{settings.host}:{settings.port}")
    await service.load_models()
    if warm:
        await service.warm_up()
    return Running(service, server, port)


async def stop(running: Running) -> None:
    await running.server.stop(None)
    await running.service.close()


@pytest_asyncio.fixture
async def running(gemma_checkpoint: Path):
    server = await start(test_settings(gemma_checkpoint))
    yield server
    await stop(server)


@pytest.fixture(scope="session")
def metrics_url():
    """/metrics of this process (the series are process-wide), on a free port, as a server serves it."""
    server = start_metrics_server("127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()
