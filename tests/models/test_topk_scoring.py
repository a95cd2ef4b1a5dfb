"""Top-k and candidate log-probs through the scorer (packing, shared prompts, micro-batches, the
engine) equal a float64 full-softmax top-k from the model's own full logits.

Llama, Qwen2 and Gemma 2 (final-logit softcap); the eager lm_head and the fused kernel (Triton's
interpreter on a CPU). Tolerance: as for the log-probs (``tests.helpers.models.ScoreReference``);
ids are the reference's wherever its neighbouring log-probs are further apart than twice that.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from logprob_service.errors import ErrorCode, LogprobError
from logprob_service.offline import OfflineScorer
from logprob_service.ops.dispatch import LogprobOp

from tests.helpers.models import VOCAB, ScoreReference, make_model, random_sequences
from tests.helpers.topk import assert_top_k, full_logp

pytestmark = pytest.mark.numerical

OPS = {"eager": LogprobOp("eager", chunk_bytes=3 * VOCAB * 4), "triton": LogprobOp("triton")}


CASES = [("llama", "eager", 40), ("qwen2", "eager", 40), ("gemma2", "eager", 40)]
try:
    import triton  # noqa: F401

    # the fused kernel: on the GPU, or in Triton's interpreter on a CPU (tests/conftest.py)
    CASES += [("qwen2", "triton", 40), ("gemma2", "triton", 400)]
except ImportError:
    pass


@pytest.mark.parametrize("arch,kernel,batch_tokens", CASES, ids=[f"{a}-{k}" for a, k, _ in CASES])
def test_top_k_and_candidates_match_the_full_softmax(arch, kernel, batch_tokens, rng):
    model = make_model(arch, tied=arch == "gemma2", seed=int(rng.integers(1 << 30)))
    sequences = random_sequences(rng, 5, max_len=12)
    # two completions of one prompt (a shared-prompt group), candidates on some sequences only
    sequences.append(dataclasses.replace(sequences[2], completion_ids=rng.integers(0, VOCAB, 4, dtype=np.int64)))
    sequences = [
        dataclasses.replace(s, candidate_ids=rng.integers(0, VOCAB, (len(s.completion_ids), 3 + i), dtype=np.int64))
        if i % 2
        else s
        for i, s in enumerate(sequences)
    ]
    k, temperature = 9, 0.8
    on_gpu = kernel == "triton" and torch.cuda.is_available()
    served = model.cuda() if on_gpu else model  # the references copy it to the CPU
    with OfflineScorer(served, logprob_op=OPS[kernel], max_batch_tokens=batch_tokens, max_batch_sequences=3) as scorer:
        out = scorer.score(sequences, temperature=temperature, top_k=k)
    reference = ScoreReference(model, sequences, temperature)
    reference.check([s.logprobs for s in out])
    for seq, scores in zip(sequences, out):
        logp = full_logp(model, seq, temperature)
        assert_top_k(scores.top_ids, scores.top_logprobs, logp, k, reference.atol)
        if seq.candidate_ids is None:
            assert scores.candidate_logprobs is None
        else:
            want = np.take_along_axis(logp, seq.candidate_ids, -1)
            assert scores.candidate_logprobs.dtype == np.float32 and scores.candidate_logprobs.shape == want.shape
            np.testing.assert_allclose(scores.candidate_logprobs, want, atol=reference.atol, rtol=0)


def test_without_top_k_nothing_more_comes(rng):
    model = make_model("llama", tied=False, seed=int(rng.integers(1 << 30)))
    with OfflineScorer(model) as scorer:
        (out,) = scorer.score(random_sequences(rng, 1))
    assert out.top_ids is None and out.top_logprobs is None and out.candidate_logprobs is None


@pytest.mark.skipif("triton" not in {kernel for _, kernel, _ in CASES}, reason="needs triton")
def test_an_incomplete_fused_top_k_fails_its_requests(rng, monkeypatch):
    # Every key survives stage 1 (no threshold), past 2 K slots a row, and no repair round runs: the
    # fused op's flag is set, Launched.fetch raises, and the engine fails the request with that
    # message (INTERNAL: no change to the request helps), not a wrong top-k and not a hang. The same
    # scorer then answers it exactly with the rounds.
    from logprob_service.ops.lm_head import fused_logprobs, repair
    from logprob_service.ops.lm_head.keys import MIN_KEY

    model = make_model("qwen2", tied=False, seed=int(rng.integers(1 << 30)))
    sequences = random_sequences(rng, 3, max_len=12)
    k = 9
    served = model.cuda() if torch.cuda.is_available() else model  # the references copy it to the CPU
    with OfflineScorer(served, logprob_op=OPS["triton"]) as scorer:
        monkeypatch.setattr(
            fused_logprobs,
            "sample_thresholds",
            lambda hidden, *args: (torch.full((len(hidden),), MIN_KEY, dtype=torch.int64, device=hidden.device),) * 2,
        )
        monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: 2 * k)
        monkeypatch.setattr(repair, "REPAIR_ROUNDS", 0)
        with pytest.raises(
            LogprobError, match=r"top-9 did not finish some rows of this micro-batch of \d+ sequences"
        ) as err:
            scorer.score(sequences, top_k=k)
        assert err.value.code is ErrorCode.INTERNAL
        monkeypatch.undo()
        out = scorer.score(sequences, top_k=k)
    reference = ScoreReference(model, sequences, 1.0)
    for seq, scores in zip(sequences, out):
        assert_top_k(scores.top_ids, scores.top_logprobs, full_logp(model, seq, 1.0), k, reference.atol)
