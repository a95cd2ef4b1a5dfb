"""Data parallel on two GPUs (``device="cuda:0,cuda:1"``): one endpoint, a replica per GPU.

A request's log-probs never depend on which replica scored it: with the deterministic setting
(on by default) every response is bit for bit the one-GPU server's for the same request, while
concurrent requests spread over both GPUs. An update goes live on both replicas together: every
later response, from either GPU, is bit for bit the one-GPU server's after the same update.
Skipped without two GPUs.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient

from tests.helpers.models import make_model, random_sequences
from tests.helpers.server import as_lists, new_seed, settings, start, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def count_launches(replica) -> list[int]:
    counted = [0]
    launch = replica.scorer.launch

    def counting(*args, **kwargs):
        counted[0] += 1
        return launch(*args, **kwargs)

    replica.scorer.launch = counting
    return counted


async def score_all(target: str, batches, **keywords) -> list:
    async with AsyncLogprobClient(target, model="policy") as client:
        return await asyncio.gather(*(client.score(*as_lists(b), **keywords) for b in batches))


async def test_two_gpus_score_bit_for_bit_as_one_before_and_after_an_update(tmp_path, rng):
    make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).save_pretrained(tmp_path)
    new = make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).state_dict()
    cfg = {"dtype": "bfloat16", "max_batch_tokens": 512}  # small micro-batches: many in flight
    one = await start(settings({"policy": str(tmp_path)}, device="cuda:0", **cfg))
    two = None
    try:
        two = await start(settings({"policy": str(tmp_path)}, device="cuda:0,cuda:1", **cfg))
        replicas = two.service.device_side.registry.replicas("policy")
        assert [str(r.device) for r in replicas] == ["cuda:0", "cuda:1"]
        counts = [count_launches(r) for r in replicas]
        batches = [random_sequences(rng, 4, max_len=60) for _ in range(48)]
        for round_ in range(2):
            want = await score_all(one.target, batches)
            got = await score_all(two.target, batches)
            for w, g in zip(want, got, strict=True):
                for a, b in zip(w, g, strict=True):
                    np.testing.assert_array_equal(a, b)
            if round_ == 0:
                async with AsyncLogprobClient(two.target) as a, AsyncLogprobClient(one.target) as b:
                    pushed = await a.update_weights("policy", new)
                    assert (await b.update_weights("policy", new)).fingerprint == pushed.fingerprint
                assert [(r.info.version, r.info.fingerprint) for r in replicas] == [(1, pushed.fingerprint)] * 2
        assert all(c[0] > 0 for c in counts), counts  # both GPUs scored
    finally:
        await stop(one)
        if two is not None:
            await stop(two)
