"""TLS, mutual TLS and bearer tokens with scopes, over real gRPC on loopback.

Certificates are made for the session (tests/certs.py). Negative cases use ``max_attempts=1``
and calls without wait-for-ready, so a refused handshake shows as UNAVAILABLE at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from logprob_client import (
    AsyncLogprobClient,
    LogprobClient,
    PermissionDenied,
    ScoreInput,
    Unauthenticated,
    Unavailable,
)
from logprob_client.channel import open_channel
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.security import exposure
from prometheus_client import REGISTRY

from tests.helpers.calls import assert_matches_reference, random_batch
from tests.helpers.certs import OTHER_NAME, make_pki
from tests.helpers.processes import free_port, launch
from tests.helpers.server import start, stop, test_settings

DENIED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tokens(tmp_path_factory):
    """A tokens file: a score token given as its sha256, an admin-only token, one with both."""
    values = {name: secrets.token_urlsafe(32) for name in ("trainer", "ops", "both")}
    path = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        f"  - {{name: trainer, scopes: [score], sha256: {hashlib.sha256(values['trainer'].encode()).hexdigest()}}}\n"
        f"  - {{name: ops, scopes: [admin], token: {values['ops']}}}\n"
        f"  - {{name: both, scopes: [score, admin], token: {values['both']}}}\n"
    )
    return path, values


async def score_and_check(running, client, rng: np.random.Generator) -> None:
    """One scoring call through ``client`` (either kind), checked against the float64 reference."""
    prompts, completions = random_batch(rng, 3, 4096)
    if isinstance(client, AsyncLogprobClient):
        logprobs = await client.score(prompts, completions)
    else:
        logprobs = await asyncio.to_thread(client.score, prompts, completions)
    assert_matches_reference(running, "default", prompts, completions, logprobs)


def health_status(target: str, **security) -> int:
    with open_channel(target, aio=False, max_attempts=1, **security) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def refused(target: str, **security) -> grpc.StatusCode:
    """The status of a ListModels call that the transport or the server refuses."""
    with LogprobClient(target, max_attempts=1, timeout=10, **security) as client:
        with pytest.raises((Unavailable, Unauthenticated, PermissionDenied)) as info:
            client.list_models()
    return info.value.code


async def test_tls_serves_clients_that_trust_its_ca(gemma_checkpoint, pki, rng):
    running = await start(test_settings(gemma_checkpoint, tls_cert_file=pki.server.cert, tls_key_file=pki.server.key))
    try:
        with LogprobClient(running.target, tls_ca_file=pki.ca) as client:
            await score_and_check(running, client, rng)
        async with AsyncLogprobClient(f"localhost:{running.port}", tls_ca_file=pki.ca) as client:
            await score_and_check(running, client, rng)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await asyncio.to_thread(health_status, running.target, tls_ca_file=pki.ca) == serving
        # Plaintext to a TLS port, or TLS trusting another CA: no connection.
        assert await asyncio.to_thread(refused, running.target) == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(refused, running.target, tls_ca_file=pki.rogue_ca) == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop(running)


async def test_server_name_override(gemma_checkpoint, pki, rng):
    # The certificate names only OTHER_NAME; the client reaches it at 127.0.0.1.
    named = pki.named_server
    running = await start(test_settings(gemma_checkpoint, tls_cert_file=named.cert, tls_key_file=named.key))
    try:
        assert await asyncio.to_thread(refused, running.target, tls_ca_file=pki.ca) == grpc.StatusCode.UNAVAILABLE
        with LogprobClient(running.target, tls_ca_file=pki.ca, tls_server_name=OTHER_NAME) as client:
            await score_and_check(running, client, rng)
    finally:
        await stop(running)


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(gemma_checkpoint, pki, rng):
    running = await start(
        test_settings(
            gemma_checkpoint,
            tls_cert_file=pki.server.cert,
            tls_key_file=pki.server.key,
            tls_client_ca_file=pki.ca,
        )
    )
    try:
        mine = dict(tls_ca_file=pki.ca, tls_cert_file=pki.client.cert, tls_key_file=pki.client.key)
        with LogprobClient(running.target, **mine) as client:
            await score_and_check(running, client, rng)
        async with AsyncLogprobClient(running.target, **mine) as client:
            await score_and_check(running, client, rng)
        rogue = dict(tls_ca_file=pki.ca, tls_cert_file=pki.rogue_client.cert, tls_key_file=pki.rogue_client.key)
        for security in ({"tls_ca_file": pki.ca}, rogue):
            assert await asyncio.to_thread(refused, running.target, **security) == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop(running)


@pytest.fixture
async def authed(gemma_checkpoint, tokens):
    running = await start(test_settings(gemma_checkpoint, auth_tokens_file=tokens[0]))
    yield running, tokens[1]
    await stop(running)


async def test_missing_or_wrong_token_is_unauthenticated(authed, caplog):
    running, values = authed
    before = REGISTRY.get_sample_value(
        "logprob_requests_total", {"model": "", "rpc": "ScoreTokens", "code": "UNAUTHENTICATED", "protocol": "grpc"}
    )
    for security, reason in (({}, "no credentials"), ({"token": secrets.token_urlsafe(32)}, "not valid")):
        assert await asyncio.to_thread(refused, running.target, **security) == grpc.StatusCode.UNAUTHENTICATED
        with LogprobClient(running.target, **security) as client:
            with pytest.raises(Unauthenticated, match=reason):
                await asyncio.to_thread(client.score, [[1, 2]], [[3]])
            with pytest.raises(Unauthenticated, match=reason):
                await asyncio.to_thread(client.score_many, [ScoreInput([[1, 2]], [[3]])])
        async with AsyncLogprobClient(running.target, **security) as client:
            with pytest.raises(Unauthenticated, match=reason):
                await client.score([[1, 2]], [[3]])
    # Garbage from a caller without a token: refused for the token, before the bytes are looked at.
    async with grpc.aio.insecure_channel(running.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/logprob.v1.LogprobService/ScoreTokens")(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = REGISTRY.get_sample_value(
        "logprob_requests_total", {"model": "", "rpc": "ScoreTokens", "code": "UNAUTHENTICATED", "protocol": "grpc"}
    )
    assert after - (before or 0) == 5  # a sync and an async score() per case (never retried), and the garbage
    logged = [r for r in caplog.records if getattr(r, "fields", {}).get("status") == "UNAUTHENTICATED"]
    assert logged and all(r.levelno == logging.WARNING and r.fields["client"] == "127.0.0.1" for r in logged)
    assert not any(values["trainer"] in r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records)


async def test_score_token_scores_but_cannot_update_weights(authed, tokens, rng):
    running, values = authed
    path = tokens[0].parent / "trainer.token"
    path.write_text(values["trainer"] + "\n")
    with LogprobClient(running.target, token_file=path) as client:
        await score_and_check(running, client, rng)
        assert [m.name for m in await asyncio.to_thread(client.list_models)] == ["default", "gemma"]
        prompts, completions = random_batch(rng, 2, 4096)
        (streamed,) = await asyncio.to_thread(client.score_many, [ScoreInput(prompts, completions)])
        assert_matches_reference(running, "default", prompts, completions, streamed)
    async with AsyncLogprobClient(running.target, token=values["trainer"]) as client:
        await score_and_check(running, client, rng)
        # A stream carries the token too (grpc.aio files an interceptor under one kind of call only).
        (streamed,) = await client.score_many([ScoreInput(prompts, completions)])
        assert_matches_reference(running, "default", prompts, completions, streamed)
    for code in await admin_calls(running.target, values["trainer"]):
        assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_weight_receivers_take_the_servers_tls_and_tokens(gemma_checkpoint, pki, tokens, rng):
    """A push through a weight receiver (its own port, TLS from the same files) is authenticated and
    authorized as on the server's port: the same tokens, the same scopes."""
    values = tokens[1]
    running = await start(
        test_settings(
            gemma_checkpoint,
            tls_cert_file=pki.server.cert,
            tls_key_file=pki.server.key,
            auth_tokens_file=tokens[0],
            weight_receivers=1,
        )
    )
    try:
        weights = {k: v + 0.01 for k, v in running.scorer("default").model.state_dict().items()}
        (port,) = running.service.receivers.ports
        credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes())
        header = pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(model="default", partial=True))
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            update = pb_grpc.LogprobServiceStub(channel).UpdateWeights
            for token, code in ((values["trainer"], grpc.StatusCode.PERMISSION_DENIED), (None, DENIED)):
                metadata = (("authorization", f"Bearer {token}"),) if token else ()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await update(iter([header]), metadata=metadata, timeout=30)
                assert info.value.code() in (code if isinstance(code, set) else {code}), info.value.details()
        assert running.service.receivers.forwarded == 2
        target = f"localhost:{running.port}"  # the name the server's certificate carries
        async with AsyncLogprobClient(target, tls_ca_file=pki.ca, token=values["both"]) as client:
            assert (await client.update_weights("default", weights, streams=2)).version == 1
        assert running.service.receivers.forwarded == 4, "both calls of the push came through the receiver"
        # A token without the score scope cannot list the receivers: its push goes to the port.
        async with AsyncLogprobClient(target, tls_ca_file=pki.ca, token=values["ops"]) as client:
            assert (await client.update_weights("default", weights, streams=2)).version == 2
        assert running.service.receivers.forwarded == 4
        # From push processes (``push_processes``): the client's TLS and token go with them.
        with LogprobClient(target, tls_ca_file=pki.ca, token=values["both"], push_processes=2) as client:
            assert (await asyncio.to_thread(client.update_weights, "default", weights, streams=2)).version == 3
            assert running.service.receivers.forwarded == 6
        with LogprobClient(target, tls_ca_file=pki.ca, token=values["trainer"], push_processes=1) as client:
            with pytest.raises(PermissionDenied):  # a score-only token, through the receiver
                await asyncio.to_thread(client.update_weights, "default", weights, streams=2)
        # The client raises at the first refusal; its other call may be cancelled before the
        # receiver forwards it (the receiver reads a call only once the server asks for it).
        assert 7 <= running.service.receivers.forwarded <= 8
    finally:
        await stop(running)


async def admin_calls(target: str, token: str) -> list[grpc.StatusCode]:
    """The statuses, with ``token``, of the six weight-update RPCs, each made so it can change
    nothing: an UpdateWeights of a header and no commit, a LoadWeights of a path that does not
    exist, an InitWeightsUpdateGroup with no trainer to join (1 s), an UpdateWeightsFromDistributed
    and a DestroyWeightsUpdateGroup of a group never joined, an UpdateWeightsFromIpc from another
    host."""
    metadata = (("authorization", f"Bearer {token}"),)
    codes = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LogprobServiceStub(channel)
        header = pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(model="default", partial=True))
        join = pb.InitWeightsUpdateGroupRequest(master_port=free_port(), world_size=2, rank_offset=1, group_name="g")
        distributed = pb.DistributedUpdateRequest(header=pb.UpdateWeightsHeader(model="default"), group_name="g")
        join.timeout_s = 1.0
        ipc = pb.IpcUpdateRequest(header=pb.UpdateWeightsHeader(model="default", partial=True), boot_id="elsewhere")
        for call in (
            stub.UpdateWeights(iter([header]), metadata=metadata, timeout=30),
            stub.LoadWeights(
                pb.LoadWeightsRequest(model="default", path="/nonexistent"), metadata=metadata, timeout=30
            ),
            stub.InitWeightsUpdateGroup(join, metadata=metadata, timeout=30),
            stub.UpdateWeightsFromDistributed(distributed, metadata=metadata, timeout=30),
            stub.DestroyWeightsUpdateGroup(pb.DestroyWeightsUpdateGroupRequest(group_name="g"), metadata=metadata),
            stub.UpdateWeightsFromIpc(ipc, metadata=metadata, timeout=30),
        ):
            try:
                if hasattr(call, "__aiter__"):  # a response stream
                    async for _ in call:
                        pass
                else:
                    await call
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.append(err.code())
    return codes


async def test_admin_scope_passes_to_the_weight_update_handlers(authed, rng):
    running, values = authed
    for token in (values["ops"], values["both"]):
        codes = await admin_calls(running.target, token)
        # Past authentication: whatever the handler answers (UNIMPLEMENTED until weight updates land).
        assert len(codes) == 6 and not DENIED & set(codes), codes
    # An admin-only token does not score.
    assert await asyncio.to_thread(refused, running.target, token=values["ops"]) == grpc.StatusCode.PERMISSION_DENIED
    with LogprobClient(running.target, token=values["both"]) as client:
        await score_and_check(running, client, rng)


async def test_health_and_reflection_stay_open(authed):
    running, _ = authed
    assert await asyncio.to_thread(health_status, running.target) == health_pb2.HealthCheckResponse.SERVING

    def services():
        with grpc.insecure_channel(running.target) as channel:
            return ProtoReflectionDescriptorDatabase(channel).get_services()

    assert "logprob.v1.LogprobService" in await asyncio.to_thread(services)


async def test_tls_and_token_together(gemma_checkpoint, pki, tokens, rng):
    path, values = tokens
    running = await start(
        test_settings(
            gemma_checkpoint,
            tls_cert_file=pki.server.cert,
            tls_key_file=pki.server.key,
            tls_client_ca_file=pki.ca,
            auth_tokens_file=path,
        )
    )
    try:
        mine = dict(tls_ca_file=pki.ca, tls_cert_file=pki.client.cert, tls_key_file=pki.client.key)
        with LogprobClient(running.target, token=values["trainer"], **mine) as client:
            await score_and_check(running, client, rng)
        async with AsyncLogprobClient(running.target, token=values["trainer"], **mine) as client:
            await score_and_check(running, client, rng)
        # The certificate gets a caller through TLS; it is not a token.
        assert await asyncio.to_thread(refused, running.target, **mine) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await stop(running)


def test_client_refuses_security_options_it_cannot_apply(tmp_path, pki):
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        with pytest.raises(ValueError, match="tls_ca_file, token cannot apply to a given channel"):
            LogprobClient("", channel=channel, tls_ca_file=pki.ca, token="t" * 20)
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        LogprobClient("127.0.0.1:1", tls_cert_file=pki.client.cert)
    with pytest.raises(ValueError, match="token or token_file, not both"):
        LogprobClient("127.0.0.1:1", token="t" * 20, token_file=tmp_path / "x")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        LogprobClient("127.0.0.1:1", token_file=tmp_path / "empty")


async def test_a_server_reachable_from_other_machines_warns_for_what_it_lacks(
    gemma_checkpoint, tokens, monkeypatch, caplog
):
    # Bound to loopback (tests stay there), but taken for an exposed address.
    monkeypatch.setattr(exposure, "is_loopback", lambda host: False)
    for extra, expected in (({}, ["PLAINTEXT", "NO AUTHENTICATION"]), ({"auth_tokens_file": tokens[0]}, ["PLAINTEXT"])):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="logprob_service.api.server"):
            running = await start(test_settings(gemma_checkpoint, **extra), warm=False)
            await stop(running)
        warned = [r.getMessage() for r in caplog.records if r.name == "logprob_service.api.server"]
        assert [next(w for w in expected if w in m) for m in warned] == expected, warned


def test_cli_refuses_a_bad_token_document_without_echoing_it():
    secret = secrets.token_urlsafe(32)
    proc = launch(
        "--metrics-port",
        "0",
        "--port",
        str(free_port()),
        env={"LOGPROB_AUTH_TOKENS": f"tokens:\n  - {{name: a, scopes: [root], token: {secret}}}\n"},
    )
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output
    assert "LOGPROB_AUTH_TOKENS: tokens.0.scopes.0" in output and secret not in output
