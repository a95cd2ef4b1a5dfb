"""Weight updates and LoRA on CUDA in bf16 (staging on the device and on the host). Skipped without a GPU.

Tolerances (nats, absolute): after an update, scores equal those of a scorer on a freshly built
model with the same weights (same kernels, same bf16 weights): 1e-4. A LoRA model against PEFT's
own bf16 forward of base + adapter (its logits rounded to bf16): 5e-2, as for any bf16 model.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient
from logprob_service.offline import OfflineScorer
from peft import LoraConfig, get_peft_model

from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.server import as_lists, new_seed, settings, start, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("reserve", [0, 10**15], ids=["staged-on-gpu", "staged-on-host"])
async def test_update_on_cuda_scores_as_a_fresh_model(tmp_path, reserve, rng):
    make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).save_pretrained(tmp_path)
    new = make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16)
    running = await start(
        settings({"policy": str(tmp_path)}, device="cuda", dtype="bfloat16", update_staging_reserve_bytes=reserve)
    )
    try:
        sequences = random_sequences(rng, 8)
        async with AsyncLogprobClient(running.target, model="policy") as client:
            result = await client.update_weights("policy", new.state_dict())
            assert result.staged_on == ("cpu" if reserve else "cuda:0")
            got = await client.score(*as_lists(sequences))
        # The same weights scored by a fresh scorer on the same GPU: the same kernels on the same
        # bf16 inputs, up to micro-batch composition (fp32 lm_head sums in other blockings, 1e-4).
        with OfflineScorer(new.cuda()) as fresh:
            want = fresh.score(sequences)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.logprobs, atol=1e-4, rtol=0)
    finally:
        await stop(running)


async def test_lora_on_cuda_against_peft_forward(tmp_path, rng):
    base = make_model("llama", tied=False, seed=new_seed(rng), dtype=torch.bfloat16)
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(new_seed(rng))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(base), config).cuda().eval()
    peft.save_pretrained(tmp_path / "adapter")
    running = await start(
        settings(
            {"ref": str(tmp_path / "base"), "policy": f"ref+{tmp_path / 'adapter'}"}, device="cuda", dtype="bfloat16"
        )
    )
    try:
        sequences = random_sequences(rng, 6)
        async with AsyncLogprobClient(running.target, model="policy") as client:
            got = await client.score(*as_lists(sequences))
        # As exact as PEFT's own bfloat16 forward of base + adapter (tests/tolerances.py).
        ScoreReference(peft, sequences, dtype=torch.bfloat16).check(got)
    finally:
        await stop(running)
