"""Shared prompts on the CUDA attention backends (cuDNN ragged, FA2 varlen): each completion's
queries against a gathered copy of its prompt's keys and its own, aligned bottom-right.

bf16 models (Llama, Qwen2 with GQA, Gemma 2 with a sliding window of 8 and softcaps, whose
softcapped layers take the exact backend): shared and unshared scores must each be as exact as the
model's own bf16 forward against float64 (``ScoreReference``, tolerances.py).
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer

from tests.helpers.models import VOCAB, ScoreReference, make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_shared_prompts_on_cuda_backends_are_as_exact_as_the_models_own_bf16_forward(arch, backend, rng, seed):
    # Prompts up to 700 tokens and completions up to 399.
    model = make_model(arch, tied=arch != "llama", seed=seed, dtype=torch.bfloat16, max_positions=1100).cuda()
    seqs = []
    for prompt_len, group in ((300, 5), (40, 3), (700, 1)):
        prompt = rng.integers(0, VOCAB, prompt_len)
        seqs += [TokenSequence(prompt.copy(), rng.integers(0, VOCAB, int(rng.integers(1, 400)))) for _ in range(group)]
    order = rng.permutation(len(seqs))  # groups interleaved
    seqs = [seqs[i] for i in order]
    reference = ScoreReference(model, seqs, dtype=torch.bfloat16)
    for share in (True, False):
        options = ScoringOptions(attention_backend=backend, share_prompts=share)
        with OfflineScorer(model, options=options, max_batch_tokens=2500) as scorer:
            out = scorer.score(seqs, return_entropy=True)
        reference.check([s.logprobs for s in out], [s.entropies for s in out])
