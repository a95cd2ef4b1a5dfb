"""The chunked log-prob op against a float64 reference, on random inputs.

Tolerance: ``tests.tolerances.OP_FP32`` (fp32 matmul + fp32 log-sum-exp); bf16/fp16 inputs are
checked against the reference on the same (rounded) inputs: what is left is fp32 accumulation.
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.logprobs import LogitTransform, chunked_token_logprobs, rows_per_chunk

from tests.helpers import tolerances
from tests.helpers.op_reference import ALL_OUTPUTS, assert_matches_reference, random_case, reference

pytestmark = pytest.mark.numerical


@pytest.mark.parametrize("n,h,v", [(1, 7, 11), (37, 33, 1001), (64, 64, 4099)])
@pytest.mark.parametrize(
    "transform",
    [LogitTransform(), LogitTransform(temperature=0.6), LogitTransform(scale=0.25, softcap=4.0, temperature=1.7)],
    ids=["plain", "temperature", "scale+softcap+temperature"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(n, h, v, transform, bias):
    hidden, weight, targets, b = random_case(n, h, v, bias=bias)
    # A budget of 3 rows per chunk forces many chunks and a ragged last one.
    out = chunked_token_logprobs(
        hidden, weight, targets, bias=b, transform=transform, chunk_bytes=3 * v * 4, **ALL_OUTPUTS
    )
    assert_matches_reference(out, hidden, weight, targets, b, transform, tolerances.OP_FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    hidden, weight, targets, _ = random_case(50, 64, 999, dtype=dtype)
    out = chunked_token_logprobs(hidden, weight, targets, chunk_bytes=7 * 999 * 4)
    ref_lp, _ = reference(hidden, weight, targets)  # same rounded inputs, exact arithmetic
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=tolerances.OP_FP32, rtol=0)


def test_chunking_does_not_change_results():
    hidden, weight, targets, _ = random_case(33, 16, 257)
    whole = chunked_token_logprobs(
        hidden, weight, targets, options=ScoreOptions(return_entropy=True), chunk_bytes=1 << 30
    )
    rowwise = chunked_token_logprobs(hidden, weight, targets, options=ScoreOptions(return_entropy=True), chunk_bytes=1)
    # Chunks change only how the float32 sums are blocked: both are as exact as the op itself.
    ref_lp, ref_ent = reference(hidden, weight, targets)
    for out in (whole, rowwise):
        torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=tolerances.OP_FP32, rtol=0)
        torch.testing.assert_close(out.entropies.double(), ref_ent, atol=tolerances.OP_FP32, rtol=0)


def test_no_entropy_unless_asked():
    hidden, weight, targets, _ = random_case(4, 8, 16)
    assert chunked_token_logprobs(hidden, weight, targets).entropies is None


def test_rows_per_chunk_respects_budget():
    assert rows_per_chunk(151936, 256 * 1024**2) == 441  # 441 * 151936 * 4 B = 255.6 MiB
    assert rows_per_chunk(151936, 1) == 1  # always progresses
    assert rows_per_chunk(1000, 4000 * 10 + 3999) == 10
