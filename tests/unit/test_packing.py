"""Right-padded batches and the padded-token batch planner."""

from __future__ import annotations

import numpy as np
import pytest
from logprob_service.jobs import TokenSequence
from logprob_service.packing import pad_right, plan_padded_batches


def test_pad_right_rows_predict_the_completion_tokens():
    seqs = [
        TokenSequence(np.array([5, 6, 7]), np.array([8, 9])),
        TokenSequence(np.array([1]), np.array([2])),
    ]
    batch = pad_right(seqs, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    # Row of token 7 (flat 2) predicts 8; row of 8 (flat 3) predicts 9; row of 1 (flat 5) predicts 2.
    assert batch.rows.tolist() == [2, 3, 5]
    assert batch.targets.tolist() == [8, 9, 2]
    assert batch.completion_lengths == [2, 1]


@pytest.mark.parametrize("trial", range(20))
def test_plan_respects_budgets_and_covers_every_sequence_once(trial):
    rng = np.random.default_rng()
    lengths = rng.integers(1, 300, int(rng.integers(1, 60))).tolist()
    budget, max_seqs = int(rng.integers(50, 1200)), int(rng.integers(1, 9))
    plan = plan_padded_batches(lengths, max_batch_tokens=budget, max_batch_sequences=max_seqs)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert len(batch) <= max_seqs
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= budget or len(batch) == 1  # only a lone over-budget sequence may exceed it
