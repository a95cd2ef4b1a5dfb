"""Weights by broadcast (InitWeightsUpdateGroup, UpdateWeightsFromDistributed) through a real server
on loopback, on the CPU with gloo: the trainer's ``WeightBroadcaster`` as rank 0, the server rank 1.

The result is the update a gRPC push of the same weights makes (equal fingerprints, the scores of
the new weights); tensors the model cannot take are refused before anything is broadcast; a
trainer that stops midway aborts the update after the group's timeout, with the old weights live.
"""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess

import grpc
import pytest
import torch
from logprob_client import AsyncLogprobClient, FailedPrecondition, InvalidRequest, LogprobClient
from logprob_client.collective import WeightBroadcaster
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api.probe import check as health_check
from logprob_service.models.weights import model_fingerprint

from tests.helpers.calls import random_batch
from tests.helpers.models import make_model, random_sequences
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.seeds import session_seed
from tests.helpers.server import as_lists, assert_scores_match, settings, start, stop

TIMEOUT_S = 5.0  # the group's: how long the server waits for a broadcast that does not come


@pytest.fixture
async def served(tmp_path):
    make_model("llama", tied=False, seed=session_seed("llama-broadcast")).save_pretrained(tmp_path)
    running = await start(settings({"policy": str(tmp_path)}))
    yield running
    await stop(running)


def new_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def broadcaster(client: LogprobClient) -> WeightBroadcaster:
    return WeightBroadcaster(client, master_port=free_port(), backend="gloo", timeout_s=TIMEOUT_S)


async def test_a_broadcast_update_lands_as_a_grpc_push_of_the_same_weights(served, rng, seed):
    model = served.scorer("policy").model
    weights = new_weights(model, seed)
    expected = make_model("llama", tied=False, seed=0)
    expected.load_state_dict(weights)
    sequences = random_sequences(rng, 4)

    def run():
        with LogprobClient(served.target, model="policy", timeout=60) as client, broadcaster(client) as sync:
            joined = sync.connect()
            assert (joined.rank, joined.world_size, joined.backend, joined.device) == (1, 2, "gloo", "cpu")
            result = sync.push("policy", weights, version=7)
            scored = client.score(*as_lists(sequences))
        # Closing the broadcaster left the group on both sides (DestroyWeightsUpdateGroup).
        with LogprobClient(served.target, model="policy", timeout=60) as client:
            leave = pb.DestroyWeightsUpdateGroupRequest(group_name="trainer")
            with pytest.raises(grpc.RpcError) as caught:
                client._stub.DestroyWeightsUpdateGroup(leave, timeout=30)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no weight group 'trainer' joined (none)" in caught.value.details()
        return result, scored

    result, logprobs = await asyncio.to_thread(run)
    assert (result.version, result.tensors) == (7, len(weights))
    assert result.fingerprint == model_fingerprint(expected.eval())
    assert_scores_match(expected, sequences, logprobs)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda w: w | {"model.norm.weight": torch.zeros(3)}, "model.norm.weight"),
        (lambda w: w | {"lm_head.weight": w["lm_head.weight"].double()}, "lm_head.weight"),
        (lambda w: w | {"model.bogus": torch.zeros(3)}, "model.bogus"),
    ],
    ids=["shape", "dtype", "name"],
)
async def test_tensors_the_model_cannot_take_are_refused_before_any_broadcast(served, seed, change, fragment):
    model = served.scorer("policy").model
    before = served.service.device_side.registry.get("policy").info

    def run():
        with LogprobClient(served.target, model="policy", timeout=60) as client, broadcaster(client) as sync:
            with pytest.raises(InvalidRequest, match=fragment):
                sync.push("policy", change(new_weights(model, seed)))
            # The group is fine: a good push goes through it next.
            return sync.push("policy", new_weights(model, seed + 1))

    assert (await asyncio.to_thread(run)).version == before.version + 1


async def test_a_trainer_that_stops_midway_aborts_the_update_and_the_group(served, seed):
    model = served.scorer("policy").model
    weights = new_weights(model, seed)
    before = served.service.device_side.registry.get("policy").info

    def run():
        with LogprobClient(served.target, model="policy", timeout=60) as client, broadcaster(client) as sync:
            sync.connect()
            request = pb.DistributedUpdateRequest(
                header=pb.UpdateWeightsHeader(model="policy"),
                group_name=sync.group_name,
                tensors=[pb.TensorSpec(name=n, dtype="float32", shape=t.shape) for n, t in weights.items()],
            )
            responses = client._stub.UpdateWeightsFromDistributed(request, timeout=60)
            assert next(responses).WhichOneof("kind") == "ready"
            sync._broadcast(next(iter(weights.values())).contiguous())  # one tensor, then nothing
            with pytest.raises(grpc.RpcError) as caught:
                next(responses)
            assert caught.value.code() == grpc.StatusCode.ABORTED
            assert "1 of" in caught.value.details() and "the group is closed" in caught.value.details()
            with pytest.raises(FailedPrecondition, match="InitWeightsUpdateGroup"):
                sync.push("policy", weights)  # the server left the group
        with LogprobClient(served.target, model="policy", timeout=60) as client, broadcaster(client) as sync:
            return sync.push("policy", weights)  # a new group works

    result = await asyncio.to_thread(run)
    assert result.version == before.version + 1  # the aborted update never went live


async def test_no_group_no_update(served):
    def run():
        with LogprobClient(served.target, model="policy", timeout=60) as client:
            request = pb.DistributedUpdateRequest(header=pb.UpdateWeightsHeader(model="policy"), group_name="nobody")
            with pytest.raises(grpc.RpcError) as caught:
                next(client._stub.UpdateWeightsFromDistributed(request, timeout=30))
            return caught.value

    err = await asyncio.to_thread(run)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "'nobody'" in err.details()


def unreachable_join(timeout_s: float, name: str = "g") -> pb.InitWeightsUpdateGroupRequest:
    """A join of a trainer whose TCP store is nowhere (port 1 of loopback: nothing listens)."""
    return pb.InitWeightsUpdateGroupRequest(
        master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name=name, timeout_s=timeout_s
    )


@pytest.mark.parametrize("timeout_s", [3600.0, 1e300, math.inf, math.nan, -1.0])
async def test_a_group_timeout_past_the_limit_or_not_a_number_is_refused(served, timeout_s):
    async with grpc.aio.insecure_channel(served.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            # The call's own timeout: an old server took such a join and blocked in it.
            await pb_grpc.LogprobServiceStub(channel).InitWeightsUpdateGroup(unreachable_join(timeout_s), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "timeout_s" in caught.value.details() and "300" in caught.value.details()


async def test_a_failed_join_keeps_the_group_that_works(served, seed):
    """The trainer's group is joined; a join of that name to a trainer that is not there fails,
    and the trainer's next push still goes through the group it had."""
    weights = new_weights(served.scorer("policy").model, seed)

    def run():
        with LogprobClient(served.target, model="policy", timeout=60) as client, broadcaster(client) as sync:
            sync.connect()
            with pytest.raises(grpc.RpcError) as caught:
                client._stub.InitWeightsUpdateGroup(unreachable_join(1.0, sync.group_name), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no TCP store" in caught.value.details()
            return sync.push("policy", weights)

    assert (await asyncio.to_thread(run)).version == 1


PENDING_JOINS = 4  # what the server lets run at once (engine.weights.updater.MAX_PENDING_JOINS)
GRACE_S = 5.0


async def test_joins_blocked_on_an_unreachable_trainer_hold_nothing_the_server_needs(rng):
    """Joins to a trainer that is not there block in the TCP store's connect until their timeout
    (300 s, the most the server allows), whatever becomes of their calls. Their calls end at their
    deadlines; a fifth while four are blocked is refused; the server still scores and takes
    pushes, says SERVING, and SIGTERM ends it within its drain time (a server subprocess)."""
    port = free_port()
    proc = launch(
        *("--port", str(port), "--metrics-port", "0", "--device", "cpu"),
        *("--grace-period-s", str(GRACE_S), "--drain-notice-s", "0.1"),
        stdout=subprocess.DEVNULL,
    )
    target = f"127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_serving, target, proc)
        async with grpc.aio.insecure_channel(target) as channel, AsyncLogprobClient(target) as client:
            stub = pb_grpc.LogprobServiceStub(channel)
            for _ in range(PENDING_JOINS):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.InitWeightsUpdateGroup(unreachable_join(300.0), timeout=1)
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.InitWeightsUpdateGroup(unreachable_join(300.0), timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"{PENDING_JOINS} joins" in caught.value.details()

            prompts, completions = random_batch(rng, 4, 4096)
            assert len(await client.score(prompts, completions, timeout=30)) == 4
            norm = {"model.norm.weight": torch.ones(128)}
            assert (await client.update_weights("default", norm, partial=True, timeout=30)).version == 1
        assert health_check(target, timeout_s=5)[0], "the server is not SERVING"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, GRACE_S + 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
