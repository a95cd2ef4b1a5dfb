"""Turn a micro-batch of sequences into one packed, padding-free model input.

The sequences are concatenated into a single row of T tokens; position ids restart at 0 for
each sequence, and ``cu_seqlens`` (cumulative lengths, int32, [n + 1]) tells the attention op
(``ops.attention``) where each sequence starts, so attention stays within a sequence. No token
is padding, so no compute is spent on padding.

For a sequence starting at offset o with prompt length P and completion length C, the row that
predicts completion token t (0-based) is o + P - 1 + t: the last prompt token predicts the first
completion token. Only these rows reach the log-prob op.

Shared prompts. Sequences of the micro-batch whose prompts are identical (GRPO's G completions
of one prompt) put the prompt in the row once: the group is laid out as

    [prompt: P tokens, positions 0..P-1] [completion 1: R_1 tokens, positions P..P+R_1-1] ... [completion G]

and each is a segment of ``cu_seqlens``. The prompt segment attends causally to itself; a
completion segment's keys are the prompt's rows followed by its own (``SharedKeys``), its queries
the last R_i of those P + R_i keys, causal aligned bottom-right: completion token t sees the whole
prompt and completion tokens 0..t, exactly as in the sequence alone. The prompt's last row
predicts every completion's first token; row c + t - 1 of completion i (c its first row) predicts
its token t >= 1. Results come back in the sequences' order, whatever the layout.

Everything here is numpy: it runs on whichever thread prepares the next micro-batch, and the
scorer (``models.scorer``, which defines ``PackedBatch``, its input) turns the arrays into
(pinned) tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from logprob_service.domain import TokenSequence, prompt_groups
from logprob_service.models.scorer import PackedBatch, SharedKeys


def pack(sequences: Sequence[TokenSequence], *, share_prompts: bool = True) -> PackedBatch:
    groups = prompt_groups(sequences) if share_prompts else [[i] for i in range(len(sequences))]
    ids, positions, q_lengths, key_rows = [], [], [], []
    rows: list[np.ndarray] = [np.empty(0, np.int64)] * len(sequences)
    offset = 0
    for group in groups:
        p = len(sequences[group[0]].prompt_ids)
        if len(group) == 1 or p == 0:  # whole sequences: a segment each, keys their own rows
            for i in group:
                seq = sequences[i]
                n = seq.num_tokens
                ids += [seq.prompt_ids, seq.completion_ids]
                positions.append(np.arange(n))
                q_lengths.append(n)
                key_rows.append(offset + np.arange(n))
                rows[i] = offset + p - 1 + np.arange(len(seq.completion_ids))
                offset += n
            continue
        prompt_rows = offset + np.arange(p)
        ids.append(sequences[group[0]].prompt_ids)
        positions.append(np.arange(p))
        q_lengths.append(p)
        key_rows.append(prompt_rows)
        offset += p
        for i in group:
            r = len(sequences[i].completion_ids)
            own = offset + np.arange(r)
            ids.append(sequences[i].completion_ids)
            positions.append(p + np.arange(r))
            q_lengths.append(r)
            key_rows.append(np.concatenate([prompt_rows, own]))
            rows[i] = np.concatenate([[prompt_rows[-1]], own[:-1]])
            offset += r
    key_lengths = [len(k) for k in key_rows]
    shared = sum(key_lengths) > offset  # some prompt's rows serve several segments
    return PackedBatch(
        input_ids=np.concatenate(ids).astype(np.int64),
        position_ids=np.concatenate(positions).astype(np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32),
        max_seqlen=int(max(q_lengths)),
        rows=np.concatenate(rows).astype(np.int64),
        targets=np.concatenate([s.completion_ids for s in sequences]).astype(np.int64),
        completion_lengths=[len(s.completion_ids) for s in sequences],
        candidates=_candidates(sequences),
        candidate_widths=[0 if s.candidate_ids is None else s.candidate_ids.shape[1] for s in sequences],
        shared_keys=SharedKeys(
            index=np.concatenate(key_rows).astype(np.int64),
            cu_seqlens=np.concatenate([[0], np.cumsum(key_lengths)]).astype(np.int32),
            max_seqlen=int(max(key_lengths)),
        )
        if shared
        else None,  # every segment's keys are its own rows: plain self-attention, no gather
    )


def _candidates(sequences: Sequence[TokenSequence]) -> np.ndarray | None:
    """[N, Kc] candidate ids of every completion position, row for row with ``rows``, Kc the most
    of any sequence's; shorter rows (and sequences without) padded with id 0, their results cut
    off again in ``Launched.fetch``. None when no sequence has any."""
    widths = [0 if s.candidate_ids is None else s.candidate_ids.shape[1] for s in sequences]
    if not any(widths):
        return None
    out = np.zeros((sum(len(s.completion_ids) for s in sequences), max(widths)), dtype=np.int64)
    row = 0
    for seq, width in zip(sequences, widths):
        if width:
            out[row : row + len(seq.completion_ids), :width] = seq.candidate_ids
        row += len(seq.completion_ids)
    return out
