"""Push processes (the client's ``push_processes`` option): a push's UpdateWeights calls made from
processes of the client's own, its messages handed over through shared memory
(``logprob_client.push_processes``, ``logprob_client.push_process``); through a real server on
loopback (CPU, float32).

A push from them must go live exactly as one from the client's own process (the same fingerprint,
the same scores, the same errors), their slots must come back whatever becomes of a call, and a
process that dies must fail its push with a clear error and be replaced at the next.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from logprob_client import AsyncLogprobClient, InvalidRequest, LogprobClient, Unavailable
from logprob_client.channel import Connection
from logprob_client.push_processes import PushProcesses
from logprob_client.weights import update_streams
from logprob_proto import logprob_pb2 as pb
from logprob_service.models.weights import model_fingerprint

from tests.helpers.models import make_model, random_sequences
from tests.helpers.server import as_lists, assert_scores_match, live, new_seed
from tests.helpers.waiting import TIMEOUT_S

SMALL_PIECES = 4096  # the test model's tensors in many more messages than a process has slots


def processes_of(client) -> list:
    return [p for p in client._processes._processes if p is not None]


def gated(state: dict, read: threading.Event, go: threading.Event):
    """``state``'s tensors, as a trainer's iterator: ``read`` set before the third, which waits for ``go``."""
    for i, (name, tensor) in enumerate(state.items()):
        if i == 2:
            read.set()
            go.wait(TIMEOUT_S)
        yield name, tensor


async def test_a_push_from_push_processes_goes_live_as_one_from_the_client(policy_server, rng):
    first, second = (make_model("llama", tied=False, seed=new_seed(rng)) for _ in range(2))
    sequences = random_sequences(rng, 4)

    def pushes() -> tuple:
        with LogprobClient(policy_server.target, model="policy", push_processes=2) as client:
            dense = client.update_weights("policy", first.state_dict(), streams=4, chunk_bytes=SMALL_PIECES)
            started = [p.process.pid for p in processes_of(client)]
            scores = client.score(*as_lists(sequences))
            # Deltas (the first dense, the next sparse) through the same processes, kept between pushes.
            deltas = [
                client.update_weights("policy", w, streams=3, chunk_bytes=SMALL_PIECES, delta=True)
                for w in (first.state_dict(), second.state_dict())
            ]
            assert [p.process.pid for p in processes_of(client)] == started
            popens = [p.process for p in processes_of(client)]
        return dense, scores, deltas, started, popens

    dense, scores, deltas, started, popens = await asyncio.to_thread(pushes)  # the server runs on this loop
    assert len(started) == 2
    assert (dense.version, dense.fingerprint) == (1, model_fingerprint(first))
    assert_scores_match(first, sequences, scores)
    assert [d.fingerprint for d in deltas] == [model_fingerprint(first), model_fingerprint(second)]
    assert [p.poll() for p in popens] == [0, 0], "closing the client stops its push processes"
    async with AsyncLogprobClient(policy_server.target, model="policy") as client:
        assert (await live(client, "policy")).fingerprint == model_fingerprint(second)


async def test_push_processes_spread_a_push_over_the_weight_receivers(receivers_server, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    async with AsyncLogprobClient(receivers_server.target, model="policy", push_processes=2) as client:
        result = await client.update_weights("policy", new.state_dict(), streams=4, chunk_bytes=SMALL_PIECES)
        assert len(processes_of(client)) == 2
    assert result.fingerprint == model_fingerprint(new)
    assert receivers_server.service.receivers.forwarded == 4, "each call went to a receiver's port"


async def test_a_refused_push_from_push_processes_names_the_tensor_and_frees_every_slot(policy_server, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    good = new.state_dict()
    renamed = {("model.not_a_weight" if name == "model.norm.weight" else name): t for name, t in good.items()}

    def pushes():
        with LogprobClient(policy_server.target, model="policy", push_processes=1) as client:
            before = client.list_models()[0]
            for _ in range(3):  # more messages in all than the process has slots
                with pytest.raises(InvalidRequest, match=r"model\.not_a_weight"):
                    client.update_weights("policy", renamed, streams=2, chunk_bytes=SMALL_PIECES)
            assert client.list_models()[0].version == before.version, "the live weights are unchanged"
            return client.update_weights("policy", good, streams=2, chunk_bytes=SMALL_PIECES)

    result = await asyncio.to_thread(pushes)
    assert result.fingerprint == model_fingerprint(new)


async def test_a_trainers_exception_while_reading_its_tensors_is_raised_as_it_is(policy_server, rng):
    state = make_model("llama", tied=False, seed=new_seed(rng)).state_dict()

    def failing():
        for i, (name, tensor) in enumerate(state.items()):
            if i == 3:
                raise RuntimeError("the trainer's tensors are gone")
            yield name, tensor

    def push():
        with LogprobClient(policy_server.target, model="policy", push_processes=1) as client:
            before = client.list_models()[0].version
            with pytest.raises(RuntimeError, match="the trainer's tensors are gone"):
                client.update_weights("policy", failing(), streams=1, chunk_bytes=SMALL_PIECES)
            return before, client.list_models()[0].version

    before, after = await asyncio.to_thread(push)
    assert after == before


async def test_a_push_process_that_dies_fails_its_push_and_is_started_again(policy_server, rng):
    state = make_model("llama", tied=False, seed=new_seed(rng)).state_dict()
    read, go = threading.Event(), threading.Event()

    def push():
        with LogprobClient(policy_server.target, model="policy", push_processes=1) as client:
            before = client.list_models()[0].version
            client.update_weights("policy", state, streams=1)  # starts the process
            (process,) = processes_of(client)

            def kill():
                read.wait(TIMEOUT_S)
                process.process.kill()
                process.process.wait()
                go.set()

            killer = threading.Thread(target=kill)
            killer.start()
            with pytest.raises(Unavailable, match=f"push process 0 \\(pid {process.process.pid}\\) exited"):
                client.update_weights("policy", gated(state, read, go), streams=1, chunk_bytes=SMALL_PIECES)
            killer.join()
            assert client.list_models()[0].version == before + 1, "the broken push changed nothing"
            again = client.update_weights("policy", state, streams=2)
            (fresh,) = processes_of(client)
            return before, again, process.process.pid, fresh.process.pid

    before, again, dead, fresh = await asyncio.to_thread(push)
    assert again.version == before + 2 and fresh != dead


async def test_messages_larger_than_a_slot_go_over_the_pipe(policy_server, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    # Slots of 1 KiB: the 4 KiB pieces go over the pipe; the header and commit, in slots.
    processes = PushProcesses(Connection(max_attempts=1), 2, slot_bytes=1024)
    try:
        calls = update_streams("policy", new.state_dict(), version=0, partial=False, chunk_bytes=4096, streams=3)
        raw = await asyncio.to_thread(processes.push, [policy_server.target] * 3, calls, TIMEOUT_S)
    finally:
        processes.close()
    assert pb.UpdateWeightsResponse.FromString(raw).fingerprint == model_fingerprint(new)


def test_push_processes_refuse_bad_settings():
    with pytest.raises(ValueError, match="push_processes must be >= 0, got -1"):
        LogprobClient("localhost:1", push_processes=-1)
    with pytest.raises(ValueError, match="push_processes needs a target"):
        LogprobClient("localhost:1", push_processes=2, channel=object())
    with pytest.raises(ValueError, match="push_processes must be >= 1"):
        PushProcesses(Connection(), 0, slot_bytes=1024)


async def test_an_async_push_cancelled_mid_way_changes_nothing(policy_server, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    state = new.state_dict()
    read, go = threading.Event(), threading.Event()

    async with AsyncLogprobClient(policy_server.target, model="policy", push_processes=1) as client:
        before = (await live(client, "policy")).version
        weights = gated(state, read, go)
        push = asyncio.ensure_future(client.update_weights("policy", weights, streams=1, chunk_bytes=SMALL_PIECES))
        assert await asyncio.to_thread(read.wait, TIMEOUT_S)
        push.cancel()
        with pytest.raises(asyncio.CancelledError):
            await push
        go.set()
        assert (await live(client, "policy")).version == before, "the cancelled push changed nothing"
        again = await client.update_weights("policy", state, streams=2)
        assert again.version == before + 1 and again.fingerprint == model_fingerprint(new)
