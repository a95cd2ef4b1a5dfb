"""The finiteness check of weight updates on CUDA (``check_finite_weights``; the CPU's paths are in
tests/integration/weights/test_nonfinite_weights.py): pushes staged on the device and in host memory, and
a sparse delta (its changed values probed on the device, ``DeviceStager._changed_copies``), through
a real server in bf16. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from logprob_client import AsyncLogprobClient, InvalidRequest
from logprob_client.weights import WeightDeltas
from logprob_service.models.weights import model_fingerprint

from tests.helpers.models import make_model
from tests.helpers.server import live, new_seed, settings, start, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYER = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("reserve", [0, 10**15], ids=["staged-on-gpu", "staged-on-host"])
async def test_nonfinite_pushes_are_refused_on_cuda(tmp_path, reserve, rng):
    make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).save_pretrained(tmp_path)
    new = make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16)
    state = new.state_dict()
    running = await start(
        settings({"policy": str(tmp_path)}, device="cuda", dtype="bfloat16", update_staging_reserve_bytes=reserve)
    )
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            before = await live(client, "policy")
            for value in (math.nan, math.inf, -math.inf):
                bad = state[LAYER].clone()
                bad.view(-1)[int(rng.integers(bad.numel()))] = value
                with pytest.raises(InvalidRequest, match=rf"tensor '{LAYER}': holds NaN or infinite values"):
                    await client.update_weights("policy", {**state, LAYER: bad})
                with pytest.raises(InvalidRequest, match=rf"tensor '{LAYER}': holds NaN or infinite values"):
                    await client.update_weights("policy", {k: v.cuda() for k, v in {**state, LAYER: bad}.items()})
            assert await live(client, "policy") == before
            # Sparse: a finite first push, then a delta of one NaN element.
            client.deltas["policy"] = WeightDeltas()
            assert (await client.update_weights("policy", state, delta=True)).version == 1
            bad = state[LAYER].clone()
            bad.view(-1)[0] = math.nan
            with pytest.raises(InvalidRequest, match=rf"tensor '{LAYER}': holds NaN or infinite values"):
                await client.update_weights("policy", {**state, LAYER: bad}, delta=True)
            assert client.deltas["policy"].last["sparse"] >= 1
            # A finite delta still lands, bit for bit.
            step = {k: v + 0.01 if k == LAYER else v for k, v in state.items()}
            client.deltas["policy"] = WeightDeltas()
            assert (await client.update_weights("policy", state, delta=True)).version == 2
            result = await client.update_weights("policy", step, delta=True)
            new.load_state_dict(step)
            assert result.version == 3 and result.fingerprint == model_fingerprint(new)
    finally:
        await stop(running)
