"""Packed, padding-free micro-batches."""

from __future__ import annotations

import numpy as np
from logprob_service.domain import TokenSequence
from logprob_service.worker.packing import pack


def test_pack_concatenates_restarts_positions_and_selects_completion_rows():
    seqs = [
        TokenSequence(np.array([5, 6, 7]), np.array([8, 9])),
        TokenSequence(np.array([1]), np.array([2])),
        TokenSequence(np.array([3, 4]), np.array([10, 11, 12])),
    ]
    batch = pack(seqs)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4, 10, 11, 12]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4]
    assert batch.cu_seqlens.tolist() == [0, 5, 7, 12] and batch.cu_seqlens.dtype == np.int32
    assert batch.max_seqlen == 5 and batch.num_tokens == 12
    # Rows of 7, 8 predict 8, 9; the row of 1 predicts 2; rows of 4, 10, 11 predict 10, 11, 12.
    assert batch.rows.tolist() == [2, 3, 5, 8, 9, 10]
    assert batch.targets.tolist() == [8, 9, 2, 10, 11, 12]
    assert batch.completion_lengths == [2, 1, 3]


def test_pack_random_rows_always_point_one_before_their_target(rng):
    seqs = [
        TokenSequence(rng.integers(0, 1000, int(rng.integers(1, 20))), rng.integers(0, 1000, int(rng.integers(1, 20))))
        for _ in range(int(rng.integers(1, 30)))
    ]
    batch = pack(seqs)
    assert batch.num_tokens == sum(s.num_tokens for s in seqs)
    np.testing.assert_array_equal(batch.input_ids[batch.rows + 1], batch.targets)
    # Every predicting row lies inside its own sequence.
    seq_of_row = np.searchsorted(batch.cu_seqlens, batch.rows, side="right") - 1
    seq_of_target = np.searchsorted(batch.cu_seqlens, batch.rows + 1, side="right") - 1
    np.testing.assert_array_equal(seq_of_row, seq_of_target)


def test_identical_prompts_are_laid_out_once_and_each_completion_keys_on_them():
    a, b = np.array([5, 6, 7]), np.array([5, 6, 8])  # b differs from a in its last token: not shared
    seqs = [
        TokenSequence(a, np.array([20, 21])),
        TokenSequence(b, np.array([30])),
        TokenSequence(a.copy(), np.array([40, 41, 42])),
    ]
    batch = pack(seqs)
    # Group a first (its first member comes first): prompt, completion 0, completion 2; then b whole.
    assert batch.input_ids.tolist() == [5, 6, 7, 20, 21, 40, 41, 42, 5, 6, 8, 30]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 3]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8, 12] and batch.max_seqlen == 4
    keys = batch.shared_keys
    assert keys is not None
    segments = np.split(keys.index, keys.cu_seqlens[1:-1])
    assert [s.tolist() for s in segments] == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7], [8, 9, 10, 11]]
    assert keys.max_seqlen == 6
    # In the sequences' order: the prompt's last row (2) predicts each first completion token.
    assert batch.rows.tolist() == [2, 3, 10, 2, 5, 6]
    assert batch.targets.tolist() == [20, 21, 30, 40, 41, 42]
    assert batch.completion_lengths == [2, 1, 3]
    assert pack(seqs, share_prompts=False).shared_keys is None


def test_shared_layout_rows_see_what_the_sequence_alone_would(rng):
    """Every predicting row's keys (its segment's) are, token for token and position for position,
    the tokens before its target in its own sequence."""
    prompts = [rng.integers(0, 50, int(rng.integers(1, 8))) for _ in range(4)]
    seqs = [
        TokenSequence(prompts[int(rng.integers(0, 4))].copy(), rng.integers(0, 50, int(rng.integers(1, 9))))
        for _ in range(int(rng.integers(2, 20)))
    ]
    batch = pack(seqs)
    keys = batch.shared_keys
    index = keys.index if keys is not None else np.arange(batch.num_tokens)
    cu_k = keys.cu_seqlens if keys is not None else batch.cu_seqlens
    segment_of_row = np.searchsorted(batch.cu_seqlens, batch.rows, side="right") - 1
    done = 0
    for seq, n in zip(seqs, batch.completion_lengths):
        tokens = np.concatenate([seq.prompt_ids, seq.completion_ids])
        for t in range(n):
            row, s = batch.rows[done + t], segment_of_row[done + t]
            seg_keys = index[cu_k[s] : cu_k[s + 1]]
            # Queries are the segment's last positions: the row's keys end at the row itself.
            visible = seg_keys[: len(seg_keys) - (batch.cu_seqlens[s + 1] - 1 - row)]
            p = len(seq.prompt_ids) + t  # tokens before the target
            np.testing.assert_array_equal(batch.input_ids[visible], tokens[:p])
            np.testing.assert_array_equal(batch.position_ids[visible], np.arange(p))
        done += n
