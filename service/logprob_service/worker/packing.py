"""Turn a micro-batch of sequences into one packed, padding-free model input.

The sequences are concatenated into a single row of T tokens; position ids restart at 0 for
each sequence, and ``cu_seqlens`` (cumulative lengths, int32, [n + 1]) tells the attention op
(``ops.attention``) where each sequence starts, so attention stays within a sequence. No token
is padding, so no compute is spent on padding.

For a sequence starting at offset o with prompt length P and completion length C, the row that
predicts completion token t (0-based) is o + P - 1 + t: the last prompt token predicts the first
completion token. Only these rows reach the log-prob op.

Everything here is numpy: it runs on whichever thread prepares the next micro-batch, and the
scorer (``models.scorer``, which defines ``PackedBatch``, its input) turns the arrays into
(pinned) tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from logprob_service.domain import TokenSequence
from logprob_service.models.scorer import PackedBatch


def pack(sequences: Sequence[TokenSequence]) -> PackedBatch:
    lengths = np.array([s.num_tokens for s in sequences], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])  # [n + 1]
    input_ids = np.concatenate([np.concatenate([s.prompt_ids, s.completion_ids]) for s in sequences])
    # Position of token i within its sequence: i - start of its sequence.
    position_ids = np.arange(starts[-1]) - np.repeat(starts[:-1], lengths)
    rows = np.concatenate(
        [start + len(s.prompt_ids) - 1 + np.arange(len(s.completion_ids)) for start, s in zip(starts, sequences)]
    )
    return PackedBatch(
        input_ids=input_ids.astype(np.int64),
        position_ids=position_ids,
        cu_seqlens=starts.astype(np.int32),
        max_seqlen=int(lengths.max()),
        rows=rows.astype(np.int64),
        targets=np.concatenate([s.completion_ids for s in sequences]).astype(np.int64),
        completion_lengths=[len(s.completion_ids) for s in sequences],
    )
