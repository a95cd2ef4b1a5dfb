"""Pushes that a test cuts off: raw UpdateWeights calls cancelled at a chosen point."""

from __future__ import annotations

import asyncio

from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc


async def cancelled_push(
    stub: pb_grpc.LogprobServiceStub, messages: list[pb.UpdateWeightsRequest], cut: int, pause_s: float, delay_s: float
) -> None:
    """Send ``messages[:cut]`` (before the last, the commit, wait ``pause_s``: the server then has
    every tensor staged when the commit comes), wait ``delay_s``, cancel the call; then give the
    server a moment to end the call (else the next push may find the model's update slot still
    held, and test less)."""
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


def cut_point(rng, messages: list, after_commit: float) -> tuple[int, float, float]:
    """Where ``cancelled_push`` cuts a push: after its commit with probability ``after_commit`` (0-1.5
    ms after it, half of the time with every tensor staged first), else anywhere before it
    (before the header included). Returns (cut, pause_s, delay_s)."""
    if rng.random() < after_commit:
        return len(messages), (0.02 if rng.random() < 0.5 else 0.0), float(rng.uniform(0, 0.0015))
    return int(rng.integers(0, len(messages))), 0.0, 0.0
