"""``input_embeddings=host`` on a GPU: an untied model's input embedding in pinned host memory.

A lookup copies rows, so the scores must be bitwise those with the table on the device (same
model, same micro-batches), for a plain embedding (Llama), one scaled in the model's forward
(Gemma2) and one scaled inside the embedding module (Gemma3); the table's device memory is freed;
a tied table (it is the lm_head) stays; a push of the table lands as it does on the device.
Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.models.scorer import ScoringOptions
from logprob_service.models.weights import UpdatableWeights
from logprob_service.offline import OfflineScorer

from tests.helpers.models import make_model, random_sequences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HOST = ScoringOptions(input_embeddings="host")


def _scores(model, sequences, options=None) -> list[np.ndarray]:
    with OfflineScorer(model, options=options, max_batch_tokens=200) as scorer:
        return [s.logprobs for s in scorer.score(sequences, return_entropy=True)]


def _assert_bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_scores_are_bitwise_those_with_the_table_on_the_device(arch, rng):
    model = make_model(arch, tied=False, seed=int(rng.integers(1 << 30)), dtype=torch.bfloat16).cuda()
    sequences = random_sequences(rng, 12)
    on_device = _scores(model, sequences)
    table = model.get_input_embeddings().weight.detach().cpu()
    on_host = _scores(model, sequences, HOST)
    moved = model.get_input_embeddings().weight
    assert moved.device.type == "cpu" and moved.is_pinned()
    assert torch.equal(moved, table)
    assert all(p.is_cuda for p in model.parameters() if p is not moved)  # only the table moved
    _assert_bitwise(on_host, on_device)


def test_a_tied_table_stays_on_the_device(rng):
    model = make_model("qwen2", tied=True, seed=int(rng.integers(1 << 30)), dtype=torch.bfloat16).cuda()
    sequences = random_sequences(rng, 6)
    on_device = _scores(model, sequences)
    _assert_bitwise(_scores(model, sequences, HOST), on_device)
    assert model.get_input_embeddings().weight.is_cuda


def test_a_push_of_the_table_lands_as_on_the_device(rng):
    seed = int(rng.integers(1 << 30))
    sequences = random_sequences(rng, 8)
    pushed = torch.randn_like(make_model("llama", tied=False, seed=seed).get_input_embeddings().weight)
    scores = []
    for options in (None, HOST):
        model = make_model("llama", tied=False, seed=seed, dtype=torch.bfloat16).cuda()
        with OfflineScorer(model, options=options, max_batch_tokens=200) as scorer:
            live = model.state_dict()
            table = model.get_input_embeddings().weight
            name = next(n for n, t in live.items() if t.data_ptr() == table.data_ptr())
            UpdatableWeights(live).apply({name: pushed.to("cuda", torch.bfloat16)})
            scores.append([s.logprobs for s in scorer.score(sequences)])
        assert model.get_input_embeddings().weight.device.type == ("cpu" if options else "cuda")
    _assert_bitwise(scores[1], scores[0])
