"""Input layouts the client accepts, and putting the scores back into the same layout.

Two layouts (and groups, ``flatten_groups``):

* lists: ``prompt_ids`` and ``completion_ids`` are sequences of token-id sequences (lists or
  1-D arrays). Result: a list of float32 numpy arrays, one per completion.
* dense: 2-D numpy arrays or torch tensors ``(B, P)`` and ``(B, C)``, as trainers hold them:
  prompts left-padded with ``prompt_mask``, completions right-padded with ``completion_mask``
  (TRL's GRPOTrainer layout). The tokens where a mask is 1 form the sequence. Result: one
  ``(B, C)`` float32 array (or tensor, on ``completion_ids``' device) aligned with
  ``completion_ids``, 0 where ``completion_mask`` is 0. Rows with no completion token are not
  sent. torch is imported only when tensors are passed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _to_numpy(x: Any) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _is_dense(x: Any) -> bool:
    return (isinstance(x, np.ndarray) or _is_torch(x)) and x.ndim == 2


@dataclass(frozen=True)
class Prepared:
    """Sequences to send, and how to lay their scores out again."""

    sequences: list[tuple[np.ndarray, np.ndarray]]  # (prompt_ids, completion_ids), int64
    dense_shape: tuple[int, int] | None = None  # (B, C) for the dense layout
    rows: list[int] | None = None  # dense: the row of each sent sequence
    columns: list[np.ndarray] | None = None  # dense: the completion columns of each sent sequence
    like: Any = None  # the torch tensor whose device the dense result goes to, if any


def prepare(prompt_ids: Any, completion_ids: Any, prompt_mask: Any = None, completion_mask: Any = None) -> Prepared:
    prepared = _prepare(prompt_ids, completion_ids, prompt_mask, completion_mask)
    for i, (prompt, completion) in enumerate(prepared.sequences):
        for name, ids in (("prompt", prompt), ("completion", completion)):
            if ids.size and not (INT32_MIN <= ids.min() and ids.max() <= INT32_MAX):
                raise ValueError(f"sequence {i}'s {name} holds ids outside int32, which the wire carries")
    return prepared


def _prepare(prompt_ids: Any, completion_ids: Any, prompt_mask: Any, completion_mask: Any) -> Prepared:
    if _is_dense(prompt_ids) or _is_dense(completion_ids):
        return _prepare_dense(prompt_ids, completion_ids, prompt_mask, completion_mask)
    if prompt_mask is not None or completion_mask is not None:
        raise ValueError("prompt_mask/completion_mask go with 2-D (B, P)/(B, C) inputs, not lists")
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    sequences = [
        (np.asarray(p, dtype=np.int64).reshape(-1), np.asarray(c, dtype=np.int64).reshape(-1))
        for p, c in zip(prompt_ids, completion_ids)
    ]
    return Prepared(sequences=sequences)


def _mask(mask: Any, ids: np.ndarray, name: str) -> np.ndarray:
    if mask is None:
        return np.ones(ids.shape, dtype=bool)
    m = _to_numpy(mask)
    if m.shape != ids.shape:
        raise ValueError(f"{name} has shape {m.shape}, expected {ids.shape}")
    return m.astype(bool)


def _prepare_dense(prompt_ids: Any, completion_ids: Any, prompt_mask: Any, completion_mask: Any) -> Prepared:
    prompts, completions = _to_numpy(prompt_ids), _to_numpy(completion_ids)
    if prompts.ndim != 2 or completions.ndim != 2 or prompts.shape[0] != completions.shape[0]:
        raise ValueError(
            f"dense inputs must be (B, P) and (B, C) with the same B; got {prompts.shape} and {completions.shape}"
        )
    pmask = _mask(prompt_mask, prompts, "prompt_mask")
    cmask = _mask(completion_mask, completions, "completion_mask")
    sequences, rows, columns = [], [], []
    for b in range(prompts.shape[0]):
        cols = np.flatnonzero(cmask[b])
        if cols.size == 0:
            continue  # nothing to score in this row: its output stays 0
        sequences.append((prompts[b][pmask[b]].astype(np.int64), completions[b, cols].astype(np.int64)))
        rows.append(b)
        columns.append(cols)
    return Prepared(
        sequences=sequences,
        dense_shape=completions.shape,
        rows=rows,
        columns=columns,
        like=completion_ids if _is_torch(completion_ids) else None,
    )


def assemble(prepared: Prepared, per_sequence: Sequence[np.ndarray]) -> Any:
    """Scores in the caller's layout: a list of arrays, or a dense (B, C) array/tensor."""
    if prepared.dense_shape is None:
        return list(per_sequence)
    out = np.zeros(prepared.dense_shape, dtype=np.float32)
    for row, cols, values in zip(prepared.rows, prepared.columns, per_sequence):
        out[row, cols] = values
    if prepared.like is None:
        return out
    import torch

    return torch.from_numpy(out).to(prepared.like.device)


def flatten_groups(prompt_ids: Sequence[Any], completion_ids: Sequence[Sequence[Any]]) -> tuple[list, list, list[int]]:
    """GRPO groups (``completion_ids[g]``: the completions of ``prompt_ids[g]``) as the lists layout,
    each prompt repeated before its completions, and the groups' sizes."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} groups of completions")
    prompts = [p for p, group in zip(prompt_ids, completion_ids) for _ in group]
    completions = [c for group in completion_ids for c in group]
    return prompts, completions, [len(group) for group in completion_ids]


def regroup(flat: Any, sizes: Sequence[int]) -> Any:
    """Per-sequence results (a list, or a (logprobs, entropies) pair of lists) cut back into groups."""
    if isinstance(flat, tuple):
        return tuple(regroup(part, sizes) for part in flat)
    bounds = np.cumsum([0, *sizes])
    return [flat[start:end] for start, end in itertools.pairwise(bounds)]
