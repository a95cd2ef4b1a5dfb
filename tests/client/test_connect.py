"""A server that cannot be reached fails a scoring call fast, as ``Unavailable`` naming the target
and gRPC's connection error; a server that was reached (loading, say) keeps the call's deadline;
a target gRPC cannot parse is refused when the client is built (``channel.ConnectionWatch``).

Before, every scoring call waited for a connection (``wait_for_ready``) until its deadline (120 s
by default) and then said only "Deadline Exceeded"."""

from __future__ import annotations

import asyncio
import time

import pytest
from grpc_health.v1 import health_pb2
from logprob_client import AsyncLogprobClient, LogprobClient, ScoreInput, Unavailable
from logprob_client.channel import channel_target
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.fake_server import HealthServicer, serving
from tests.helpers.processes import free_port

# A call's deadline far above the connect timeout: a call that waited for it would be seen to.
TIMEOUT_S, CONNECT_TIMEOUT_S = 60.0, 0.5
SERVICE = "logprob.v1.LogprobService"


class Answering(pb_grpc.LogprobServiceServicer):
    async def ScoreTokens(self, request, context):
        return pb.ScoreResponse(request_id=request.request_id, scores=[pb.SequenceScores(logprobs=[-1.5])])


async def score(target: str, how: str, **options) -> object:
    """One scoring call (``how``: which client and path) to ``target``; its result."""
    options = {"timeout": TIMEOUT_S, "connect_timeout_s": CONNECT_TIMEOUT_S, **options}
    if how.startswith("async"):
        async with AsyncLogprobClient(target, **options) as client:
            if how == "async-stream":
                return await client.score_many([ScoreInput([[1]], [[2]])])
            return await client.score([[1]], [[2]])

    def sync() -> object:
        with LogprobClient(target, **options) as client:
            if how == "sync-stream":
                return client.score_many([ScoreInput([[1]], [[2]])])
            return client.score([[1]], [[2]])

    return await asyncio.to_thread(sync)


HOW = ["sync", "sync-stream", "async", "async-stream"]


@pytest.mark.parametrize("how", HOW)
async def test_nothing_listening_is_unavailable_within_the_connect_timeout(how):
    target = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(Unavailable) as caught:
        await score(target, how)
    elapsed = time.monotonic() - start
    assert CONNECT_TIMEOUT_S <= elapsed < TIMEOUT_S / 4, f"{elapsed:.1f} s"
    message = caught.value.message
    assert f"cannot connect to '{target}' within 0.5 s (connect_timeout_s)" in message, message
    assert "Connection refused" in message, message


async def test_a_name_that_does_not_resolve_is_unavailable_naming_it():
    with pytest.raises(Unavailable, match=r"cannot connect to 'nowhere\.invalid:50051'.*nowhere\.invalid"):
        await score("nowhere.invalid:50051", "sync")


async def test_a_call_with_a_shorter_timeout_says_so():
    with pytest.raises(Unavailable, match=r"within 0.2 s \(the call's timeout\)"):
        await score(f"127.0.0.1:{free_port()}", "sync", timeout=0.2, connect_timeout_s=5)


async def test_a_server_starting_within_the_connect_timeout_is_waited_for():
    port = free_port()
    pending = asyncio.create_task(score(f"127.0.0.1:{port}", "sync", connect_timeout_s=30))
    await asyncio.sleep(0.5)  # refused meanwhile
    assert not pending.done()
    async with serving(Answering(), port=port):
        assert (await asyncio.wait_for(pending, 30))[0].tolist() == [-1.5]


@pytest.mark.parametrize("how", ["sync", "async"])
async def test_a_connected_server_not_yet_serving_keeps_the_calls_deadline(how):
    """Connected, but its health says NOT_SERVING (loading): the call waits past the connect
    timeout, for SERVING, within its deadline."""
    health = HealthServicer()
    await health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    async with serving(Answering(), health=health) as target:
        pending = asyncio.create_task(score(target, how))
        await asyncio.sleep(4 * CONNECT_TIMEOUT_S)
        assert not pending.done()
        await health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        assert (await asyncio.wait_for(pending, 30))[0].tolist() == [-1.5]


@pytest.mark.parametrize("target", ["not a target", "bogus:///x", "host:port", "dns:///a b:1", "", "[::1:5"])
def test_a_target_grpc_cannot_parse_is_refused_when_the_client_is_built(target):
    with pytest.raises(ValueError, match="is not host:port"):
        LogprobClient(target)


@pytest.mark.parametrize(
    "target",
    [
        "localhost:50051",
        "localhost",
        "10.0.0.1:1",
        "[::1]:50051",
        "::1",
        "dns:///svc.ns.svc.cluster.local:50051",
        "dns://8.8.8.8/example.com:443",
        "ipv4:127.0.0.1:1,127.0.0.1:2",
        "unix:/tmp/socket",
        "my_host-1.local.:8",
    ],
)
def test_targets_grpc_parses_are_taken_as_they_are(target):
    assert channel_target(target) == target


def test_the_connect_timeout_must_be_positive():
    with pytest.raises(ValueError, match="connect_timeout_s must be > 0"):
        LogprobClient("localhost:1", connect_timeout_s=0)
