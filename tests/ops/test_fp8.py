"""FP8 weights' ops (ops.fp8) against their definitions in float64.

Dequantization is Q * S in float32 (as transformers dequantizes a checkpoint), then the output
dtype: every path (eager, the Triton kernel) must equal the float64 product so rounded, bit for bit. The W8A8
product is checked against float64 of its own definition (the activations' e4m3 quantization
applied to the same float32 input, then the product of the dequantized operands): what is left is
float32's accumulation over K terms, bounded by K u sum|x||w| (tests/helpers/tolerances.py).
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.ops.fp8 import (
    FP8,
    FP8_MAX,
    dequantize,
    quantize,
    quantize_activations,
    w8a8_linear,
    w8a8_supported,
    weights_only_linear,
)

from tests.helpers.tolerances import U32

BLOCKS = [(128, 128), (1, 320), (200, 320), (64, 32)]  # blocks, per channel, per tensor, partial blocks


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different sizes: each block's scale matters.
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]


def _exact_dequantized(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    full = s.double().repeat_interleave(bn, 0)[: q.shape[0]].repeat_interleave(bk, 1)[:, : q.shape[1]]
    return q.double() * full


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_takes_max_abs_over_448_per_block_and_dequantize_rounds_the_exact_product_once(block, seed):
    w = _weight((200, 320), seed)
    q, s = quantize(w, block)
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == w.shape
    exact = _exact_dequantized(q, s, block)
    # Every element within half an e4m3 step of its block's scale grid (3 mantissa bits: 2^-4 relative,
    # plus the subnormal step 2^-9 * S for small elements).
    full_s = _exact_dequantized(torch.ones_like(q, dtype=torch.float32).to(FP8), s, block)
    assert ((exact - w.double()).abs() <= w.double().abs() * 2**-4 + full_s * 2**-10).all()
    assert (q.float().abs().amax() == FP8_MAX).item()  # the largest element of some block maps to 448
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(q, s, block, dtype), exact.float().to(dtype)), dtype
    assert torch.equal(dequantize(q, s, block, torch.float64), exact)  # exact in float64


def test_an_all_zero_block_gets_scale_one(seed):
    w = _weight((128, 256), seed)
    w[:, :128] = 0
    q, s = quantize(w, (128, 128))
    assert s[0, 0] == 1 and (q[:, :128].float() == 0).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_the_triton_kernel_equals_the_exact_product_bit_for_bit(block, seed, monkeypatch):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from logprob_service.ops.fp8_kernel import dequantize_blocks

    q, s = quantize(_weight((200, 320), seed), block)
    # Triton's CPU interpreter casts float32 to bfloat16 by truncation, the GPU by rounding to nearest:
    # bfloat16 outputs are checked on the GPU only.
    for dtype in (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,):
        got = dequantize_blocks(q.to(device), s.to(device), block, dtype).cpu()
        assert torch.equal(got, _exact_dequantized(q, s, block).float().to(dtype)), dtype


def test_weights_only_is_the_dequantized_weights_linear(seed):
    w = _weight((256, 384), seed)
    q, s = quantize(w, (128, 128))
    x = torch.randn(5, 7, 384, generator=torch.Generator().manual_seed(seed))
    bias = torch.randn(256)
    want = torch.nn.functional.linear(x, dequantize(q, s, (128, 128), torch.float32), bias)
    assert torch.equal(weights_only_linear(x, q, s, (128, 128), bias), want)


@pytest.mark.parametrize("block", [(128, 128), (1, 384), (256, 384)])
def test_w8a8_is_the_product_of_the_quantized_operands(block, seed):
    w = _weight((256, 384), seed)
    q, s = quantize(w, block)
    x = torch.randn(33, 384, generator=torch.Generator().manual_seed(seed)) * 3
    group = 128 if block == (128, 128) else 384
    x_q, x_s = quantize_activations(x, group)
    assert x_q.dtype == FP8 and x_s.shape == (33, 384 // group)
    a = _exact_dequantized(x_q, x_s, (1, group))
    b = _exact_dequantized(q, s, block)
    want = a @ b.t()
    got = w8a8_linear(x, q, s, block, None)
    bound = 384 * U32 * (a.abs() @ b.abs().t())  # float32's accumulation over K terms, worst case
    assert got.dtype == x.dtype and ((got.double() - want).abs() <= bound).all()
    # ... and the activations' rounding is what separates it from the dequantized model
    assert (
        (a - x.double()).abs() <= x.double().abs() * 2**-4 + x_s.double().repeat_interleave(group, 1) * 2**-10
    ).all()


def test_w8a8_says_which_weights_it_cannot_run():
    assert w8a8_supported((256, 512), (128, 128)) is None
    assert w8a8_supported((256, 384), (1, 384)) is None
    assert "N a multiple of 128 and K of 512" in w8a8_supported((200, 512), (128, 128))
    assert "N a multiple of 128 and K of 512" in w8a8_supported((256, 384), (128, 128))
    assert "blocks 64 x 64" in w8a8_supported((256, 384), (64, 64))


def test_the_activation_kernel_equals_the_torch_quantization(seed, monkeypatch):
    """One Triton pass (ops.fp8_kernel) against the torch ops it replaces: the same scales, and on a
    GPU the same codes (Triton's CPU interpreter rounds to float8 otherwise than the GPU does)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from logprob_service.ops import fp8
    from logprob_service.ops.fp8_kernel import quantize_groups

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(37, 512, generator=g) * torch.logspace(-3, 2, 37)[:, None]).to(torch.bfloat16)
    x[3, :128] = 0  # an all-zero group: the floor's scale
    q, s = quantize_groups(x.to(device), 128, fp8.MIN_AMAX, fp8.FP8_MAX)
    monkeypatch.setattr(fp8, "FUSED_ACTIVATIONS", False)
    want_q, want_s = fp8.quantize_activations(x, 128)
    assert torch.equal(s.cpu(), want_s)
    if device == "cuda":
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
