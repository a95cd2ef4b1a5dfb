"""How the scheduler forms micro-batches (no device involved: the loop is not started)."""

from __future__ import annotations

import asyncio

import numpy as np
from logprob_service.domain import ScoreJob, TokenSequence
from logprob_service.engine.scheduler import Scheduler
from logprob_service.models.registry import ModelRegistry


def job(request_id: str, lengths: list[int], temperature: float = 1.0) -> ScoreJob:
    rng = np.random.default_rng(sum(lengths))  # the ids do not matter here, only the lengths
    return ScoreJob(
        request_id=request_id,
        model="m",
        sequences=[TokenSequence(rng.integers(0, 100, n - 1), rng.integers(0, 100, 1)) for n in lengths],
        temperature=temperature,
    )


async def queued(*jobs: ScoreJob, max_batch_tokens: int = 400, max_batch_sequences: int = 100):
    scheduler = Scheduler(
        ModelRegistry(),
        executor=None,  # never reached: the loop is not started
        max_queued_tokens=10**6,
        max_queued_tokens_per_client=10**6,
        max_batch_tokens=max_batch_tokens,
        max_batch_sequences=max_batch_sequences,
        max_wait_ms=0,
    )
    tasks = [asyncio.create_task(scheduler.submit(j)) for j in jobs]
    await asyncio.sleep(0)  # let every submit enqueue its units
    return scheduler, tasks


def described(units) -> list[tuple[str, list[int]]]:
    return [(u.request.job.request_id, u.indices) for u in units]


async def test_units_are_split_to_fill_the_budget_in_arrival_order():
    scheduler, tasks = await queued(job("a", [100, 100, 100]), job("b", [100, 100, 100]))
    assert described(scheduler._take()) == [("a", [0, 1, 2]), ("b", [0])]  # 400 tokens: full
    assert described(scheduler._take()) == [("b", [1, 2])]
    for t in tasks:
        t.cancel()


async def test_sequence_cap_and_keys_are_respected():
    scheduler, tasks = await queued(
        job("a", [10] * 3), job("hot", [10] * 2, temperature=0.5), job("b", [10] * 3), max_batch_sequences=4
    )
    assert described(scheduler._take()) == [("a", [0, 1, 2]), ("b", [0])]  # 4 sequences; "hot" waits
    assert described(scheduler._take()) == [("hot", [0, 1])]  # now the oldest: its own micro-batch
    assert described(scheduler._take()) == [("b", [1, 2])]
    for t in tasks:
        t.cancel()


async def test_a_sequence_longer_than_the_budget_goes_alone():
    scheduler, tasks = await queued(job("long", [50, 900, 60]), job("b", [30]))
    batches = [described(scheduler._take()) for _ in range(2)]
    assert [("long", [1])] in batches
    assert sorted(i for b in batches for r, idx in b for i in idx if r == "long") == [0, 1, 2] and not scheduler._units
    for t in tasks:
        t.cancel()


async def test_a_swap_whose_caller_goes_away_before_it_starts_never_runs():
    scheduler, _ = await queued()  # the batching loop is not started: the swap stays pending
    applied = []
    task = asyncio.create_task(scheduler.swap("m", lambda: applied.append(1)))
    await asyncio.sleep(0)
    assert "m" in scheduler._swaps
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert "m" not in scheduler._swaps and applied == []
