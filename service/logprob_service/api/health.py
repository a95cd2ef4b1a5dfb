"""The engine's serving phase (starting -> serving -> draining), mirrored in the gRPC health service."""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from logprob_service.engine import LogprobEngine, Phase

SERVICE_NAME = "logprob.v1.LogprobService"


class HealthMirror:
    """Owns the health servicer: SERVING exactly while the engine serves."""

    def __init__(self, engine: LogprobEngine) -> None:
        self.health = health_aio.HealthServicer()
        self._engine = engine
        engine.on_phase(self.show)

    @property
    def phase(self) -> Phase:
        return self._engine.phase

    async def show(self, phase: Phase) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if phase is Phase.SERVING
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):  # "" is the whole server, as probes ask by default
            await self.health.set(service, status)
