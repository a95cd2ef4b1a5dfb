"""``wire.count_fields``: a ScoreRequest's sequences counted from its bytes, as protobuf reads them."""

from __future__ import annotations

import numpy as np
import pytest
from logprob_proto import logprob_pb2 as pb
from logprob_service.api.wire import SEQUENCES_FIELD, count_fields, count_sequences, request_head


def _request(rng: np.random.Generator, sequences: int) -> pb.ScoreRequest:
    """Every kind of field around the sequences: strings, varints, floats, groups, packed ids."""

    def ids() -> list[int]:
        return rng.integers(0, 1 << 31, int(rng.integers(0, 40))).tolist()

    request = pb.ScoreRequest(
        request_id="r" * int(rng.integers(0, 300)),
        model="m",
        temperature=0.7,
        return_entropy=True,
        min_version=int(rng.integers(0, 1 << 40)),
        top_k=int(rng.integers(0, 300)),
    )
    for i in range(sequences):
        request.sequences.append(pb.Sequence(prompt_ids=ids(), completion_ids=ids()))
        if i % 3 == 0:  # groups interleaved: another field, its completions not counted here
            request.groups.append(pb.SequenceGroup(prompt_ids=ids(), completions=[pb.Completion(completion_ids=ids())]))
    return request


@pytest.mark.parametrize("sequences", [0, 1, 7, 300])
def test_the_count_is_protobufs_and_stops_past_the_limit(sequences, rng):
    request = _request(rng, sequences)
    raw = request.SerializeToString()
    assert count_fields(raw, SEQUENCES_FIELD, 10**6) == len(request.sequences) == sequences
    if sequences > 5:
        assert count_fields(raw, SEQUENCES_FIELD, 5) == 6  # stopped there


def test_malformed_bytes_end_the_count_without_error(rng):
    raw = _request(rng, 50).SerializeToString()
    for cut in (1, 7, len(raw) // 2, len(raw) - 1):
        assert 0 <= count_fields(raw[:cut], SEQUENCES_FIELD, 10**6) <= 50
    noise = rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    assert count_fields(noise, SEQUENCES_FIELD, 10**6) >= 0


@pytest.mark.parametrize("sequences", [0, 1, 7, 300])
def test_a_requests_sequences_count_each_groups_completions_as_the_limit_does(sequences, rng):
    """``count_sequences``: the plain sequences and every group's completions (what
    ``max_sequences_per_request`` counts), stopping past the limit inside a group as well."""
    request = _request(rng, sequences)
    for _ in range(int(rng.integers(0, 4))):
        request.groups.append(
            pb.SequenceGroup(completions=[pb.Completion(completion_ids=[1])] * int(rng.integers(0, 9)))
        )
    raw = request.SerializeToString()
    total = len(request.sequences) + sum(len(group.completions) for group in request.groups)
    assert count_sequences(raw, 10**6) == total
    if total > 5:
        assert count_sequences(raw, 5) == 6  # stopped there
    many = pb.ScoreRequest(groups=[pb.SequenceGroup(completions=[pb.Completion(completion_ids=[2])] * 1000)] * 1000)
    assert count_sequences(many.SerializeToString(), 4096) == 4097


def test_a_requests_head_holds_its_id_and_model_and_none_of_its_sequences(rng):
    request = _request(rng, 50)
    request.request_id, request.model = "r-1", "m-2"
    head = request_head(request.SerializeToString())
    assert pb.ScoreRequest.FromString(head) == pb.ScoreRequest(request_id="r-1", model="m-2")
    assert request_head(b"") == b"" and request_head(pb.ScoreRequest(model="x").SerializeToString()) == b"\x12\x01x"
