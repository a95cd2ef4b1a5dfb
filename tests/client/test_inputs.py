"""Client input layouts: lists, and dense (B, P)/(B, C) arrays or tensors with masks."""

from __future__ import annotations

import re

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
    with pytest.raises(ValueError, match=re.escape("completion_ids[1][0]: 2147483648 is outside int32")):
        prepare([[1], [2]], [[3], [2**31]])
    with pytest.raises(ValueError, match=re.escape("prompt_ids[0][1]: 1180591620717411303424 is outside int32")):
        prepare([[1, 2**70]], [[3]])  # (too large for any numpy integer)
    dense = np.array([[0, 7, 2**40]]), np.array([[5, 0]]), np.array([[0, 1, 1]]), np.array([[1, 0]])
    with pytest.raises(ValueError, match=re.escape("prompt_ids[0][2]: 1099511627776 is outside int32")):
        prepare(*dense)  # the column in the caller's padded row


def test_flat_lists_are_refused_not_taken_as_one_token_sequences():
    """``score([1, 2, 3], [4, 5, 6])`` was three sequences of one token each."""
    with pytest.raises(ValueError, match=re.escape("prompt_ids must be 2-D") + ".*" + re.escape("prompt_ids[0] is 1,")):
        prepare([1, 2, 3], [4, 5, 6])
    with pytest.raises(ValueError, match=re.escape("completion_ids must be 2-D") + ".*completion_ids\\[1\\] is 5,"):
        prepare([[1], [2]], [[4], 5])
    with pytest.raises(ValueError, match=re.escape("prompt_ids has shape (3,)")):
        prepare(np.array([1, 2, 3]), np.array([4, 5, 6]))  # 1-D arrays: not a batch either
    with pytest.raises(ValueError, match=re.escape("completion_ids[0] has shape (1, 2)")):
        prepare([[1]], [[[2, 3]]])


@pytest.mark.parametrize(
    "args,error,match",
    [
        (([[1.5, 2]], [[3]]), TypeError, "prompt_ids[0][0] is 1.5 (float), not an integer token id"),
        (([[1], [2]], [[3], [4, 5.0]]), TypeError, "completion_ids[1][1] is 5.0 (float)"),  # integral, still a float
        (([[True, False]], [[3]]), TypeError, "prompt_ids[0][0] is True (bool)"),  # (a mask for ids)
        (([[1], [2]], [[3], ["4"]]), TypeError, "completion_ids[1][0] is '4' (str)"),
        (([[1]], [np.array([3.0])]), TypeError, "completion_ids[0] has dtype float64"),
        (([[1]], [torch.tensor([True])]), TypeError, "completion_ids[0] has dtype torch.bool"),
        ((torch.tensor([[1, 2]]), torch.tensor([[1.0, 2.0]])), TypeError, "completion_ids has dtype torch.float32"),
        ((np.array([[True]]), np.array([[3]])), TypeError, "prompt_ids has dtype bool"),
        (("abc", "def"), TypeError, "prompt_ids is a str"),
    ],
)
def test_ids_that_are_not_integers_are_refused_naming_where(args, error, match):
    """Float ids were truncated to integers without a word."""
    with pytest.raises(error, match=re.escape(match)):
        prepare(*args)


def test_integer_ids_of_any_integer_type_are_taken():
    ids = [np.int32(4), np.uint8(5), 6]
    prepared = prepare([np.array([1, 2], np.uint16), torch.tensor([3], dtype=torch.int32)], [ids, []])
    assert [(p.tolist(), c.tolist()) for p, c in prepared.sequences] == [([1, 2], [4, 5, 6]), ([3], [])]
    assert all(a.dtype == np.int64 for pair in prepared.sequences for a in pair)


P, Q = [1, 2, 3], [4, 5]
ROWS = [P, P, Q, Q, Q], [[6], [7], [8], [9, 10], [11]]  # two GRPO groups, laid out as TRL does


def named(message: str, *, code=None, rpc: int = 0, groups: bool = False, **client_options):
    """The client's error for the server's ``message`` about RPC ``rpc`` of ``score(*ROWS)`` (or of
    ``score_groups`` of the same sequences)."""
    import grpc
    from logprob_client import LogprobClient

    with LogprobClient("127.0.0.1:1", **client_options) as client:
        if groups:
            scoring, _ = client.prepare_groups([P, Q], [ROWS[1][:2], ROWS[1][2:]], {})
        else:
            scoring = client.prepare_one(*ROWS, {})
    return scoring.error(rpc, code or grpc.StatusCode.INVALID_ARGUMENT, message)


@pytest.mark.parametrize(
    "message,expected",
    [
        (
            "groups[1].completions[1].completion_ids[1]: token id 5000 is outside [0, 4096) of model 'default'",
            "completion_ids[3][1]: token id 5000 is outside [0, 4096) of model 'default' "
            "(sent as groups[1].completions[1].completion_ids[1])",
        ),
        ("groups[1].prompt_ids[0]: token id -1 is outside", "prompt_ids[2][0]: token id -1 is outside"),
        ("groups[0].completions[1].completion_ids: is empty", "completion_ids[1]: is empty"),
        (
            "groups[1].completions[2]: 2 prompt + 1 completion = 3 tokens exceed",
            "prompt_ids[4] + completion_ids[4]: 2 prompt + 1 completion = 3 tokens exceed",
        ),
    ],
)
def test_the_servers_errors_name_the_callers_rows_not_the_wires(message, expected):
    """The client sends rows that share a prompt as one group: the server's ``groups[1]...`` is
    the caller's row 3."""
    error = named(message)
    assert error.message.startswith(expected) and error.server_message == message


def test_errors_name_the_callers_rows_across_rpcs_groups_and_dense_rows():
    # Cut into RPCs of 2 sequences, each whole: RPC 2's sequences[1] is row 3.
    split = named("sequences[1].completion_ids[1]: token id 5000", rpc=1, max_sequences_per_rpc=2, share_prompts=False)
    assert split.message == "completion_ids[3][1]: token id 5000 (sent as sequences[1].completion_ids[1] of RPC 2 of 3)"
    # score_groups: the caller's group 1, its completion 1.
    grouped = named("groups[1].completions[1].completion_ids[1]: token id 5000", groups=True)
    assert grouped.message.startswith("completion_ids[1][1][1]: token id 5000")
    assert named("groups[1].prompt_ids[0]: bad", groups=True).message.startswith("prompt_ids[1][0]: bad")
    # Dense: row 1 has nothing to score and is not sent; ids are named by their padded columns.
    import grpc
    from logprob_client import LogprobClient

    prompt_ids = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 4, 5], [0, 4, 5]])
    completion_ids = torch.tensor([[6, 0], [7, 0], [8, 0], [9, 10]])
    masks = {"prompt_mask": (prompt_ids > 0).long(), "completion_mask": torch.tensor([[1, 0], [0, 0], [1, 0], [1, 1]])}
    with LogprobClient("127.0.0.1:1") as client:
        scoring = client.prepare_one(prompt_ids, completion_ids, dict(masks))
    bad = grpc.StatusCode.INVALID_ARGUMENT
    # Sent: rows 0, 2 and 3, the last two as one group (one prompt).
    assert scoring.error(0, bad, "groups[1].completions[1].completion_ids[1]: x").message.startswith(
        "completion_ids[3][1]: x"
    )
    assert scoring.error(0, bad, "groups[1].prompt_ids[1]: x").message.startswith("prompt_ids[2][2]: x")


def test_other_errors_keep_the_servers_words():
    import grpc

    assert (
        named("sequences: 17 sequences exceed the limit of 16").message
        == "sequences: 17 sequences exceed the limit of 16"
    )
    unknown = named("groups[0].prompt_ids[0]: x", code=grpc.StatusCode.NOT_FOUND)
    assert unknown.message == "groups[0].prompt_ids[0]: x" and unknown.code == grpc.StatusCode.NOT_FOUND
