"""Clients sharing one device through the scheduler (``engine.scheduler`` over ``BatchQueue``'s
round-robin), with a fake device whose micro-batch takes a known time (a clock the test moves).

Client a queues its whole share; client b's small call, with a deadline, is then admitted and
scored within a few micro-batches, not after a's backlog (in arrival order it was refused for its
deadline, or waited for all of a's work). One client alone gets full micro-batches, and every
response holds its own sequences' scores, in order.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from logprob_service.domain import ModelInfo, ScoreJob, SequenceScores, TokenSequence
from logprob_service.engine import scheduler as scheduler_module
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler

BATCH_TOKENS = 1000
BATCH_S = 2.0  # each micro-batch's time on the fake device
VOCAB = 50


@dataclass
class Served:
    info: ModelInfo
    device: str = "fake"

    def updatable(self):  # the scheduler never asks
        raise NotImplementedError


@dataclass
class LaunchGroup:
    indices: list[int]
    launched: asyncio.Future
    error: Exception | None = None


class Clock:
    """The scheduler's clock, ``offset_s`` ahead of the real one."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def perf_counter_ns(self) -> int:
        return time.perf_counter_ns() + round(self.offset_s * 1e9)

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s


@dataclass
class FakeDevice:
    """Records each micro-batch's sequences; ``finish_one`` ends the oldest in flight, BATCH_S
    later on the clock. Each completion token's log-prob is minus its id, so a response shows
    whose sequences it holds."""

    clock: Clock
    launched: list[list[TokenSequence]] = field(default_factory=list)
    pending: list[tuple[asyncio.Future, list[TokenSequence]]] = field(default_factory=list)

    async def launch(self, served, sequences, options):
        future = asyncio.get_running_loop().create_future()
        self.launched.append(list(sequences))
        self.pending.append((future, list(sequences)))
        return [LaunchGroup(list(range(len(sequences))), future)]

    async def fetch(self, launched):
        return await launched

    async def run(self, fn):
        return fn()

    def finish_one(self) -> None:
        future, sequences = self.pending.pop(0)
        self.clock.offset_s += BATCH_S
        future.set_result([SequenceScores(-s.completion_ids.astype(np.float32)) for s in sequences])


def scheduler_of(device: FakeDevice) -> Scheduler:
    registry = ModelRegistry()
    registry.add(Served(ModelInfo("m", "fake", "fake", VOCAB, None, "float32", "", 0, "")))
    return Scheduler(
        registry,
        [device],
        max_queued_tokens=10**6,
        max_queued_tokens_per_client=10**6,
        max_batch_tokens=BATCH_TOKENS,
        max_batch_sequences=256,
        max_wait_ms=0,
    )


def job(rng: np.random.Generator, name: str, client: str, lengths: list[int], deadline: float | None = None):
    """A request of sequences of ``lengths`` tokens (one completion token each)."""
    sequences = [TokenSequence(rng.integers(0, VOCAB, n - 1), rng.integers(0, VOCAB, 1)) for n in lengths]
    return ScoreJob(name, "m", sequences, client=client, deadline=deadline)


def assert_scored(job_: ScoreJob, result) -> None:
    """``result`` holds ``job_``'s own sequences' scores, in order."""
    assert result.request_id == job_.request_id and len(result.scores) == len(job_.sequences)
    for sequence, scores in zip(job_.sequences, result.scores):
        np.testing.assert_array_equal(scores.logprobs, -sequence.completion_ids.astype(np.float32))


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    return clock


async def test_a_clients_backlog_delays_anothers_small_call_by_a_few_micro_batches(rng, clock):
    """The issue's scenario at the engine: a queues 40 micro-batches of work; b's one 4-token
    sequence, with a deadline of 5 micro-batches, is admitted (a's backlog is not all ahead of it)
    and scored within 3 micro-batches (the two in flight, then its own), while a's work fills its
    micro-batch. In arrival order it was refused: 40 micro-batches ahead, 80 s past 10."""
    device = FakeDevice(clock)
    scheduler = scheduler_of(device)
    scheduler.start()
    try:
        backlog = [job(rng, f"a{i}", "a", [4] * 250) for i in range(40)]  # 1,000 tokens each
        a_tasks = [asyncio.create_task(scheduler.submit(j)) for j in backlog]
        await until(lambda: len(device.launched) == 2)
        for _ in range(3):  # the throughput is measured: 1,000 tokens in BATCH_S
            device.finish_one()
            await until(lambda: len(device.pending) == 2)
        assert scheduler.admission.throughput == pytest.approx(BATCH_TOKENS / BATCH_S, rel=0.01)

        small = job(rng, "b", "b", [4], deadline=clock.monotonic() + 5 * BATCH_S)
        b_task = asyncio.create_task(scheduler.submit(small))
        await asyncio.sleep(0)
        assert not b_task.done(), b_task  # admitted
        finished = 0
        while not b_task.done():
            device.finish_one()
            finished += 1
            await until(lambda: b_task.done() or len(device.pending) == 2)
        assert_scored(small, b_task.result())
        assert finished <= 3 and clock.monotonic() < small.deadline
        b_batch = next(batch for batch in device.launched if any(s is small.sequences[0] for s in batch))
        assert sum(s.num_tokens for s in b_batch) == BATCH_TOKENS  # a's work filled the rest
        assert sum(not t.done() for t in a_tasks) >= 30  # a's backlog still queued

        while not all(t.done() for t in a_tasks):
            device.finish_one()
            await until(lambda: all(t.done() for t in a_tasks) or device.pending)
        for j, task in zip(backlog, a_tasks):
            assert_scored(j, task.result())
    finally:
        await scheduler.close()


async def test_one_client_alone_gets_full_micro_batches_and_its_results_in_order(rng, clock):
    device = FakeDevice(clock)
    scheduler = scheduler_of(device)
    scheduler.start()
    try:
        jobs = [job(rng, f"a{i}", "a", rng.integers(2, 40, 60).tolist()) for i in range(20)]
        tasks = [asyncio.create_task(scheduler.submit(j)) for j in jobs]
        while not all(t.done() for t in tasks):
            await until(lambda: all(t.done() for t in tasks) or device.pending)
            if device.pending:
                device.finish_one()
        sizes = [sum(s.num_tokens for s in batch) for batch in device.launched]
        assert sum(sizes) == sum(j.num_tokens for j in jobs)
        assert all(size > BATCH_TOKENS - 40 for size in sizes[:-1]), sizes  # full to within a sequence
        for j, task in zip(jobs, tasks):
            assert_scored(j, task.result())
    finally:
        await scheduler.close()
