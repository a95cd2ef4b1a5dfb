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
from tests.helpers.pushes import cancelled_push, cut_point

GRACE_S = 5.0  # the server's drain time (grace_period_s)
EXIT_MARGIN_S = 10.0  # the interpreter's own exit after the drain, on a loaded 2-core machine
TRIES = 60


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).state_dict()


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
                # Two thirds cut after the commit (where the wedge was), the rest anywhere before it.
                await cancelled_push(stub, messages, *cut_point(rng, messages, after_commit=2 / 3))
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
