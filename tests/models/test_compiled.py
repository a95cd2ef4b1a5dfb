"""Decoder layers' norms and MLPs under torch.compile (``models.compiled``), on the CPU.

The compiler here is AOTAutograd with no code generation (``aot_eager``: the traced ATen graph
run eagerly, the same kernels as eager mode), wrapped to count the graphs it is handed; Inductor's
generated kernels are checked on the GPU (tests/gpu/test_compiled_cuda.py). So compiled and eager
scores must be bitwise equal, and what is checked is the wiring: every fusable module compiled,
one graph per module class for every token count, weights updated in place seen by the graphs,
eager execution restored on demand, copies that do not share the original's compiled forwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models import compiled
from logprob_service.models.compiled import eager_layers, fusable_modules, layers_compiled
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import serve_lora_model, serve_model
from logprob_service.offline import OfflineScorer
from torch._dynamo.backends.registry import lookup_backend

from tests.helpers.models import VOCAB, ScoreReference, make_model, stock_copy
from tests.integration.test_lora import make_adapter

pytestmark = pytest.mark.numerical


@pytest.fixture
def graphs(monkeypatch) -> list[torch.fx.GraphModule]:
    """The graphs compiled from now on (compiler: aot_eager), fresh of any earlier test's."""
    seen: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", counting)
    yield seen
    torch._dynamo.reset()


def mixes(rng: np.random.Generator) -> list[list[TokenSequence]]:
    """Three micro-batches of different token counts (one sequence alone, then packed rows)."""
    shapes = [[(3, 9)], [(5, 20), (1, 1), (12, 7)], [(30, 41), (2, 13)]]
    return [[TokenSequence(rng.integers(0, VOCAB, p), rng.integers(0, VOCAB, c)) for p, c in mix] for mix in shapes]


def score(scorer: CausalLMScorer, batches: list[list[TokenSequence]]) -> list:
    with OfflineScorer(serve_model("m", "test", scorer)) as offline:
        return [s for batch in batches for s in offline.score(batch, return_entropy=True)]


def assert_bitwise_equal(got: list, want: list) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a.logprobs, b.logprobs, err_msg=f"sequence {i}")
        np.testing.assert_array_equal(a.entropies, b.entropies, err_msg=f"sequence {i}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_compiled_layers_score_as_eager_ones_with_one_graph_per_module_class(arch, graphs, rng, seed):
    model = make_model(arch, tied=arch != "llama", seed=seed)
    batches = mixes(rng)
    eager = score(CausalLMScorer(model, options=ScoringOptions(compile_layers="off")), batches)
    assert graphs == [] and not layers_compiled(model.base_model)

    scorer = CausalLMScorer(model, options=ScoringOptions(compile_layers="on"))
    classes = {type(m) for m in fusable_modules(model.base_model)}
    assert scorer.layers_compiled and {c.__name__[-3:] for c in classes} == {"orm", "MLP"}
    assert all("forward" in vars(m) for m in fusable_modules(model.base_model))
    assert len(graphs) == len(classes)  # the probe compiled each class once
    got = score(scorer, batches)
    assert len(graphs) == len(classes)  # ... for every token count since
    assert_bitwise_equal(got, eager)
    reference = ScoreReference(model, [s for batch in batches for s in batch])
    reference.check([s.logprobs for s in got], [s.entropies for s in got])


def test_weights_changed_in_place_reach_the_compiled_graphs(graphs, rng, seed):
    model = make_model("qwen2", tied=True, seed=seed)
    scorer = CausalLMScorer(model, options=ScoringOptions(compile_layers="on"))
    batches = mixes(rng)
    before = score(scorer, batches)
    with torch.no_grad():  # as a weight swap does: copy_ into the live parameters
        for module in fusable_modules(model.base_model):
            for p in module.parameters():
                p.copy_(p * 1.5)
    after = score(scorer, batches)
    assert not np.array_equal(after[0].logprobs, before[0].logprobs)
    with eager_layers(model.base_model):
        assert not layers_compiled(model.base_model)
        eager = score(CausalLMScorer(model, options=ScoringOptions(compile_layers="off")), batches)
    assert layers_compiled(model.base_model)
    assert_bitwise_equal(after, eager)


def test_a_copy_of_a_compiled_model_runs_its_own_weights(graphs, rng, seed):
    model = make_model("llama", tied=False, seed=seed)
    CausalLMScorer(model, options=ScoringOptions(compile_layers="on"))
    copy = stock_copy(model)
    assert layers_compiled(model.base_model) and not layers_compiled(copy.base_model)
    with torch.no_grad():
        model.base_model.layers[0].mlp.down_proj.weight.zero_()  # must not reach the copy
    ids = torch.from_numpy(rng.integers(0, VOCAB, (1, 12)))
    with torch.no_grad():
        fresh = stock_copy(model)  # the weights changed: a new copy
        assert not torch.equal(copy(ids).logits, fresh(ids).logits)


def test_compile_layers_off_or_auto_on_the_cpu_leaves_the_layers_eager(graphs, seed):
    for setting in ("off", "auto"):
        model = make_model("llama", tied=False, seed=seed)
        assert not CausalLMScorer(model, options=ScoringOptions(compile_layers=setting)).layers_compiled
        assert not layers_compiled(model.base_model)
    assert graphs == []


def test_a_failing_compile_with_compile_layers_on_stops_and_leaves_the_layers_eager(monkeypatch, seed):
    def failing(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", failing)
    model = make_model("llama", tied=False, seed=seed)
    with pytest.raises(RuntimeError, match=r"(?s)compile_layers=on: compiling the decoder layers failed.*no compiler"):
        CausalLMScorer(model, options=ScoringOptions(compile_layers="on"))
    assert not layers_compiled(model.base_model)
    torch._dynamo.reset()


def test_a_lora_base_runs_its_layers_eagerly(graphs, tmp_path, rng, seed):
    model = make_model("llama", tied=False, seed=seed)
    make_adapter(model, tmp_path / "adapter", rng)
    base = serve_model("base", "test", CausalLMScorer(model, options=ScoringOptions(compile_layers="on")))
    assert base.scorer.layers_compiled
    serve_lora_model("tuned", base, str(tmp_path / "adapter"))
    assert not base.scorer.layers_compiled and not layers_compiled(model.base_model)
