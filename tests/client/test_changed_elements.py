"""``weights.changed_elements``: the elements a sparse delta sends, found in parallel parts."""

from __future__ import annotations

import numpy as np
import pytest
from logprob_client import weights


@pytest.mark.parametrize("size", [0, 1, 1000, 4099])
def test_the_parts_find_exactly_the_changed_elements(monkeypatch, rng, size):
    monkeypatch.setattr(weights, "COMPARE_ELEMENTS", 64)  # many parts, some changes on their edges
    old = rng.integers(0, 2**16, size, dtype=np.uint16)
    new = old.copy()
    where = np.unique(np.concatenate([rng.integers(0, max(size, 1), size // 50), [0, 63, 64, 127, 128, size - 1]]))
    where = where[(where >= 0) & (where < size)]
    new[where] ^= rng.integers(1, 2**16, where.size, dtype=np.uint16)  # a nonzero xor: every one changes
    found = weights.changed_elements(old, new)
    assert found.dtype == np.int64
    np.testing.assert_array_equal(found, where)
