"""The JSON writers of the per-token answers give, byte for byte, what the answers were before they
were rewritten for speed: each number written by pydantic-core (the shortest text that reads back
as the same float, ``-Infinity`` / ``NaN``), a bytes object per entry, joined."""

from __future__ import annotations

import numpy as np
import pydantic_core
import pytest
from logprob_service.http import encoding

# log-probs a writer must keep as they are: non-finite, signed zero, the float32 extremes
SPECIAL = np.array(
    [-np.inf, np.inf, np.nan, -0.0, 0.0, 1e-45, -1e-45, 1.2e-38, -3.4028235e38, 3.4028235e38, -1e-7, -100.0],
    dtype=np.float32,
)


def numbers(values: np.ndarray) -> list[bytes]:
    return pydantic_core.to_json(values.ravel().tolist())[1:-1].split(b",")


def triples_before(logprobs: np.ndarray, ids: np.ndarray) -> bytes:
    """SGLang's triples as the edge wrote them before ``encoding.triples``."""
    lps, names = numbers(logprobs), numbers(ids)
    entries = [b"[%b,%b,null]" % (lp, t) for lp, t in zip(lps, names)]
    if ids.ndim == 1:
        return b"[" + b",".join(entries) + b"]"
    width = ids.shape[1]
    rows = [b"[" + b",".join(entries[p : p + width]) + b"]" for p in range(0, len(entries), width)]
    return b"[" + b",".join(rows) + b"]"


def random_logprobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 log-probs of ``shape``, a fifth of them from SPECIAL and some of magnitudes far from 1."""
    values = -rng.exponential(2.0, shape) * 10.0 ** rng.integers(-30, 30, shape)
    values = values.astype(np.float32)
    chosen = rng.random(shape) < 0.2
    values[chosen] = rng.choice(SPECIAL, int(chosen.sum()))
    return values


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("shape", [(1,), (2,), (777,), (1, 1), (1, 20), (5, 1), (300, 20)])
def test_triples_equal_the_writing_before(rng, shape, dtype):
    ids = rng.integers(0, 151_936, shape).astype(dtype)
    ids.flat[0] = 0
    logprobs = random_logprobs(rng, shape)
    written = encoding.triples(logprobs, ids)
    assert written == triples_before(logprobs, ids)
    assert pydantic_core.from_json(written, allow_inf_nan=True)  # and it is JSON


def test_triples_of_every_special_value(rng):
    ids = rng.integers(0, 151_936, SPECIAL.shape)
    assert encoding.triples(SPECIAL, ids) == triples_before(SPECIAL, ids)
    grid = np.tile(SPECIAL, (3, 1))
    assert encoding.triples(grid, np.tile(ids, (3, 1))) == triples_before(grid, np.tile(ids, (3, 1)))


def test_triples_of_nothing():
    assert encoding.triples(np.zeros(0, np.float32), np.zeros(0, np.int64)) == b"[]"
    assert encoding.triples(np.zeros((2, 0), np.float32), np.zeros((2, 0), np.int64)) == b"[[],[]]"


def test_prepend():
    assert encoding.prepend(b"null", b"[[1,2,null]]") == b"[null,[1,2,null]]"
    assert encoding.prepend(b"[null,7,null]", b"[]") == b"[[null,7,null]]"
