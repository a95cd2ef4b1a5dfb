"""Teacher top-k and candidate log-probs through gRPC and the client: the sync, async and stream
calls, lists, dense (TRL) and grouped layouts, against the float64 full softmax of the served
model; bad top_k and candidates refused with INVALID_ARGUMENT naming field, sequence and position,
while the other requests are answered."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from logprob_client import AsyncLogprobClient, InvalidRequest, LogprobClient, ScoreInput, TeacherScores
from logprob_proto import logprob_pb2 as pb
from logprob_service.domain import TokenSequence

from tests.helpers.calls import call, expect, trl_layout
from tests.helpers.models import ScoreReference
from tests.helpers.topk import assert_top_k, full_logp

pytestmark = pytest.mark.numerical

VOCAB = 4096  # the running server's model's (checked in ``check``)


def batch(rng, n: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist() for _ in range(n)]
    return prompts, [rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist() for _ in range(n)]


def check(running, prompts, completions, answer: TeacherScores, k: int, candidates=None, temperature=1.0) -> None:
    """Every sequence's answer against the float64 full softmax of the served model."""
    model = running.scorer("default").model
    assert running.scorer("default").vocab_size == VOCAB
    sequences = [TokenSequence(np.asarray(p), np.asarray(c)) for p, c in zip(prompts, completions)]
    reference = ScoreReference(model, sequences, temperature)
    reference.check(answer.logprobs)
    for i, seq in enumerate(sequences):
        logp = full_logp(model, seq, temperature)
        assert_top_k(answer.top_ids[i], answer.top_logprobs[i], logp, k, reference.atol)
        if candidates is not None:
            want = np.take_along_axis(logp, np.asarray(candidates[i]), -1)
            np.testing.assert_allclose(answer.candidate_logprobs[i], want, atol=reference.atol, rtol=0)


async def test_sync_lists_with_top_k_and_candidates(running, rng):
    prompts, completions = batch(rng, 5)
    candidates = [rng.integers(0, VOCAB, (len(c), 1 + i)) for i, c in enumerate(completions)]
    with LogprobClient(running.target) as client:
        answer = await asyncio.to_thread(
            client.score, prompts, completions, top_k=20, candidate_ids=candidates, temperature=0.7, return_entropy=True
        )
        plain = await asyncio.to_thread(client.score, prompts, completions, temperature=0.7)
    assert isinstance(answer, TeacherScores) and len(answer.entropies) == 5
    check(running, prompts, completions, answer, 20, candidates, temperature=0.7)
    assert all(np.array_equal(a, b) for a, b in zip(answer.logprobs, plain))  # without top-k: the same log-probs


async def test_async_dense_trl_layout_and_groups(running, rng):
    prompts, completions = batch(rng, 2)
    prompts = [prompts[0]] * 3 + [prompts[1]]  # a group of 3 completions, then a lone sequence
    completions = [*batch(rng, 3)[1], completions[1]]
    prompt_ids, prompt_mask, completion_ids, completion_mask = trl_layout(rng, prompts, completions)
    width = completion_ids.shape[1]
    dense_candidates = rng.integers(0, VOCAB, (4, width, 6))
    async with AsyncLogprobClient(running.target) as client:
        dense = await client.score(
            prompt_ids,
            completion_ids,
            prompt_mask=prompt_mask,
            completion_mask=completion_mask,
            top_k=5,
            candidate_ids=dense_candidates,
        )
        grouped = await client.score_groups([prompts[0], prompts[3]], [completions[:3], completions[3:]], top_k=5)
    assert dense.top_ids.shape == (4, width, 5) and dense.top_ids.dtype == np.int32
    assert dense.candidate_logprobs.shape == (4, width, 6)
    mask = completion_mask.astype(bool)
    assert not dense.top_ids[~mask].any() and not dense.top_logprobs[~mask].any()  # 0 where nothing was sent
    rows = range(4)
    check(
        running,
        prompts,
        completions,
        TeacherScores(
            logprobs=[dense.logprobs[i][mask[i]] for i in rows],
            top_ids=[dense.top_ids[i][mask[i]] for i in rows],
            top_logprobs=[dense.top_logprobs[i][mask[i]] for i in rows],
            candidate_logprobs=[dense.candidate_logprobs[i][mask[i]] for i in rows],
        ),
        5,
        [dense_candidates[i][mask[i]] for i in rows],
    )
    assert [len(g) for g in grouped.top_ids] == [3, 1]  # cut back into the caller's groups
    for got, want in zip([*grouped.top_ids[0], *grouped.top_ids[1]], dense.top_ids):
        np.testing.assert_array_equal(got, want[: len(got)])


@pytest.mark.parametrize("which", ["sync", "async"])
async def test_stream_with_candidates_per_batch_and_a_bad_one(running, rng, which):
    batches = [batch(rng, 3) for _ in range(3)]
    inputs = [ScoreInput(p, c, candidate_ids=[rng.integers(0, VOCAB, (len(x), 2)) for x in c]) for p, c in batches]
    bad = rng.integers(0, VOCAB, (len(batches[0][1][1]), 2))
    bad[-1, 1] = VOCAB
    inputs.insert(1, ScoreInput(*batches[0], candidate_ids=[inputs[0].candidate_ids[0], bad, None]))
    if which == "sync":
        with LogprobClient(running.target) as client:
            results = await asyncio.to_thread(client.score_many, inputs, top_k=3, return_exceptions=True)
    else:
        async with AsyncLogprobClient(running.target) as client:
            results = await client.score_many(inputs, top_k=3, return_exceptions=True)
    assert isinstance(results[1], InvalidRequest)
    last = len(bad) - 1
    assert f": candidate_ids[1][{last}][1]: token id {VOCAB} (completion position {last}) is outside" in str(results[1])
    for (prompts, completions), inp, answer in zip(batches, inputs[:1] + inputs[2:], results[:1] + results[2:]):
        check(running, prompts, completions, answer, 3, inp.candidate_ids)


async def test_bad_top_k_and_candidates_are_refused_by_name_and_others_answered(running, rng):
    def seq(completion: int, candidates: np.ndarray | None = None, width: int = 0) -> pb.Sequence:
        extra = {} if candidates is None else {"candidate_ids_i32": candidates.astype("<i4").tobytes()}
        return pb.Sequence(
            prompt_ids=[1, 2], completion_ids=list(range(3, 3 + completion)), num_candidates=width, **extra
        )

    good = pb.ScoreRequest(sequences=[seq(4, np.zeros((4, 2)), 2)], top_k=4)
    wrong_rows = np.zeros((3, 2))
    out_of_vocab = np.zeros((4, 2))
    out_of_vocab[2, 1] = VOCAB
    bad = [
        (pb.ScoreRequest(sequences=[seq(4)], top_k=257), "top_k: 257 must lie in [0, 256]"),
        (pb.ScoreRequest(sequences=[seq(4)], top_k=-1), "top_k: -1 must lie in [0, 256]"),
        (
            pb.ScoreRequest(sequences=[seq(4), seq(4, out_of_vocab, 2)]),
            f"sequences[1].candidate_ids[2][1]: token id {VOCAB} (completion position 2) is outside [0, {VOCAB})",
        ),
        (
            pb.ScoreRequest(sequences=[seq(4, wrong_rows, 2)]),
            "sequences[0].candidate_ids: 3 rows of 2 ids; the completion has 4 tokens",
        ),
        (
            pb.ScoreRequest(
                groups=[
                    pb.SequenceGroup(
                        prompt_ids=[1],
                        completions=[pb.Completion(completion_ids=[5], candidate_ids_i32=b"\0" * 12, num_candidates=2)],
                    )
                ]
            ),
            "groups[0].completions[0].candidate_ids_i32: 3 ids are not whole rows of num_candidates 2",
        ),
        (
            pb.ScoreRequest(sequences=[seq(2, np.zeros((2, 1)), 0)]),
            "sequences[0].num_candidates: 0 must be >= 1",
        ),
        (
            pb.ScoreRequest(sequences=[seq(1, np.zeros((1, 257)), 257)]),
            "sequences[0].candidate_ids: 257 candidates per position; 1 to 256 allowed",
        ),
    ]
    answers = await asyncio.gather(
        call(running.target, good),
        *(expect(running.target, req, grpc.StatusCode.INVALID_ARGUMENT, message) for req, message in bad),
        call(running.target, good),
    )
    for response in (answers[0], answers[-1]):
        (scores,) = response.scores
        assert len(np.frombuffer(scores.top_ids_i32, "<i4")) == 16 and len(scores.candidate_logprobs_f32) == 32


def test_client_refuses_what_it_can_tell(running):
    with LogprobClient(running.target) as client:
        with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
            client.score([[1]], [[2]], top_k=-3)
        with pytest.raises(ValueError, match=r"candidate_ids\[0\] has shape \(2, 3\): it is \(C, Kc\)"):
            client.score([[1]], [[2]], candidate_ids=[np.zeros((2, 3), np.int64)])
    with LogprobClient(running.target, legacy_wire=True) as client, pytest.raises(ValueError, match="legacy_wire"):
        client.score([[1]], [[2]], top_k=2)
