"""Cutting a call into RPC-sized parts: contiguous, in order, within both limits, and greedy."""

from __future__ import annotations

import itertools

import pytest
from logprob_client.split import RpcLimits, split


def check_parts(lengths: list[int], limits: RpcLimits, parts: list[slice]) -> None:
    """The contract of ``split``, stated independently of how it is computed."""
    assert parts[0].start == 0 and parts[-1].stop == len(lengths)
    assert all(part.stop > part.start for part in parts), "no empty part"
    for a, b in itertools.pairwise(parts):
        assert a.stop == b.start, "contiguous, in order"
    for i, part in enumerate(parts):
        size, tokens = part.stop - part.start, sum(lengths[part])
        assert size <= limits.max_sequences
        assert tokens <= limits.max_tokens or size == 1, "only a lone sequence may pass the token limit"
        if i + 1 < len(parts):  # greedy: the next sequence would have broken a limit
            nxt = lengths[part.stop]
            assert size + 1 > limits.max_sequences or tokens + nxt > limits.max_tokens


@pytest.mark.parametrize("trial", range(20))
def test_random_lengths(trial, rng):
    lengths = rng.integers(1, 300, int(rng.integers(1, 200))).tolist()
    limits = RpcLimits(max_sequences=int(rng.integers(1, 40)), max_tokens=int(rng.integers(1, 2000)))
    check_parts(lengths, limits, split(lengths, limits))


def test_sequence_longer_than_the_token_limit_is_a_part_of_its_own():
    lengths = [3, 50, 4, 4]
    parts = split(lengths, RpcLimits(max_sequences=10, max_tokens=10))
    assert [(p.start, p.stop) for p in parts] == [(0, 1), (1, 2), (2, 4)]


def test_within_limits_is_one_part_and_empty_is_one_empty_part():
    assert split([5, 6, 7], RpcLimits()) == [slice(0, 3)]
    assert split([], RpcLimits()) == [slice(0, 0)]


@pytest.mark.parametrize("bad", [dict(max_sequences=0), dict(max_tokens=0)])
def test_limits_must_be_positive(bad):
    with pytest.raises(ValueError, match=">= 1"):
        RpcLimits(**bad)


def test_consecutive_sequences_sharing_a_prompt_count_it_once_per_part():
    # Two groups: prompt 100 with completions 10, 20, 30; then prompt 50 with 5, 5.
    lengths, shared = [110, 120, 130, 55, 55], [0, 100, 100, 0, 50]
    assert split(lengths, RpcLimits(max_tokens=160), shared) == [slice(0, 3), slice(3, 5)]  # 160, 110
    # A group over the limit is cut, and its next part pays the prompt again.
    assert split(lengths, RpcLimits(max_tokens=130), shared) == [slice(0, 2), slice(2, 3), slice(3, 5)]
    assert split(lengths, RpcLimits(max_tokens=160)) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 5)]
