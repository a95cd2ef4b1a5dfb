"""One UpdateWeights push over several calls at once (``UpdateWeightsHeader.streams``/``update_id``),
through a real server on loopback (CPU, float32): the calls join one update, which goes live once
when the last commits, every call answered alike; a failure of any call fails them all, leaves the
live weights, and frees the model's update slot.

Raw calls send what ``logprob_client.weights`` serializes, through a multicallable that takes
bytes, so that each call's own answer is seen. Where a test needs every stream joined before any
sends a tensor, the streams hold their tensors until the server's session of the update counts
them all (``WeightUpdater._sessions``, read by ``joined``).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Iterable

import grpc
import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient, LogprobClient
from logprob_client.weights import dense_piece
from logprob_proto import logprob_pb2 as pb
from logprob_service.engine.weights import session as weights_session
from logprob_service.models.weights import UpdatableWeights, model_fingerprint

from tests.helpers.calls import parsed, unpacked, update_calls
from tests.helpers.models import make_model, random_sequences
from tests.helpers.server import as_lists, assert_scores_match, live, new_seed, settings, start, stop
from tests.helpers.waiting import TIMEOUT_S, eventually

UPDATE_WEIGHTS = "/logprob.v1.LogprobService/UpdateWeights"
NORM = "model.norm.weight"


@pytest.fixture
def served(policy_server):
    return policy_server


def raw_update(channel: grpc.aio.Channel):
    """UpdateWeights taking serialized messages, as ``logprob_client`` sends them."""
    return channel.stream_unary(
        UPDATE_WEIGHTS, request_serializer=None, response_deserializer=pb.UpdateWeightsResponse.FromString
    )


async def answers(channel: grpc.aio.Channel, calls: Iterable) -> list[pb.UpdateWeightsResponse | grpc.aio.AioRpcError]:
    """Each call's answer (its response or its error), the calls made together."""
    update = raw_update(channel)
    return await asyncio.wait_for(
        asyncio.gather(*(update(call, timeout=TIMEOUT_S) for call in calls), return_exceptions=True), 2 * TIMEOUT_S
    )


def assert_failed(answer, code: grpc.StatusCode, *fragments: str) -> None:
    assert isinstance(answer, grpc.aio.AioRpcError), answer
    assert answer.code() == code, (answer.code(), answer.details())
    for fragment in fragments:
        assert fragment in answer.details(), (fragment, answer.details())


def noisy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with a little noise (torch's global generator is seeded per test)."""
    return {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}


def fingerprint_of(weights: dict[str, torch.Tensor]) -> str:
    model = make_model("llama", tied=False, seed=0)
    model.load_state_dict(weights)
    return model_fingerprint(model)


def joined(running) -> int:
    """How many streams the update of ``policy`` over several has (0: no such update in progress)."""
    session = running.service.device_side.updater._sessions.get("policy")  # private: the moment of the join
    return 0 if session is None else session.joined


async def held(messages: list[bytes], go: asyncio.Event) -> AsyncIterator[bytes]:
    """A call that sends its header, then the rest once ``go`` is set."""
    yield messages[0]
    await go.wait()
    for message in messages[1:]:
        yield message


async def go_once_joined(running, streams: int, go: asyncio.Event) -> None:
    await eventually(lambda: joined(running) == streams, f"{streams} streams to join the update")
    go.set()


@pytest.mark.parametrize("chunk_bytes", [4096, 100 << 10], ids=["4KiB-pieces", "100KiB-pieces-viewed"])
async def test_a_push_over_three_streams_goes_live_once(served, rng, chunk_bytes):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    state = new.state_dict()
    sequences = random_sequences(rng, 4)
    calls = update_calls("policy", state, version=0, partial=False, chunk_bytes=chunk_bytes, streams=3)
    assert len(calls) == 3
    async with (
        grpc.aio.insecure_channel(served.target) as channel,
        AsyncLogprobClient(served.target, model="policy") as client,
    ):
        before = await live(client, "policy")
        responses = await answers(channel, calls)
        assert all(isinstance(r, pb.UpdateWeightsResponse) for r in responses), responses
        assert all(r == responses[0] for r in responses[1:]), "every call is answered with the one outcome"
        r = responses[0]
        assert (r.model, r.version, r.tensors) == ("policy", before.version + 1, len(state))
        assert r.bytes == sum(t.nbytes for t in state.values())
        after = await live(client, "policy")
        assert after.version == before.version + 1, "one update, one version"
        assert after.fingerprint == r.fingerprint == model_fingerprint(new) != before.fingerprint
        assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))
        assert not served.service.device_side.updater.updating("policy")


async def test_an_ended_update_over_several_streams_holds_no_staged_tensors(served, rng, monkeypatch):
    """Once live, an update's staged copies are garbage: the updater remembers an ended update's
    id (for streams that come late), never the update, which holds them (a model's size each)."""
    updates = []
    start_update = served.service.device_side.updater._start_update

    def recording(header):
        update = start_update(header)
        updates.append(weakref.ref(update))
        return update

    monkeypatch.setattr(served.service.device_side.updater, "_start_update", recording)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        for _ in range(2):
            state = make_model("llama", tied=False, seed=new_seed(rng)).state_dict()
            await client.update_weights("policy", state, streams=3)
    gc.collect()
    assert len(updates) == 2 and all(ref() is None for ref in updates), "an ended update is still referenced"


async def test_the_clients_push_over_several_streams(served, rng):
    first, second = (make_model("llama", tied=False, seed=new_seed(rng)) for _ in range(2))
    async with AsyncLogprobClient(served.target, model="policy") as client:
        result = await client.update_weights("policy", first.state_dict(), streams=3, chunk_bytes=10_000)
        assert result.version == 1 and result.fingerprint == model_fingerprint(first)

    def sync_push():
        with LogprobClient(served.target, model="policy") as sync_client:
            return sync_client.update_weights("policy", second.state_dict(), streams=4, version=9)

    result = await asyncio.to_thread(sync_push)  # the server runs on this loop: the blocking client off it
    assert result.version == 9 and result.fingerprint == model_fingerprint(second)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        assert (await live(client, "policy")).fingerprint == model_fingerprint(second)


async def test_a_bad_tensor_in_one_stream_fails_every_call_and_changes_nothing(served):
    good = noisy(served.scorer("policy").model)
    bad = good | {NORM: torch.randn(7)}  # the model's is [64]
    calls = update_calls("policy", bad, version=0, partial=False, streams=3)
    carrier = next(c for c, call in enumerate(calls) if any(m.tensor.name == NORM for m in unpacked(parsed(call))))
    go = asyncio.Event()
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        waiter = asyncio.create_task(go_once_joined(served, 3, go))
        results = await answers(channel, [held(call, go) for call in calls])
        await waiter
        assert_failed(results[carrier], grpc.StatusCode.INVALID_ARGUMENT, NORM, "shape [7]")
        for result in results:
            assert isinstance(result, grpc.aio.AioRpcError), "every call of the update fails"
            assert result.code() == grpc.StatusCode.INVALID_ARGUMENT and NORM in result.details(), result.details()
        assert await live(client, "policy") == before
        assert not served.service.device_side.updater.updating("policy")

        result = await client.update_weights("policy", good, streams=3)
        assert result.version == before.version + 1 and result.fingerprint == fingerprint_of(good)


async def test_a_missing_stream_aborts_the_update_after_the_join_time(served, monkeypatch):
    monkeypatch.setattr(weights_session, "STREAMS_JOIN_S", 0.5)
    good = noisy(served.scorer("policy").model)
    calls = update_calls("policy", good, version=0, partial=False, streams=2)
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        (result,) = await answers(channel, calls[:1])  # the other call is never made
        assert_failed(result, grpc.StatusCode.ABORTED, "only 1 of the 2 streams", "0.5 s", "nothing applied")
        assert await live(client, "policy") == before
        assert not served.service.device_side.updater.updating("policy") and joined(served) == 0, (
            "the update slot is free"
        )

        result = await client.update_weights("policy", good, streams=2)
        assert result.version == before.version + 1 and result.fingerprint == fingerprint_of(good)


def with_header(call: Iterable[bytes], **changes) -> list[bytes]:
    """A call's messages with its header changed."""
    messages = list(call)
    header = pb.UpdateWeightsRequest.FromString(messages[0])
    for field, value in changes.items():
        setattr(header.header, field, value)
    return [header.SerializeToString(), *messages[1:]]


@pytest.mark.parametrize(
    "changes", [dict(partial=True), dict(version=5), dict(streams=3)], ids=["partial", "version", "streams"]
)
async def test_streams_whose_headers_differ_fail_the_update(served, changes):
    good = noisy(served.scorer("policy").model)
    first, second = update_calls("policy", good, version=0, partial=False, streams=2)
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        results = await answers(channel, [list(first), with_header(second, **changes)])
        for result in results:
            assert_failed(result, grpc.StatusCode.INVALID_ARGUMENT, "header", "nothing applied")
        assert await live(client, "policy") == before
        assert not served.service.device_side.updater.updating("policy")
        assert (await client.update_weights("policy", good, streams=2)).fingerprint == fingerprint_of(good)


def one_tensor_stream(header: pb.UpdateWeightsHeader, name: str, data: np.ndarray, chunk_bytes: int) -> list[bytes]:
    raw = memoryview(data.view(np.uint8).reshape(-1))
    pieces = [
        dense_piece(name, data.dtype.name, data.shape, offset, raw[offset : offset + chunk_bytes])
        for offset in range(0, len(raw), chunk_bytes)
    ]
    commit = pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(tensor_count=1))
    return [pb.UpdateWeightsRequest(header=header).SerializeToString(), *pieces, commit.SerializeToString()]


async def test_a_tensor_sent_on_two_streams_of_one_update_is_refused(served, rng):
    header = pb.UpdateWeightsHeader(model="policy", partial=True, streams=2, update_id="same-tensor-twice")
    norm = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    calls = [one_tensor_stream(header, NORM, norm, 64), one_tensor_stream(header, NORM, norm[::-1].copy(), 100)]
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        for result in await answers(channel, calls):
            assert_failed(result, grpc.StatusCode.INVALID_ARGUMENT, NORM, "sent twice")
        assert await live(client, "policy") == before
        assert not served.service.device_side.updater.updating("policy")

        # The same two streams, each with a tensor of its own, go live together.
        other = "model.layers.0.input_layernorm.weight"
        header.update_id = "two-tensors"
        calls = [one_tensor_stream(header, NORM, norm, 64), one_tensor_stream(header, other, norm[::-1].copy(), 100)]
        results = await answers(channel, calls)
        assert all(isinstance(r, pb.UpdateWeightsResponse) and r == results[0] for r in results), results
        assert (results[0].version, results[0].tensors, results[0].bytes) == (before.version + 1, 2, 2 * norm.nbytes)
        model = served.scorer("policy").model
        np.testing.assert_array_equal(model.get_parameter(NORM).detach().numpy(), norm)
        np.testing.assert_array_equal(model.get_parameter(other).detach().numpy(), norm[::-1])


async def test_a_stream_too_many_is_refused_alone(served):
    good = noisy(served.scorer("policy").model)
    calls = update_calls("policy", good, version=0, partial=False, streams=2)
    extra = [calls[0][0], pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit()).SerializeToString()]
    go = asyncio.Event()
    async with grpc.aio.insecure_channel(served.target) as channel:
        update = raw_update(channel)
        streams = [asyncio.ensure_future(update(held(call, go), timeout=TIMEOUT_S)) for call in calls]
        await eventually(lambda: joined(served) == 2, "the update's 2 streams to join")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await update(iter(extra), timeout=TIMEOUT_S)  # a third, while the two hold their tensors
        assert_failed(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "already has its 2 streams")
        go.set()
        first, second = await asyncio.gather(*streams)
        assert first == second and first.fingerprint == fingerprint_of(good)


async def test_a_stream_that_comes_after_its_update_failed_gets_the_updates_failure(served, monkeypatch):
    """A stream of an update that already failed (another of its streams was refused) must be
    answered with that failure, as every stream of the update is, not start the update anew: it
    would then take the model's update slot, keep it for STREAMS_JOIN_S waiting for streams that
    already ended, and answer ABORTED for a missing stream."""
    monkeypatch.setattr(weights_session, "STREAMS_JOIN_S", 2.0)
    good = noisy(served.scorer("policy").model)
    bad = good | {NORM: torch.randn(7)}
    calls = update_calls("policy", bad, version=0, partial=False, streams=2)
    carrier = next(c for c, call in enumerate(calls) if any(m.tensor.name == NORM for m in unpacked(parsed(call))))
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        (failed,) = await answers(channel, [calls[carrier]])  # its partner has not come yet
        assert_failed(failed, grpc.StatusCode.INVALID_ARGUMENT, NORM)
        assert not served.service.device_side.updater.updating("policy")
        (late,) = await answers(channel, [calls[1 - carrier]])
        assert await live(client, "policy") == before
        assert not served.service.device_side.updater.updating("policy")
        assert_failed(late, grpc.StatusCode.INVALID_ARGUMENT, NORM)


async def test_a_stream_cancelled_once_the_swap_has_begun_leaves_the_others_a_true_answer(served, monkeypatch):
    """The last stream of an update to commit runs its swap, and a swap that has begun runs to its
    end (``Scheduler.swap``): if that stream's call is cancelled meanwhile, the update still goes
    live, so the other streams must not be answered that nothing was applied (nor the model's
    update slot be freed before the swap is done)."""
    in_apply, release = threading.Event(), threading.Event()
    apply = UpdatableWeights.apply

    def held_apply(self, staged):  # on the device thread: the swap has begun
        in_apply.set()
        assert release.wait(TIMEOUT_S), "the test never let the swap go on"
        return apply(self, staged)

    monkeypatch.setattr(UpdatableWeights, "apply", held_apply)
    good = noisy(served.scorer("policy").model)
    first, last = update_calls("policy", good, version=0, partial=False, streams=2)
    committed = asyncio.Event()

    async def commits_after_the_first(messages):
        for message in messages[:-1]:
            yield message
        await committed.wait()
        yield messages[-1]

    def first_committed() -> bool:
        session = served.service.device_side.updater._sessions.get("policy")  # private: the moment of the commit
        return session is not None and session.committed == 1

    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        update = raw_update(channel)
        try:
            first_call = asyncio.ensure_future(update(iter(first), timeout=TIMEOUT_S))
            last_call = update(commits_after_the_first(last), timeout=TIMEOUT_S)
            await eventually(first_committed, "the first stream to commit")
            committed.set()
            assert await asyncio.to_thread(in_apply.wait, TIMEOUT_S), "the swap never began"
            last_call.cancel()
            await asyncio.wait([first_call], timeout=5.0)  # time for the cancellation to reach the server
            slot_held_during_swap = served.service.device_side.updater.updating("policy")
        finally:
            release.set()
        with pytest.raises(asyncio.CancelledError):
            await last_call
        answer = await asyncio.gather(first_call, return_exceptions=True)
        await served.service.engine.lanes[0].run(lambda: None)  # the device thread is past the swap
        after = await live(client, "policy")
    assert after.version == before.version + 1 and after.fingerprint == fingerprint_of(good)  # it went live
    assert isinstance(answer[0], pb.UpdateWeightsResponse), (
        f"answered {answer[0]!r} though the update went live (update slot held during the swap: "
        f"{slot_held_during_swap})"
    )
    assert answer[0].version == after.version
    assert slot_held_during_swap, "the model's update slot was freed while its swap was still running"


IDLE_S = 0.5  # the server's update_idle_timeout_s in the tests below


@pytest.fixture
async def idle_served(llama_checkpoint):
    running = await start(settings({"policy": str(llama_checkpoint)}, update_idle_timeout_s=IDLE_S))
    yield running
    await stop(running)


async def header_then_nothing(messages: list[bytes]) -> AsyncIterator[bytes]:
    """A call that sends its header and then holds its stream open, sending nothing."""
    yield messages[0]
    await asyncio.Event().wait()


async def test_a_stream_that_sends_only_its_header_is_aborted_after_the_idle_limit(idle_served):
    """One call of a two-call update sends all of its share; the other only its header, and holds
    its stream open. Past the server's idle limit both calls are answered ABORTED (neither is
    left waiting for a client that sends nothing), the model's update slot is free, nothing
    changed; a push then goes through. A single-call update likewise."""
    served = idle_served
    good = noisy(served.scorer("policy").model)
    first, second = update_calls("policy", good, version=0, partial=False, streams=2)
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        update = raw_update(channel)
        answered = await asyncio.wait_for(
            asyncio.gather(
                update(iter(first), timeout=TIMEOUT_S),
                update(header_then_nothing(second), timeout=TIMEOUT_S),
                return_exceptions=True,
            ),
            TIMEOUT_S,
        )
        for answer in answered:
            assert_failed(answer, grpc.StatusCode.ABORTED, f"no message came for {IDLE_S:g} s", "update_idle_timeout_s")
        assert not served.service.device_side.updater.updating("policy") and joined(served) == 0, (
            "the update slot is free"
        )
        assert await live(client, "policy") == before

        (alone,) = update_calls("policy", good, version=0, partial=False, streams=1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(update(header_then_nothing(alone), timeout=TIMEOUT_S), TIMEOUT_S)
        assert_failed(caught.value, grpc.StatusCode.ABORTED, "update_idle_timeout_s", "model 'policy'")
        assert not served.service.device_side.updater.updating("policy")

        result = await client.update_weights("policy", good, streams=2)
        assert result.version == before.version + 1 and result.fingerprint == fingerprint_of(good)
