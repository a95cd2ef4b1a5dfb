"""The ``deterministic`` setting on the CPU: what it switches, and that ListModels says what holds.

Bitwise batch invariance itself is a CUDA property (ops.determinism); tests/gpu/test_batch_invariance_cuda.py
checks it on the GPU. On the CPU the setting changes the same choices, and says results are only
reproducible run to run.
"""

from __future__ import annotations

import pytest
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import serve_model

from tests.helpers.models import make_model


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_setting_picks_one_attention_kernel_and_an_invariant_lm_head_and_says_so(deterministic, seed):
    options = ScoringOptions(compile_layers="off", deterministic=deterministic)
    scorer = CausalLMScorer(make_model("llama", tied=False, seed=seed), options=options)
    assert scorer.logprob_op.invariant is deterministic
    # "auto" would serve a lone sequence with torch's SDPA and a packed row with the ragged kernel.
    assert scorer.attention_preference == ("cudnn" if deterministic else "auto")
    info = serve_model("m", "test", scorer).info
    assert info.determinism == scorer.determinism()
    assert info.determinism.startswith("on, but on the CPU only run to run" if deterministic else "off:")
