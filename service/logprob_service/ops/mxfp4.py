"""MXFP4 weights (OCP microscaling, as gpt-oss ships its experts): dequantization and quantization.

A weight row of K values is stored as K / 32 groups: 16 bytes of 4-bit e2m1 codes (two a byte, the
low nibble first) and one uint8 e8m0 scale, the exponent e of 2^(e - 127):

    W[r, 32 g + j] = E2M1[code(r, g, j)] * 2^(scale[r, g] - 127)

with E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign bit (bit 3). Every such value times a power of
two is exact in bf16 (and float32) unless it leaves the exponent range, so dequantization is exact:
the same tensor transformers' ``convert_moe_packed_tensors`` makes (its loader's dequantized model).
4.25 bits a weight in memory: 4 for the code, 8 per 32 values for the scale.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in ``dtype``."""
    if blocks.is_cuda:
        from logprob_service.ops.mxfp4_kernel import dequantize_mxfp4_blocks  # Triton: GPU servers only

        return dequantize_mxfp4_blocks(blocks, scales, dtype)
    lut = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].to(dtype)).flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``weight`` [..., K] (K a multiple of 32), as the OCP MX format defines
    them: each group's scale 2^(floor(log2 max|w|) - 2) (e2m1's largest exponent is 2), every
    value rounded to the nearest e2m1 code of w / scale (saturating at 6)."""
    *lead, k = weight.shape
    groups = weight.float().reshape(*lead, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    grid = torch.tensor(E2M1[:8], device=weight.device)
    codes = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)  # nearest magnitude (ties: the smaller)
    codes = (codes | (scaled < 0).long() << 3).to(torch.uint8).reshape(*lead, k // GROUP, GROUP // 2, 2)
    blocks = codes[..., 0] | codes[..., 1] << 4
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
