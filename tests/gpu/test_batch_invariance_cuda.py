"""``deterministic``: on CUDA every sequence's log-probs and entropies are bit for bit those it gets
scored alone, whatever shares its micro-batch.

bf16 Llama and Qwen2 (GQA, tied) models; a pool of sequences of 1 to 8192 tokens, some in groups
sharing a prompt (scored with shared prompts on: a completion scored in a group equals itself
scored in another mix of groups, or alone). 200 random mixes of 1 to 64 of them, in random order,
under three micro-batch budgets (so a sequence lands in different micro-batches, at different
rows, beside different prompts), each compared with the sequence scored alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer

from tests.helpers.models import VOCAB, make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIXES = 200
BUDGETS = (4096, 16384, 65536)


def pool(rng: np.random.Generator) -> list[TokenSequence]:
    """48 sequences: mostly short, a few long (up to 8192 tokens), and 4 prompts shared by 4 each."""
    seqs = []
    for _ in range(32):
        total = int(
            rng.choice([rng.integers(2, 300), rng.integers(300, 2048), rng.integers(2048, 8193)], p=[0.6, 0.3, 0.1])
        )
        prompt = int(rng.integers(1, total))
        seqs.append(TokenSequence(rng.integers(0, VOCAB, prompt), rng.integers(0, VOCAB, total - prompt)))
    for _ in range(4):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 1500)))
        seqs += [TokenSequence(prompt.copy(), rng.integers(0, VOCAB, int(rng.integers(1, 600)))) for _ in range(4)]
    return seqs


def same_bits(got, want, where: str) -> None:
    for field in ("logprobs", "entropies"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32)), (
            f"{where}: {field} differ by up to {np.abs(a - b).max():.3g}"
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_sequence_scores_as_it_does_alone(arch, rng, seed):
    model = make_model(arch, tied=arch == "qwen2", seed=seed, dtype=torch.bfloat16).cuda()
    seqs = pool(rng)
    options = ScoringOptions(deterministic=True)
    scorers = [OfflineScorer(model, options=options, max_batch_tokens=budget) for budget in BUDGETS]
    try:
        alone = [scorers[0].score([seq], return_entropy=True)[0] for seq in seqs]
        for mix in range(MIXES):
            size = int(rng.integers(1, 65))
            chosen = rng.choice(len(seqs), size=min(size, len(seqs)), replace=False)
            budget = int(rng.integers(len(BUDGETS)))
            out = scorers[budget].score([seqs[i] for i in chosen], return_entropy=True)
            for i, got in zip(chosen, out, strict=True):
                same_bits(got, alone[i], f"mix {mix} (budget {BUDGETS[budget]}): sequence {i}")
    finally:
        for scorer in scorers:
            scorer.close()
    assert "bitwise batch-invariant" in scorers[0].scorer.determinism()
