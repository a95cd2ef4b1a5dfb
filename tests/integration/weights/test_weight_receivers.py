"""Weight receivers (the ``weight_receivers`` setting): processes of the server's own that take
UpdateWeights calls on ports of their own and hand the messages to the serving process through
shared memory (``api.receiver_process``, ``api.receivers``); through a real server on loopback
(CPU, float32).

A forwarded call must be answered exactly as the same call on the server's own port (the same
interceptors and handler run it), its slots must come back whatever becomes of the call (pushes of
many more messages than a receiver has slots, after failures and broken-off calls), and a
receiver that dies must leave the server serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
import torch
from logprob_client import AsyncLogprobClient, InvalidRequest, LogprobClient
from logprob_proto import logprob_pb2 as pb
from logprob_service.api import receiver_process, receivers, wire
from logprob_service.models.builtin import build_builtin
from logprob_service.models.weights import model_fingerprint
from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings
from prometheus_client import REGISTRY

from tests.helpers.calls import update_calls
from tests.helpers.models import make_model, random_sequences
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.server import as_lists, assert_scores_match, live, new_seed, settings, start, stop
from tests.helpers.waiting import TIMEOUT_S, eventually

UPDATE_WEIGHTS = "/logprob.v1.LogprobService/UpdateWeights"
SMALL_PIECES = 4096  # the test model's tensors in many more messages than a receiver has slots


@pytest.fixture
def served(receivers_server):
    return receivers_server


def receiver_target(served, i: int = 0) -> str:
    return f"127.0.0.1:{served.service.receivers.ports[i]}"


async def answer(target: str, messages) -> pb.UpdateWeightsResponse | grpc.aio.AioRpcError:
    """One UpdateWeights call of serialized ``messages`` to ``target``: its response or its error."""
    async with grpc.aio.insecure_channel(target) as channel:
        update = channel.stream_unary(
            UPDATE_WEIGHTS, request_serializer=None, response_deserializer=pb.UpdateWeightsResponse.FromString
        )
        try:
            return await update(iter(messages), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return err


def update_requests(served) -> float:
    labels = {"model": "policy", "rpc": "UpdateWeights", "code": "OK", "protocol": "grpc"}
    return REGISTRY.get_sample_value("logprob_requests_total", labels) or 0.0


async def test_a_push_over_the_receivers_goes_live_as_over_the_servers_port(served, rng):
    ports = served.service.receivers.ports
    assert len(ports) == 2 and served.port not in ports
    first, second = (make_model("llama", tied=False, seed=new_seed(rng)) for _ in range(2))
    sequences = random_sequences(rng, 4)
    counted = update_requests(served)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        listed = await client._stub.ListModels(pb.ListModelsRequest())
        assert list(listed.weight_receiver_ports) == ports
        result = await client.update_weights("policy", first.state_dict(), streams=4, chunk_bytes=SMALL_PIECES)
        assert served.service.receivers.forwarded == 4, "each of the 4 calls went through a receiver"
        assert set(client._push_channels) == {f"127.0.0.1:{port}" for port in ports}
        assert result.version == 1 and result.fingerprint == model_fingerprint(first)
        assert (await live(client, "policy")).fingerprint == model_fingerprint(first)
        assert_scores_match(first, sequences, await client.score(*as_lists(sequences)))
    # Accounted for as calls on the port: the push over 4 calls is one request.
    assert update_requests(served) == counted + 1, "forwarded calls are accounted for as calls on the port"

    def sync_pushes() -> list:
        with LogprobClient(served.target, model="policy") as client:
            return [
                client.update_weights("policy", weights, streams=3, chunk_bytes=SMALL_PIECES, delta=True)
                for weights in (first.state_dict(), second.state_dict())
            ]

    dense, delta = await asyncio.to_thread(sync_pushes)  # the server runs on this loop
    assert served.service.receivers.forwarded == 10
    assert dense.fingerprint == model_fingerprint(first) and delta.fingerprint == model_fingerprint(second)

    async with AsyncLogprobClient(served.target, model="policy", weight_receivers=False) as client:
        result = await client.update_weights("policy", first.state_dict(), streams=2)
        assert result.fingerprint == model_fingerprint(first)
    assert served.service.receivers.forwarded == 10, "weight_receivers=False pushes to the server's port"


async def test_a_receivers_port_takes_only_update_weights(served):
    async with grpc.aio.insecure_channel(receiver_target(served)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(
                "/logprob.v1.LogprobService/ListModels",
                request_serializer=pb.ListModelsRequest.SerializeToString,
                response_deserializer=pb.ListModelsResponse.FromString,
            )(pb.ListModelsRequest(), timeout=TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def bad_calls(state: dict[str, torch.Tensor]) -> dict[str, list[bytes]]:
    """Calls the server refuses, each as it is sent."""
    good = update_calls("policy", state, version=0, partial=False, chunk_bytes=SMALL_PIECES, streams=1)[0]
    renamed = {("model.not_a_weight" if name == "model.norm.weight" else name): t for name, t in state.items()}
    reshaped = state | {"model.norm.weight": state["model.norm.weight"][:-1]}
    return {
        "unknown tensor": update_calls("policy", renamed, version=0, partial=False, streams=1)[0],
        "malformed message": [good[0], b"\xff\xff\xff", *good[1:]],
        "no commit": good[:-1],
        "wrong shape": update_calls("policy", reshaped, version=0, partial=False, streams=1)[0],
    }


async def test_bad_pushes_get_the_same_answers_from_a_receiver_as_from_the_servers_port(served, rng):
    before = (await asyncio.to_thread(lambda: LogprobClient(served.target).list_models()))[0]
    new = make_model("llama", tied=False, seed=new_seed(rng))
    state = new.state_dict()
    for what, messages in bad_calls(state).items():
        direct = await answer(served.target, messages)
        forwarded = await answer(receiver_target(served), messages)
        assert isinstance(direct, grpc.aio.AioRpcError), (what, direct)
        assert isinstance(forwarded, grpc.aio.AioRpcError), (what, forwarded)
        assert (forwarded.code(), forwarded.details()) == (direct.code(), direct.details()), what
    assert served.service.receivers.forwarded == 4
    unknown = await answer(receiver_target(served), bad_calls(state)["unknown tensor"])
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT and "model.not_a_weight" in unknown.details()
    async with AsyncLogprobClient(served.target, model="policy") as client:
        assert (await live(client, "policy")).fingerprint == before.fingerprint, "no refused push changed a weight"
        # Their slots came back: a push of many more messages than a receiver has slots goes through.
        result = await client.update_weights("policy", state, streams=2, chunk_bytes=SMALL_PIECES)
        assert result.fingerprint == model_fingerprint(new)


async def test_a_call_broken_off_leaves_the_live_weights_and_the_receiver_serving(served, rng):
    state = make_model("llama", tied=False, seed=new_seed(rng)).state_dict()
    (messages,) = update_calls("policy", state, version=0, partial=False, chunk_bytes=SMALL_PIECES, streams=1)
    sent = asyncio.Event()

    async def half_then_wait():
        for message in messages[: len(messages) // 2]:
            yield message
        sent.set()
        await asyncio.Event().wait()  # never sends the rest

    async with AsyncLogprobClient(served.target, model="policy") as client:
        before = await live(client, "policy")
        async with grpc.aio.insecure_channel(receiver_target(served)) as channel:
            call = channel.stream_unary(UPDATE_WEIGHTS, request_serializer=None)(half_then_wait(), timeout=TIMEOUT_S)
            await sent.wait()
            await eventually(lambda: served.service.device_side.updater.updating("policy"), "the update to start")
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        await eventually(
            lambda: not served.service.device_side.updater.updating("policy"), "the broken-off update to end"
        )
        assert (await live(client, "policy")).fingerprint == before.fingerprint
        result = await client.update_weights("policy", state, streams=2, chunk_bytes=SMALL_PIECES)
        assert result.version == before.version + 1


async def test_messages_larger_than_a_slot_go_over_the_pipe(llama_checkpoint, rng, monkeypatch):
    monkeypatch.setattr(receivers, "RECEIVER_SLOT_BYTES", 8192)
    server = await start(settings({"policy": str(llama_checkpoint)}, weight_receivers=1))
    try:
        new = make_model("llama", tied=False, seed=new_seed(rng))
        async with AsyncLogprobClient(server.target, model="policy") as client:
            # Pieces of 20,000 bytes: larger than a slot; the smaller tensors still fit one.
            result = await client.update_weights("policy", new.state_dict(), streams=2, chunk_bytes=20_000)
        assert server.service.receivers.forwarded == 2
        assert result.fingerprint == model_fingerprint(new)
    finally:
        await stop(server)


async def test_receivers_slots_are_page_locked_at_start_and_unlocked_at_close_unless_lent():
    # With a page_lock (the server's on a GPU: worker.pinned.page_lock), each receiver's slots
    # are locked as it starts, and unlocked as it stops, unless a view of a slot is still alive
    # (a copy may still read it): then its memory stays, locked.
    locked: list[int] = []
    unlocked: list[int] = []

    def page_lock(buffer):
        locked.append(len(buffer))
        index = len(locked) - 1
        return lambda: unlocked.append(index)

    started = await receivers.WeightReceivers.start(
        settings({"policy": "unused"}, weight_receivers=2), lambda details: None, page_lock
    )
    try:
        assert locked == [receiver_process.SLOTS * receiver_process.RECEIVER_SLOT_BYTES] * 2
        view = started._view(started._receivers[1], 3, 100)
    finally:
        await started.close()
    assert unlocked == [0]
    del view


async def test_a_receiver_that_dies_is_no_longer_announced_and_pushes_go_on(served, rng):
    gone = served.service.receivers._receivers[0]
    gone.process.kill()
    await eventually(
        lambda: served.service.receivers.ports == [served.service.receivers._receivers[1].port], "the loss"
    )
    new = make_model("llama", tied=False, seed=new_seed(rng))
    async with AsyncLogprobClient(served.target, model="policy") as client:
        listed = await client._stub.ListModels(pb.ListModelsRequest())
        assert list(listed.weight_receiver_ports) == served.service.receivers.ports
        result = await client.update_weights("policy", new.state_dict(), streams=3)
        assert result.fingerprint == model_fingerprint(new)
        sequences = random_sequences(rng, 2)
        assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))


async def test_a_receiver_that_cannot_start_stops_the_server_from_starting(llama_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError) as info:
            await start(settings({"policy": str(llama_checkpoint)}, weight_receivers=1, weight_receiver_port=port))
        assert str(info.value) == (
            f"cannot listen on 127.0.0.1:{port} (--weight-receiver-port): Address already in use "
            "(another server on this port?)"
        )


def children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


def two_consecutive_free_ports() -> int:
    """P such that P and P + 1 are free (as ``free_port``'s are: until someone takes them)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            first = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", first + 1))
            except (OSError, OverflowError):  # taken, or past 65535
                continue
            return first
    raise RuntimeError("no two consecutive free ports in 100 tries")


def test_the_cli_serves_receivers_on_its_ports_and_stops_them_on_sigterm(tmp_path, rng):
    """``serve --weight-receivers 2 --weight-receiver-port P``: receivers on P and P + 1, a push
    through them, and on SIGTERM the server drains and exits 0 with its receivers gone."""
    first = two_consecutive_free_ports()
    port = free_port()
    proc = launch(
        "--model", "default=builtin:tiny-llama", "--device", "cpu", "--metrics-port", "0",
        "--weight-receivers", "2", "--weight-receiver-port", str(first), "--grace-period-s", "5",
        env={"LOGPROB_PORT": str(port)},
        stdout=(tmp_path / "server.log").open("w"),
    )  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        receivers = children_of(proc.pid)
        assert len(receivers) == 2, receivers
        with LogprobClient(f"127.0.0.1:{port}") as client:
            listed = client._stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT_S)
            assert list(listed.weight_receiver_ports) == [first, first + 1]
            weights = {k: v + 0.01 for k, v in build_builtin("tiny-llama").state_dict().items()}
            assert client.update_weights("default", weights, streams=2).version == 1
            with pytest.raises(InvalidRequest, match="does not match the model's"):
                client.update_weights("default", make_model("llama", tied=False, seed=new_seed(rng)).state_dict())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "server.log").read_text()[-3000:]
        for pid in receivers:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2], pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_receiver_imports_no_torch():
    """A receiver is a small process: nothing of torch (also an import contract, for the layers)."""
    code = "import sys, logprob_service.api.receiver_process; print('torch' in sys.modules)"
    package_root = receiver_process.__file__.rsplit("/logprob_service/", 1)[0]
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {"PYTHONPATH": path}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_receiver_ports_must_not_take_the_servers_ports():
    with pytest.raises(ValueError, match="metrics_port"):
        Settings(device="cpu", weight_receivers=2, weight_receiver_port=9480, metrics_port=9481)
    with pytest.raises(ValueError, match="passes port 65535"):
        Settings(device="cpu", weight_receivers=3, weight_receiver_port=65534)
    assert Settings(device="cpu", weight_receivers=2, weight_receiver_port=50052).weight_receivers == 2


async def test_slots_come_back_while_finished_calls_generators_are_kept_alive(served, rng, monkeypatch):
    """A slot goes back once no view of it is left. A finished call's async generators may outlive
    the call (held by a profiler or a debugger, or not yet finalized by the loop): they must then
    hold no view. In a GPU run under yappi they were kept, each held its call's last messages,
    and after four pushes every slot was held and the next push stalled."""
    kept = []

    def keeping(original):
        def make(*args):
            generator = original(*args)
            kept.append(generator)
            return generator

        return make

    monkeypatch.setattr(wire, "update_messages", keeping(wire.update_messages))
    monkeypatch.setattr(receivers, "_messages", keeping(receivers._messages))
    first, second = (make_model("llama", tied=False, seed=new_seed(rng)).state_dict() for _ in range(2))
    broken = second | {"model.layers.1.input_layernorm.weight": torch.randn(3)}  # refused midway

    def pushes() -> None:
        with LogprobClient(served.target, model="policy") as client:
            for weights in (first, second, first):
                client.update_weights("policy", weights, streams=4, chunk_bytes=SMALL_PIECES, delta=True)
            with pytest.raises(InvalidRequest, match="input_layernorm"):
                client.update_weights("policy", broken, streams=4, chunk_bytes=SMALL_PIECES)

    await asyncio.to_thread(pushes)
    # The 12 calls of the pushes that landed, and those of the refused one that reached the server
    # before the client cancelled them on its first error.
    assert 2 * 12 < len(kept) <= 2 * 16, len(kept)
    lent = lambda: [sorted(r.lent) for r in served.service.receivers._receivers]  # noqa: E731
    await eventually(lambda: not any(lent()), "every slot to come back")
