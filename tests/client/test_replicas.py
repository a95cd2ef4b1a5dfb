"""One client, several replicas: the target forms, round-robin spreading, retries on another
replica, and keepalive settings the server accepts."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2
from logprob_client import AsyncLogprobClient, LogprobClient
from logprob_client.channel import SERVICE, channel_options, channel_target, service_config
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api.server_options import server_options
from logprob_service.settings.model import Settings

from tests.helpers.fake_server import HealthServicer, sequences_of, serving
from tests.helpers.waiting import wait_until


class Replica(pb_grpc.LogprobServiceServicer):
    """Answers each sequence with its own prompt ids as log-probs (so a reply shows whose it is),
    counts calls and the client connections (peers) they came on, and refuses every call with
    UNAVAILABLE while ``draining``."""

    def __init__(self) -> None:
        self.calls = 0
        self.peers: set[str] = set()
        self.draining = False

    async def ScoreTokens(self, request, context):
        self.calls += 1
        self.peers.add(context.peer())
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        scores = [pb.SequenceScores(logprobs=[float(t) for t in s.prompt_ids]) for s in sequences_of(request)]
        return pb.ScoreResponse(request_id=request.request_id, scores=scores)

    async def ListModels(self, request, context):
        return pb.ListModelsResponse()  # no queue limits told: the client's parts go unpaced


@contextlib.asynccontextmanager
async def replicas(n: int, health: list[HealthServicer] | None = None):
    async with contextlib.AsyncExitStack() as stack:
        servicers = [Replica() for _ in range(n)]
        health = health or [None] * n
        targets = [await stack.enter_async_context(serving(s, health=h)) for s, h in zip(servicers, health)]
        yield servicers, targets


def connect_all(client: LogprobClient, servicers: list[Replica]) -> None:
    """Call until every replica has answered once: round_robin connects to all of them at the first
    call, and a call picks among the replicas already connected. Then list the models: a client
    asks for its share of the queue once (pacing.py), and that call is a pick too."""
    for _ in range(200):
        if all(s.calls for s in servicers):
            break
        client.score([[1]], [[2]])
    assert all(s.calls for s in servicers), [s.calls for s in servicers]
    client.list_models()
    for s in servicers:
        s.calls = 0


async def test_a_list_of_replicas_is_served_round_robin():
    async with replicas(3) as (servicers, targets):
        # Host names, as users write them; the list becomes one ipv4: target.
        names = [t.replace("127.0.0.1", "localhost") for t in targets]
        with LogprobClient(names, timeout=10) as client:
            await asyncio.to_thread(connect_all, client, servicers)
            for _ in range(30):
                await asyncio.to_thread(client.score, [[3]], [[4]])
        assert [s.calls for s in servicers] == [10, 10, 10]


async def test_the_parts_of_one_large_call_go_to_every_replica_at_once(rng):
    prompts = [rng.integers(0, 1000, 3).tolist() for _ in range(12)]
    async with replicas(3) as (servicers, targets):
        with LogprobClient(targets, timeout=10, max_sequences_per_rpc=2) as client:
            await asyncio.to_thread(connect_all, client, servicers)
            out = await asyncio.to_thread(client.score, prompts, [[1]] * 12)
        # Six RPCs, two per replica, and the answers put back in order.
        assert [s.calls for s in servicers] == [2, 2, 2]
        assert [x.tolist() for x in out] == prompts


async def test_unavailable_is_retried_on_another_replica():
    async with replicas(3) as (servicers, targets):
        with LogprobClient(targets, timeout=10) as client:
            await asyncio.to_thread(connect_all, client, servicers)
            servicers[1].draining = True
            for i in range(12):
                assert (await asyncio.to_thread(client.score, [[i]], [[1]]))[0].tolist() == [i]
        # The draining replica was picked (and refused) in turn; each of those calls was retried.
        assert servicers[1].calls >= 3
        assert servicers[0].calls + servicers[2].calls == 12


async def test_a_replica_whose_health_is_not_serving_gets_no_calls_until_it_serves_again():
    # What a draining (or still loading) server says: the client's health watch takes it out of
    # the rotation, so its shutdown cuts no call off (server.Service.drain).
    health = [HealthServicer() for _ in range(3)]
    for h in health:
        await h.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    async with replicas(3, health) as (servicers, targets):
        with LogprobClient(targets, timeout=10, max_attempts=1) as client:
            await asyncio.to_thread(connect_all, client, servicers)
            await health[1].set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

            def left_out() -> bool:  # two whole rounds without it: the watch has told the channel
                before = servicers[1].calls
                for _ in range(6):
                    client.score([[0]], [[1]])
                return servicers[1].calls == before

            await asyncio.to_thread(wait_until, left_out, "the NOT_SERVING replica to be left out")
            for s in servicers:
                s.calls = 0
            for i in range(30):
                assert (await asyncio.to_thread(client.score, [[i]], [[1]]))[0].tolist() == [i]
            assert [s.calls for s in servicers] == [15, 0, 15]

            await health[1].set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
            await asyncio.to_thread(wait_until, lambda: client.score([[0]], [[1]]) and servicers[1].calls, "it back")


def test_target_forms():
    assert channel_target("dns:///logprob-headless.ml.svc.cluster.local:50051") == (
        "dns:///logprob-headless.ml.svc.cluster.local:50051"
    )
    assert channel_target(["localhost:50051"]) == "localhost:50051"  # one replica: gRPC resolves it
    assert channel_target(["127.0.0.1:1", "localhost:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target(("[::1]:1", "[::1]:2")) == "ipv6:[::1]:1,[::1]:2"


@pytest.mark.parametrize(
    "replicas,message",
    [
        ([], "the list of replicas is empty"),
        (["127.0.0.1:1", "dns:///x:2"], "target[1]: 'dns:///x:2' is not host:port"),
        (["127.0.0.1:1", "127.0.0.1"], "target[1]: '127.0.0.1' is not host:port"),
        (["::1:5", "127.0.0.1:1"], "target[0]: '::1:5' is not host:port"),
        (["127.0.0.1:1", "no-such-host.invalid:2"], "target[1]: cannot resolve 'no-such-host.invalid'"),
        (["127.0.0.1:1", "[::1]:2"], "share no address family"),
    ],
)
def test_bad_replica_lists_name_the_entry(replicas, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        channel_target(replicas)


def test_service_config_balances_round_robin_over_healthy_replicas_and_retries_unary_calls():
    config = json.loads(dict(channel_options())["grpc.service_config"])
    assert config == service_config(5)
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "logprob.v1.LogprobService"}
    (method,) = config["methodConfig"]
    assert {n["method"] for n in method["name"]} == {"ScoreTokens", "ListModels"}
    assert sorted(method["retryPolicy"]["retryableStatusCodes"]) == ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]
    # No retries: still round-robin over healthy replicas, no retry policy.
    assert json.loads(dict(channel_options(max_attempts=1))["grpc.service_config"]) == {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "logprob.v1.LogprobService"},
    }


def test_client_keepalive_is_what_the_server_permits():
    client = dict(channel_options())
    server = dict(server_options(Settings(device="cpu")))
    # Idle connections are pinged, and the server lets them be...
    assert client["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"] == 1
    # ...no more often than it tolerates (faster pings earn a GOAWAY "too_many_pings").
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]


async def test_the_asyncio_client_spreads_over_the_same_replicas():
    async with replicas(3) as (servicers, targets):
        async with AsyncLogprobClient(targets, timeout=10) as client:
            for _ in range(200):  # until connected to all, as connect_all
                if all(s.calls for s in servicers):
                    break
                await client.score([[1]], [[2]])
            assert all(s.calls for s in servicers), [s.calls for s in servicers]
            await client.list_models()  # (its share of the queue, as connect_all)
            for s in servicers:
                s.calls = 0
            out = await asyncio.gather(*(client.score([[i]], [[1]]) for i in range(9)))
        assert [x[0].tolist() for x in out] == [[i] for i in range(9)]
        assert [s.calls for s in servicers] == [3, 3, 3]


async def test_connections_older_than_the_max_age_are_replaced_without_failing_calls():
    # What lets a client of a DNS name find new replicas: the server's GOAWAY at the age limit
    # makes it reconnect (and re-resolve). Calls meanwhile all succeed.
    servicer = Replica()
    options = server_options(Settings(device="cpu", max_connection_age_s=0.3))
    assert dict(options)["grpc.max_connection_age_ms"] == 300
    assert "grpc.max_connection_age_ms" not in dict(server_options(Settings(device="cpu", max_connection_age_s=0)))
    async with serving(servicer, options) as target:
        with LogprobClient(target, timeout=10) as client:
            for i in range(20):
                assert (await asyncio.to_thread(client.score, [[i]], [[1]]))[0].tolist() == [i]
                await asyncio.sleep(0.1)
    assert servicer.calls == 20
    assert len(servicer.peers) >= 3  # a new connection (client port) at least every ~0.3 s of 2 s
