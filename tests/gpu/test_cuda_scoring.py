"""The CUDA paths, at realistic vocabulary sizes. Skipped without a GPU.

Tolerances (nats, absolute), against the float64 forward of the same weights:
* float32 model: as exact as the model's own float32 computation (``tests.helpers.models.ScoreReference``;
  TF32 stays off: fp32 GEMMs).
* bf16 model: as exact as the model's own bfloat16 computation, the same way.
* the lm_head stage alone gets 1e-4 against float64 logits of the same bf16 hidden states
  (fp32 accumulation and fp32 logits, no bf16 rounding; logits of std 2.5 over H <= 1024 terms:
  sqrt(H) u |x| = 32 * 6e-8 * 12 = 2.3e-5 per logit, doubled by x_y - lse, x 2 margin).
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.offline import OfflineScorer
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import chunked_token_logprobs

from tests.helpers.models import ARCHITECTURES, ScoreReference, assert_scores_close, make_model, random_sequences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("kernel", ["triton", "eager"])
def test_float32_model_on_cuda_matches_full_logits_reference(arch, kernel, rng):
    model = make_model(arch, tied=arch in ("gemma2", "qwen2"), seed=int(rng.integers(1 << 30))).cuda()
    sequences = random_sequences(rng, 8)
    with OfflineScorer(model, logprob_op=LogprobOp(kernel), max_batch_tokens=200) as scorer:
        out = scorer.score(sequences, temperature=0.9, return_entropy=True)
    assert_scores_close(model, sequences, [s.logprobs for s in out], [s.entropies for s in out], 0.9)


@pytest.mark.parametrize("n,h,v", [(1, 896, 151936), (3000, 896, 151936), (777, 1024, 128257)])
def test_bf16_lm_head_stage_keeps_fp32_logits(n, h, v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 2.5 / h**0.5).bfloat16()  # logits std ~2.5
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    out = chunked_token_logprobs(
        hidden, weight, targets, options=ScoreOptions(return_entropy=True), chunk_bytes=64 * 1024**2
    )
    logp = (hidden.double() @ weight.double().T).log_softmax(-1)
    ref = logp.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    assert (out.logprobs.double() - ref).abs().max().item() < 1e-4
    assert (out.entropies.double() - ref_ent).abs().max().item() < 1e-4


@torch.no_grad()
def test_bf16_model_end_to_end_against_its_own_logits(rng):
    model = make_model("qwen2", tied=True, seed=int(rng.integers(1 << 30)), dtype=torch.bfloat16).cuda()
    sequences = random_sequences(rng, 6)
    with OfflineScorer(model) as scorer:
        assert scorer.scorer.logprob_op.kernel == "triton"  # the default on CUDA
        out = scorer.score(sequences)
    ScoreReference(model, sequences, dtype=torch.bfloat16).check([s.logprobs for s in out])
