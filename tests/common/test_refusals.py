"""The hold of refused calls (``security.refusals``): the buckets on an injected clock (no sleeps),
and the async hold ended by its clock, its caller, its deadline, the drain and its caps."""

from __future__ import annotations

import asyncio
import logging

import pytest
from logprob_service.errors import ErrorCode
from logprob_service.security import refusals
from logprob_service.security.refusals import RefusalBuckets, RefusalThrottle
from logprob_service.stats import RefusalHeld

BURST, PER_S = 20, 5.0


def test_a_burst_is_answered_at_once_then_one_refusal_an_interval():
    buckets = RefusalBuckets(BURST, PER_S)
    assert [buckets.charge("a", 0.0) for _ in range(BURST)] == [0.0] * BURST
    waits = [buckets.charge("a", 0.0) for _ in range(3)]
    assert waits == pytest.approx([0.2, 0.4, 0.6])


def test_a_closed_loop_of_refusals_runs_at_the_rate():
    """Each refusal resent the moment it is answered: after the burst, one every 1 / per_s."""
    buckets, now, answered = RefusalBuckets(BURST, PER_S), 0.0, 0
    while now < 10.0:
        now += buckets.charge("loop", now) + 0.001  # the refusal itself takes a millisecond
        answered += 1
    assert BURST + 10 * PER_S - 2 <= answered <= BURST + 10 * PER_S + 2


def test_the_bucket_refills_at_the_rate():
    buckets = RefusalBuckets(BURST, PER_S)
    for _ in range(BURST):
        buckets.charge("a", 0.0)
    assert buckets.charge("a", 1.0) == 0.0  # 5 refilled in a second
    assert [buckets.charge("a", 1.0) for _ in range(4)] == [0.0] * 4
    assert buckets.charge("a", 1.0) == pytest.approx(0.2)


def test_a_client_refused_once_in_a_while_is_never_held(rng):
    buckets, now = RefusalBuckets(BURST, PER_S), 0.0
    for _ in range(1000):
        now += float(rng.uniform(0.2, 5.0))  # never faster than the rate on average
        assert buckets.charge("trainer", now) == 0.0
    # A split call all of whose parts are refused at once, within the burst: none held.
    assert [buckets.charge("trainer", now + 10) for _ in range(BURST)] == [0.0] * BURST


def test_a_wait_is_at_most_what_the_burst_takes_to_refill_however_many_are_held():
    buckets = RefusalBuckets(BURST, PER_S)
    waits = [buckets.charge("many", 0.0) for _ in range(10_000)]
    assert max(waits) == pytest.approx(BURST / PER_S)
    # The debt is capped too: the client's bucket is full again within twice that.
    assert buckets.charge("many", 2 * BURST / PER_S) == 0.0


def test_clients_have_buckets_of_their_own():
    buckets = RefusalBuckets(BURST, PER_S)
    for _ in range(BURST + 10):
        buckets.charge("greedy", 0.0)
    assert buckets.charge("greedy", 0.0) > 0
    assert buckets.charge("other", 0.0) == 0.0


def test_clients_whose_bucket_is_full_again_are_forgotten(monkeypatch):
    buckets = RefusalBuckets(BURST, PER_S)
    for i in range(1000):
        buckets.charge(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(buckets) == 1000
    buckets.charge("late", 1 / PER_S)  # each was refused once: its bucket is full again an interval later
    assert len(buckets) == 1
    for _ in range(10_000):
        buckets.charge("looper", 1.0)
    buckets.charge("late", 1.0 + 2 * BURST / PER_S)  # the most a client's debt reaches
    assert len(buckets) == 1
    monkeypatch.setattr(refusals, "MAX_CLIENTS", 100)
    for i in range(1000):
        buckets.charge(f"c{i}", 100.0)
    assert len(buckets) == 100


def test_a_clients_throttle_is_logged_once_when_it_starts(caplog):
    caplog.set_level(logging.INFO, logger=refusals.__name__)
    buckets = RefusalBuckets(BURST, PER_S)
    for _ in range(BURST * 5):
        buckets.charge("looper", 0.0)
    buckets.charge("polite", 0.0)
    lines = [r for r in caplog.records if r.getMessage() == "refusals held"]
    assert [r.fields["client"] for r in lines] == ["looper"]
    assert "refusal_burst" in lines[0].fields["why"] and "refusals_per_s" in lines[0].fields["why"]
    # Once its bucket is full again it is forgotten: a new loop is logged again.
    for _ in range(BURST + 1):
        buckets.charge("looper", 100.0)
    assert len([r for r in caplog.records if r.getMessage() == "refusals held"]) == 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def throttle(**kwargs) -> tuple[RefusalThrottle, list]:
    records: list = []

    class Sink:
        def record(self, stat) -> None:
            records.append(stat)

    values = dict(burst=2, per_s=1.0, max_held_bytes=1000, stats=Sink(), clock=Clock())
    return RefusalThrottle(**(values | kwargs)), records


async def held(throttle: RefusalThrottle, client: str = "a", **kwargs) -> asyncio.Task:
    """A hold started and waiting (the throttle's clock stands still: its bucket is past the burst)."""
    task = asyncio.ensure_future(throttle.hold(client, ErrorCode.INVALID_ARGUMENT, "grpc", **kwargs))
    await asyncio.sleep(0)
    return task


async def test_only_refusals_a_client_can_cure_are_counted_and_none_when_off():
    counted = 3 * len(refusals.HELD_CODES)
    refused, records = throttle(burst=counted)
    for code in ErrorCode:
        for _ in range(3):
            await asyncio.wait_for(refused.hold("b", code, "http"), 1)
    assert records == []  # all within the burst
    # Exactly the held codes' refusals were counted: the next one is the first past the burst.
    assert refused.buckets is not None and refused.buckets.charge("b", 0.0) == 1.0
    off, records = throttle(per_s=0.0)
    await asyncio.wait_for(asyncio.gather(*(off.hold("b", ErrorCode.INVALID_ARGUMENT, "grpc") for _ in range(10))), 1)
    assert off.buckets is None and records == []


async def test_a_hold_ends_by_its_deadline():
    refused, records = throttle()
    for _ in range(2):
        await held(refused)
    clock = refused._clock
    await asyncio.wait_for(refused.hold("a", ErrorCode.NOT_FOUND, "http", deadline=clock() + 0.01), 1)
    await asyncio.wait_for(refused.hold("a", ErrorCode.NOT_FOUND, "http", deadline=clock()), 1)
    assert records == [RefusalHeld("http")]  # the second had no time left: answered at once


async def test_a_hold_ends_when_the_server_drains_and_none_is_held_after():
    refused, records = throttle()
    await held(refused)
    await held(refused)
    tasks = [await held(refused) for _ in range(3)]
    assert refused.held_calls == 3 and records == [RefusalHeld("grpc")] * 3
    assert not any(t.done() for t in tasks)
    refused.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert refused.held_calls == 0
    await asyncio.wait_for(refused.hold("a", ErrorCode.INVALID_ARGUMENT, "grpc"), 1)


async def test_a_hold_ends_when_its_caller_goes_or_its_call_is_cancelled():
    refused, _ = throttle()
    for _ in range(2):
        await held(refused)
    hung_up = asyncio.Event()
    watched = await held(refused, gone=hung_up.wait)
    cancelled = await held(refused)
    assert refused.held_calls == 2
    hung_up.set()
    await asyncio.wait_for(watched, 1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert refused.held_calls == 0 and refused.held_bytes == 0


async def test_held_calls_are_capped_by_count_and_by_the_bytes_they_keep():
    refused, records = throttle(max_held_calls=3, max_held_bytes=1000)
    for _ in range(2):
        await held(refused)
    big = await held(refused, nbytes=900)
    assert refused.held_bytes == 900
    await asyncio.wait_for(refused.hold("a", ErrorCode.INVALID_ARGUMENT, "grpc", nbytes=200), 1)  # past the bytes
    two = [await held(refused, nbytes=50) for _ in range(2)]
    await asyncio.wait_for(refused.hold("a", ErrorCode.INVALID_ARGUMENT, "grpc"), 1)  # past the count
    assert refused.held_calls == 3 and len(records) == 3
    refused.release()
    await asyncio.gather(big, *two)
