"""A dense push into a quantized model against a reload of the pushed weights so quantized.

``push_serves_as_reload`` writes two random models' checkpoints in a case's layout, serves both
through a real server on loopback (on the device the caller names), pushes the second model's dense
weights into the first, and returns the two models' scores and fingerprints, which must be equal:
a dense push is quantized on arrival with the checkpoint's own scheme.
"""

from __future__ import annotations

import numpy as np
import torch
from logprob_client import AsyncLogprobClient

from tests.helpers.models import make_model, random_sequences
from tests.helpers.quantized import FP8_DIMS, write_checkpoint, write_mxfp4_checkpoint
from tests.helpers.server import as_lists, live, new_seed, settings, start, stop

MOE_DIMS = {**FP8_DIMS, "moe_intermediate_size": 128}
CASES = {  # name: (architecture, layout, dims)
    "llama-fp8-blocks": ("llama", "fp8-blocks", FP8_DIMS),
    "llama-ct-channel": ("llama", "ct-channel", FP8_DIMS),
    "qwen3-moe-fp8-blocks": ("qwen3_moe", "fp8-blocks", MOE_DIMS),
    "gpt-oss-mxfp4": ("gpt_oss", "mxfp4", None),
}


async def scores_and_fingerprint(target: str, model: str, sequences) -> tuple[list, str]:
    async with AsyncLogprobClient(target, model=model) as client:
        scores = await client.score(*as_lists(sequences))
        return [list(s) for s in scores], (await live(client, model)).fingerprint


async def push_serves_as_reload(tmp_path, case: str, rng: np.random.Generator, **overrides) -> tuple[tuple, tuple]:
    """(scores, fingerprint) of the pushed model and of the reloaded one; ``overrides`` go to the
    server's settings (``device="cuda"``, ``dtype="bfloat16"``). Both models are made in the served
    dtype: a push sends the dense weights in it, as a trainer does, and the reload's checkpoint is
    quantized from those same values."""
    arch, layout, dims = CASES[case]
    dtype = getattr(torch, overrides.get("dtype", "float32"))
    old, new = (make_model(arch, tied=False, seed=new_seed(rng), dims=dims).to(dtype) for _ in range(2))
    for name, model in (("old", old), ("new", new)):
        if layout == "mxfp4":
            write_mxfp4_checkpoint(tmp_path / name, model)
        else:
            write_checkpoint(tmp_path / name, model, layout)
    running = await start(settings({"pushed": str(tmp_path / "old"), "reloaded": str(tmp_path / "new")}, **overrides))
    try:
        sequences = random_sequences(rng, 4, max_len=24)
        async with AsyncLogprobClient(running.target, model="pushed") as client:
            result = await client.update_weights("pushed", new.state_dict())  # dense, as a trainer holds it
            assert result.version == 1
        pushed = await scores_and_fingerprint(running.target, "pushed", sequences)
        reloaded = await scores_and_fingerprint(running.target, "reloaded", sequences)
        return pushed, reloaded
    finally:
        await stop(running)
