"""An update that fails or is cancelled while its tensors are being staged drops them: ``abandon``
waits for the staging work given to the pools, run or cancelled, and returns. It once waited with
``concurrent.futures.wait`` on each tensor's own future too; cancelled (the call's cancellation
reaches it through ``asyncio.wrap_future``), such a future never counts as done there, and the
wait, the model's update slot and the process's exit were held for good.

A fake stager whose staging job the test holds (threading events); no torch, no server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass

import numpy as np
import pytest
from logprob_service.domain import ModelInfo, TensorPiece, UpdateHeader
from logprob_service.engine.weights.update import Stream, Update

SHAPE = (4, 4)
WAIT_S = 30.0  # how long a broken abandon may hang before the test fails (it returns in milliseconds)


class HeldStaging:
    """Stages every tensor in a job that lasts until ``release`` is set."""

    def __init__(self) -> None:
        self.staging = threading.Event()
        self.release = threading.Event()
        self.finished = 0  # ``Stager.finish`` calls
        self.places: set[str] = set()

    def stager(self, device):
        return self

    def receive(self, dtype, shape, replicas=()):
        return self

    def write(self, offset, data) -> None:
        pass

    def finish(self, pending=None):
        if pending is None:  # ``Received.finish``: the tensor's staging job
            self.staging.set()
            assert self.release.wait(WAIT_S), "the test never released the staging job"
            return [None], None
        self.finished += 1  # ``Stager.finish``
        return [None for _ in pending]


@dataclass
class Replica:
    info: ModelInfo
    device: str = "cpu"

    def updatable(self):
        return self

    def check(self, name, dtype, shape, *, sparse=False):
        return None

    def missing(self, names):
        return []


@pytest.fixture
def pools():
    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        concurrent.futures.ThreadPoolExecutor(2) as writers,
    ):
        yield pool, writers


def whole_tensor(name: str) -> TensorPiece:
    data = np.zeros(SHAPE, np.float32).tobytes()
    return TensorPiece(name, "float32", SHAPE, 0, data)


async def test_a_commit_cancelled_while_its_tensors_are_staged_ends(pools):
    staging = HeldStaging()
    info = ModelInfo("m", "fake", "fake", 100, None, "float32", "cpu", 0, "")
    update = Update([Replica(info)], UpdateHeader("m", 1, partial=True), staging, *pools)
    stream = Stream()
    for name in ("a", "b", "c"):  # the first runs (held), the other two wait for the pool's 2nd thread or queue
        update.add_piece(whole_tensor(name), stream)
    await asyncio.to_thread(staging.staging.wait, WAIT_S)

    committing = asyncio.ensure_future(update.staged_tensors())
    await asyncio.sleep(0.05)  # waiting for the held job
    committing.cancel()  # cancels each tensor's future it waits on
    await asyncio.sleep(0.05)
    staging.release.set()  # the running jobs end; abandon must not wait for anything else
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(committing), WAIT_S)
    assert staging.finished == 1  # abandon ended with the stager's finish
