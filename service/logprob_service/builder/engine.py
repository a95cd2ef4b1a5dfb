"""Builds the engine: its device workers and staging under the torch-free facade.

``engine_on`` is the one place a ``LogprobEngine`` is made from served models (the server, data
parallel over several devices, tensor parallel's rank 0, ``OfflineScorer``, tests and
benchmarks); ``build_engine`` makes a server's from its settings, with its models still to load
(``load_models``: ``models.build`` once per device). The engine reports its GPUs' memory to the
metrics through ``gpu_memory_of``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

import torch

from logprob_service.config import Settings
from logprob_service.engine.engine import EngineConfig, LogprobEngine
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.build import build_models, logprob_op
from logprob_service.models.loading import resolve_devices
from logprob_service.stats import NO_STATS, MemorySnapshot, StatsSink
from logprob_service.worker import gpu_memory
from logprob_service.worker.collectives import WeightGroup
from logprob_service.worker.executor import DeviceExecutor
from logprob_service.worker.staging import Staging


def engine_on(
    registry: ModelRegistry,
    devices: Sequence[torch.device],
    config: EngineConfig,
    *,
    staging_reserve_bytes: int = 0,
    check_finite_weights: bool = True,
    join_groups: bool = False,
    stats: StatsSink = NO_STATS,
) -> LogprobEngine:
    """An engine over ``registry`` (its models' replicas on ``devices``, in that order) with one
    device worker per device. ``check_finite_weights``: updates with a non-finite value are refused.
    ``join_groups``: it may join trainers' NCCL/gloo weight groups."""
    return LogprobEngine(
        registry,
        [DeviceExecutor(stats, device) for device in devices],
        config,
        staging=Staging(staging_reserve_bytes, check_finite_weights),
        join_group=WeightGroup if join_groups else None,
        stats=stats,
        device_memory=functools.partial(gpu_memory_of, list(devices)),
    )


def gpu_memory_of(devices: list[torch.device]) -> dict[str, MemorySnapshot]:
    """The memory of the GPUs among ``devices``, by device name."""
    return {str(device): gpu_memory.snapshot(device) for device in devices if device.type == "cuda"}


def server_devices(settings: Settings) -> list[torch.device]:
    """The devices a server's lanes run on: a replica of each model on each; with tensor parallel,
    rank 0's alone (the other ranks follow its launches). ``ModelLoadError`` for devices this host lacks."""
    devices = resolve_devices(settings.device, settings.tensor_parallel)
    return devices[:1] if settings.tensor_parallel > 1 else devices


def build_engine(
    settings: Settings,
    devices: Sequence[torch.device],
    *,
    registry: ModelRegistry | None = None,
    stats: StatsSink = NO_STATS,
) -> LogprobEngine:
    """A server's engine on ``devices`` (``server_devices``), its models not yet loaded
    (``load_models``) unless ``registry`` holds them already."""
    return engine_on(
        registry if registry is not None else ModelRegistry(),
        devices,
        EngineConfig.from_settings(settings),
        staging_reserve_bytes=settings.update_staging_reserve_bytes,
        check_finite_weights=settings.check_finite_weights,
        join_groups=True,
        stats=stats,
    )


async def load_models(registry: ModelRegistry, settings: Settings, devices: Sequence[torch.device]) -> None:
    """Load every configured model on every device, in a worker thread (the event loop keeps
    answering health checks), and register each with its replicas in lane order."""
    for device in devices:  # a forced kernel a device cannot run fails before any weight loads
        logprob_op(settings, device)
    loop = asyncio.get_running_loop()
    per_device = [
        await loop.run_in_executor(None, functools.partial(build_models, settings, device)) for device in devices
    ]
    for name, served in per_device[0].items():
        registry.add(served, [models[name] for models in per_device[1:]])
