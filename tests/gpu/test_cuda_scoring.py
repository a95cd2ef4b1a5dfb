"""The CUDA paths, at realistic vocabulary sizes. Skipped without a GPU.

Tolerances (nats, absolute):
* float32 model: 1e-4 against the float64 full-logits reference (TF32 stays off: fp32 GEMMs).
* bf16 model: the lm_head stage gets 1e-4 against float64 logits of the same bf16 hidden states
  (fp32 accumulation and fp32 logits, no bf16 rounding); the model's own bf16 logits are
  themselves rounded to bf16, so against them the bound is 5e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import chunked_token_logprobs

from tests.models import ARCHITECTURES, make_model, random_sequences, reference_scores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("kernel", ["triton", "eager"])
def test_float32_model_on_cuda_matches_full_logits_reference(arch, kernel):
    rng = np.random.default_rng()
    model = make_model(arch, tied=arch in ("gemma2", "qwen2"), seed=int(rng.integers(1 << 30))).cuda()
    scorer = CausalLMScorer(model, logprob_op=LogprobOp(kernel), max_batch_tokens=200)
    sequences = random_sequences(rng, 8)
    out = scorer.score(sequences, temperature=0.9, return_entropy=True)
    for seq, scores in zip(sequences, out):
        ref_lp, ref_ent = reference_scores(model, seq, 0.9)
        np.testing.assert_allclose(scores.logprobs, ref_lp, atol=1e-4, rtol=0)
        np.testing.assert_allclose(scores.entropies, ref_ent, atol=1e-4, rtol=0)


@pytest.mark.parametrize("n,h,v", [(1, 896, 151936), (3000, 896, 151936), (777, 1024, 128257)])
def test_bf16_lm_head_stage_keeps_fp32_logits(n, h, v):
    g = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 2.5 / h**0.5).bfloat16()  # logits std ~2.5
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    out = chunked_token_logprobs(hidden, weight, targets, return_entropy=True, chunk_bytes=64 * 1024**2)
    logp = (hidden.double() @ weight.double().T).log_softmax(-1)
    ref = logp.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    assert (out.logprobs.double() - ref).abs().max().item() < 1e-4
    assert (out.entropies.double() - ref_ent).abs().max().item() < 1e-4


@torch.no_grad()
def test_bf16_model_end_to_end_against_its_own_logits():
    rng = np.random.default_rng()
    model = make_model("qwen2", tied=True, seed=int(rng.integers(1 << 30)), dtype=torch.bfloat16).cuda()
    scorer = CausalLMScorer(model)
    assert scorer.logprob_op.kernel == "triton"  # the default on CUDA
    sequences = random_sequences(rng, 6)
    out = scorer.score(sequences)
    for seq, scores in zip(sequences, out):
        ref_lp, _ = reference_scores(model, seq)
        np.testing.assert_allclose(scores.logprobs, ref_lp, atol=5e-2, rtol=0)
