"""``ops.finite``: the probes that find a NaN or an infinity among staged weights (CPU here; the
same torch calls run on the GPU, tests/gpu/test_finite_weights_cuda.py)."""

from __future__ import annotations

import math

import pytest
import torch
from logprob_service.ops.finite import nonfinite, probe, segment_probes

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_probe_is_finite_exactly_when_its_tensor_is(dtype, rng):
    size = int(rng.integers(1, 5000))
    tensors = []
    for value in (None, math.nan, math.inf, -math.inf):
        t = torch.from_numpy(rng.standard_normal(size)).to(dtype)
        if value is not None:
            t[int(rng.integers(size))] = value
        tensors.append(t.reshape(1, -1))
    # The largest finite value of the dtype is finite: no overflow in the probe.
    tensors.append(torch.full((3,), torch.finfo(dtype).max, dtype=dtype))
    assert nonfinite([probe(t) for t in tensors]) == [1, 2, 3]


def test_integer_and_empty_tensors_have_no_probe():
    assert probe(torch.arange(5)) is None
    assert probe(torch.zeros(0)) is None
    assert nonfinite([None, probe(torch.tensor([math.nan])), None]) == [1]


def test_segment_probes_flag_the_segments_that_hold_a_nonfinite_value(rng):
    counts = [3, 0, 5, 1, 4]
    values = torch.from_numpy(rng.standard_normal(sum(counts))).to(torch.bfloat16)
    values[3 + 2] = math.nan  # segment 2
    values[3 + 5 + 1 + 3] = -math.inf  # segment 4
    probes = segment_probes(values, torch.tensor(counts))
    assert nonfinite(list(probes)) == [2, 4]
    assert nonfinite(list(segment_probes(values[:0], torch.zeros(2, dtype=torch.int64)))) == []


def test_probes_of_several_dtypes_and_kinds_together(rng):
    tensors = [torch.ones(4, dtype=dtype) for dtype in FLOATS]
    tensors[2][1] = math.inf
    segments = segment_probes(torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1, 2]))
    assert nonfinite([*map(probe, tensors), *segments, None]) == [2, 5]
