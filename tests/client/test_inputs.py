"""Client input layouts: lists, and dense (B, P)/(B, C) arrays or tensors with masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_client.inputs import assemble, flatten_groups, prepare, regroup

from tests.helpers.fake_server import sequences_of


def test_lists_round_trip():
    prepared = prepare([[1, 2], np.array([3])], [[4, 5, 6], [7]])
    assert [(p.tolist(), c.tolist()) for p, c in prepared.sequences] == [([1, 2], [4, 5, 6]), ([3], [7])]
    out = assemble(prepared, [np.array([0.1, 0.2, 0.3], np.float32), np.array([0.4], np.float32)])
    assert isinstance(out, list) and out[1].tolist() == pytest.approx([0.4])


def test_dense_masks_select_tokens_and_scatter_back():
    prompt_ids = np.array([[0, 0, 11, 12], [21, 22, 23, 24], [0, 0, 0, 31]])
    prompt_mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    completion_ids = np.array([[13, 14, 0], [25, 0, 0], [32, 33, 34]])
    completion_mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2: nothing to score
    prepared = prepare(prompt_ids, completion_ids, prompt_mask, completion_mask)
    assert [(p.tolist(), c.tolist()) for p, c in prepared.sequences] == [([11, 12], [13, 14]), ([21, 22, 23, 24], [25])]
    out = assemble(prepared, [np.array([-1.0, -2.0], np.float32), np.array([-3.0], np.float32)])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[-1, -2, 0], [-3, 0, 0], [0, 0, 0]])


def test_dense_torch_in_torch_out_on_the_same_device():
    completion_ids = torch.tensor([[5, 6]])
    prepared = prepare(torch.tensor([[1, 2]]), completion_ids)
    out = assemble(prepared, [np.array([-0.5, -0.25], np.float32)])
    assert isinstance(out, torch.Tensor) and out.device == completion_ids.device and out.dtype == torch.float32
    assert out.tolist() == [[-0.5, -0.25]]


@pytest.mark.parametrize(
    "args,match",
    [
        (([[1]], [[2], [3]]), "1 prompts but 2 completions"),
        (([[1]], [[2]], [[1]]), "go with 2-D"),
        ((np.ones((2, 3), int), np.ones((3, 2), int)), "same B"),
        ((np.ones((2, 3), int), np.ones((2, 2), int), np.ones((2, 2))), "prompt_mask has shape"),
    ],
)
def test_bad_layouts_are_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        prepare(*args)


def test_groups_flatten_prompt_before_each_completion_and_regroup():
    prompts, completions, sizes = flatten_groups([[1, 2], [3]], [[[4], [5, 6]], []])
    assert (prompts, completions, sizes) == ([[1, 2], [1, 2]], [[4], [5, 6]], [2, 0])
    assert regroup(["a", "b"], sizes) == [["a", "b"], []]
    assert regroup((["a", "b"], ["x", "y"]), sizes) == ([["a", "b"], []], [["x", "y"], []])
    with pytest.raises(ValueError, match="2 prompts but 3 groups"):
        flatten_groups([[1], [2]], [[[3]], [[4]], [[5]]])


def test_the_wire_groups_consecutive_equal_prompts_only():
    from logprob_client.wire import Options, repeats_prompt, score_request

    a, b = np.array([1, 2, 3]), np.array([4])
    seqs = [(a, np.array([5])), (a.copy(), np.array([6, 7])), (b, np.array([8])), (a.copy(), np.array([9]))]
    request = score_request(seqs, Options("m", 1.0, False, 0), repeats=repeats_prompt(seqs))
    assert not request.sequences and request.scores_f32
    assert [(i32(g.prompt_ids_i32), [i32(c.completion_ids_i32) for c in g.completions]) for g in request.groups] == [
        ([1, 2, 3], [[5], [6, 7]]),
        ([4], [[8]]),
        ([1, 2, 3], [[9]]),  # not consecutive: its own group (the server still runs the prompt once)
    ]
    # As the server reads it: the sequences in order.
    assert [(list(s.prompt_ids), list(s.completion_ids)) for s in sequences_of(request)] == [
        (p.tolist(), c.tolist()) for p, c in seqs
    ]


def i32(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i4").tolist()


@pytest.mark.parametrize("legacy", [False, True])
def test_a_client_not_sharing_prompts_sends_every_sequence_whole(legacy):
    """``share_prompts=False``: sequences, as many RPCs as the token limit needs; with
    ``legacy_wire`` as v1 requests (repeated fields, scores asked as repeated floats)."""
    from logprob_client import LogprobClient

    with LogprobClient("127.0.0.1:1", share_prompts=False, legacy_wire=legacy, max_tokens_per_rpc=7) as client:
        scoring = client.prepare_one([[1, 2, 3]] * 3, [[4], [5], [6]], {})
    # The shared prompt is not counted once: 4 + 4 > 7 tokens, so one sequence an RPC.
    assert [[(list(s.prompt_ids), list(s.completion_ids)) for s in sequences_of(r)] for r in scoring.requests] == [
        [([1, 2, 3], [4])],
        [([1, 2, 3], [5])],
        [([1, 2, 3], [6])],
    ]
    assert not any(r.groups for r in scoring.requests)
    assert all(r.scores_f32 != legacy and bool(r.sequences[0].prompt_ids) == legacy for r in scoring.requests)


def test_ids_outside_int32_are_refused_before_the_wire():
    with pytest.raises(ValueError, match="sequence 1's completion holds ids outside int32"):
        prepare([[1], [2]], [[3], [2**31]])
