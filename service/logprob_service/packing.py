"""Turn a list of sequences into model inputs.

Today: right-padded batches, planned under a padded-token budget. A sequence's real tokens come
first and its padding after, so under causal attention no real token ever attends to padding:
no attention mask is needed (which keeps SDPA on its fused causal kernels), position ids are
simply 0..L-1, and the padded rows are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .jobs import TokenSequence


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded
    position_ids: torch.Tensor  # [B, L] int64, 0..L-1 per row
    rows: torch.Tensor  # [N] int64: flat indices into [B*L] of the rows that predict completion tokens
    targets: torch.Tensor  # [N] int64: the completion tokens those rows predict
    completion_lengths: list[int]  # to split the N results back per sequence

    def to(self, device: torch.device) -> PaddedBatch:
        move = {"device": device, "non_blocking": True}
        return PaddedBatch(
            input_ids=self.input_ids.to(**move),
            position_ids=self.position_ids.to(**move),
            rows=self.rows.to(**move),
            targets=self.targets.to(**move),
            completion_lengths=self.completion_lengths,
        )


def pad_right(sequences: Sequence[TokenSequence], pad_id: int = 0) -> PaddedBatch:
    """Build a right-padded batch; the row predicting completion token t of a sequence with
    prompt length P sits at position P - 1 + t (the last prompt token predicts the first)."""
    lengths = [s.num_tokens for s in sequences]
    width = max(lengths)
    input_ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    rows, targets = [], []
    for b, seq in enumerate(sequences):
        p, c = len(seq.prompt_ids), len(seq.completion_ids)
        input_ids[b, :p] = seq.prompt_ids
        input_ids[b, p : p + c] = seq.completion_ids
        rows.append(b * width + np.arange(p - 1, p - 1 + c))
        targets.append(seq.completion_ids)
    return PaddedBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.arange(width).expand(len(sequences), width).contiguous(),
        rows=torch.from_numpy(np.concatenate(rows).astype(np.int64)),
        targets=torch.from_numpy(np.concatenate(targets).astype(np.int64)),
        completion_lengths=[len(s.completion_ids) for s in sequences],
    )


def plan_padded_batches(lengths: Sequence[int], *, max_batch_tokens: int, max_batch_sequences: int) -> list[list[int]]:
    """Group sequence indices into batches whose padded size (count x longest) stays within
    ``max_batch_tokens`` and whose count stays within ``max_batch_sequences``.

    Sequences are taken longest first, so each batch holds similar lengths and little padding.
    A sequence longer than the budget forms a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        # Longest first: the batch's first sequence is its widest, so its width bounds the padding.
        if (
            current is not None
            and len(current) < max_batch_sequences
            and (len(current) + 1) * lengths[current[0]] <= max_batch_tokens
        ):
            current.append(i)
        else:
            batches.append([i])
    return batches
