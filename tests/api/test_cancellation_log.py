"""A cancelled call's log line says why it was cancelled: the caller's deadline, or the caller
itself. It said ``CancelledError: `` and nothing more, so a deadline that a client's share of the
queue ran out was indistinguishable from a trainer going away."""

from __future__ import annotations

import asyncio
import logging

import grpc
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.calls import Gate, random_sequence, request
from tests.helpers.waiting import eventually


def failures(caplog) -> list[str]:
    """The ``error`` field of each CANCELLED line of the request log."""
    return [
        r.fields["error"]
        for r in caplog.records
        if r.name == "logprob_service.requests" and getattr(r, "fields", {}).get("status") == "CANCELLED"
    ]


async def test_a_cancelled_call_logs_whether_its_deadline_passed_or_its_caller_left(running, rng, caplog):
    caplog.set_level(logging.DEBUG, logger="logprob_service.requests")
    gate = Gate(running)
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            held = asyncio.ensure_future(stub.ScoreTokens(request(random_sequence(rng, 3, 2)), timeout=60))
            await gate.wait_entered()  # the device is busy: what follows waits in the queue
            late = stub.ScoreTokens(request(random_sequence(rng, 4, 4)), timeout=0.5)
            assert (await late.code()) == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: len(failures(caplog)) == 1, "the expired call's log line")
            left = stub.ScoreTokens(request(random_sequence(rng, 4, 4)), timeout=60)
            await eventually(
                lambda: running.service.device_side.scheduler.admission.queued_tokens > 5, "the call queued"
            )
            left.cancel()
            await eventually(lambda: len(failures(caplog)) == 2, "the cancelled call's log line")
            gate.release.set()
            await held
    finally:
        gate.restore()
    deadline, caller = failures(caplog)
    assert "the caller's deadline passed before the answer" in deadline and "max_queued_tokens_per_client" in deadline
    assert "the caller cancelled the call or closed its connection" in caller
