"""Requests for top-k and candidate log-probs: checked with names (field, sequence, position, limit),
batched only with requests of the same top_k, and their extra outputs counted by admission."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from logprob_service.domain import MAX_TOP_K, ModelInfo, ScoreJob, ScoreOptions, TokenSequence
from logprob_service.engine.batch_queue import BatchQueue, Request
from logprob_service.engine.costs import OUTPUTS_PER_TOKEN, output_cost
from logprob_service.engine.validation import RequestLimits, validate_job
from logprob_service.errors import InvalidArgument

INFO = ModelInfo("m", "fake", "fake", 1000, None, "float32", "fake", 0, "fp")
LIMITS = RequestLimits(max_sequences_per_request=100, max_tokens_per_request=10_000)


def seq(rng, completion: int = 5, candidates: int | None = None) -> TokenSequence:
    cand = None if candidates is None else rng.integers(0, 1000, (completion, candidates))
    return TokenSequence(rng.integers(0, 1000, 3), rng.integers(0, 1000, completion), candidate_ids=cand)


def job(sequences, *, top_k: int = 0, group_sizes=()) -> ScoreJob:
    return ScoreJob("r", "m", list(sequences), ScoreOptions(top_k=top_k), group_sizes=tuple(group_sizes))


def test_valid_requests_pass(rng):
    validate_job(job([seq(rng, candidates=MAX_TOP_K), seq(rng)], top_k=MAX_TOP_K), INFO, LIMITS)


@pytest.mark.parametrize("top_k", [-1, MAX_TOP_K + 1])
def test_top_k_out_of_range_is_refused(rng, top_k):
    with pytest.raises(InvalidArgument, match=rf"^top_k: {top_k} must lie in \[0, 256\]"):
        validate_job(job([seq(rng)], top_k=top_k), INFO, LIMITS)


def test_top_k_above_a_small_vocabulary_is_refused(rng):
    small = dataclasses.replace(INFO, vocab_size=10)
    s = TokenSequence(np.array([1]), np.array([2, 3]))
    with pytest.raises(InvalidArgument, match=r"^top_k: 11 must lie in \[0, 10\]"):
        validate_job(job([s], top_k=11), small, LIMITS)


def test_a_candidate_out_of_vocabulary_is_named_by_sequence_and_position(rng):
    bad = seq(rng, completion=4, candidates=3)
    bad.candidate_ids[2, 1] = 1000
    with pytest.raises(
        InvalidArgument,
        match=r"^sequences\[1\]\.candidate_ids\[2\]\[1\]: token id 1000 \(completion position 2\) "
        r"is outside \[0, 1000\)",
    ):
        validate_job(job([seq(rng), bad]), INFO, LIMITS)
    bad.candidate_ids[2, 1] = -1
    grouped = job([seq(rng), seq(rng), bad], group_sizes=[2])  # in a group: named as the request named it
    with pytest.raises(InvalidArgument, match=r"^groups\[0\]\.completions\[1\]\.candidate_ids\[2\]\[1\]: token id -1"):
        validate_job(grouped, INFO, LIMITS)


def test_candidate_rows_must_match_the_completion(rng):
    s = dataclasses.replace(seq(rng, completion=4), candidate_ids=np.zeros((3, 2), np.int64))
    with pytest.raises(
        InvalidArgument, match=r"^sequences\[0\]\.candidate_ids: 3 rows of 2 ids; the completion has 4 tokens"
    ):
        validate_job(job([s]), INFO, LIMITS)


@pytest.mark.parametrize("width", [0, MAX_TOP_K + 1])
def test_candidates_per_position_are_limited(rng, width):
    s = seq(rng, completion=2, candidates=width)
    with pytest.raises(
        InvalidArgument, match=rf"^sequences\[0\]\.candidate_ids: {width} candidates per position; 1 to 256"
    ):
        validate_job(job([s]), INFO, LIMITS)


def test_admission_counts_the_extra_outputs_and_batches_by_top_k(rng):
    plain = [seq(rng, completion=10), seq(rng, completion=10, candidates=100)]
    assert output_cost(plain[0], 0) == 0
    assert output_cost(plain[0], 200) == -(-10 * 200 // OUTPUTS_PER_TOKEN)
    assert output_cost(plain[1], 200) == -(-10 * 300 // OUTPUTS_PER_TOKEN)
    queue = BatchQueue(max_batch_tokens=1000, max_batch_sequences=10)
    requests = []
    for top_k in (0, 200):
        request = Request(job(plain, top_k=top_k), lambda: False, print, print)
        (unit,) = queue.plan(request)
        assert unit.cost == 26  # micro-batches are cut by the tokens they run
        requests.append(request)
    assert requests[0].cost == 26 + output_cost(plain[1], 0)  # its candidates
    assert requests[1].cost == 26 + output_cost(plain[0], 200) + output_cost(plain[1], 200)
    assert requests[0].key != requests[1].key  # a launch has one top_k
