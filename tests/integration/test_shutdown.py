"""Graceful drain: in-flight work finishes, new work is refused, health says NOT_SERVING."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.engine.engine import Phase

from tests.helpers.calls import OK, Gate, call, request
from tests.helpers.server import start, test_settings
from tests.helpers.waiting import eventually


async def test_drain_finishes_in_flight_work_and_refuses_new(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint))
    gate = Gate(running)
    in_flight = asyncio.create_task(call(running.target, request(OK, request_id="in-flight")))
    await gate.wait_entered()
    drain = asyncio.create_task(running.service.drain(running.server, grace_s=20))
    await eventually(lambda: running.service.engine.phase is Phase.DRAINING, "the drain to begin")
    # Draining: health says NOT_SERVING and a new call is refused.
    health = await running.service.edge.health.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(running.target, request(OK), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    gate.release.set()
    response = await in_flight
    assert response.request_id == "in-flight" and len(response.scores[0].logprobs) == 2
    await drain
    gate.restore()


async def test_drain_refuses_new_calls_at_once_on_a_connection_already_open(gemma_checkpoint):
    # A client of several replicas holds one open connection to each: a new call on the draining
    # server's connection must fail at once (for the client to retry it elsewhere), while the
    # call in flight on that same connection finishes.
    running = await start(test_settings(gemma_checkpoint))
    gate = None
    try:
        async with grpc.aio.insecure_channel(running.target, options=[("grpc.enable_retries", 0)]) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            await stub.ScoreTokens(request(OK), timeout=30)  # the connection is open
            gate = Gate(running)
            in_flight = stub.ScoreTokens(request(OK, request_id="in-flight"), timeout=30)
            await gate.wait_entered()
            drain = asyncio.create_task(running.service.drain(running.server, grace_s=20))
            await eventually(lambda: running.service.engine.phase is Phase.DRAINING, "the drain to begin")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ScoreTokens(request(OK), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # Refused while the drain still waits for the call in flight (held at the gate), so
            # refused at once, not left waiting for the drain to end.
            assert not in_flight.done() and not drain.done()
            gate.release.set()
            assert (await in_flight).request_id == "in-flight"
            await drain
    finally:
        if gate is not None:
            gate.restore()
