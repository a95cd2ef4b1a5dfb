"""Decoder layers' norms and MLPs compiled by Inductor on CUDA (``models.compiled``, on by default).

Inductor's fused kernels round differently from eager's one-op-at-a-time kernels (a bf16 RMSNorm
computed in one float32 pass, say, against eager's bf16 intermediate), so compiled scores are held
to the same bound as every bf16 path: as exact as the model's own bf16 computation against the
float64 forward (``tests.helpers.models.ScoreReference``, tolerances.py), on three architectures.
"""

from __future__ import annotations

import logging

import pytest
import torch
from logprob_service.models import compiled
from logprob_service.models.compiled import layers_compiled
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer
from torch._dynamo.utils import counters

from tests.helpers.models import ScoreReference, make_model, random_sequences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_inductor_compiled_layers_are_as_exact_as_the_models_own_bf16_forward(arch, rng, seed):
    model = make_model(arch, tied=arch != "llama", seed=seed, dtype=torch.bfloat16).cuda()
    sequences = random_sequences(rng, 12)
    reference = ScoreReference(model, sequences, dtype=torch.bfloat16)
    with OfflineScorer(model, max_batch_tokens=300) as scorer:  # several micro-batches, several sizes
        assert scorer.scorer.layers_compiled  # auto, on CUDA
        graphs = counters["stats"]["unique_graphs"]
        out = scorer.score(sequences, return_entropy=True)
        assert counters["stats"]["unique_graphs"] == graphs  # no recompile for new token counts
    reference.check([s.logprobs for s in out], [s.entropies for s in out])
    model = make_model(arch, tied=arch != "llama", seed=seed, dtype=torch.bfloat16).cuda()
    with OfflineScorer(model, options=ScoringOptions(compile_layers="off")) as eager:
        assert not layers_compiled(model.base_model)
        eager_out = eager.score(sequences, return_entropy=True)
    reference.check([s.logprobs for s in eager_out], [s.entropies for s in eager_out])


def test_auto_leaves_the_layers_eager_with_a_warning_when_compiling_fails(monkeypatch, caplog, rng, seed):
    def failing(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", failing)
    model = make_model("qwen2", tied=True, seed=seed, dtype=torch.bfloat16).cuda()
    sequences = random_sequences(rng, 4)
    with caplog.at_level(logging.WARNING), OfflineScorer(model) as scorer:
        assert not scorer.scorer.layers_compiled and not layers_compiled(model.base_model)
        out = scorer.score(sequences)
    assert "decoder layers left eager" in caplog.text and "no compiler here" in caplog.text
    ScoreReference(model, sequences, dtype=torch.bfloat16).check([s.logprobs for s in out])
    torch._dynamo.reset()
