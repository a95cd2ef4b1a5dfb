"""Layer-major, token-chunked scoring of a long sequence (``models.chunked``), on the CPU.

A tiny model per architecture (``tests.helpers.models.ARCHITECTURES``: Llama, Qwen2 with GQA,
Gemma 2 with softcaps and a sliding window of 8, shorter than a chunk, and the families of issue 42:
sliding windows, gpt-oss's sinks, Llama 4's attention chunks of 8 and NoPE layers, DeepSeek's MLA)
scores one sequence of 150 tokens both ways: whole, and in chunks of 23 tokens (not a divisor, so
the last chunk is ragged; longer than the window, so a chunk's queries see keys of earlier chunks).
Both must be as exact as the model's own float32 forward (``tests.helpers.models.ScoreReference``),
and no layer may see more than a chunk's rows at once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.chunked import _RowSlices
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions, model_body
from logprob_service.models.served import serve_model
from logprob_service.offline import OfflineScorer
from logprob_service.ops.attention import sequence_attention

from tests.helpers.models import ARCHITECTURES, VOCAB, ScoreReference, make_model
from tests.helpers.tolerances import PACKED_HIDDEN_FP32

pytestmark = pytest.mark.numerical

CHUNK = 23


def long_sequence(rng: np.random.Generator, prompt: int = 40, completion: int = 110) -> TokenSequence:
    return TokenSequence(rng.integers(0, VOCAB, prompt), rng.integers(0, VOCAB, completion))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_chunked_sequence_scores_as_the_whole_one(arch, rng, seed):
    model = make_model(arch, tied=arch != "llama", seed=seed)
    seq = long_sequence(rng)
    whole = CausalLMScorer(model, options=ScoringOptions(long_sequence_tokens=10**9))
    chunked = CausalLMScorer(model, options=ScoringOptions(long_sequence_tokens=100, chunk_tokens=CHUNK))
    rows_seen = []
    norm = model_body(model).layers[0].input_layernorm  # every family has one, and it sees the layer's rows
    hook = norm.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[1]))
    try:
        results = {}
        for name, scorer in (("whole", whole), ("chunked", chunked)):
            rows_seen.clear()
            with OfflineScorer(serve_model("m", "test", scorer)) as offline:
                results[name] = offline.score([seq], return_entropy=True)[0]
            results[name + " rows"] = list(rows_seen)
    finally:
        hook.remove()
    assert results["whole rows"] == [150]
    assert results["chunked rows"] == [CHUNK] * 6 + [150 - 6 * CHUNK]  # never more than a chunk at once
    reference = ScoreReference(model, [seq])
    for name in ("whole", "chunked"):
        reference.check([results[name].logprobs], [results[name].entropies])


def test_a_short_or_packed_batch_is_not_chunked(rng, seed):
    model = make_model("llama", tied=False, seed=seed)
    scorer = CausalLMScorer(model, options=ScoringOptions(long_sequence_tokens=100, chunk_tokens=CHUNK))
    rows_seen = []
    model.base_model.layers[0].mlp.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[1]))
    with OfflineScorer(serve_model("m", "test", scorer), max_batch_tokens=400) as offline:
        offline.score([long_sequence(rng, 20, 60)])  # 80 tokens: under the threshold
        offline.score([long_sequence(rng, 40, 50), long_sequence(rng, 40, 50)])  # 180 tokens, two sequences
    assert rows_seen == [80, 180]


@pytest.mark.parametrize("window", [None, 5])
def test_queries_of_a_chunk_see_their_keys_aligned_bottom_right(window, seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, length, d = 4, 2, 40, 8
    q = torch.randn(heads, length, d, generator=g)
    k, v = (torch.randn(kv_heads, length, d, generator=g) for _ in range(2))
    kwargs = dict(scale=d**-0.5, sliding_window=window, softcap=None)
    whole = sequence_attention(q, k, v, **kwargs)  # [L, H, D]
    for start in (0, 13, 39):  # the last queries, against every key up to the end
        tail = sequence_attention(q[:, start:], k, v, **kwargs, score_bytes=4 * heads * length * 3)
        torch.testing.assert_close(tail, whole[start:], atol=PACKED_HIDDEN_FP32, rtol=0)
    with pytest.raises(ValueError, match="queries but only"):
        sequence_attention(q, k[:, :10], v[:, :10], **kwargs)


def test_the_final_norm_by_row_slices_gives_every_row_its_own_value(seed):
    norm = make_model("llama", tied=False, seed=seed).base_model.norm
    x = torch.randn(1, 100, 64, generator=torch.Generator().manual_seed(seed)) * 3
    whole = norm(x)
    sliced = _RowSlices(norm.forward, rows=7)  # 15 slices, the last ragged
    torch.testing.assert_close(sliced(x), whole, atol=0, rtol=0)  # a row's value never depends on its slice
