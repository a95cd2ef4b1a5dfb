"""MXFP4 dequantization on the GPU (``ops.mxfp4.dequantize_mxfp4``): one Triton kernel, registered as
a torch custom op so that a compiled graph calls it as one step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Scale groups a program: [ROWS, 16] bytes in, [ROWS, 32] values out.
ROWS = 128


@triton.jit
def _e2m1(code):
    # code: 4 bits, s e e m. Magnitude m/2 for e = 0 (0 or 0.5), else (1 + m/2) * 2^(e - 1).
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _dequantize_kernel(blocks_ptr, scales_ptr, out_ptr, groups, ROWS: tl.constexpr):
    # One program: ROWS scale groups. Byte j of a group holds values 2j (low nibble) and 2j + 1.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < groups
    cols = tl.arange(0, 16)
    packed = tl.load(blocks_ptr + rows[:, None] * 16 + cols[None, :], mask=live[:, None], other=0).to(tl.int32)
    scale = tl.exp2(tl.load(scales_ptr + rows, mask=live, other=127).to(tl.float32) - 127.0)
    low = _e2m1(packed & 15) * scale[:, None]
    high = _e2m1(packed >> 4) * scale[:, None]
    values = tl.reshape(tl.join(low, high), (ROWS, 32))  # interleaved: low, high, low, high, ...
    outs = tl.arange(0, 32)
    tl.store(out_ptr + rows[:, None] * 32 + outs[None, :], values.to(out_ptr.dtype.element_ty), mask=live[:, None])


@torch.library.custom_op("logprob::dequantize_mxfp4", mutates_args=())
def _dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    groups = scales.numel()
    out = torch.empty((*scales.shape[:-1], scales.shape[-1] * 32), dtype=dtype, device=blocks.device)
    _dequantize_kernel[(triton.cdiv(groups, ROWS),)](blocks, scales, out, groups, ROWS=ROWS)
    return out


@_dequantize.register_fake
def _(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return blocks.new_empty((*scales.shape[:-1], scales.shape[-1] * 32), dtype=dtype)


def dequantize_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 (contiguous) -> [..., G * 32] in ``dtype``."""
    return _dequantize(blocks.contiguous(), scales.contiguous(), dtype)
