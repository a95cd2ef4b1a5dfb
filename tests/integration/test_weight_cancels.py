"""Pushes cancelled at any point never wedge the server: a server subprocess (CLI, CPU, builtin
tiny-llama) takes single-call pushes cancelled before their header, midway, or 0-1.5 ms after
their commit (where a cancelled push once held the model's update slot until SIGKILL, and
SIGTERM never ended the process). Afterwards a push goes through, health says SERVING, every
version that went live is in the log, and SIGTERM ends the process within its drain time."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import torch
from logprob_client import AsyncLogprobClient, UpdateAborted
from logprob_client.weights import update_requests
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api.probe import check as health_check
from logprob_service.models.builtin import tiny_llama_config
from transformers import LlamaForCausalLM

from tests.helpers.calls import parsed
from tests.helpers.processes import free_port, launch, wait_serving

GRACE_S = 5.0  # the server's drain time (grace_period_s)
EXIT_MARGIN_S = 10.0  # the interpreter's own exit after the drain, on a loaded 2-core machine
TRIES = 60


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).state_dict()


async def cancelled_push(
    stub: pb_grpc.LogprobServiceStub, messages: list, cut: int, pause_s: float, delay_s: float
) -> None:
    """Send ``messages[:cut]`` (after the last but one, wait ``pause_s``: the server has staged
    every tensor when the commit comes), wait ``delay_s``, cancel the call; give the server a
    moment to end the call (else the next push may find the slot still held, and test less)."""
    sent = asyncio.Event()

    async def stream():
        for i, message in enumerate(messages[:cut]):
            if i == len(messages) - 1:
                await asyncio.sleep(pause_s)
            yield message
        sent.set()
        await asyncio.Event().wait()

    call = stub.UpdateWeights(stream())
    await sent.wait()
    await asyncio.sleep(delay_s)
    call.cancel()
    await asyncio.sleep(0.05)


async def push_once_free(client: AsyncLogprobClient, weights, timeout_s: float = 20.0) -> int:
    """A whole push, retried while the update slot is still held by a cancelled push finishing."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return (await client.update_weights("default", weights)).version
        except UpdateAborted:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_cancelled_pushes_never_wedge_the_server(tmp_path, rng, seed):
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = launch(
            *("--port", str(port), "--metrics-port", "0", "--device", "cpu"),
            *("--grace-period-s", str(GRACE_S), "--drain-notice-s", "0.1"),
            stdout=log,
        )
    target = f"127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_serving, target, proc)
        weights = new_weights(seed)
        pushes = {  # the whole push in a few messages (the wedge came within 2-10 tries so), or in many
            chunk: parsed(update_requests("default", weights, version=0, partial=False, chunk_bytes=chunk))
            for chunk in (4 << 20, 1 << 16)
        }
        async with grpc.aio.insecure_channel(target) as channel, AsyncLogprobClient(target) as client:
            stub = pb_grpc.LogprobServiceStub(channel)
            for _ in range(TRIES):
                messages = pushes[int(rng.choice(list(pushes)))]
                # Two thirds cut after the commit (where the wedge was; half of them with every
                # tensor staged first), the rest anywhere before it.
                after_commit = rng.random() < 2 / 3
                cut = len(messages) if after_commit else int(rng.integers(0, len(messages)))
                pause = 0.02 if after_commit and rng.random() < 0.5 else 0.0
                delay = float(rng.uniform(0, 0.0015)) if after_commit else 0.0
                await cancelled_push(stub, messages, cut, pause, delay)
            final = await push_once_free(client, new_weights(seed + 1))
            assert (await client.list_models())[0].version == final
        assert health_check(target, timeout_s=5)[0], "the server is not SERVING"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, GRACE_S + EXIT_MARGIN_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    logged = {int(v) for v in re.findall(r"model 'default': version (\d+) live", log_path.read_text())}
    assert logged == set(range(1, final + 1)), f"versions live but not logged: {set(range(1, final + 1)) - logged}"
