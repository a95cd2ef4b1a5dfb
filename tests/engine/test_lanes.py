"""The scheduler over several devices (data parallel), with fake devices: each lane's executor
records what it ran and finishes a micro-batch when the test says so.

Checked: a micro-batch goes to the lane with the least work in flight (not round robin); a
lane's two-batch pipeline is respected; a weight swap runs on every lane, with no micro-batch of
the model launched anywhere until all replicas have swapped, and each response reports the
version of the replica that scored it; an idle device waits for more work while requests keep
coming, and not for a lone one; the throughput is measured from each micro-batch's time on its
device.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from logprob_service.domain import ModelInfo, ScoreJob, SequenceScores, TokenSequence
from logprob_service.engine import scheduler as scheduler_module
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler


@dataclass
class Replica:
    """A model on one fake device: its version is what its lane's swaps made it."""

    info: ModelInfo
    device: str

    def updatable(self):  # the scheduler never asks; the WeightUpdater does
        raise NotImplementedError


@dataclass
class LaunchGroup:
    indices: list[int]
    launched: asyncio.Future
    error: Exception | None = None


@dataclass
class FakeDevice:
    """A lane's executor: launch records (version, tokens) and returns a part that finishes when
    ``finish_one`` is called; ``run`` (swaps) runs at once, in order after what was launched."""

    name: str
    launched: list[tuple[int, int]] = field(default_factory=list)  # (model version, tokens)
    pending: list[asyncio.Future] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)

    async def launch(self, served, sequences, options):
        future = asyncio.get_running_loop().create_future()
        self.launched.append((served.info.version, sum(s.num_tokens for s in sequences)))
        self.pending.append((future, [len(s.completion_ids) for s in sequences], served.info.version))
        return [LaunchGroup(list(range(len(sequences))), future)]

    async def fetch(self, launched):
        return await launched

    async def run(self, fn):
        self.ran.append("swap")
        return fn()

    def finish_one(self) -> None:
        future, lengths, version = self.pending.pop(0)
        # Each log-prob says which version scored it, so a response shows what scored each sequence.
        future.set_result([SequenceScores(np.full(n, -float(version), np.float32)) for n in lengths])


def registry_of(devices: list[FakeDevice]) -> tuple[ModelRegistry, list[Replica]]:
    info = ModelInfo("m", "fake", "fake", 100, None, "float32", "", 0, "")
    replicas = [Replica(replace(info, device=d.name), d.name) for d in devices]
    registry = ModelRegistry()
    registry.add(replicas[0], replicas[1:])
    return registry, replicas


def scheduler_of(registry: ModelRegistry, devices: list[FakeDevice], **waits: float) -> Scheduler:
    """One sequence per micro-batch (each request is one batch) and no wait, unless ``waits`` say."""
    return Scheduler(
        registry,
        devices,
        max_queued_tokens=10**6,
        max_queued_tokens_per_client=10**6,
        max_batch_tokens=100,
        max_batch_sequences=1 if not waits else 100,
        **({"max_wait_ms": 0} | waits),
    )


def job(i: int, tokens: int) -> ScoreJob:
    ids = np.arange(tokens, dtype=np.int64) % 100
    return ScoreJob(f"r{i}", "m", [TokenSequence(ids[: tokens // 2], ids[tokens // 2 :])])


async def until(condition, timeout: float = 10.0) -> None:
    """Yield to the loop until ``condition()`` holds (fails the test after ``timeout`` s)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


@pytest.fixture
async def two():
    devices = [FakeDevice("dev0"), FakeDevice("dev1")]
    registry, replicas = registry_of(devices)
    scheduler = scheduler_of(registry, devices)
    scheduler.start()
    yield scheduler, devices, replicas
    await scheduler.close()


async def test_a_batch_goes_to_the_lane_with_the_fewest_tokens_in_flight(two):
    scheduler, (d0, d1), _ = two
    tasks = [asyncio.create_task(scheduler.submit(job(0, 80)))]
    await until(lambda: len(d0.launched) == 1)  # both idle: the first lane
    tasks.append(asyncio.create_task(scheduler.submit(job(1, 10))))
    await until(lambda: len(d1.launched) == 1)  # lane 0 holds 80 tokens, lane 1 none
    tasks.append(asyncio.create_task(scheduler.submit(job(2, 10))))
    await until(lambda: len(d1.launched) == 2)  # 80 against 10: lane 1 again, not round robin
    # Lane 1 is full (two in flight), lane 0 has room: the next goes there whatever its tokens.
    tasks.append(asyncio.create_task(scheduler.submit(job(3, 10))))
    await until(lambda: len(d0.launched) == 2)
    # Both full: the next waits for a batch to finish, then takes the lane that freed.
    tasks.append(asyncio.create_task(scheduler.submit(job(4, 10))))
    await asyncio.sleep(0.05)
    assert (len(d0.launched), len(d1.launched)) == (2, 2)
    d1.finish_one()
    await until(lambda: len(d1.launched) == 3)
    for device in (d0, d1):
        while device.pending:
            device.finish_one()
            await asyncio.sleep(0)
    await until(lambda: all(t.done() for t in tasks))
    assert [len(t.result().scores) for t in tasks] == [1] * 5


async def test_a_swap_runs_on_every_lane_before_the_model_launches_again(two):
    scheduler, (d0, d1), replicas = two
    first = [asyncio.create_task(scheduler.submit(job(i, 10))) for i in range(2)]
    await until(lambda: len(d0.launched) == len(d1.launched) == 1)  # one in flight on each lane

    def apply(lane: int) -> None:
        replicas[lane].info = replace(replicas[lane].info, version=7)

    swap = asyncio.create_task(scheduler.swap("m", apply))
    await until(lambda: d0.ran == d1.ran == ["swap"])
    await swap
    assert [r.info.version for r in replicas] == [7, 7]
    later = [asyncio.create_task(scheduler.submit(job(i, 10))) for i in range(2, 6)]
    for device in (d0, d1):
        device.finish_one()
    await until(lambda: len(d0.launched) + len(d1.launched) == 6)
    for device in (d0, d1):
        while device.pending:
            device.finish_one()
            await asyncio.sleep(0)
    results = [await t for t in first + later]
    # The two batches launched before the swap were scored by version 0 (their kernels queued
    # first); every later one by version 7, on whichever replica it ran.
    assert [v for v, _ in d0.launched[1:] + d1.launched[1:]] == [7] * 4
    assert [r.model_version for r in results] == [0, 0, 7, 7, 7, 7]
    assert all(float(r.scores[0].logprobs[0]) == -r.model_version for r in results)


async def test_an_idle_device_does_not_hold_a_lone_request_for_work_that_is_not_coming():
    device = FakeDevice("dev0")
    registry, _ = registry_of([device])
    scheduler = scheduler_of(registry, [device], max_wait_ms=60_000, max_wait_quiet_ms=20)
    scheduler.start()
    try:
        task = asyncio.create_task(scheduler.submit(job(0, 10)))
        await until(lambda: len(device.launched) == 1)  # after ~20 ms, not the minute max_wait_ms allows
        device.finish_one()
        await task
    finally:
        await scheduler.close()


async def test_an_idle_device_batches_requests_that_keep_coming():
    """The second request comes 50 ms after the first: within the quiet limit (2 s), so the idle
    device's wait goes on and both share one micro-batch."""
    device = FakeDevice("dev0")
    registry, _ = registry_of([device])
    scheduler = scheduler_of(registry, [device], max_wait_ms=60_000, max_wait_quiet_ms=2_000)
    scheduler.start()
    try:
        tasks = [asyncio.create_task(scheduler.submit(job(0, 10)))]
        await asyncio.sleep(0.05)
        assert not device.launched
        tasks.append(asyncio.create_task(scheduler.submit(job(1, 12))))
        await until(lambda: len(device.launched) == 1)
        assert device.launched == [(0, 22)]  # one micro-batch of both
        device.finish_one()
        await asyncio.gather(*tasks)
    finally:
        await scheduler.close()


class Clock:
    """The scheduler's clock, ``offset_ns`` ahead of the real one."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def perf_counter_ns(self) -> int:
        return time.perf_counter_ns() + self.offset_ns

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_ns / 1e9


async def test_the_throughput_counts_each_micro_batchs_time_on_its_device(monkeypatch):
    """Two micro-batches are in flight at once: the second holds the device from when the first is
    done, not from its launch, so a device that does one a second does 100 tokens/s (launch to
    result would say 50)."""
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    device = FakeDevice("dev0")
    registry, _ = registry_of([device])
    scheduler = scheduler_of(registry, [device])  # one request a micro-batch
    scheduler.start()
    try:
        tasks = [asyncio.create_task(scheduler.submit(job(i, 100))) for i in range(3)]
        await until(lambda: len(device.launched) == 2)
        for task in tasks:
            clock.offset_ns += 1_000_000_000
            device.finish_one()
            await until(task.done)
            await until(lambda: len(device.launched) == 3)
        assert scheduler.admission.throughput == pytest.approx(100, rel=0.01)
    finally:
        await scheduler.close()


async def test_a_swap_asked_for_while_another_model_swaps_runs_and_frees_its_model():
    """Model b's swap, and a request for b (held for it), come while model a's swap runs on the
    device: both wakes came before the loop went back to sleep. Before the fix the loop cleared
    them and slept, so b's swap never ran and b's request never launched (the soak test's wedge)."""
    device = FakeDevice("dev0")
    info = ModelInfo("a", "fake", "fake", 100, None, "float32", "", 0, "")
    a, b = Replica(info, "dev0"), Replica(replace(info, name="b"), "dev0")
    registry = ModelRegistry()
    registry.add(a)
    registry.add(b)
    scheduler = scheduler_of(registry, [device])
    gate = asyncio.Event()
    swapped_once = device.run

    async def run_a_then_the_rest(fn):  # a's swap waits for the gate, later ones do not
        if not gate.is_set():
            device.ran.append("a waits")
            await gate.wait()
        return await swapped_once(fn)

    device.run = run_a_then_the_rest
    scheduler.start()
    try:
        swap_a = asyncio.create_task(scheduler.swap("a", lambda lane: setattr(a, "info", replace(a.info, version=1))))
        await until(lambda: device.ran == ["a waits"])
        swap_b = asyncio.create_task(scheduler.swap("b", lambda lane: setattr(b, "info", replace(b.info, version=2))))
        for_b = asyncio.create_task(scheduler.submit(replace(job(0, 10), model="b")))
        await until(lambda: scheduler.pending_swaps == {"a", "b"} or scheduler.pending_swaps == {"b"})
        await asyncio.sleep(0.01)
        assert not device.launched  # b's request is held for b's swap
        gate.set()
        await asyncio.wait_for(asyncio.gather(swap_a, swap_b), 5)
        await until(lambda: len(device.launched) == 1)
        device.finish_one()
        assert (await asyncio.wait_for(for_b, 5)).model_version == 2
    finally:
        await scheduler.close()
