"""JSON written in pieces, for answers with an object per token (vLLM's ``prompt_logprobs``,
SGLang's ``input_token_logprobs``), numbers written as every other answer's are: the shortest
text that reads back as the same float, ``-Infinity`` / ``NaN`` for the non-finite.

The edge writes these on the event loop's thread, holding the GIL that the device thread needs to
launch kernels (handing them to another thread would not free it: this is Python and compiled
writers that keep the GIL), so what counts is the CPU time a token. Built as Python dicts and
lists they cost 4 us a token on the 2-core CPU machine; written as below, without a Python object
per token but the numbers' texts, a fraction of that (``benchmarks/bench_http.py --encode`` and
``--route-cost``, docs/http.md has the figures)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import orjson
import pydantic_core

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _written(values: np.ndarray) -> bytes:
    """The 1-D array ``values`` as a JSON list. orjson writes a float64 as pydantic-core does (the
    shortest text that reads back as it; float32 widened first, as a Python float is), at a third
    of the cost and without a Python object a number, but writes the non-finite as ``null``:
    a list holding one is written by pydantic-core."""
    if values.dtype.kind != "f":
        return orjson.dumps(np.ascontiguousarray(values, dtype=np.int64), option=_NUMPY)
    if np.isfinite(values).all():
        return orjson.dumps(np.ascontiguousarray(values, dtype=np.float64), option=_NUMPY)
    return pydantic_core.to_json(values.tolist())


def numbers(values: np.ndarray) -> list[bytes]:
    """Each number of the 1-D array ``values`` (integers or floats) as JSON text."""
    return _written(values)[1:-1].split(b",") if len(values) else []


# A column of ``interleave``: one text for every row (bytes), a number a row (a numeric array,
# written by ``numbers``), or a text a row (an object array of bytes).
Column = bytes | np.ndarray


def interleave(*columns: Column, head: bytes = b"", tail: bytes = b"", block: int = 1024) -> list[bytes]:
    """The columns' items joined in turn (the first of each column, then the second of each, and
    so on), between ``head`` and ``tail``, as chunks to join: one a ``block`` of rows.

    A block at a time, from the numbers to its chunk, so that its numbers' texts and the list that
    joins them stay in the CPU's caches and their memory is reused by the next block: written
    whole, the texts of a top-20 answer of 2,700 tokens (55,000 entries) and their lists took half
    again as long (``bench_http.py --encode``). A numeric array given twice is written once a block.
    ``bytes.join`` allocates an 80-byte record per part, and a block's few thousand keep it in
    the heap (past 32 MiB, glibc maps fresh pages on every call)."""
    rows = max(len(column) for column in columns if not isinstance(column, bytes))
    width = len(columns)
    chunks = [head]
    for begin in range(0, rows, block):
        end = min(begin + block, rows)
        parts = [b""] * ((end - begin) * width)
        written: dict[int, list[bytes]] = {}
        for i, column in enumerate(columns):
            if isinstance(column, bytes):
                parts[i::width] = [column] * (end - begin)
            elif column.dtype == object:
                parts[i::width] = column[begin:end].tolist()
            else:
                if id(column) not in written:
                    written[id(column)] = numbers(column[begin:end])
                parts[i::width] = written[id(column)]
        chunks.append(b"".join(parts))
    chunks.append(tail)
    return chunks


def array(items: Sequence[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def with_raw(value: dict, **raw: bytes | Sequence[bytes]) -> bytes:
    """``value`` as JSON with each of ``raw``'s values (JSON text already written, whole or as
    chunks to join) as the value of its key, which ``value`` must hold as None, in ``raw``'s
    order. The text replaced is the first ``"<key>":null`` after the one before: no string value
    can hold it (each of a string's quotes is escaped), and no key written before does unless it
    holds a quote (the answers' keys are the peers' own names). One join, so the raw texts are
    copied once."""
    assert [key for key in value if key in raw] == list(raw) and all(value[key] is None for key in raw)
    rest = pydantic_core.to_json(value)
    parts: list[bytes] = []
    for key, written in raw.items():
        before, name, rest = rest.partition(pydantic_core.to_json(key) + b":null")
        parts += [before, name[: -len(b"null")]]
        parts += [written] if isinstance(written, bytes) else written
    return b"".join([*parts, rest])


def prepend(item: bytes, array: bytes) -> bytes:
    """The JSON list ``array`` with ``item`` (JSON text) put first (``array`` copied once)."""
    if array == b"[]":
        return b"[" + item + b"]"
    return b"".join([b"[", item, b",", memoryview(array)[1:]])


def triples(logprobs: np.ndarray, ids: np.ndarray) -> bytes:
    """SGLang's ``[logprob, token_id, null]`` of each element of ``logprobs`` and ``ids`` (one
    shape) as JSON: a list of them for 1-D arrays, a list of such lists (one a row) for 2-D.

    Written without a Python object per triple: the numbers go into one flat list a row, in C (a
    numpy object array's ``tolist``: Python floats and ints, as ``tolist`` gives them), each row
    inside a list of its own, and pydantic-core writes them all in one call:
    ``[[lp,id,null,lp,id,null]]`` a row. Every comma it writes separates two values (numbers and
    null hold none), so each ``,null,`` is a triple's end followed by another's start, where
    ``],[`` goes in: ``[[lp,id,null],[lp,id,null]]``. A replace over the text costs less than a
    Python list a triple (0.17 against 0.22 us a token)."""
    if not ids.size:
        return pydantic_core.to_json(np.empty(ids.shape).tolist())  # [] or [[], ...]
    table = np.empty((*ids.shape, 3), dtype=object)
    table[..., 0] = logprobs
    table[..., 1] = ids
    rows = table.reshape(*ids.shape[:-1], 1, -1).tolist()
    return pydantic_core.to_json(rows).replace(b",null,", b",null],[")
