"""Graceful drain: in-flight work finishes, new work is refused, health says NOT_SERVING."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.integration.conftest import start, test_settings
from tests.integration.test_errors import OK, Gate, call, request


async def test_drain_finishes_in_flight_work_and_refuses_new(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint))
    gate = Gate(running)
    in_flight = asyncio.create_task(call(running.target, request(OK, request_id="in-flight")))
    await asyncio.to_thread(gate.entered.wait, 10)
    drain = asyncio.create_task(running.service.drain(running.server, grace_s=20))
    await asyncio.sleep(0.2)
    # Draining: health says NOT_SERVING and a new call is refused.
    health = await running.service.state.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(running.target, request(OK), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    gate.release.set()
    response = await in_flight
    assert response.request_id == "in-flight" and len(response.scores[0].logprobs) == 2
    await drain
    gate.restore()
