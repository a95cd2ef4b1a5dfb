"""A server's device side: its engine, one lane a device, and the models loaded into it.

``DeviceSide.create`` makes the engine on the devices the settings name (``engine.engine_on``),
before any model loads. ``load_models`` then loads every configured model: a replica on each
device (data parallel: ``models.build_models`` once per device), or each model sharded over a
tensor-parallel group, whose other ranks it starts (``worker.tensor_parallel.Leader``) and
whose rank 0 this process is: every rank loads the same models with the same function
(``models.build_rank``), and rank 0's launches lead the others'. Start-up wires the edges over
``engine`` and runs its lifecycle; it never sees a device.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from logprob_service.builder.engine import engine_on
from logprob_service.builder.models import build_models, build_rank, logprob_op
from logprob_service.engine import EngineConfig, LogprobEngine, ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.weights.updater import WeightUpdater
from logprob_service.models.loading import resolve_devices
from logprob_service.settings.model import Settings
from logprob_service.stats import NO_STATS, StatsSink
from logprob_service.worker.pinned import page_lock
from logprob_service.worker.tensor_parallel import Build, Leader


@dataclass
class DeviceSide:
    """What a server runs on its devices; owned by one event loop."""

    settings: Settings
    devices: list[torch.device]  # the engine's lanes, one device each
    engine: LogprobEngine
    build: Build | None = None  # with tensor parallel, what loads each rank's models (default: those the settings name)
    # With tensor_parallel > 1: rank 0's side of the group, once load_models started it.
    leader: Leader | None = None
    _lost: asyncio.Future[str] | None = field(default=None, init=False)

    @classmethod
    def create(
        cls,
        settings: Settings,
        *,
        registry: ModelRegistry | None = None,
        build: Build | None = None,
        stats: StatsSink = NO_STATS,
    ) -> DeviceSide:
        """Raises ``ModelLoadError`` for devices this host lacks. A ``registry`` given already filled
        holds one replica per device of ``settings.device``; otherwise the models are still to load
        (``load_models``). ``build``: with tensor parallel, what ``load_models`` runs on every rank
        instead of loading the settings' models (benchmarks)."""
        devices = resolve_devices(settings.device, settings.tensor_parallel)
        # A replica of each model on each device; with tensor parallel, rank 0's device alone (the
        # other ranks follow its launches).
        lanes = devices[:1] if settings.tensor_parallel > 1 else devices
        engine = engine_on(
            registry if registry is not None else ModelRegistry(),
            lanes,
            EngineConfig.from_settings(settings),
            staging_reserve_bytes=settings.update_staging_reserve_bytes,
            check_finite_weights=settings.check_finite_weights,
            join_groups=True,
            stats=stats,
        )
        return cls(settings, lanes, engine, build)

    # What tests and benchmarks reach through a running server.
    @property
    def registry(self) -> ModelRegistry:
        return self.engine.registry

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def updater(self) -> WeightUpdater:
        return self.engine.updater

    @property
    def page_lock(self) -> Callable[[mmap.mmap], Callable[[], None] | None] | None:
        """What page-locks a weight receiver's slots in place (``worker.pinned.page_lock``) on a
        GPU server, so that a dense piece goes from its slot to the device; None on the CPU."""
        return page_lock if any(device.type == "cuda" for device in self.devices) else None

    def lost(self) -> asyncio.Future[str]:
        """A future that gets the reason once the tensor-parallel group is lost (a rank gone): the
        server then exits. Never done without tensor parallel."""
        if self._lost is None:
            self._lost = asyncio.get_running_loop().create_future()
        return self._lost

    async def load_models(self) -> None:
        """Load every configured model in a worker thread (the loop keeps answering health checks),
        once per device, or over the tensor-parallel group."""
        if self.settings.tensor_parallel > 1:
            await self._load_tensor_parallel()
        else:
            await self._load_replicas()

    async def _load_replicas(self) -> None:
        """Every model on every device, registered with its replicas in lane order."""
        for device in self.devices:  # a forced kernel a device cannot run fails before any weight loads
            logprob_op(self.settings, device)
        loop = asyncio.get_running_loop()
        per_device = [
            await loop.run_in_executor(None, functools.partial(build_models, self.settings, device))
            for device in self.devices
        ]
        for name, served in per_device[0].items():
            self.registry.add(served, [models[name] for models in per_device[1:]])

    async def _load_tensor_parallel(self) -> None:
        """Start the group's other ranks and load every model's shards on all of them."""
        s = self.settings
        loop = asyncio.get_running_loop()
        lost = self.lost()

        def on_lost(reason: str) -> None:  # from any thread; the first reason wins
            loop.call_soon_threadsafe(lambda: lost.done() or lost.set_result(reason))

        devices = resolve_devices(s.device, s.tensor_parallel)
        build = self.build or functools.partial(build_rank, s)
        self.leader = await loop.run_in_executor(
            None, functools.partial(Leader.start, devices, build, s.log_level, s.log_format)
        )
        self.leader.watch(on_lost)
        served = await loop.run_in_executor(None, build, self.leader.tp, devices[0])
        for name, model in served.items():
            self.leader.lead(name, model.scorer, on_lost)
            self.registry.add(model)

    async def close(self) -> None:
        """Close the engine (its device workers), then stop the group's other ranks."""
        await self.engine.close()
        if self.leader is not None:
            self.leader.stop()
