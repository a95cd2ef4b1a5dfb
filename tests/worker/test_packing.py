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
