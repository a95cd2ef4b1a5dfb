"""The one place a ``LogprobEngine`` is made from served models and given its device workers.

``engine_on`` makes it for a server (one lane a device: data parallel, or tensor parallel's rank
0) and for ``OfflineScorer``: a ``DeviceExecutor`` a device, the weight staging, the trainers'
weight groups when asked for. The engine reports its GPUs' memory to the metrics through
``gpu_memory_of``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from logprob_service.engine import EngineConfig, LogprobEngine, ModelRegistry
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


def cuda_version() -> str:
    """The CUDA version torch was built with ("none": a CPU build)."""
    return torch.version.cuda or "none"
