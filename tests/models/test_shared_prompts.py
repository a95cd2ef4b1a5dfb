"""Sequences sharing a prompt, scored with the prompt run once (``worker.packing``), on the CPU.

Every tiny architecture of ``tests.helpers.models.ARCHITECTURES`` (Gemma 2, Gemma 3, Mistral,
Phi-3 and gpt-oss with sliding windows of 8-11 shorter than the prompts, so a completion's window
reaches back into its shared prompt; Llama 4 with attention chunks of 8, so a completion's chunk may
start inside its prompt, and NoPE layers whose query scale follows the position). Shared and
unshared layouts must each be as exact as the model's own float32 forward (``ScoreReference``), and
no further from each other than that bound allows.
"""

from __future__ import annotations

import numpy as np
import pytest
from logprob_service.domain import ScoreOptions, TokenSequence
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.offline import OfflineScorer
from logprob_service.worker.packing import pack

from tests.helpers.models import ARCHITECTURES, VOCAB, ScoreReference, make_model

pytestmark = pytest.mark.numerical


def grpo_mix(rng: np.random.Generator) -> list[TokenSequence]:
    """Two prompts with 3 and 2 completions (interleaved), a prompt of its own, and a prompt that
    differs from the first in one token (must not be shared with it)."""
    a, b = rng.integers(0, VOCAB, 20), rng.integers(0, VOCAB, 13)
    near = a.copy()
    near[7] = (near[7] + 1) % VOCAB

    def completion() -> np.ndarray:
        return rng.integers(0, VOCAB, int(rng.integers(1, 15)))

    return [
        TokenSequence(a, completion()),
        TokenSequence(b, completion()),
        TokenSequence(a.copy(), completion()),
        TokenSequence(rng.integers(0, VOCAB, 9), completion()),
        TokenSequence(near, completion()),
        TokenSequence(b.copy(), completion()),
        TokenSequence(a.copy(), completion()),
    ]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_shared_prompts_score_as_the_sequences_alone(arch, rng, seed):
    model = make_model(arch, tied=arch != "llama", seed=seed)
    scorer = CausalLMScorer(model, options=ScoringOptions(compile_layers="off"))
    seqs = grpo_mix(rng)
    shared_batch = pack(seqs)
    assert shared_batch.num_tokens == sum(s.num_tokens for s in seqs) - 2 * 20 - 13  # a twice, b once saved
    shared = scorer.launch(shared_batch, ScoreOptions(return_entropy=True)).fetch()
    whole = scorer.launch(pack(seqs, share_prompts=False), ScoreOptions(return_entropy=True)).fetch()
    reference = ScoreReference(model, seqs)
    reference.check([s.logprobs for s in shared], [s.entropies for s in shared])
    reference.check([s.logprobs for s in whole], [s.entropies for s in whole])
    for i, (s, w) in enumerate(zip(shared, whole, strict=True)):
        np.testing.assert_allclose(s.logprobs, w.logprobs, atol=reference.atol, rtol=0, err_msg=f"sequence {i}")


@pytest.mark.parametrize("share", [True, False])
def test_groups_split_across_micro_batches_and_alone_score_exactly(share, rng, seed):
    """Through the served path (queue, planner, worker): a group of 7 over a 60-token budget is
    cut into parts that each run the prompt; a group of one (G=1); another prompt's group."""
    model = make_model("qwen2", tied=True, seed=seed)
    prompt, other = rng.integers(0, VOCAB, 25), rng.integers(0, VOCAB, 11)
    seqs = [TokenSequence(prompt.copy(), rng.integers(0, VOCAB, int(rng.integers(3, 12)))) for _ in range(7)]
    seqs.insert(3, TokenSequence(rng.integers(0, VOCAB, 30), rng.integers(0, VOCAB, 5)))  # G = 1
    seqs += [TokenSequence(other.copy(), rng.integers(0, VOCAB, 6)) for _ in range(2)]
    launched: list[int] = []
    options = ScoringOptions(compile_layers="off", share_prompts=share)
    with OfflineScorer(model, options=options, max_batch_tokens=60, max_batch_sequences=8) as offline:
        launch = offline.scorer.launch
        offline.scorer.launch = lambda batch, options: launched.append(batch.num_tokens) or launch(batch, options)
        out = offline.score(seqs, return_entropy=True)
        assert offline.engine.scheduler.admission.queued_tokens == 0  # released as admitted, not as run
    assert max(launched) <= 60 or not share  # the budget counts the tokens run
    if share:
        assert sum(launched) < sum(s.num_tokens for s in seqs)
    ScoreReference(model, seqs).check([s.logprobs for s in out], [s.entropies for s in out])


def test_empty_prompts_are_refused_not_shared(rng, seed):
    """An empty prompt leaves the first completion token nothing to be scored from: two of them
    must not form a group (of a zero-token prompt) but be refused, naming the sequence."""
    from logprob_service.errors import InvalidArgument

    seqs = [TokenSequence(rng.integers(0, VOCAB, 4), rng.integers(0, VOCAB, 3))]
    seqs += [TokenSequence(np.zeros(0, dtype=np.int64), rng.integers(0, VOCAB, 3)) for _ in range(2)]
    with OfflineScorer(
        make_model("llama", tied=False, seed=seed), options=ScoringOptions(compile_layers="off")
    ) as offline:
        with pytest.raises(InvalidArgument, match=r"sequences\[1\]\.prompt_ids: is empty"):
            offline.score(seqs)
        assert offline.score(seqs[:1])[0].logprobs.shape == (3,)
