"""A bare gRPC server for a hand-written servicer: what a client test needs to see the wire."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api import wire

HealthServicer = health_aio.HealthServicer
T = TypeVar("T")


def at_once(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that awaits nothing but ``asyncio.sleep(0)`` (``api.wire``'s, which
    hand the event loop back between slices), run to its end at once, in a loop or outside one."""
    try:
        while True:
            coroutine.send(None)
    except StopIteration as done:
        return done.value


def sequences_of(request: pb.ScoreRequest) -> list[pb.Sequence]:
    """A request's sequences as the server reads them (``api.wire``: its own, then each group's
    completions; ids from repeated fields or int32 bytes), as plain v1 ``Sequence`` messages."""
    job = at_once(wire.job_from_request(pb.ScoreRequest(sequences=request.sequences, groups=request.groups), None, ""))
    return [
        pb.Sequence(prompt_ids=s.prompt_ids.tolist(), completion_ids=s.completion_ids.tolist()) for s in job.sequences
    ]


@contextlib.asynccontextmanager
async def serving(
    servicer: pb_grpc.LogprobServiceServicer,
    options: list | None = None,
    health: HealthServicer | None = None,
    port: int = 0,
) -> AsyncIterator[str]:
    """A server for ``servicer`` on loopback (with gRPC server ``options``, and the ``health``
    service when given; on ``port``, or a free one); yields its target."""
    server = grpc.aio.server(options=options)
    pb_grpc.add_LogprobServiceServicer_to_server(servicer, server)
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
