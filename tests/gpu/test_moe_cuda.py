"""Mixture-of-experts models on CUDA: transformers' grouped-GEMM experts, exact and batch-invariant.

Why grouped_mm should be batch-invariant, and what this file checks of it:

* Routing is per token: the router is one GEMM (cuBLAS, split-K off under ``deterministic``:
  ``ops.determinism``), then a softmax and a top-k of each row.
* ``grouped_mm_experts_forward`` (transformers.integrations.moe) sorts the (token, expert) pairs by
  expert, gathers their rows and runs one grouped GEMM per projection over all experts. Each
  output row is one tile's in-order sum over K whatever rows share its expert's group (CUTLASS
  grouped GEMM, no split-K), and the gather, the activation, the routing-weight product and the
  sum over a token's top_k (a reshape and a sum, no atomics) are per row. What follows the batch:
  torch picks the CUTLASS tile by the mean rows per expert (``small``: M = rows / experts <= 128
  -> 64x128x128 tiles, else 128x256x64; aten/src/ATen/native/cuda/GroupMM.cu), i.e. around 2048
  tokens at the Qwen3-30B-A3B shape (8 of 128 experts per token). Both tiles accumulate K in
  16-wide MMA steps in order, so a row's sum should not change across that switch; the first test
  crosses it on purpose, rows permuted, to see.
* The sort is unstable on CUDA: rows of one expert may come in any order, which only moves them
  between a group's tile rows.

Models at the Qwen3-30B-A3B and gpt-oss-20b layer shapes (bf16, random weights), and the tiny
Qwen3-MoE over two GPUs (expert parallel) when there are two. Run with
``pytest -q tests/gpu/test_moe_cuda.py`` on a GPU host.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from logprob_client import LogprobClient
from logprob_service.domain import ScoreOptions
from logprob_service.models.loading import use_experts_implementation
from logprob_service.models.routed_llama4 import routed_forward
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.weights import model_fingerprint
from logprob_service.offline import OfflineScorer
from logprob_service.ops.determinism import pin_matmul_reductions
from logprob_service.worker.packing import pack
from transformers import GptOssConfig, Llama4TextConfig, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.gpu.test_batch_invariance_cuda import pool, restore_cublas_settings, same_bits  # noqa: F401 (a fixture)
from tests.helpers.models import ScoreReference, random_sequences
from tests.helpers.moe import make_moe_model
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.server import as_lists

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
# Token counts on both sides of the tile switch (mean rows per expert 128: 2048 tokens at the
# Qwen3 shape, 1024 at gpt-oss's), and a lone token.
SUBSETS = (1, 3, 100, 1024, 1025, 2048, 2049, 4096)
# The batches the service runs: every packed batch holds at least two rows (each sequence has a
# prompt token and a completion token). On an H200, cuBLAS runs a one-row GEMM of Llama 4's shared
# expert with another kernel than any larger batch's (its output 9.5e-7 off at the test's layer;
# the router, the routed rows and the grouped GEMMs are bit for bit the same at one row).
SERVED_SUBSETS = (2, *(n for n in SUBSETS if n > 1))
ROWS = 8192


def moe_block(arch: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**QWEN3_30B_A3B, norm_topk_prob=True)
        block = Qwen3MoeSparseMoeBlock(config)
        weights = [block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight]
    else:
        config = GptOssConfig(**GPT_OSS_20B)
        block = GptOssMLP(config)
        weights = [block.experts.gate_up_proj, block.experts.down_proj, block.router.weight]
        for bias in (block.experts.gate_up_proj_bias, block.experts.down_proj_bias, block.router.bias):
            torch.nn.init.normal_(bias, std=0.02)
    for w in weights:
        torch.nn.init.normal_(w, std=config.hidden_size**-0.5)
    config._experts_implementation = "grouped_mm"
    return block.cuda().bfloat16().eval()


def run_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@torch.inference_mode()
def test_grouped_mm_experts_give_each_row_the_same_bits_whatever_the_batch(arch, seed):
    assert pin_matmul_reductions() is None
    block = moe_block(arch, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (QWEN3_30B_A3B if arch == "qwen3_moe" else GPT_OSS_20B)["hidden_size"]
    x = torch.randn(ROWS, hidden, device="cuda", generator=g).bfloat16()
    full = run_block(block, x)
    for n in SUBSETS:
        part = run_block(block, x[:n])
        assert torch.equal(part, full[:n]), f"{n} rows: differ by up to {(part - full[:n]).abs().max()}"
    perm = torch.randperm(ROWS, device="cuda", generator=g)
    assert torch.equal(run_block(block, x[perm]), full[perm]), "rows in another order"
    # And it is the model's arithmetic: the per-expert loop on the same rows, to bf16 rounding.
    block.experts.config._experts_implementation = "eager"
    eager = run_block(block, x[:512])
    torch.testing.assert_close(full[:512].float(), eager.float(), rtol=2e-2, atol=2e-2)


# Llama-4-Scout's MoE layer at a third of its width: 16 experts, 1 a token, a shared expert.
LLAMA4 = dict(hidden_size=1664, intermediate_size=2816, intermediate_size_mlp=2816, num_local_experts=16)


@torch.inference_mode()
def test_llama4_routed_experts_are_the_block_s_arithmetic_batch_invariant_and_faster(seed):
    """``models.routed_llama4`` (grouped GEMMs on the routed rows) against transformers' block (all
    16 experts on every token): within bf16 rounding, each row's bits the same whatever the batch,
    and the time of both at 8192 tokens (printed; the routed one must be faster)."""
    assert pin_matmul_reductions() is None
    torch.manual_seed(seed)
    config = Llama4TextConfig(**LLAMA4, num_experts_per_tok=1, num_attention_heads=8, num_key_value_heads=8)
    block = Llama4TextMoe(config)
    for w in (block.experts.gate_up_proj, block.experts.down_proj, block.router.weight):
        torch.nn.init.normal_(w, std=config.hidden_size**-0.5)
    block = block.cuda().bfloat16().eval()
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(ROWS, config.hidden_size, device="cuda", generator=g).bfloat16()
    full = routed_forward(block, True, x)[0]
    transformers_out = Llama4TextMoe.forward(block, x)[0]
    torch.testing.assert_close(full.float(), transformers_out.float(), rtol=2e-2, atol=2e-2)
    for n in SERVED_SUBSETS:
        part = routed_forward(block, True, x[:n])[0]
        assert torch.equal(part, full[:n]), f"{n} rows: differ by up to {(part - full[:n]).abs().max()}"
    perm = torch.randperm(ROWS, device="cuda", generator=g)
    assert torch.equal(routed_forward(block, True, x[perm])[0], full[perm]), "rows in another order"
    runs = {"routed": lambda: routed_forward(block, True, x), "transformers": lambda: Llama4TextMoe.forward(block, x)}
    times = {}
    for name, forward in runs.items():
        for _ in range(3):
            forward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            forward()
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(
        f"Llama 4 MoE layer, {ROWS} tokens: routed {times['routed']:.2f} ms, all experts {times['transformers']:.2f} ms"
    )
    assert times["routed"] < times["transformers"]


def shape_model(seed: int, layers: int = 2) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **QWEN3_30B_A3B, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()


def test_moe_scores_are_batch_invariant(rng, seed):
    """As tests/gpu/test_batch_invariance_cuda.py for dense models: every sequence of random mixes
    under three budgets scores bit for bit as it does alone; so do its routed experts."""
    model = shape_model(seed).cuda()
    seqs = pool(rng, model.config.vocab_size)
    options = ScoringOptions(deterministic=True)
    scorers = [OfflineScorer(model, options=options, max_batch_tokens=b) for b in (4096, 16384, 65536)]
    try:
        determinism = scorers[0].scorer.determinism()
        assert "bitwise batch-invariant" in determinism and determinism.endswith("experts: grouped_mm"), determinism
        alone = [(s.logprobs, s.entropies) for seq in seqs for s in scorers[0].score([seq], return_entropy=True)]
        for mix in range(60):
            chosen = rng.choice(len(seqs), size=int(rng.integers(1, 33)), replace=False)
            budget = int(rng.integers(3))
            out = scorers[budget].score([seqs[i] for i in chosen], return_entropy=True)
            for i, got in zip(chosen, out, strict=True):
                same_bits((got.logprobs, got.entropies), alone[i], f"mix {mix} (budget {budget}): sequence {i}")
    finally:
        for scorer in scorers:
            scorer.close()
    scorer = CausalLMScorer(model, options=options)
    routed = ScoreOptions(return_routed_experts=True)
    routed_alone = [scorer.launch(pack([s]), routed).fetch_routed_experts()[0] for s in seqs[:12]]
    mixed = scorer.launch(pack(seqs[:12][::-1]), routed).fetch_routed_experts()[::-1]
    for i, (got, want) in enumerate(zip(mixed, routed_alone, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"sequence {i}")


def test_bf16_moe_is_as_exact_as_its_own_bf16_forward(rng, seed):
    """The tiny Qwen3-MoE in bf16 on CUDA (grouped_mm) against float64, within the bf16 criterion
    (the reference is taken on the CPU, with the exact loop, before the model moves)."""
    model = make_moe_model("qwen3_moe", seed=seed, dtype=torch.bfloat16)
    seqs = random_sequences(rng, 8)
    reference = ScoreReference(model, seqs, dtype=torch.bfloat16)
    model = model.cuda()
    assert use_experts_implementation(model, torch.device("cuda")) == "grouped_mm"
    with OfflineScorer(model, options=ScoringOptions(deterministic=True)) as offline:
        assert offline.scorer.experts == "grouped_mm"
        out = offline.score(seqs, return_entropy=True)
    reference.check([s.logprobs for s in out], [s.entropies for s in out])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_moe_model_over_two_gpus_scores_as_the_model(tmp_path, rng, seed):
    """``serve --tensor-parallel 2`` on two GPUs (NCCL): heads sharded, experts split by expert, the
    grouped GEMM skipping the other rank's experts; within the bf16 criterion, fingerprint whole."""
    model = make_moe_model("qwen3_moe", seed=seed, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    seqs = random_sequences(rng, 8, max_len=80)
    reference = ScoreReference(model, seqs, dtype=torch.bfloat16)
    port = free_port()
    with (tmp_path / "server.log").open("w") as log:
        proc = launch(
            f"--model=moe={tmp_path / 'model'}", "--device=cuda:0,cuda:1", "--tensor-parallel=2",
            f"--port={port}", "--metrics-port=0", stdout=log,
        )  # fmt: skip
        try:
            wait_serving(f"127.0.0.1:{port}", proc, timeout=300)
            with LogprobClient(f"127.0.0.1:{port}", model="moe") as client:
                logprobs, entropies = client.score(*as_lists(seqs), return_entropy=True)
                (info,) = client.list_models()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, (tmp_path / "server.log").read_text()[-3000:]
    reference.check(logprobs, entropies)
    assert info.fingerprint == model_fingerprint(model)
    assert info.determinism.endswith("experts: grouped_mm"), info.determinism
