"""Weight updates into quantized models through a real server on loopback (CPU).

A dense push into an FP8 or MXFP4 model is quantized on arrival with the checkpoint's own scheme:
the model then serves what a reload of a checkpoint of the pushed weights, so quantized, serves:
the same scores bit for bit and the same fingerprint (of the served tensors: codes and scales). A
push of the quantized tensors themselves (FP8 codes and their scales) is taken as it is.
"""

from __future__ import annotations

import pytest
import torch
from logprob_client import AsyncLogprobClient
from safetensors.torch import load_file

from tests.helpers.models import make_model, random_sequences
from tests.helpers.quantized import FP8_DIMS, write_checkpoint
from tests.helpers.quantized_pushes import CASES, push_serves_as_reload, scores_and_fingerprint
from tests.helpers.server import new_seed, settings, start, stop


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_dense_push_serves_as_a_reload_of_the_pushed_weights_quantized(tmp_path, case, rng):
    pushed, reloaded = await push_serves_as_reload(tmp_path, case, rng)
    assert pushed == reloaded


async def test_fp8_tensors_with_their_scales_are_taken_as_they_are(tmp_path, rng):
    old, new = (make_model("llama", tied=False, seed=new_seed(rng), dims=FP8_DIMS) for _ in range(2))
    write_checkpoint(tmp_path / "old", old, "fp8-blocks")
    write_checkpoint(tmp_path / "new", new, "fp8-blocks")
    running = await start(settings({"pushed": str(tmp_path / "old"), "reloaded": str(tmp_path / "new")}))
    try:
        quantized = load_file(tmp_path / "new" / "model.safetensors")
        quantized["lm_head.weight"] = new.state_dict()["lm_head.weight"]
        sequences = random_sequences(rng, 4, max_len=24)
        async with AsyncLogprobClient(running.target, model="pushed") as client:
            assert (await client.update_weights("pushed", quantized)).version == 1
        assert await scores_and_fingerprint(running.target, "pushed", sequences) == await scores_and_fingerprint(
            running.target, "reloaded", sequences
        )
    finally:
        await stop(running)
    assert torch.float8_e4m3fn in {t.dtype for t in quantized.values()}
