"""Llama 4's MoE blocks on their routed rows (``models.routed_llama4``) against transformers' own
block, which runs every expert on every token: the same outputs and router logits.

float64: the exact loop, within float64 rounding (the expert matmuls are the same products, summed
by other kernels). float32 on the CPU: torch's grouped GEMM, the call the service makes on CUDA,
within float32 rounding. tests/gpu/test_families_cuda.py scores a whole Llama 4 model in bf16.
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.models.loading import use_experts_implementation
from logprob_service.models.routed_llama4 import llama4_blocks, route_llama4_experts, routed_forward
from transformers import Llama4ForCausalLM, Llama4TextConfig

pytestmark = pytest.mark.numerical


def llama4_model(seed: int, *, experts: int, top_k: int, dtype: torch.dtype) -> Llama4ForCausalLM:
    torch.manual_seed(seed)
    config = Llama4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        intermediate_size_mlp=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        interleave_moe_layer_step=1,
        max_position_embeddings=128,
    )
    model = Llama4ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.to(dtype).eval()


# The same products summed by other kernels and in another order: the difference is a few rounding
# units of the largest intermediates. Bound: ULPS units of the output's largest magnitude (worst
# measured over 450 seeded cases: 7 units in float64, 1.5 in float32).
ULPS = 64


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    bound = ULPS * torch.finfo(want.dtype).eps * float(want.abs().max())
    assert float((got - want).abs().max()) <= bound, (float((got - want).abs().max()), bound)


def block_outputs(block: torch.nn.Module, x: torch.Tensor, forward) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return forward(x)


@pytest.mark.parametrize(("experts", "top_k"), [(4, 1), (6, 2), (16, 1)])
def test_the_routed_block_equals_transformers_block_in_float64(seed, experts, top_k):
    block = llama4_blocks(llama4_model(seed, experts=experts, top_k=top_k, dtype=torch.float64))[0]
    x = torch.randn(3, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    want_out, want_logits = block_outputs(block, x, lambda t: type(block).forward(block, t))
    got_out, got_logits = block_outputs(block, x, lambda t: routed_forward(block, False, t))
    assert torch.equal(got_logits, want_logits)  # the router itself, unchanged
    assert_within_rounding(got_out, want_out)


def test_an_expert_no_token_chose_gets_no_rows(seed):
    """16 experts, 5 tokens: most experts get no row, and the loop skips them."""
    block = llama4_blocks(llama4_model(seed, experts=16, top_k=1, dtype=torch.float64))[0]
    x = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    chosen = torch.topk(block.router(x)[1], 1, dim=1).indices.unique()
    assert len(chosen) < 16
    want, _ = block_outputs(block, x, lambda t: type(block).forward(block, t))
    got, _ = block_outputs(block, x, lambda t: routed_forward(block, False, t))
    assert_within_rounding(got, want)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_grouped_gemm_path_equals_transformers_block_in_float32(seed, top_k):
    """torch's grouped GEMM on the CPU (float32; its strides 16-byte aligned at these widths)."""
    block = llama4_blocks(llama4_model(seed, experts=4, top_k=top_k, dtype=torch.float32))[0]
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(seed))
    want, _ = block_outputs(block, x, lambda t: type(block).forward(block, t))
    got, _ = block_outputs(block, x, lambda t: routed_forward(block, True, t))
    assert_within_rounding(got, want)


def test_the_service_routes_llama4_blocks_and_says_so(seed):
    model = llama4_model(seed, experts=4, top_k=1, dtype=torch.float64)
    assert use_experts_implementation(model, torch.device("cpu")) == "eager (routed rows)"
    blocks = llama4_blocks(model)
    assert len(blocks) == 2 and all("forward" in vars(b) for b in blocks)
    ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        routed = model(ids).logits
        for b in blocks:
            del b.forward
        assert_within_rounding(routed, model(ids).logits)
        route_llama4_experts(blocks, grouped=False)
        assert torch.equal(model(ids).logits, routed)


def test_the_reference_copy_runs_transformers_block_whatever_the_service_routed(seed):
    """tests.helpers.models.stock_copy (the float64 reference of every score test) must not keep the
    routed forward: on CUDA bf16 it runs grouped GEMMs, which take no float64 (seen on an H100)."""
    from tests.helpers.models import stock_copy

    model = llama4_model(seed, experts=4, top_k=1, dtype=torch.float32)
    route_llama4_experts(llama4_blocks(model), grouped=True)
    reference = stock_copy(model, torch.float64)
    assert not any("forward" in vars(b) for b in llama4_blocks(reference))
    assert all("forward" in vars(b) for b in llama4_blocks(model))  # the served model keeps its routing
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert reference(ids).logits.dtype == torch.float64
