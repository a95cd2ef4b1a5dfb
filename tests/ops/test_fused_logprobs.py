"""The fused Triton log-prob kernel against the float64 reference, at small shapes.

Without a GPU it runs in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
with one, on the GPU. Small tiles (16 rows x 32 tokens x 16 of H) and explicit launch plans force
many tiles, ragged last tiles, several vocabulary splits and program groups at these shapes.
bfloat16 runs on the GPU only: the interpreter's numpy dots have no bfloat16 (tests/gpu cover it).

Tolerances: ``tests.tolerances.OP_FP32`` for fp32 and fp16 inputs (the reference uses the same
rounded inputs; the kernel accumulates in fp32), as for the eager op.
"""

from __future__ import annotations

import math

import pytest
import torch
from logprob_service.domain import ScoreOptions

triton = pytest.importorskip("triton")

from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs  # noqa: E402  (after the importorskip)
from logprob_service.ops.lm_head.plans import DeviceInfo, KernelConfig, LaunchPlan, device_info, plan_launch  # noqa: E402
from logprob_service.ops.logprobs import LogitTransform  # noqa: E402

from tests.helpers import tolerances  # noqa: E402
from tests.helpers.op_reference import ALL_OUTPUTS, assert_matches_reference, random_case, reference  # noqa: E402

pytestmark = pytest.mark.numerical

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SMALL = KernelConfig(block_n=16, block_v=32, block_k=16, num_warps=4, num_stages=2)
TRANSFORMS = {
    "plain": LogitTransform(),
    "temperature": LogitTransform(temperature=0.6),
    "scale+softcap+temperature": LogitTransform(scale=0.25, softcap=4.0, temperature=1.7),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,h,v", [(1, 45, 301), (37, 33, 97), (70, 64, 250)])  # odd H: pointer loads; 64: TMA
@pytest.mark.parametrize("transform", list(TRANSFORMS.values()), ids=list(TRANSFORMS))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matches_float64_reference(dtype, n, h, v, transform, bias):
    hidden, weight, targets, b = random_case(n, h, v, dtype=dtype, bias=bias, device=DEVICE)
    out = fused_token_logprobs(
        hidden, weight, targets, bias=b, transform=transform, config=SMALL, plan=LaunchPlan(3, 2), **ALL_OUTPUTS
    )
    assert_matches_reference(out, hidden, weight, targets, b, transform, tolerances.OP_FP32)


@pytest.mark.parametrize("plan", [LaunchPlan(1, 1), LaunchPlan(2, 5), LaunchPlan(8, 1), LaunchPlan(100, 3)])
def test_any_launch_plan_gives_the_same_scores(plan):
    # 100 splits of 8 vocabulary tiles: the plan is clamped to one tile per split, none empty.
    hidden, weight, targets, _ = random_case(50, 48, 251, device=DEVICE)
    out = fused_token_logprobs(
        hidden, weight, targets, options=ScoreOptions(return_entropy=True), config=SMALL, plan=plan
    )
    ref_lp, ref_ent = reference(hidden, weight, targets)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=tolerances.OP_FP32, rtol=0)
    torch.testing.assert_close(out.entropies.double(), ref_ent, atol=tolerances.OP_FP32, rtol=0)


def test_default_tiles_and_plan():
    hidden, weight, targets, _ = random_case(130, 64, 700, device=DEVICE)
    out = fused_token_logprobs(hidden, weight, targets)
    torch.testing.assert_close(
        out.logprobs.double(), reference(hidden, weight, targets)[0], atol=tolerances.OP_FP32, rtol=0
    )
    assert out.entropies is None  # not asked for


def test_no_rows():
    hidden, weight, _, _ = random_case(1, 16, 40, device=DEVICE)
    out = fused_token_logprobs(hidden[:0], weight, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert out.logprobs.shape == (0,)


def test_extreme_logits_stay_finite():
    # Logits of +-1e4: exp would overflow without the running max; -inf never appears.
    hidden, weight, targets, _ = random_case(20, 32, 300, device=DEVICE)
    out = fused_token_logprobs(hidden * 3000, weight, targets, options=ScoreOptions(return_entropy=True), config=SMALL)
    ref_lp, ref_ent = reference(hidden * 3000, weight, targets)
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.entropies).all()
    # fp32 logits of magnitude 1e4 carry ~1e-3 of rounding: the bound scales with them.
    atol = tolerances.op_fp32_scaled(float((hidden.double() * 3000 @ weight.double().T).abs().max()))
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=atol, rtol=0)
    torch.testing.assert_close(out.entropies.double(), ref_ent, atol=atol, rtol=0)


def test_a_bias_of_minus_inf_masks_tokens():
    # -inf on all but 3 of 250 tokens: whole tiles and splits of -inf (no -inf - -inf in the running
    # max, no 0 * -inf in the entropy): the scores of the 3 tokens' softmax
    hidden, weight, targets, _ = random_case(20, 32, 250, device=DEVICE)
    bias = torch.full((250,), float("-inf"), device=DEVICE)
    kept = torch.tensor([3, 100, 249], device=DEVICE)
    bias[kept] = torch.randn(3, device=DEVICE)
    targets = kept[targets % 3]
    out = fused_token_logprobs(hidden, weight, targets, bias=bias, config=SMALL, plan=LaunchPlan(3, 2), **ALL_OUTPUTS)
    x = (hidden.double() @ weight.double().T + bias.double())[:, kept]  # [N, 3]
    logp = x.log_softmax(-1)
    want = logp.gather(1, (targets[:, None] == kept).double().argmax(1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), want, atol=tolerances.OP_FP32, rtol=0)
    torch.testing.assert_close(out.entropies.double(), -(logp.exp() * logp).sum(-1), atol=tolerances.OP_FP32, rtol=0)
    torch.testing.assert_close(out.lse.double(), x.logsumexp(-1), atol=tolerances.OP_FP32, rtol=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's limitation")
def test_bfloat16_is_refused_by_the_interpreter():
    hidden, weight, targets, _ = random_case(4, 16, 40, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="float16 and float32"):
        fused_token_logprobs(hidden, weight, targets)


@pytest.mark.parametrize("n_rows", [1, 700, 24576, 65536, 3_000_000])
@pytest.mark.parametrize("hdim", [896, 4096])
def test_launch_plan_fills_the_gpu_and_fits_l2(n_rows, hdim):
    cfg, dev = KernelConfig(), DeviceInfo(num_sms=132, l2_bytes=50 * 1024**2)
    vocab = 151936
    plan = plan_launch(n_rows, hdim, vocab, 2, cfg, dev)
    row_blocks, v_tiles = triton.cdiv(n_rows, cfg.block_n), triton.cdiv(vocab, cfg.block_v)
    assert 1 <= plan.splits <= v_tiles
    assert 1 <= plan.group_rows <= row_blocks
    # a group's hidden states fit in a third of L2 (or the group is a single row block)
    assert plan.group_rows == 1 or plan.group_rows * cfg.block_n * hdim * 2 <= dev.l2_bytes // 3
    programs = row_blocks * plan.splits
    efficiency = programs / (math.ceil(programs / dev.num_sms) * dev.num_sms)
    assert efficiency >= 0.95 or plan.splits == v_tiles
    if n_rows == 1:  # one row block: the vocabulary is spread over every SM
        assert plan.splits >= dev.num_sms


def test_an_invariant_launch_scores_each_row_alike_whatever_the_batch():
    """``invariant=True``: the vocabulary splits do not follow the batch (the default plan's do:
    4 splits for 3 rows, 3 for 200, on the interpreter's device figures; 32 and 20 on an H100's), so
    a row's log-prob and entropy are bit for bit the same alone and among 199 others."""
    hidden, weight, targets, _ = random_case(200, 33, 1000, dtype=torch.float32, bias=False, device=DEVICE)
    dev = device_info(hidden.device)
    assert plan_launch(3, 33, 1000, 4, SMALL, dev).splits != plan_launch(200, 33, 1000, 4, SMALL, dev).splits
    alone = fused_token_logprobs(
        hidden[:3], weight, targets[:3], options=ScoreOptions(return_entropy=True), config=SMALL, invariant=True
    )
    packed = fused_token_logprobs(
        hidden, weight, targets, options=ScoreOptions(return_entropy=True), config=SMALL, invariant=True
    )
    assert torch.equal(alone.logprobs, packed.logprobs[:3]) and torch.equal(alone.entropies, packed.entropies[:3])
