"""A bare gRPC server for a hand-written servicer: what a client test needs to see the wire."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc


def sequences_of(request: pb.ScoreRequest) -> list[pb.Sequence]:
    """A request's sequences as the server scores them: its own, then each group's completions."""
    return list(request.sequences) + [
        pb.Sequence(prompt_ids=g.prompt_ids, completion_ids=c.completion_ids)
        for g in request.groups
        for c in g.completions
    ]


@contextlib.asynccontextmanager
async def serving(servicer: pb_grpc.LogprobServiceServicer, options: list | None = None) -> AsyncIterator[str]:
    """A server for ``servicer`` on loopback (with gRPC server ``options``); yields its target."""
    server = grpc.aio.server(options=options)
    pb_grpc.add_LogprobServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
