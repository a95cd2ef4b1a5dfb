"""FP8 (e4m3) weights with float32 scales: dequantization, quantization and the two GEMMs.

A quantized weight W [N, K] is stored as Q (float8_e4m3fn) and S (float32), one scale per block of
``block = (bn, bk)`` elements: W[n, k] = Q[n, k] * S[n // bn, k // bk]. The formats checkpoints
ship are all blocks of this kind:

* block-scaled (DeepSeek-V3, Qwen3-*-FP8: transformers' ``fp8``): ``block = (128, 128)``,
  S [ceil(N/128), ceil(K/128)] (``weight_scale_inv``);
* per-channel (compressed-tensors ``channel``): ``block = (1, K)``, S [N, 1] (``weight_scale``);
* per-tensor (compressed-tensors ``tensor``, transformers' ``fp8`` without blocks): ``block = (N, K)``,
  S [1, 1] (stored as [1] or []).

Two ways to compute y = x W^T (+ b):

* ``weights_only_linear``: W is dequantized into a bf16 scratch tensor (the product Q * S in
  float32, then the activation dtype: exactly the tensor transformers makes when it loads the
  checkpoint dequantized, as a trainer does), then one ordinary GEMM. The scratch lives for one layer; reading one
  byte and writing two per weight costs about 1% of a GEMM of thousands of rows. Its answers are
  the dequantized model's, and batch-invariant wherever the bf16 GEMM is.
* ``w8a8_linear``: x is quantized too, one scale per token and group of 128 inputs (per token for
  per-channel weights), s = max|x_group| / 448, as DeepSeek-V3's and vLLM's inference do, and
  the product runs on the FP8 tensor cores: torch's ``_scaled_mm`` with 1 x 128 / 128 x 128 block
  scales (cuBLAS, Hopper and later), or row-wise scales for per-channel weights. The activations'
  rounding (3 mantissa bits) makes it differ from the dequantized model; that error is measured,
  not bounded here. On the CPU (tests) the same quantization is applied and the product computed in
  float32 from the dequantized operands, which is what the kernel computes up to its accumulation
  order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The activations' group along K in W8A8 (the block-scaled GEMM's K block).
ACTIVATION_GROUP = 128
# The inputs K of a block-scaled FP8 GEMM: a multiple of this, so that each weight block row's
# K / 128 float32 scales fill 16 bytes. With K / 128 of 1 or 2 and more blocks along N than along
# K, cuBLAS (torch 2.11, CUDA 13.0, H200) returned wrong products without an error; every K of
# 4,096 and more that was tried was right.
SCALE_ROW_INPUTS = 512
# The rows of a block-scaled FP8 GEMM: cuBLAS takes multiples of this.
M_ALIGNMENT = 16
# The activations' 128-groups quantized by one Triton pass on CUDA (ops.fp8_kernel), not torch's ops.
FUSED_ACTIVATIONS = True
# A group whose largest |x| is below this gets this as its max: the scale of an all-zero group.
MIN_AMAX = 1e-12


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scales' shape for a weight of ``shape`` in blocks of ``block``."""
    (n, k), (bn, bk) = shape, block
    return -(-n // bn), -(-k // bk)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Q * S in float32 (float64 when asked), then ``dtype``: [N, K]."""
    n, k = weight.shape
    scale = scale.reshape(scale_grid((n, k), block))
    if weight.is_cuda:
        from logprob_service.ops.fp8_kernel import dequantize_blocks  # Triton: GPU servers only

        return dequantize_blocks(weight, scale, block, dtype)
    bn, bk = block
    # S expanded to every element: [N, K] float32 (a test's or the CPU's shapes).
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (weight.to(work) * full.to(work)).to(dtype)


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, the IEEE quotient on every device. CUDA divides by a Python number as a product
    with its rounded reciprocal (one ulp off the quotient for some amax), so a GPU's scales would
    differ from a CPU's, and from a checkpoint's; a 0-d tensor on the same device is divided."""
    return amax / amax.new_full((), FP8_MAX)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, S) of ``weight`` in blocks of ``block``: S = max|W_block| / 448 (1 for an all-zero
    block), Q = W / S rounded to e4m3; as DeepSeek's and transformers' FP8 quantizers do, so a
    weight pushed in bf16 is served as the same trainer would save it."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = scale_grid((n, k), block)
    padded = F.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, _over_fp8_max(amax), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, s) of x [M, K] in groups of ``group`` along K: s [M, K / group] float32,
    x_q = x / s in e4m3 with s = max|x_group| / 448 (one Triton pass on CUDA for 128-groups)."""
    m, k = x.shape
    if x.is_cuda and group == ACTIVATION_GROUP and FUSED_ACTIVATIONS:
        from logprob_service.ops.fp8_kernel import quantize_groups

        return quantize_groups(x, group, MIN_AMAX, FP8_MAX)
    grouped = x.float().view(m, k // group, group)
    scale = _over_fp8_max(grouped.abs().amax(dim=-1).clamp(min=MIN_AMAX))
    q = (grouped / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, k), scale


def weights_only_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] @ dequantize(Q, S)^T (+ b): the dequantized model's linear."""
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


def w8a8_supported(shape: tuple[int, int], block: tuple[int, int]) -> str | None:
    """Why a weight of ``shape`` in ``block`` cannot run as W8A8, or None when it can."""
    n, k = shape
    if block == (1, k) or block == (n, k):
        return None if k % 16 == 0 and n % 16 == 0 else f"dimensions {n} x {k} are not multiples of 16"
    if block != (ACTIVATION_GROUP, ACTIVATION_GROUP):
        return f"blocks {block[0]} x {block[1]}: the FP8 GEMM takes 128 x 128 blocks, per-channel or per-tensor scales"
    if n % ACTIVATION_GROUP or k % SCALE_ROW_INPUTS:
        return f"dimensions {n} x {k}: the block-scaled FP8 GEMM takes N a multiple of 128 and K of {SCALE_ROW_INPUTS}"
    return None


def w8a8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ b) with x quantized per token and 128-group (per token for per-channel
    or per-tensor weights) and the product on the FP8 tensor cores."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    blockwise = block == (ACTIVATION_GROUP, ACTIVATION_GROUP)
    x_q, x_scale = quantize_activations(rows, ACTIVATION_GROUP if blockwise else k)
    w_scale = scale.reshape(scale_grid((n, k), block)).float()
    if x.is_cuda:
        out = scaled_mm_fp8(x_q, x_scale, weight, w_scale, blockwise, x.dtype)
    else:
        deq_x = dequantize(x_q, x_scale, (1, ACTIVATION_GROUP if blockwise else k), torch.float32)
        out = (deq_x @ dequantize(weight, w_scale, block, torch.float32).t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


# One opaque step for torch.compile (models.compiled): the scales' layouts below are what cuBLAS
# checks, which a compiled graph need not keep.
@torch.library.custom_op("logprob::fp8_scaled_mm", mutates_args=())
def scaled_mm_fp8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    blockwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x_q [M, K] e4m3 with its scales (per 128-group when ``blockwise``, else per row) times
    ``weight``^T [N, K] e4m3 with its (128 x 128 block, or [N, 1]) scales, on the FP8 tensor cores:
    [M, N] in ``dtype``."""
    n, m = weight.shape[0], x_q.shape[0]
    if blockwise:
        # cuBLAS's block-scaled layouts: the activations' scales M-major ([M, K/128] with
        # strides (1, M)), the weights' as the transposed operand's [K/128, N/128]. It takes
        # only M a multiple of 16 (seen on an H200: 1, 37 and 32,767 rows refused, 256 and
        # 4,096 run): zero rows pad the operand, and their outputs are dropped.
        pad = -m % M_ALIGNMENT
        x_q = F.pad(x_q.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
        a_scale, b_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0).t().contiguous().t(), w_scale.t()
    else:
        # Row-wise: [M, 1] and [1, N] (a per-tensor scale broadcast to every row).
        a_scale, b_scale = x_scale.contiguous(), w_scale.expand(n, 1).reshape(1, n).contiguous()
    return torch._scaled_mm(x_q, weight.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=dtype)[:m]


@scaled_mm_fp8.register_fake
def _(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    blockwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=dtype)
