"""A request of thousands of sequences is converted, planned and answered in slices: another
coroutine on the event loop makes progress between them, as every other caller's calls do. Counted
in turns of the loop, not timed."""

from __future__ import annotations

import asyncio

import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_service.api import wire
from logprob_service.domain import ScoreResult, SequenceScores
from logprob_service.engine.batch_queue import BatchQueue, Request
from logprob_service.engine.slices import SLICE_STEPS, finish, sequence_steps

SEQUENCES, TOKENS = 4096, 64  # the soak's hog: the most sequences the default limits accept


async def _with_ticks(coroutine):
    """``coroutine``'s result, and how many times a coroutine beside it ran meanwhile."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    before = ticks
    try:
        return await coroutine, ticks - before
    finally:
        ticker.cancel()


def _request(rng) -> pb.ScoreRequest:
    ids = rng.integers(3, 4096, (SEQUENCES, TOKENS))
    return pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=row[:8], completion_ids=row[8:]) for row in ids])


async def test_a_large_requests_job_is_built_in_slices(rng):
    request = _request(rng)
    job, ticks = await _with_ticks(wire.job_from_request(request, None, "c"))
    assert len(job.sequences) == SEQUENCES
    np.testing.assert_array_equal(job.sequences[-1].completion_ids, request.sequences[-1].completion_ids)
    # every slice at most SLICE_STEPS: the loop went round at least once per slice
    assert ticks >= SEQUENCES * sequence_steps(TOKENS) // SLICE_STEPS - 1, ticks


async def test_a_large_requests_answer_is_written_in_slices():
    scores = [SequenceScores(np.full(TOKENS - 8, -float(i), np.float32)) for i in range(SEQUENCES)]
    result = ScoreResult("r", "m", 3, scores, tokens=SEQUENCES * TOKENS)
    response, ticks = await _with_ticks(wire.response_from_result(result))
    assert len(response.scores) == SEQUENCES and response.scores[-1].logprobs[0] == -(SEQUENCES - 1)
    assert response.model_version == 3 and response.metadata.tokens == SEQUENCES * TOKENS
    assert ticks >= SEQUENCES * sequence_steps(TOKENS - 8) // SLICE_STEPS - 1, ticks


async def test_a_large_requests_plan_is_made_in_slices(rng):
    """256-token micro-batches (the soak's): 1,024 parts by longest-first; 64 Ki: 4 parts of 1,024
    sequences by Karmarkar-Karp. Either plan comes in many slices, and is the plan made at once."""
    job = await wire.job_from_request(_request(rng), None, "c")
    for batch_tokens, sequences, slices in ((256, SEQUENCES, 16), (1 << 16, 1024, 4)):
        small = type(job)(job.request_id, job.model, job.sequences[:sequences])
        queue = BatchQueue(max_batch_tokens=batch_tokens, max_batch_sequences=256, share_prompts=True)
        steps = queue.plan_steps(Request(small, done=bool, fail=print, complete=print))
        yielded = 0
        try:
            while True:
                next(steps)
                yielded += 1
        except StopIteration as done:
            units = done.value
        at_once = finish(queue.plan_steps(Request(small, done=bool, fail=print, complete=print)))
        assert [u.indices for u in units] == [u.indices for u in at_once]
        assert yielded >= slices, (batch_tokens, yielded)
