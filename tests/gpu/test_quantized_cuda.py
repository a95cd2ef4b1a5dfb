"""Quantized checkpoints on the GPU: FP8 in memory, weights-only equal to the dequantized model, W8A8
on the FP8 tensor cores equal to its definition; MXFP4 experts. Skipped without a GPU.

References: the float64 forward of the checkpoint's dequantized weights (bf16 tolerance: as exact
as the dequantized model's own bf16 computation, ``ScoreReference``); and the dequantized model
itself, served in bf16 by the same service, which weights-only must equal bit for bit (its layers
run the same GEMMs on the same bf16 weights). W8A8's GEMM is checked against float64 of its own
definition on the same quantized operands.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from logprob_service.models.loading import load_causal_lm, to_serving_dtype
from logprob_service.models.quantized import Fp8Experts, Fp8Linear, quantized_layers
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer
from logprob_service.ops.fp8 import FP8, dequantize, quantize, quantize_activations, w8a8_linear
from logprob_service.ops.mxfp4 import dequantize_mxfp4

from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.quantized import FP8_DIMS, LAYOUTS, W8A8_DIMS, write_checkpoint, write_mxfp4_checkpoint
from tests.helpers.quantized_pushes import CASES, MOE_DIMS, push_serves_as_reload
from tests.helpers.tolerances import U32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda:0")


def _score(model, sequences, **options):
    with OfflineScorer(model, options=ScoringOptions(**options), max_batch_tokens=160) as scorer:
        return [s.logprobs for s in scorer.score(sequences, temperature=0.9)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_weights_only_keeps_fp8_and_equals_the_dequantized_model_bit_for_bit(tmp_path, layout, arch, tied, rng):
    dense = make_model(arch, tied=tied, seed=int(rng.integers(1 << 30)), dims=FP8_DIMS)
    reference = write_checkpoint(tmp_path, dense, layout)
    model = load_causal_lm(str(tmp_path), device=CUDA, dtype=torch.bfloat16)
    layers = quantized_layers(model)
    assert layers and all(layer.weight.dtype == FP8 and layer.weight.is_cuda for layer in layers)
    # The dequantized model as a trainer loads it: every quantized weight Q * S in bf16 (float32
    # product, as transformers dequantizes), the rest as the dense model's, RoPE in float32.
    dequantized = to_serving_dtype(copy.deepcopy(dense).to(CUDA), torch.bfloat16)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Fp8Linear):
                exact = reference.get_submodule(name).weight.to(CUDA)
                weight = dequantize(module.weight, module.scale, module.block, torch.bfloat16)
                assert torch.equal(weight, exact.float().to(torch.bfloat16))
                dequantized.get_submodule(name).weight.copy_(weight)
    sequences = random_sequences(rng, 8, max_len=40)
    got = _score(model, sequences)
    want = _score(dequantized, sequences)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    ScoreReference(reference, sequences, temperature=0.9, dtype=torch.bfloat16).check(got)


def test_weights_only_is_batch_invariant(tmp_path, rng):
    write_checkpoint(
        tmp_path, make_model("llama", tied=False, seed=int(rng.integers(1 << 30)), dims=FP8_DIMS), "fp8-blocks"
    )
    model = load_causal_lm(str(tmp_path), device=CUDA, dtype=torch.bfloat16)
    sequences = random_sequences(rng, 12, max_len=40)
    together = _score(model, sequences, deterministic=True)
    alone = [_score(model, [seq], deterministic=True)[0] for seq in sequences[:4]]
    for a, b in zip(alone, together):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kind", ["blocks", "channel", "tensor"])
@pytest.mark.parametrize("rows", [1, 37, 4096])
@pytest.mark.parametrize("n", [1024, 12288])  # more blocks along N than along K, too
def test_the_fp8_tensor_core_gemm_computes_its_definition(kind, rows, n, seed):
    block = {"blocks": (128, 128), "channel": (1, 4096), "tensor": (n, 4096)}[kind]
    g = torch.Generator(CUDA).manual_seed(seed)
    w = torch.randn(n, 4096, generator=g, device=CUDA) * 0.02
    x = torch.randn(rows, 4096, generator=g, device=CUDA).to(torch.bfloat16)
    q, s = quantize(w, block)
    got = w8a8_linear(x, q, s, block, None).double()
    group = 128 if block == (128, 128) else 4096
    x_q, x_s = quantize_activations(x, group)
    a = dequantize(x_q, x_s, (1, group), torch.float64)
    b = dequantize(q, s, block, torch.float64)
    want = a @ b.t()
    # float32 accumulation over K terms (worst case), then the bf16 output's rounding (2^-9 relative).
    bound = 4096 * U32 * (a.abs() @ b.abs().t()) + want.abs() * 2**-8
    assert ((got - want).abs() <= bound).all()


def test_w8a8_layers_compute_the_same_compiled_or_eager(tmp_path, rng):
    """The FP8 GEMM is one opaque op inside a compiled MLP (its scales' layouts are cuBLAS's): the
    compiled model scores as the eager one, to bf16 rounding of the fused norms; its error against
    the dequantized model is printed for the log (benchmarks/bench_fp8.py measures it at scale)."""
    reference = write_checkpoint(
        tmp_path, make_model("llama", tied=False, seed=int(rng.integers(1 << 30)), dims=W8A8_DIMS), "fp8-blocks"
    )
    model = load_causal_lm(str(tmp_path), device=CUDA, dtype=torch.bfloat16, fp8_compute="w8a8")
    sequences = random_sequences(rng, 8, max_len=40)
    compiled = _score(model, sequences, compile_layers="on")
    eager = _score(model, sequences, compile_layers="off")
    exact = ScoreReference(reference, sequences, temperature=0.9, dtype=torch.bfloat16)
    gap = max(float(np.abs(a - b).max()) for a, b in zip(compiled, eager))
    error = max(float(np.abs(a - want).max()) for a, (want, _) in zip(eager, exact.exact))
    print(f"w8a8: compiled - eager {gap:.3e}; eager - exact {error:.3e}; own bf16 error {exact.own_error:.3e}")
    assert gap <= exact.atol


def test_mxfp4_experts_stay_mxfp4_and_score_the_dequantized_model(tmp_path, rng):
    """gpt-oss with MXFP4 banks on the GPU: uint8 blocks in memory, dequantized exactly inside each
    bank's forward (the Triton kernel) and run by the grouped GEMM; the scores equal the float64
    forward of the dequantized model within bf16's criterion."""
    dense = make_model("gpt_oss", tied=False, seed=int(rng.integers(1 << 30)))
    reference = write_mxfp4_checkpoint(tmp_path, dense)
    model = load_causal_lm(str(tmp_path), device=CUDA, dtype=torch.bfloat16)
    banks = quantized_layers(model)
    assert banks and all(b.gate_up_proj_blocks.is_cuda and b.gate_up_proj_blocks.dtype == torch.uint8 for b in banks)
    for bank in banks:
        for proj in bank.PROJECTIONS:
            blocks, scales = getattr(bank, f"{proj}_blocks"), getattr(bank, f"{proj}_scales")
            on_gpu = dequantize_mxfp4(blocks, scales, torch.bfloat16).cpu()
            assert torch.equal(on_gpu, dequantize_mxfp4(blocks.cpu(), scales.cpu(), torch.bfloat16))
    sequences = random_sequences(rng, 8, max_len=40)
    ScoreReference(reference, sequences, temperature=0.9, dtype=torch.bfloat16).check(_score(model, sequences))


@pytest.mark.parametrize("layout", ["fp8-blocks", "ct-channel"])
def test_fp8_expert_banks_stay_fp8_and_score_the_dequantized_experts(tmp_path, layout, rng):
    """Qwen3-MoE with FP8 experts on the GPU: the banks hold FP8 codes on the device, dequantized
    per bank inside its forward (the Triton kernel); scores within bf16's criterion of the float64
    forward of the dequantized model."""
    dense = make_model("qwen3_moe", tied=False, seed=int(rng.integers(1 << 30)), dims=MOE_DIMS)
    reference = write_checkpoint(tmp_path, dense, layout)
    model = load_causal_lm(str(tmp_path), device=CUDA, dtype=torch.bfloat16)
    banks = [m for m in quantized_layers(model) if isinstance(m, Fp8Experts)]
    assert len(banks) == dense.config.num_hidden_layers
    assert all(b.gate_up_proj.dtype == FP8 and b.gate_up_proj.is_cuda for b in banks)
    sequences = random_sequences(rng, 8, max_len=40)
    ScoreReference(reference, sequences, temperature=0.9, dtype=torch.bfloat16).check(_score(model, sequences))


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_dense_push_into_a_quantized_model_on_the_gpu_serves_as_a_reload(tmp_path, case, rng):
    """The push is quantized on the device (the GPU kernels), the reload on the host from the file:
    the same codes and scales, so the same scores bit for bit and the same fingerprint."""
    pushed, reloaded = await push_serves_as_reload(tmp_path, case, rng, device="cuda:0", dtype="bfloat16")
    assert pushed == reloaded


@pytest.mark.parametrize("block", [(128, 128), (1, 4096), (1024, 4096)])
def test_a_weight_quantizes_on_the_gpu_as_on_the_cpu(block, seed):
    """Codes and scales bit for bit: a push quantized on the device must equal a checkpoint
    quantized on a host (the scale's division is IEEE's on both)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(1024, 4096, generator=g) * 0.02).to(torch.bfloat16)
    q_cpu, s_cpu = quantize(w, block)
    q_gpu, s_gpu = quantize(w.to(CUDA), block)
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
