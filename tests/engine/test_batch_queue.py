"""How micro-batches are formed (``engine.batch_queue``), driven synchronously: no loop, no device."""

from __future__ import annotations

import asyncio

import numpy as np
from logprob_service.domain import ScoreJob, ScoreOptions, TokenSequence
from logprob_service.engine.batch_queue import BatchQueue, Request
from logprob_service.engine.costs import KEYS_PER_TOKEN
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.errors import DeadlineExceeded


def job(
    request_id: str,
    lengths: list[int],
    *,
    model: str = "m",
    temperature: float = 1.0,
    deadline=None,
    client: str = "",
) -> ScoreJob:
    rng = np.random.default_rng(sum(lengths))  # the ids do not matter here, only the lengths
    return ScoreJob(
        request_id=request_id,
        model=model,
        sequences=[TokenSequence(rng.integers(0, 100, n - 1), rng.integers(0, 100, 1)) for n in lengths],
        options=ScoreOptions(temperature=temperature),
        deadline=deadline,
        client=client,
    )


class Outcome:
    """What a request's caller would see: nothing yet, or an error."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def request(self, job: ScoreJob) -> Request:
        return Request(job, done=lambda: self.error is not None, fail=self._fail, complete=lambda result: None)

    def _fail(self, error: BaseException) -> None:
        self.error = error


def queue_of(*jobs: ScoreJob, max_batch_tokens: int = 400, max_batch_sequences: int = 100) -> BatchQueue:
    queue = BatchQueue(max_batch_tokens=max_batch_tokens, max_batch_sequences=max_batch_sequences)
    for j in jobs:
        queue.push(Outcome().request(j))
    return queue


def described(units) -> list[tuple[str, list[int]]]:
    return [(u.request.job.request_id, u.indices) for u in units]


def test_units_are_split_to_fill_the_budget_in_arrival_order():
    queue = queue_of(job("a", [100, 100, 100]), job("b", [100, 100, 100]))
    assert described(queue.take()) == [("a", [0, 1, 2]), ("b", [0])]  # 400 tokens: full
    assert described(queue.take()) == [("b", [1, 2])]
    assert queue.units == []


def test_sequence_cap_and_keys_are_respected():
    queue = queue_of(
        job("a", [10] * 3), job("hot", [10] * 2, temperature=0.5), job("b", [10] * 3), max_batch_sequences=4
    )
    assert described(queue.take()) == [("a", [0, 1, 2]), ("b", [0])]  # 4 sequences; "hot" waits
    assert described(queue.take()) == [("hot", [0, 1])]  # now the oldest: its own micro-batch
    assert described(queue.take()) == [("b", [1, 2])]


def makespan(queue: BatchQueue, devices: int, spread: int) -> int:
    """When the last of ``devices`` is done with ``queue``'s work, each taking a micro-batch whenever
    it is free and spending one time unit per token."""
    clocks = [0] * devices
    while queue.units:
        free = clocks.index(min(clocks))
        clocks[free] += sum(u.cost for u in queue.take(spread=spread))
    return max(clocks)


def test_shared_by_devices_a_bursts_last_micro_batches_get_smaller():
    # 1,100 tokens, a budget of 400: greedy full micro-batches (400, 400, 300) leave one of two
    # devices a whole micro-batch behind; taking at most half of what is left (and no less than
    # 100) ends them closer: 400, 300, 200, 100, 100.
    queue = queue_of(job("a", [100] * 11))
    assert [sum(u.cost for u in queue.take(spread=2)) for _ in range(5)] == [400, 300, 200, 100, 100]
    assert not queue.units
    assert makespan(queue_of(job("a", [100] * 11)), 2, spread=1) == 700
    assert makespan(queue_of(job("a", [100] * 11)), 2, spread=2) == 600  # the ideal: 550


def test_shared_by_devices_a_sequence_over_the_share_still_goes():
    queue = queue_of(job("a", [300, 50]), max_batch_tokens=400)  # a share of 350 over 4: 100
    assert described(queue.take(spread=4)) == [("a", [0, 1])]  # 300 > 100: the full budget instead


def test_a_sequence_longer_than_the_budget_goes_alone():
    queue = queue_of(job("long", [50, 900, 60]), job("b", [30]))
    batches = [described(queue.take()) for _ in range(2)]
    assert [("long", [1])] in batches
    assert sorted(i for b in batches for r, idx in b for i in idx if r == "long") == [0, 1, 2] and not queue.units


def test_a_held_model_waits_unless_its_request_has_started():
    queue = queue_of(job("m1", [10, 10], model="m"), job("other", [10], model="n"), job("m2", [10], model="m"))
    assert queue.fills_a_batch(queue.first_eligible()) is False
    assert described(queue.take(held={"m"})) == [("other", [0])]  # m is held for a swap
    assert queue.first_eligible(held={"m"}) is None and not queue.holds_started_work("m", held={"m"})
    queue.units[0].request.first_launch_ns = 1  # m1 started before the swap was asked for: it goes on
    assert queue.holds_started_work("m", held={"m"})
    assert described(queue.take(held={"m"})) == [("m1", [0, 1])]
    assert described(queue.take()) == [("m2", [0])]


def test_a_started_request_behind_many_discarded_units_still_holds_its_models_swap():
    """A client's queue is searched only near its front: the units of a request discarded there
    must not hide a started request behind them from the swap's wait (it would finish on the new
    weights)."""
    queue = queue_of(job("x", [10]), max_batch_tokens=100)
    gone = Outcome().request(job("gone", [100] * 40))  # 40 units of one sequence each
    started = Outcome().request(job("started", [10, 10]))
    for request in (gone, started):
        queue.push(request)
    assert queue.discard(gone) == 4000
    started.first_launch_ns = 1
    assert queue.holds_started_work("m", held={"m"})
    assert described(queue.take(held={"m"})) == [("started", [0, 1])]
    assert not queue.holds_started_work("m", held={"m"})


def test_expired_and_abandoned_requests_are_dropped_and_the_expired_told_why():
    late, gone, alive, left = Outcome(), Outcome(), Outcome(), Outcome()
    queue = BatchQueue(max_batch_tokens=400, max_batch_sequences=100)
    queue.push(late.request(job("late", [10], deadline=5.0)))
    queue.push(gone.request(job("gone", [10, 10])))
    queue.push(alive.request(job("alive", [10], deadline=50.0)))
    behind = left.request(job("left", [10, 20]))
    queue.push(behind)
    gone.error = asyncio.CancelledError()  # its caller went away
    dropped = queue.drop_dead(now=10.0)  # with what admission counted for each
    assert sorted((r.job.request_id, admitted) for r, admitted in dropped) == [("gone", 20), ("late", 10)]
    assert isinstance(late.error, DeadlineExceeded) and "late: deadline passed while queued" in str(late.error)
    assert alive.error is None and described(queue.units) == [("alive", [0]), ("left", [0, 1])]
    # One that ends behind others (its caller cancelled, a part of it failed) is discarded by its owner.
    assert queue.discard(behind) == 30 and queue.discard(behind) == 0
    assert described(queue.units) == [("alive", [0])] and queue.drop_dead(now=10.0) == []
    assert described(queue.take()) == [("alive", [0])] and not queue.units


def test_a_clients_backlog_delays_anothers_call_by_a_turn_not_by_itself():
    """Client a queues 20 micro-batches of work, then b one sequence: b's turn comes next, its
    sequence and a's work filling the micro-batch. Taken in arrival order, b waited for all of a's."""
    queue = queue_of(*(job(f"a{i}", [100] * 4, client="a") for i in range(20)))
    assert described(queue.take()) == [("a0", [0, 1, 2, 3])]
    queue.push(Outcome().request(job("b", [100], client="b")))
    assert described(queue.take()) == [("b", [0]), ("a1", [0, 1, 2])]  # full: 400 tokens
    assert described(queue.take()) == [("a1", [3]), ("a2", [0, 1, 2])]


def test_a_sparse_clients_call_goes_next_ahead_of_every_backlog():
    """a, b and c each keep a backlog of their own key (temperature); d, with nothing queued,
    sends one sequence of a fourth key: its micro-batch is the next, not the one after a turn
    of each backlog (three micro-batches, each client joining at the back). Sparse again once
    its queue is empty, d's next call goes next too; a backlogged client never goes ahead of the
    others' turns (clients that arrive together keep their order), and after d the round goes
    on where it was."""
    queue = queue_of(
        *(job(f"{c}{i}", [100] * 4, client=c, temperature=t) for i in range(5) for c, t in zip("abc", (1.0, 0.5, 0.7)))
    )
    assert [described(queue.take())[0][0] for _ in range(4)] == ["a0", "b0", "c0", "a1"]
    queue.push(Outcome().request(job("d0", [100], client="d", temperature=0.3)))
    assert described(queue.take()) == [("d0", [0])]  # alone: nobody else has work of its key
    assert described(queue.take())[0][0] == "b1"
    queue.push(Outcome().request(job("d1", [100], client="d", temperature=0.3)))
    queue.push(Outcome().request(job("a9", [100], client="a")))  # a is backlogged: not sparse
    assert described(queue.take()) == [("d1", [0])]
    assert [described(queue.take())[0][0] for _ in range(3)] == ["c1", "a2", "b2"]


def test_clients_take_turns_whatever_their_keys():
    """a's backlog, then b's at another temperature: their micro-batches alternate. In arrival
    order, the oldest unit's key went first, so b's work waited for all of a's."""
    queue = queue_of(
        *(job(f"a{i}", [100] * 4, client="a") for i in range(5)),
        *(job(f"b{i}", [100] * 4, client="b", temperature=0.5) for i in range(5)),
    )
    taken = [described(queue.take())[0][0] for _ in range(10)]
    assert taken == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"] and not queue.units


def test_micro_batches_stay_full_with_one_client_or_several(rng):
    """Fairness orders what goes in, never makes micro-batches smaller: with enough work queued,
    every micro-batch but the last is full to within its next sequence, one client or three."""
    for clients in (["a"], ["a", "b", "c"]):
        lengths = rng.integers(1, 60, (30, 8)).tolist()
        queue = queue_of(
            *(job(f"r{i}", row, client=clients[i % len(clients)]) for i, row in enumerate(lengths)),
            max_batch_tokens=400,
        )
        batches = []
        while queue.units:
            batches.append(sum(u.cost for u in queue.take()))
        assert sum(batches) == sum(map(sum, lengths))
        assert all(cost > 400 - 60 for cost in batches[:-1]), batches


def test_forming_a_micro_batch_looks_at_the_fronts_of_the_clients_queues_not_the_whole_queue():
    """The host's work per micro-batch grows with the clients and what is taken, not with the
    queue: a client's 2,000 queued requests are not each looked at for every micro-batch."""
    looked = []

    def request(j: ScoreJob) -> Request:
        return Request(j, done=lambda: looked.append(j) or False, fail=lambda error: None, complete=lambda r: None)

    queue = BatchQueue(max_batch_tokens=400, max_batch_sequences=100)
    for i in range(2000):
        queue.push(request(job(f"a{i}", [100], client="a", deadline=1e9)))
    queue.push(request(job("b", [100], client="b")))
    for _ in range(3):
        queue.drop_dead(now=0.0)
        queue.take()
    assert len(looked) < 100  # a few at the front of each queue per piece taken, not 2,001 each time


async def test_a_swap_whose_caller_goes_away_before_it_starts_never_runs():
    scheduler = Scheduler(
        ModelRegistry(),
        executors=[],  # never reached: the loop is not started, so the swap stays pending
        max_queued_tokens=10**6,
        max_queued_tokens_per_client=10**6,
        max_batch_tokens=400,
        max_batch_sequences=100,
        max_wait_ms=0,
    )
    applied = []
    task = asyncio.create_task(scheduler.swap("m", lambda: applied.append(1)))
    await asyncio.sleep(0)
    assert scheduler.pending_swaps == {"m"}
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert scheduler.pending_swaps == set() and applied == []


def grouped_job(request_id: str, prompt: int, completions: list[int], rng: np.random.Generator) -> ScoreJob:
    """One prompt of ``prompt`` tokens with a completion of each length (GRPO's G samples)."""
    ids = rng.integers(0, 100, prompt)
    return ScoreJob(request_id, "m", [TokenSequence(ids.copy(), rng.integers(0, 100, c)) for c in completions])


def shared_queue(max_batch_tokens: int, max_batch_sequences: int = 100) -> BatchQueue:
    return BatchQueue(max_batch_tokens=max_batch_tokens, max_batch_sequences=max_batch_sequences, share_prompts=True)


def test_with_shared_prompts_a_group_counts_its_prompt_once(rng):
    group = grouped_job("g", 300, [50] * 8, rng)  # 2,800 tokens as sequences, 700 run
    # The first completion with the prompt (350), each other its 50 tokens and its reads of the
    # prompt: 50 x 300 keys, 4 tokens' worth (KEYS_PER_TOKEN, rounded up).
    cost = 350 + 7 * (50 + 4)
    queue = shared_queue(cost)
    request = Outcome().request(group)
    queue.push(request)
    assert [(u.indices, u.cost) for u in queue.units] == [(list(range(8)), cost)]
    assert request.costs == [350] + [54] * 7  # what admission counts in, and out sequence by sequence
    # The budget counts the reads: at 700 (the tokens it runs) it no longer fits one micro-batch.
    queue = shared_queue(700)
    queue.push(Outcome().request(group))
    assert [u.cost for u in queue.units] == [350 + 6 * 54, 350]  # cut greedily, each part with the prompt
    unshared = BatchQueue(max_batch_tokens=700, max_batch_sequences=100)
    unshared.push(Outcome().request(group))
    assert len(unshared.units) == 4  # two sequences of 350 a micro-batch


def test_with_shared_prompts_a_group_over_the_budget_is_cut_into_parts_that_each_run_the_prompt(rng):
    group = grouped_job("g", 300, [40, 90, 10, 70, 60, 30, 80, 20], rng)
    queue = shared_queue(500, max_batch_sequences=3)
    queue.push(Outcome().request(group))
    seqs = group.sequences
    covered = []
    for unit in queue.units:
        completions = [len(seqs[i].completion_ids) for i in unit.indices]
        reads = [-(-c * 300 // KEYS_PER_TOKEN) for c in completions[1:]]  # of the prompt, by the others
        assert unit.cost == 300 + sum(completions) + sum(reads) <= 500
        assert len(unit.indices) <= 3
        covered += unit.indices
    assert sorted(covered) == list(range(8))


def test_with_shared_prompts_the_room_left_is_filled_counting_each_prompt_once(rng):
    queue = shared_queue(1000)
    first = grouped_job("a", 500, [100, 100], rng)  # 700 run, and 100 x 500 keys read: 713
    second = grouped_job("b", 200, [40, 40, 40, 40], rng)  # 360 run, each further one reads 2 tokens' worth
    for j in (first, second):
        queue.push(Outcome().request(j))
    taken = queue.take()
    assert described(taken) == [("a", [0, 1]), ("b", [0, 1])]
    assert [u.cost for u in taken] == [713, 282]  # b's prompt once: 240 + 42 (a third: 324, over 287 left)
    assert [(u.indices, u.cost) for u in queue.units] == [([2, 3], 282)]  # the rest runs the prompt again
