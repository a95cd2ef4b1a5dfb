"""The fused Triton log-prob kernel on the GPU, at real vocabulary sizes. Skipped without CUDA.

Tolerances (nats, absolute, against float64 logits of the same rounded inputs): log-probs 1e-4,
entropies 2e-4, for every dtype. The kernel accumulates in fp32 and never rounds a logit to 16
bits, so the error is fp32 summation over H terms (~sqrt(H) 2^-24 |x| per logit: 5e-5 at
H = 4096, as the eager cuBLAS path); the entropy adds a sum over V of p x. fp32 inputs use exact
fp32 dots (no TF32, which would cost ~1e-2).
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs
from logprob_service.ops.lm_head.plans import KernelConfig, LaunchPlan
from logprob_service.ops.logprobs import LogitTransform, chunked_token_logprobs

from tests.helpers.op_reference import reference

ENTROPY_TOL = 2e-4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_case(n, h, v, dtype, bias=False, *, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.5).to(dtype)  # logits std ~3
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    return hidden, weight, targets, b


def max_errors(out, hidden, weight, targets, b, transform, rows=256):
    ref_lp, ref_ent = reference(hidden[:rows], weight, targets[:rows], b, transform)
    err_lp = (out.logprobs[:rows].double() - ref_lp).abs().max().item()
    err_ent = (out.entropies[:rows].double() - ref_ent).abs().max().item() if out.entropies is not None else 0.0
    return err_lp, err_ent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,h,v", [(1, 896, 151936), (3001, 896, 151936), (777, 3584, 152064), (300, 4096, 128257)])
def test_matches_float64_at_real_shapes(dtype, n, h, v, seed):
    hidden, weight, targets, _ = cuda_case(n, h, v, dtype, seed=seed)
    out = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(return_entropy=True))
    err_lp, err_ent = max_errors(out, hidden, weight, targets, None, LogitTransform())
    assert err_lp < 1e-4 and err_ent < ENTROPY_TOL, (err_lp, err_ent)


@pytest.mark.parametrize(
    "transform",
    [LogitTransform(temperature=0.7), LogitTransform(scale=0.0625, temperature=1.3), LogitTransform(softcap=30.0)],
    ids=["temperature", "scale", "softcap"],
)
def test_transforms_and_bias(transform, seed):
    hidden, weight, targets, b = cuda_case(1000, 2304, 256000, torch.bfloat16, bias=True, seed=seed)  # Gemma 2 vocab
    out = fused_token_logprobs(
        hidden, weight, targets, bias=b, transform=transform, options=ScoreOptions(return_entropy=True)
    )
    err_lp, err_ent = max_errors(out, hidden, weight, targets, b, transform)
    assert err_lp < 1e-4 and err_ent < ENTROPY_TOL, (err_lp, err_ent)


def test_more_rows_than_one_grid_dimension_of_old_kernels(seed):
    # 70,001 rows: past 65,535 (the CUDA limit of grid axes 1 and 2) and not a multiple of any tile.
    hidden, weight, targets, _ = cuda_case(70_001, 256, 32_003, torch.bfloat16, seed=seed)
    out = fused_token_logprobs(hidden, weight, targets)
    eager = chunked_token_logprobs(hidden, weight, targets)
    assert torch.isfinite(out.logprobs).all()
    assert (out.logprobs - eager.logprobs).abs().max().item() < 1e-4
    tail = slice(70_001 - 200, 70_001)
    ref_lp, _ = reference(hidden[tail], weight, targets[tail])
    assert (out.logprobs[tail].double() - ref_lp).abs().max().item() < 1e-4


@pytest.mark.parametrize("splits,group_rows", [(1, 1), (7, 2), (64, 5)])
def test_grid_plans_agree(splits, group_rows, seed):
    hidden, weight, targets, _ = cuda_case(513, 1024, 50_257, torch.bfloat16, seed=seed)
    plan = LaunchPlan(splits=splits, group_rows=group_rows)
    out = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(return_entropy=True), plan=plan)
    err_lp, err_ent = max_errors(out, hidden, weight, targets, None, LogitTransform(), rows=513)
    assert err_lp < 1e-4 and err_ent < ENTROPY_TOL, (err_lp, err_ent)


@pytest.mark.parametrize("h", [896, 901])  # 901: rows not 16-byte aligned, so pointer loads instead of TMA
def test_other_tiles_agree(h, seed):
    hidden, weight, targets, _ = cuda_case(1025, h, 151936, torch.bfloat16, seed=seed)
    cfg = KernelConfig(block_n=64, block_v=128, block_k=32, num_warps=4, num_stages=2)
    out = fused_token_logprobs(hidden, weight, targets, config=cfg)
    err_lp, _ = max_errors(out, hidden, weight, targets, None, LogitTransform())
    assert err_lp < 1e-4


def test_memory_is_partials_only(seed):
    hidden, weight, targets, _ = cuda_case(16384, 3584, 152064, torch.bfloat16, seed=seed)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(return_entropy=True))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 * 1024**2, extra  # (m, s, t) partials + outputs; a logit slab would be 9.3 GiB
