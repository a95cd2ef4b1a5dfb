"""A sparse update's changes set into a tensor: uint32 indices held as int32, and (past int32's
reach) widened first."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.worker import staging


@pytest.mark.parametrize("int32_reach", [staging.INT32_INDICES, 8], ids=["int32", "widened"])
def test_changes_land_on_their_indices(monkeypatch, rng, int32_reach):
    monkeypatch.setattr(staging, "INT32_INDICES", int32_reach)  # 8: this 100-element tensor is "past" it
    tensor = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    indices = np.sort(rng.choice(100, 17, replace=False)).astype(np.uint32)
    values = rng.standard_normal(17).astype(np.float32)
    expected = tensor.clone()
    expected[torch.from_numpy(indices.astype(np.int64))] = torch.from_numpy(values)
    staging._set_elements(tensor, torch.from_numpy(indices.view(np.int32)), torch.from_numpy(values))
    assert torch.equal(tensor, expected)
