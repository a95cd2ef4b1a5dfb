"""JSON written in pieces, for answers with an object per token (vLLM's ``prompt_logprobs``,
SGLang's ``input_token_logprobs``), numbers written by pydantic-core as every other answer's are:
the shortest text that reads back as the same float, ``-Infinity`` / ``NaN`` for the non-finite.

The edge writes these on the event loop's thread, holding the GIL that the device thread needs to
launch kernels (handing them to another thread would not free it: this is Python and
pydantic-core, neither lets go of the GIL), so what counts is the CPU time a token. Built as Python
dicts and lists they cost 4 us a token on the 2-core CPU machine, as a formatted bytes object a
token 0.27 (SGLang) and 0.39 us (vLLM); written as below, without a Python object per token,
0.18 and 0.21 (``benchmarks/bench_http.py --encode``, docs/http.md has the top-20 figures)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pydantic_core


def numbers(values: Sequence[float] | Sequence[int]) -> list[bytes]:
    """Each number of ``values`` as JSON text."""
    return pydantic_core.to_json(list(values))[1:-1].split(b",") if len(values) else []


# The texts of the integers below this many are kept (``integers``): a vocabulary's ids and ranks.
KEPT_INTEGERS = 1 << 22
_texts = np.empty(0, dtype=object)


def integers(values: np.ndarray) -> list[bytes]:
    """Each integer of ``values`` as JSON text: token ids and ranks, taken from a table of their
    texts kept from call to call (grown to the largest asked, up to ``KEPT_INTEGERS``), which costs
    a reference a number instead of writing it and cutting it out of the list's text."""
    global _texts
    if not values.size:
        return []
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= KEPT_INTEGERS:
        return numbers(values.tolist())
    if high >= len(_texts):
        size = min(max(high + 1, 2 * len(_texts), 1 << 16), KEPT_INTEGERS)
        _texts = np.array(numbers(range(size)), dtype=object)
    return _texts[values].tolist()


def interleave(*columns: Sequence[bytes] | bytes, head: bytes = b"", tail: bytes = b"", block: int = 1024) -> bytes:
    """The columns' items joined in turn (the first of each column, then the second of each, and
    so on), with a lone ``bytes`` standing for a column of it, between ``head`` and ``tail``:
    ``bytes.join`` of lists filled by slices, so no Python object per row.

    ``block`` rows a join, then one join of those: ``bytes.join`` allocates an 80-byte record per
    part, and past 32 MiB (400,000 parts) glibc maps fresh pages on every call, which cost 4x the
    join itself (a vLLM top-20 answer of 2,700 tokens, 2-core CPU machine). ``head`` and ``tail``
    go into the last join because each copy of a top-20 answer's text costs ~0.7 us a token."""
    rows = max(len(column) for column in columns if not isinstance(column, bytes))
    width = len(columns)
    joined = [head]
    for begin in range(0, rows, block):
        count = min(block, rows - begin)
        parts = [b""] * (count * width)
        for i, column in enumerate(columns):
            parts[i::width] = [column] * count if isinstance(column, bytes) else column[begin : begin + count]
        joined.append(b"".join(parts))
    joined.append(tail)
    return b"".join(joined)


def array(items: Sequence[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def with_raw(value: dict, **raw: bytes) -> bytes:
    """``value`` as JSON with each of ``raw``'s values (JSON text already written) as the value of
    its key, which ``value`` must hold as None, in ``raw``'s order. The text replaced is the first
    ``"<key>":null`` after the one before: no string value can hold it (each of a string's quotes
    is escaped), and no key written before does unless it holds a quote (the answers' keys are
    the peers' own names). One join, so the raw texts are copied once."""
    assert [key for key in value if key in raw] == list(raw) and all(value[key] is None for key in raw)
    rest = pydantic_core.to_json(value)
    parts = []
    for key, written in raw.items():
        before, name, rest = rest.partition(pydantic_core.to_json(key) + b":null")
        parts += [before, name[: -len(b"null")], written]
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
