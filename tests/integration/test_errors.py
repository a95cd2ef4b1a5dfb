"""Every row of the error table: the status code and the message (field, index, value, limit).

Raw stubs are used where the client's retries would hide what the server answered.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import numpy as np
import pytest
import torch
from logprob_client import (
    AsyncLogprobClient,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    LogprobClient,
    ModelNotFound,
    Overloaded,
    ScoreInput,
)
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.calls import OK, Gate, call, expect, request
from tests.helpers.server import start, stop, test_settings


@pytest.mark.parametrize(
    "seqs,fragments",
    [
        ((OK, ([1, 2], [3, 4096, 5])), ["sequences[1].completion_ids[1]", "4096", "[0, 4096)", "'default'"]),
        ((OK, ([7, -3], [3])), ["sequences[1].prompt_ids[1]", "-3", "[0, 4096)"]),
        ((([], [3]),), ["sequences[0].prompt_ids", "empty"]),
        ((OK, OK, ([3], [])), ["sequences[2].completion_ids", "empty"]),
        ((), ["sequences", "no sequences"]),
        ((OK,) * 17, ["more than 16 sequences", "limit of 16"]),  # counted before the parse
        (
            (*(([i + 1] * 200, [2] * 50) for i in range(15)), ([1] * 700, [2] * 1)),
            ["4451 tokens", "limit of 4000"],
        ),
    ],
    ids=[
        "id-too-large",
        "id-negative",
        "empty-prompt",
        "empty-completion",
        "no-sequences",
        "too-many-seqs",
        "too-many-tokens",
    ],
)
async def test_invalid_sequences(running, seqs, fragments):
    await expect(running.target, request(*seqs), grpc.StatusCode.INVALID_ARGUMENT, *fragments)


GROUP = ([1, 2, 3], [[4, 5], [6]])


@pytest.mark.parametrize(
    "seqs,groups,fragments",
    [
        (
            (OK,),
            (GROUP, ([1, 2], [[3], [4, 4096]])),
            ["groups[1].completions[1].completion_ids[1]", "4096", "[0, 4096)"],
        ),
        ((), (GROUP, ([1, -2], [[3]])), ["groups[1].prompt_ids[1]", "-2"]),
        ((), (([], [[3]]),), ["groups[0].prompt_ids", "empty"]),
        ((OK,), (GROUP, ([1], [[3], []])), ["groups[1].completions[1].completion_ids", "empty"]),
        ((), (GROUP, ([1], [])), ["groups[1].completions", "at least 1 completion"]),
        # Counted from the message's bytes before it is parsed, stopping once past the limit.
        ((OK,) * 10, (([1], [[2]] * 7),), ["sequences: more than 16 sequences", "limit of 16"]),
        # 2000 prompt once + 2001 completion tokens; sent as sequences, the distinct prompts count once too.
        ((), (([1] * 2000, [[2] * 667] * 3),), ["4001 tokens", "limit of 4000"]),
    ],
    ids=[
        "id-too-large",
        "prompt-id-negative",
        "empty-prompt",
        "empty-completion",
        "no-completions",
        "too-many-seqs",
        "too-many-tokens",
    ],
)
async def test_invalid_groups_name_the_group_and_completion(running, seqs, groups, fragments):
    await expect(running.target, request(*seqs, groups=groups), grpc.StatusCode.INVALID_ARGUMENT, *fragments)


async def test_request_tokens_count_each_distinct_prompt_once(running):
    """15 sequences of one 250-token prompt are 15 * 250 = 3750 tokens whole, but 250 + 14 * 10 = 390
    as the server runs them: within the limit of 4000 however they are sent."""
    prompt, completion = [7] * 250, [2] * 10
    for req in (request(*[(prompt, completion)] * 15), request(groups=[(prompt, [completion] * 15)])):
        assert len((await call(running.target, req)).scores) == 15


async def test_sequence_longer_than_model_positions(running):
    # The gemma test model has 256 positions.
    await expect(
        running.target,
        request(OK, ([1] * 200, [2] * 57), model="gemma"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sequences[1]",
        "200 prompt + 57 completion = 257 tokens",
        "256 positions",
        "'gemma'",
    )


@pytest.mark.parametrize("temperature", [-1.0, float("nan"), float("inf")])
async def test_bad_temperature(running, temperature):
    await expect(running.target, request(OK, temperature=temperature), grpc.StatusCode.INVALID_ARGUMENT, "temperature")


async def test_unknown_model(running):
    await expect(running.target, request(OK, model="nope"), grpc.StatusCode.NOT_FOUND, "'nope'", "default, gemma")
    with LogprobClient(running.target) as client, pytest.raises(ModelNotFound):
        await asyncio.to_thread(client.score, [[1]], [[2]], model="nope")


async def test_client_raises_typed_invalid_request_with_server_message(running):
    with LogprobClient(running.target) as client, pytest.raises(InvalidRequest) as info:
        await asyncio.to_thread(client.score, [[1, 2]], [[5000]])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("completion_ids[0][0]: token id 5000 is outside [0, 4096)")
    assert info.value.server_message.startswith("groups[0].completions[0].completion_ids[0]: token id 5000")


# Rows 0-1 and 2-4 share prompts (GRPO groups, as TRL lays them out): the client sends each run
# as one group, so the server's names of row 3 are groups[1].completions[1]...
P, Q = [1, 2, 3], [4, 5]
PROMPTS, COMPLETIONS = [P, P, Q, Q, Q], [[6], [7], [8], [9, 5000], [10]]
BAD_ID = "completion_ids[3][1]: token id 5000 is outside [0, 4096) of model 'default'"


@pytest.mark.parametrize("how", ["score", "score_many", "async score", "async score_many", "split"])
async def test_a_bad_id_is_named_in_the_callers_rows(running, how):
    """The client regroups rows that share a prompt, and cuts a call into RPCs: the server's
    ``groups[1].completions[1].completion_ids[1]`` is the caller's ``completion_ids[3][1]``."""
    options = {"max_sequences_per_rpc": 2} if how == "split" else {}
    if how.startswith("async"):
        async with AsyncLogprobClient(running.target) as aio:
            call = aio.score_many if how.endswith("score_many") else aio.score
            with pytest.raises(InvalidRequest) as info:
                if how.endswith("score_many"):
                    await call([ScoreInput(PROMPTS, COMPLETIONS)])
                else:
                    await call(PROMPTS, COMPLETIONS)
    else:

        def sync() -> None:
            with LogprobClient(running.target, **options) as client:
                if how == "score_many":
                    client.score_many([ScoreInput(PROMPTS, COMPLETIONS)])
                else:
                    client.score(PROMPTS, COMPLETIONS)

        with pytest.raises(InvalidRequest) as info:
            await asyncio.to_thread(sync)
    assert info.value.message.startswith(BAD_ID), info.value.message
    assert info.value.server_message.endswith("token id 5000 is outside [0, 4096) of model 'default'")


async def test_bad_ids_in_tensors_and_groups_are_named_as_the_caller_gave_them(running):
    # Dense, as TRL holds a batch: row 1 has nothing to score (not sent), prompts are left-padded.
    prompt_ids = torch.tensor([[0, 1, 2], [0, 1, 2], [7, 4, 5], [0, 4, 5]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    completion_ids = torch.tensor([[6, 0], [7, 0], [8, 0], [9, 5000]])
    completion_mask = torch.tensor([[1, 0], [0, 0], [1, 0], [1, 1]])
    async with AsyncLogprobClient(running.target) as client:
        with pytest.raises(InvalidRequest, match=re.escape(BAD_ID)):
            await client.score(prompt_ids, completion_ids, prompt_mask=prompt_mask, completion_mask=completion_mask)
        bad_prompt = prompt_ids.clone()
        bad_prompt[3, 2] = 4096
        with pytest.raises(InvalidRequest, match=re.escape("prompt_ids[3][2]: token id 4096 is outside")):
            await client.score(bad_prompt, completion_ids, prompt_mask=prompt_mask, completion_mask=completion_mask)
        with pytest.raises(InvalidRequest, match=re.escape("completion_ids[1][1][1]: token id 5000 is outside")):
            await client.score_groups([P, Q], [COMPLETIONS[:2], COMPLETIONS[2:]])


async def test_a_min_version_that_does_not_come_within_the_deadline_is_failed_precondition(running):
    """With the call's deadline sooner than the server's --max-version-wait-s, the caller got a
    bare DEADLINE_EXCEEDED; the server now gives up in time to say why."""
    async with AsyncLogprobClient(running.target) as client:
        start = time.monotonic()
        with pytest.raises(FailedPrecondition) as info:
            await client.score([[1, 2]], [[3]], min_version=5, timeout=5)
    assert "min_version: model 'default' is at version 0; version 5 did not go live" in info.value.message
    assert time.monotonic() - start < 5


async def test_queue_full_is_resource_exhausted_with_retry_hint(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint, max_queued_tokens=4000))
    gate = Gate(running)
    try:
        # Distinct prompts: a prompt several sequences share counts once.
        big = [([i + 1] * 100, [2] * 100) for i in range(16)]
        blocker = asyncio.create_task(call(running.target, request(*big)))  # 3200 tokens queued
        await gate.wait_entered()
        err = await expect(
            running.target,
            request(*big[:5]),  # 1000 more would pass 4000
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "3200 tokens",
            "max_queued_tokens=4000",
            "retry after",
        )
        pushback = dict(err.trailing_metadata())["grpc-retry-pushback-ms"]
        assert int(pushback) > 0
        # The client retries (honouring the hint) and then raises its typed error.
        with LogprobClient(running.target, max_attempts=2, timeout=10) as client, pytest.raises(Overloaded):
            await asyncio.to_thread(client.score, *zip(*big[:5], strict=True))
        gate.release.set()
        assert len((await blocker).scores) == 16  # the admitted request is unharmed
    finally:
        gate.restore()
        await stop(running)


async def test_deadline_passed_while_queued_is_dropped_before_compute(running):
    gate = Gate(running)
    try:
        blocker = asyncio.create_task(call(running.target, request(OK)))
        await gate.wait_entered()
        with LogprobClient(running.target) as client, pytest.raises(DeadlineExceeded):
            await asyncio.to_thread(client.score, [[1, 2]], [[3]], timeout=0.3)
        gate.release.set()
        await blocker
        await call(running.target, request(OK))  # the queue has moved past the expired job
        assert gate.calls == [1, 1], "the expired request must never reach the model"
    finally:
        gate.restore()


async def test_scheduler_reports_deadline_exceeded_for_expired_jobs(running):
    import time

    from logprob_service.api.status import status_of
    from logprob_service.domain import ScoreJob, TokenSequence
    from logprob_service.errors import DeadlineExceeded as ServerDeadline

    job = ScoreJob(
        request_id="late",
        model="default",
        sequences=[TokenSequence(np.array([1]), np.array([2]))],
        deadline=time.monotonic() - 1,
    )
    with pytest.raises(ServerDeadline, match="late: deadline passed while queued"):
        await running.service.device_side.scheduler.submit(job)
    assert grpc.StatusCode.DEADLINE_EXCEEDED == status_of(ServerDeadline("late"))


async def test_unavailable_until_warm_and_while_draining(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint), warm=False)
    try:
        await expect(running.target, request(OK), grpc.StatusCode.UNAVAILABLE, "starting")
        await running.service.warm_up()
        await call(running.target, request(OK))
        await running.service.engine.draining()
        await expect(running.target, request(OK), grpc.StatusCode.UNAVAILABLE, "draining")
    finally:
        await stop(running)


async def test_a_bug_is_internal_logged_with_request_id_and_the_server_keeps_serving(running, caplog):
    scorer = running.scorer("default")
    original = scorer.launch

    def broken(*args, **kwargs):
        raise RuntimeError("injected bug")

    scorer.launch = broken
    with caplog.at_level(logging.ERROR):
        await expect(running.target, request(OK, request_id="bug-42"), grpc.StatusCode.INTERNAL, "bug-42")
    logged = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == "bug-42"]
    assert len(logged) == 1 and logged[0].exc_info and logged[0].fields["status"] == "INTERNAL"
    scorer.launch = original
    response = await call(running.target, request(OK, request_id="after-bug"))
    assert response.request_id == "after-bug" and len(response.scores[0].logprobs) == 2


async def test_receive_limit_is_configurable(gemma_checkpoint):
    # ~5.2 MB: over gRPC's 4 MiB default. The tiny limit refuses it; the default limit receives it
    # (and validation then refuses it for its token count, which proves it arrived).
    huge = request(*[(list(range(100_000, 104_000)), [1] * 320)] * 450)  # 3-byte varints
    assert huge.ByteSize() > 5 * 1024**2
    small = await start(test_settings(gemma_checkpoint, max_message_bytes=4 * 1024**2), warm=False)
    try:
        await expect(small.target, huge, grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        await stop(small)
    default = await start(test_settings(gemma_checkpoint))
    try:
        async with grpc.aio.insecure_channel(
            default.target, options=[("grpc.max_send_message_length", 64 * 1024**2)]
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.LogprobServiceStub(channel).ScoreTokens(huge)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await stop(default)


def i32(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


@pytest.mark.parametrize(
    "req,fragments",
    [
        (
            pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids_i32=b"\x01\x00\x00\x00\x02", completion_ids=[3])]),
            ["sequences[0].prompt_ids_i32", "5 bytes", "int32"],
        ),
        (
            pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=[1], prompt_ids_i32=i32([1]), completion_ids=[3])]),
            ["sequences[0].prompt_ids", "both"],
        ),
        (
            pb.ScoreRequest(
                groups=[
                    pb.SequenceGroup(
                        prompt_ids_i32=i32([1, 2]), completions=[pb.Completion(completion_ids_i32=i32([3, 5000]))]
                    )
                ]
            ),
            ["groups[0].completions[0].completion_ids[1]", "token id 5000", "[0, 4096)"],
        ),
    ],
    ids=["ragged-bytes", "both-fields", "id-out-of-range-in-bytes"],
)
async def test_ids_as_bytes_are_checked_as_the_repeated_fields(running, req, fragments):
    await expect(running.target, req, grpc.StatusCode.INVALID_ARGUMENT, *fragments)


async def test_ids_and_scores_as_bytes_are_the_same_scores_bit_for_bit(running, rng):
    prompt, completion = rng.integers(0, 4096, 30), rng.integers(0, 4096, 12)
    v1 = pb.ScoreRequest(return_entropy=True, sequences=[pb.Sequence(prompt_ids=prompt, completion_ids=completion)])
    v2 = pb.ScoreRequest(
        return_entropy=True,
        scores_f32=True,
        sequences=[pb.Sequence(prompt_ids_i32=i32(prompt), completion_ids_i32=i32(completion))],
    )
    (old,), (new,) = [(await call(running.target, r)).scores for r in (v1, v2)]
    assert not old.logprobs_f32 and not new.logprobs and len(new.logprobs_f32) == 4 * 12
    for field in ("logprobs", "entropies"):
        as_list = np.asarray(getattr(old, field), dtype=np.float32)
        np.testing.assert_array_equal(np.frombuffer(getattr(new, f"{field}_f32"), dtype="<f4"), as_list)
