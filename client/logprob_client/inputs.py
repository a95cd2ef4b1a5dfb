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

Either way the ids are 2-D (a flat list is one sequence's ids, not a batch: ``ValueError``) and
integers (floats, bools and anything else: ``TypeError``), each error naming the argument and
the index at fault. ``Prepared.name`` says how the caller named each id sent, so that an error the
server answers about its request (``groups[2].completions[0].completion_ids[1]``) is reported in
the caller's terms (``completion_ids[3][1]``; ``wire.caller_error``).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FIELDS = ("prompt_ids", "completion_ids")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _to_numpy(x: Any) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or _is_torch(x)


def _is_dense(x: Any) -> bool:
    return _is_array(x) and x.ndim == 2


@dataclass(frozen=True)
class Prepared:
    """Sequences to send, how to lay their scores out again, and how the caller named them."""

    sequences: list[tuple[np.ndarray, np.ndarray]]  # (prompt_ids, completion_ids), int64
    dense_shape: tuple[int, int] | None = None  # (B, C) for the dense layout
    rows: list[int] | None = None  # dense: the row of each sent sequence
    columns: list[np.ndarray] | None = None  # dense: the completion columns of each sent sequence
    like: Any = None  # the torch tensor whose device the dense result goes to, if any
    prompt_mask: np.ndarray | None = None  # dense: which prompt columns were sent, per row
    group_sizes: Sequence[int] | None = None  # groups (``flatten_groups``): completions per prompt
    # Each sent sequence's candidate ids [C, Kc] (int64), or None where it has none; None: no candidates at all
    candidates: list[np.ndarray | None] | None = None

    def name(self, index: int, field: str | None = None, position: int | None = None) -> str:
        """How the caller named sequence ``index``'s ``field`` (``FIELDS``; None: the whole
        sequence), or the id at ``position`` of the ids sent for it: ``completion_ids[3][1]``
        (lists; dense: its row and column), ``completion_ids[g][c][1]`` (groups)."""
        if field is None:
            return " + ".join(self.name(index, f) for f in FIELDS)
        row = index if self.rows is None else self.rows[index]
        if field == "candidate_ids":  # a row per completion position, named like the completion's
            return self.name(index, "completion_ids", position).replace("completion_ids", "candidate_ids", 1)
        if self.group_sizes is None:
            where = f"[{row}]"
        else:  # the flat row's group, and its place there
            starts = list(itertools.accumulate(self.group_sizes, initial=0))
            group = bisect.bisect_right(starts, row) - 1  # (the last of equal starts: empty groups have no rows)
            where = f"[{group}]" if field == "prompt_ids" else f"[{group}][{row - starts[group]}]"
        if position is not None and self.rows is not None:  # dense: the column of the id sent
            assert self.columns is not None and self.prompt_mask is not None
            sent = self.columns[index] if field == "completion_ids" else np.flatnonzero(self.prompt_mask[row])
            position = int(sent[position])
        return f"{field}{where}" + ("" if position is None else f"[{position}]")


def prepare(
    prompt_ids: Any,
    completion_ids: Any,
    prompt_mask: Any = None,
    completion_mask: Any = None,
    *,
    group_sizes: Sequence[int] | None = None,
    candidate_ids: Any = None,
) -> Prepared:
    """The sequences of one call in either layout, checked: 2-D, integer ids within int32 (the
    wire's type). ``group_sizes``: the lists are ``flatten_groups``' of the caller's groups (errors
    then name the groups). ``candidate_ids``: per completion position, ids whose log-probs to
    return: lists layout, one [C_i, Kc_i] array (or None) per sequence; dense, one (B, C, Kc)
    array/tensor aligned with ``completion_ids``."""
    if _is_dense(prompt_ids) or _is_dense(completion_ids):
        prepared = _prepare_dense(prompt_ids, completion_ids, prompt_mask, completion_mask)
    else:
        prepared = _prepare_lists(prompt_ids, completion_ids, prompt_mask, completion_mask, group_sizes)
    if candidate_ids is not None:
        prepared = _with_candidates(prepared, candidate_ids)
    for i, pair in enumerate(prepared.sequences):
        for field, ids in zip(FIELDS, pair, strict=True):
            if ids.size and not (INT32_MIN <= ids.min() and ids.max() <= INT32_MAX):
                j = int(np.flatnonzero((ids < INT32_MIN) | (ids > INT32_MAX))[0])
                raise ValueError(f"{prepared.name(i, field, j)}: {ids[j]} is outside int32, which the wire carries")
        prepared.sequences[i] = (pair[0].astype(np.int64, copy=False), pair[1].astype(np.int64, copy=False))
    return prepared


def _with_candidates(prepared: Prepared, candidate_ids: Any) -> Prepared:
    """``prepared`` with each sent sequence's candidate rows, checked: integer ids within int32,
    one row per completion position (``prepare``)."""
    if prepared.dense_shape is not None:
        dense = _ragged_safe(candidate_ids, "candidate_ids", "(B, C, Kc)")
        if dense.ndim != 3 or dense.shape[:2] != prepared.dense_shape:
            raise ValueError(
                f"candidate_ids has shape {dense.shape}: with 2-D inputs it is (B, C, Kc), "
                f"B, C = {prepared.dense_shape} as completion_ids"
            )
        assert prepared.rows is not None and prepared.columns is not None
        given = [dense[row, cols] for row, cols in zip(prepared.rows, prepared.columns)]
    else:
        given = list(_rows(candidate_ids, "candidate_ids"))
        if len(given) != len(prepared.sequences):
            raise ValueError(f"{len(given)} rows of candidate_ids for {len(prepared.sequences)} completions")
    candidates: list[np.ndarray | None] = []
    for i, (values, (_, completion)) in enumerate(zip(given, prepared.sequences)):
        name = prepared.name(i, "candidate_ids")
        if values is None:
            candidates.append(None)
            continue
        ids = _ragged_safe(values, name, "(C, Kc): the same number of candidates at each completion position")
        if ids.ndim != 2 or ids.shape[0] != len(completion):
            raise ValueError(
                f"{name} has shape {ids.shape}: it is (C, Kc), one row of candidates per completion token (C = "
                f"{len(completion)})"
            )
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"{name} has dtype {ids.dtype}: token ids are integers")
        if ids.size and not (INT32_MIN <= ids.min() and ids.max() <= INT32_MAX):
            raise ValueError(f"{name}: an id is outside int32, which the wire carries")
        candidates.append(ids.astype(np.int64, copy=False))
    return dataclasses.replace(prepared, candidates=candidates)


def _ragged_safe(values: Any, name: str, shape: str) -> np.ndarray:
    """``values`` as an array; numpy's "inhomogeneous shape" for ragged lists becomes an error
    naming the argument and the shape it must have."""
    try:
        return _to_numpy(values)
    except ValueError:
        raise ValueError(f"{name} is ragged (rows of different lengths): it is {shape}") from None


def _rows(ids: Any, name: str) -> Sequence[Any]:
    """A lists-layout argument's rows: a list or tuple of sequences."""
    if _is_array(ids):  # a 2-D one is the dense layout
        raise ValueError(
            f"{name} has shape {tuple(ids.shape)}: pass a 2-D (B, L) array/tensor or a list of token-id sequences"
        )
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} is a {type(ids).__name__}: pass a list of token-id sequences or a (B, L) array/tensor")
    return ids


def _sequence_ids(values: Any, prepared: Prepared, index: int, field: str) -> np.ndarray:
    """One sequence's ids (a list, tuple or 1-D array/tensor of integers), as given; errors name
    them as the caller did (``Prepared.name``)."""
    name = prepared.name(index, field)
    if isinstance(values, int | float | np.number):
        argument = name.partition("[")[0]
        raise ValueError(
            f"{argument} must be 2-D, a list of token-id sequences (or a (B, L) array/tensor): {name} is "
            f"{values!r}, not a sequence; one sequence goes as [[id, id, ...]]"
        )
    if isinstance(values, str | bytes) or not (_is_array(values) or isinstance(values, Sequence)):
        raise TypeError(f"{name} is a {type(values).__name__}, not a sequence of token ids")
    try:
        ids = _to_numpy(values)
    except ValueError:  # numpy: a ragged nested list
        raise ValueError(f"{name} is not a flat sequence of token ids") from None
    if ids.ndim != 1:
        raise ValueError(f"{name} has shape {ids.shape}: each sequence is a flat (1-D) list of token ids")
    if ids.dtype.kind in "iu" or ids.size == 0:  # (an empty list is float64 to numpy)
        return ids if ids.size else np.zeros(0, np.int64)
    if _is_array(values):
        raise TypeError(f"{name} has dtype {values.dtype}: token ids are integers")
    integer = (not isinstance(x, bool | np.bool_) and isinstance(x, int | np.integer) for x in values)
    j = next((j for j, ok in enumerate(integer) if not ok), None)
    if j is None:  # integers too large for any numpy integer type
        j = next(j for j, x in enumerate(values) if not INT32_MIN <= x <= INT32_MAX)
        raise ValueError(f"{prepared.name(index, field, j)}: {values[j]} is outside int32, which the wire carries")
    value = values[j]
    raise TypeError(f"{prepared.name(index, field, j)} is {value!r} ({type(value).__name__}), not an integer token id")


def _prepare_lists(
    prompt_ids: Any, completion_ids: Any, prompt_mask: Any, completion_mask: Any, group_sizes: Sequence[int] | None
) -> Prepared:
    if prompt_mask is not None or completion_mask is not None:
        raise ValueError("prompt_mask/completion_mask go with 2-D (B, P)/(B, C) inputs, not lists")
    prompts, completions = _rows(prompt_ids, "prompt_ids"), _rows(completion_ids, "completion_ids")
    prepared = Prepared(sequences=[], group_sizes=group_sizes)
    if prompts and completions:  # 1-D inputs ([1, 2, 3] for one sequence) are refused as such first
        _sequence_ids(prompts[0], prepared, 0, "prompt_ids")
        _sequence_ids(completions[0], prepared, 0, "completion_ids")
    if len(prompts) != len(completions):
        raise ValueError(
            f"{len(prompts)} prompts but {len(completions)} completions: one completion per prompt, each a list "
            "of token ids (2-D: [[id, ...], ...])"
        )
    for i, pair in enumerate(zip(prompts, completions)):
        ids = [_sequence_ids(values, prepared, i, field) for values, field in zip(pair, FIELDS, strict=True)]
        prepared.sequences.append((ids[0], ids[1]))
    return prepared


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
    for name, given, ids in (("prompt_ids", prompt_ids, prompts), ("completion_ids", completion_ids, completions)):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name} has dtype {getattr(given, 'dtype', ids.dtype)}: token ids are integers")
    pmask = _mask(prompt_mask, prompts, "prompt_mask")
    cmask = _mask(completion_mask, completions, "completion_mask")
    sequences, rows, columns = [], [], []
    for b in range(prompts.shape[0]):
        cols = np.flatnonzero(cmask[b])
        if cols.size == 0:
            continue  # nothing to score in this row: its output stays 0
        sequences.append((prompts[b][pmask[b]], completions[b, cols]))
        rows.append(b)
        columns.append(cols)
    return Prepared(
        sequences=sequences,
        dense_shape=completions.shape,
        rows=rows,
        columns=columns,
        like=completion_ids if _is_torch(completion_ids) else None,
        prompt_mask=pmask,
    )


def assemble(
    prepared: Prepared,
    per_sequence: Sequence[np.ndarray | None],
    width: int | tuple[int, ...] = 0,
    dtype: Any = np.float32,
) -> Any:
    """Scores in the caller's layout: a list of arrays, or a dense (B, C) array/tensor; with
    ``width``, per-position rows of that many ([C, width] arrays, or (B, C, width), 0 where
    nothing was sent), or of that shape (a tuple: [C, *width], or (B, C, *width))."""
    if prepared.dense_shape is None:
        return list(per_sequence)
    trailing = width if isinstance(width, tuple) else ((width,) if width else ())
    out = np.zeros(prepared.dense_shape + trailing, dtype=dtype)
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
    """Per-sequence results (a list, a (logprobs, entropies) pair of lists, or a ``TeacherScores``
    of lists) cut back into groups."""
    if isinstance(flat, tuple):
        return tuple(regroup(part, sizes) for part in flat)
    if dataclasses.is_dataclass(flat) and not isinstance(flat, type):
        parts = {f.name: getattr(flat, f.name) for f in dataclasses.fields(flat)}
        return dataclasses.replace(flat, **{k: regroup(v, sizes) for k, v in parts.items() if v is not None})
    bounds = np.cumsum([0, *sizes])
    return [flat[start:end] for start, end in itertools.pairwise(bounds)]
