"""``compare.changes`` and ``compare.set_elements``: a sparse delta's elements, found and applied
in parallel parts."""

from __future__ import annotations

import time

import numpy as np
import pytest
from logprob_client import compare, streams


@pytest.mark.parametrize("size", [0, 1, 1000, 4099])
def test_the_parts_find_and_apply_exactly_the_changed_elements(monkeypatch, rng, size):
    monkeypatch.setattr(compare, "PART_ELEMENTS", 64)  # many parts, some changes on their edges
    old = rng.integers(0, 2**16, size, dtype=np.uint16)
    new = old.copy()
    where = np.unique(np.concatenate([rng.integers(0, max(size, 1), size // 50), [0, 63, 64, 127, 128, size - 1]]))
    where = where[(where >= 0) & (where < size)]
    new[where] ^= rng.integers(1, 2**16, where.size, dtype=np.uint16)  # a nonzero xor: every one changes

    indices, values = compare.changes(old, new)
    assert indices.dtype == np.uint32 and values.dtype == np.uint16
    np.testing.assert_array_equal(indices, where)
    np.testing.assert_array_equal(values, new[where])

    compare.set_elements(old, indices, values)
    np.testing.assert_array_equal(old, new)


def test_tensors_compared_ahead_come_back_in_order(rng):
    """Work done ahead on several threads, in random durations, is yielded in the items' order."""
    delays = rng.uniform(0, 0.01, 20)
    done = []

    def work(i: int) -> int:
        time.sleep(delays[i])
        done.append(i)
        return i

    assert list(streams.read_ahead(range(20), work)) == list(range(20))
    assert sorted(done) == list(range(20))
