"""What a served model says about itself: its context length and its attention plan."""

from __future__ import annotations

from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import context_length, serve_model
from transformers import LlamaConfig, Qwen2Config

from tests.helpers.models import make_model


def test_context_length_follows_a_rope_scaling_that_stretches_it():
    assert context_length(Qwen2Config(max_position_embeddings=32768)) == 32768
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert context_length(Qwen2Config(max_position_embeddings=32768, rope_parameters=yarn)) == 131072
    # Llama 3's scaling is already in max_position_embeddings (131072 > 8 x 8192).
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # fmt: skip
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)) == 131072


def test_list_models_says_which_attention_serves_the_model(seed):
    scorer = CausalLMScorer(
        make_model("llama", tied=False, seed=seed), options=ScoringOptions(attention_backend="exact")
    )
    info = serve_model("m", "test", scorer).info
    assert info.attention == "packed rows: exact, one sequence (or its chunks): exact"
    assert "a device other than CUDA" in serve_model("m", "test", CausalLMScorer(scorer.model)).info.attention
