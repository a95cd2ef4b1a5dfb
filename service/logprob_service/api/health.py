"""Serving state: loading/warming up -> serving -> draining, mirrored in the gRPC health service."""

from __future__ import annotations

import enum

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from logprob_service.errors import Unavailable

SERVICE_NAME = "logprob.v1.LogprobService"


class Phase(enum.Enum):
    STARTING = "starting: models are loading and warming up"
    SERVING = "serving"
    DRAINING = "draining: the server is shutting down"


class ServingState:
    """Owns the health servicer; RPC handlers call ``check_accepting`` before doing any work."""

    def __init__(self) -> None:
        self.health = health_aio.HealthServicer()
        self.phase = Phase.STARTING

    async def _set(self, phase: Phase) -> None:
        self.phase = phase
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if phase is Phase.SERVING
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):  # "" is the whole server, as probes ask by default
            await self.health.set(service, status)

    async def starting(self) -> None:
        await self._set(Phase.STARTING)

    async def serving(self) -> None:
        await self._set(Phase.SERVING)

    async def draining(self) -> None:
        await self._set(Phase.DRAINING)

    def check_accepting(self) -> None:
        if self.phase is not Phase.SERVING:
            raise Unavailable(f"server is {self.phase.value}; retry on another replica or later")
