"""Weight-update streams yield to scoring: they are not read while a micro-batch is being launched
(``Scheduler.between_launches``; ``update_yield_to_launches``, on by default), each message at most
``updater.LAUNCH_YIELD_MAX_S`` late.

With a fake device whose launch the test holds: no launch, no wait (checked without the clock: the
wait never suspends); a launch in progress, a wait until it ends, or ``max_wait_s`` at most (a
lower bound only, and an upper bound many times it). Through a real server whose model's launch
the test holds (``tests.helpers.calls.Gate``): a push is not read meanwhile, read on once the
launch ends; read slowly with a short ``LAUNCH_YIELD_MAX_S``; read at once when yielding is off.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient
from logprob_client.weights import update_requests
from logprob_service.domain import ModelInfo, ScoreJob, SequenceScores, TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.weights import update as weights_update
from logprob_service.engine.weights import updater as weights_updater

from tests.helpers.calls import Gate, parsed, unpacked
from tests.helpers.server import settings, start, stop
from tests.helpers.waiting import eventually


@dataclass
class Replica:
    info: ModelInfo
    device: str


@dataclass
class LaunchGroup:
    indices: list[int]
    launched: asyncio.Future
    error: Exception | None = None


class HeldDevice:
    """A lane's executor whose launches last until the test releases them (or fail, if it says)."""

    def __init__(self) -> None:
        self.launching = asyncio.Event()
        self.release = asyncio.Event()
        self.fail_launch = False

    async def launch(self, served, sequences, options):
        self.launching.set()
        await self.release.wait()
        if self.fail_launch:
            raise RuntimeError("the launch failed")
        done = asyncio.get_running_loop().create_future()
        done.set_result([SequenceScores(np.zeros(len(s.completion_ids), np.float32)) for s in sequences])
        return [LaunchGroup(list(range(len(sequences))), done)]

    async def fetch(self, launched):
        return await launched

    async def run(self, fn):
        return fn()


@pytest.fixture
async def held():
    device = HeldDevice()
    info = ModelInfo("m", "fake", "fake", 100, None, "float32", "", 0, "")
    registry = ModelRegistry()
    registry.add(Replica(replace(info, device="dev0"), "dev0"), [])
    scheduler = Scheduler(
        registry,
        [device],
        max_queued_tokens=10**6,
        max_queued_tokens_per_client=10**6,
        max_batch_tokens=100,
        max_batch_sequences=1,
        max_wait_ms=0,
    )
    scheduler.start()
    yield scheduler, device
    device.release.set()
    await scheduler.close()


def a_job(rng: np.random.Generator) -> ScoreJob:
    ids = rng.integers(0, 100, 10)
    return ScoreJob("r", "m", [TokenSequence(ids[:6], ids[6:])])


def returns_without_waiting(scheduler: Scheduler, max_wait_s: float) -> bool:
    """Whether ``between_launches`` returns without ever suspending (driven by hand, no loop)."""
    waiting = scheduler.between_launches(max_wait_s)
    try:
        waiting.send(None)
    except StopIteration:
        return True
    waiting.close()
    return False


async def test_no_launch_no_wait(held):
    scheduler, _ = held
    assert all(returns_without_waiting(scheduler, 60.0) for _ in range(1000))
    t0 = time.monotonic()
    for _ in range(1000):
        await scheduler.between_launches(60.0)
    assert time.monotonic() - t0 < 30.0  # at once, where one wait would be a minute


async def test_a_launch_in_progress_is_waited_for_until_it_ends(held, rng):
    scheduler, device = held
    scoring = asyncio.create_task(scheduler.submit(a_job(rng)))
    await asyncio.wait_for(device.launching.wait(), 30)
    assert not returns_without_waiting(scheduler, 60.0)
    waiting = asyncio.create_task(scheduler.between_launches(60.0))
    await asyncio.sleep(0.2)
    assert not waiting.done(), "returned while the launch was in progress"
    device.release.set()
    await asyncio.wait_for(waiting, 30)  # once the launch has returned, well before 60 s
    assert len((await asyncio.wait_for(scoring, 30)).scores) == 1
    assert returns_without_waiting(scheduler, 60.0)


async def test_a_launch_in_progress_is_waited_for_at_most_max_wait_s(held, rng):
    scheduler, device = held
    scoring = asyncio.create_task(scheduler.submit(a_job(rng)))
    await asyncio.wait_for(device.launching.wait(), 30)
    for max_wait_s in (0.05, 0.3):
        t0 = time.monotonic()
        await scheduler.between_launches(max_wait_s)
        elapsed = time.monotonic() - t0
        assert 0.9 * max_wait_s <= elapsed < 10 * max_wait_s + 5.0, (max_wait_s, elapsed)
        assert not device.release.is_set() and not scoring.done()  # still launching
    device.release.set()
    await asyncio.wait_for(scoring, 30)


async def test_a_failed_launch_ends_the_wait_too(held, rng):
    scheduler, device = held
    device.fail_launch = True
    scoring = asyncio.create_task(scheduler.submit(a_job(rng)))
    await asyncio.wait_for(device.launching.wait(), 30)
    waiting = asyncio.create_task(scheduler.between_launches(60.0))
    device.release.set()
    await asyncio.wait_for(waiting, 30)
    with pytest.raises(RuntimeError, match="the launch failed"):
        await asyncio.wait_for(scoring, 30)
    assert returns_without_waiting(scheduler, 60.0)


# Through a real server: a push's reading while the model's launch is held.


@pytest.fixture
def pieces_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tensor pieces the server's updates take in, in order."""
    read: list[str] = []
    add_piece = weights_update.Update.add_piece

    def counted(self, piece, stream):
        read.append(piece.name)
        return add_piece(self, piece, stream)

    monkeypatch.setattr(weights_update.Update, "add_piece", counted)
    return read


async def push_while_a_launch_is_held(running, pieces_read: list[str], rng, check_while_held) -> None:
    """A push over one call while the model's launch of a score request is held; ``check_while_held``
    (given the push's messages) runs meanwhile, then the launch is let go and the push must land."""
    model = running.scorer("policy").model
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    messages = unpacked(parsed(update_requests("policy", state, version=0, partial=False, chunk_bytes=32 << 10)))
    gate = Gate(running, "policy")
    async with AsyncLogprobClient(running.target, model="policy") as client:
        try:
            scoring = asyncio.create_task(client.score([rng.integers(0, 500, 8).tolist()], [[1, 2, 3]]))
            await gate.wait_entered()
            pushing = asyncio.create_task(client.update_weights("policy", state, chunk_bytes=32 << 10, streams=1))
            await check_while_held(messages)
            assert not pushing.done(), "the swap waits for the held launch"
        finally:
            gate.restore()
        await asyncio.wait_for(scoring, 60)
        result = await asyncio.wait_for(pushing, 60)
    assert result.version == 1 and len(pieces_read) == len(messages) - 2


async def test_a_push_is_not_read_while_a_launch_is_in_progress(llama_checkpoint, pieces_read, monkeypatch, rng):
    monkeypatch.setattr(weights_updater, "LAUNCH_YIELD_MAX_S", 3600.0)  # yield for as long as the launch lasts
    running = await start(settings({"policy": str(llama_checkpoint)}))
    try:
        assert running.service.settings.update_yield_to_launches  # the default

        async def nothing_read(messages):
            await asyncio.sleep(0.5)  # time enough to read a few hundred KB, were it read
            assert pieces_read == []

        await push_while_a_launch_is_held(running, pieces_read, rng, nothing_read)
    finally:
        await stop(running)


async def test_a_push_goes_on_slowly_while_launches_last(llama_checkpoint, pieces_read, monkeypatch, rng):
    monkeypatch.setattr(weights_updater, "LAUNCH_YIELD_MAX_S", 0.05)
    running = await start(settings({"policy": str(llama_checkpoint)}))
    try:

        async def read_slowly(messages):
            t0 = time.monotonic()
            pieces = len(messages) - 2
            await eventually(lambda: len(pieces_read) == pieces, "every piece to be read while the launch is held")
            # Every message (the pieces and the commit) waits its LAUNCH_YIELD_MAX_S first.
            assert time.monotonic() - t0 >= 0.9 * 0.05 * pieces

        await push_while_a_launch_is_held(running, pieces_read, rng, read_slowly)
    finally:
        await stop(running)


async def test_with_yielding_off_a_push_is_read_while_a_launch_is_in_progress(llama_checkpoint, pieces_read, rng):
    running = await start(settings({"policy": str(llama_checkpoint)}, update_yield_to_launches=False))
    try:
        waits = []
        between_launches = running.service.device_side.scheduler.between_launches

        async def counted(max_wait_s):
            waits.append(max_wait_s)
            await between_launches(max_wait_s)

        running.service.device_side.scheduler.between_launches = counted

        async def all_read(messages):
            await eventually(lambda: len(pieces_read) == len(messages) - 2, "every piece to be read")
            assert waits == []

        await push_while_a_launch_is_held(running, pieces_read, rng, all_read)
        assert waits == []
    finally:
        await stop(running)
