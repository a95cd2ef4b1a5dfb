"""Data parallel inside one server, on the CPU: ``device="cpu,cpu"`` holds two replicas of each
model, each with a device thread of its own (a lane), behind one endpoint.

Checked through the real server: concurrent requests are spread over both replicas and score
as the model does (float64 reference, the CPU tolerance of ``assert_scores_match``); a weight
update reaches every replica, which go live together (same version and fingerprint on each, and
every later response scored by the new weights). Lane choice and swap ordering with fake devices
are tests/engine/test_lanes.py; bitwise equality across GPUs is tests/gpu.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient
from logprob_service.engine.weights import update as weights_update
from logprob_service.models.weights import model_fingerprint

from tests.helpers.models import make_model, random_sequences
from tests.helpers.seeds import session_seed
from tests.helpers.server import as_lists, assert_scores_match, settings, start, stop
from tests.helpers.waiting import eventually


@pytest.fixture
async def two_replicas(tmp_path):
    make_model("qwen2", tied=True, seed=session_seed("data-parallel")).save_pretrained(tmp_path)
    running = await start(settings({"default": str(tmp_path)}, device="cpu,cpu"))
    yield running
    await stop(running)


def count_launches(replica, release: threading.Event | None = None) -> list[int]:
    """Counts the micro-batches ``replica`` scores (its scorer's launches); with ``release``, their
    results wait for it, so the replica's lane stays busy until then."""
    counted = [0]
    launch = replica.scorer.launch

    class Held:
        def __init__(self, launched) -> None:
            self.launched = launched

        def fetch(self):
            release.wait(60)
            return self.launched.fetch()

    def counting(*args, **kwargs):
        counted[0] += 1
        launched = launch(*args, **kwargs)
        return launched if release is None else Held(launched)

    replica.scorer.launch = counting
    return counted


async def test_requests_spread_over_the_replicas_and_score_as_the_model(two_replicas, rng):
    replicas = two_replicas.service.device_side.registry.replicas("default")
    assert len(replicas) == 2 and replicas[0].scorer.model is not replicas[1].scorer.model
    release = threading.Event()
    counts = [count_launches(replicas[0], release), count_launches(replicas[1])]
    batches = [random_sequences(rng, 3) for _ in range(16)]
    async with AsyncLogprobClient(two_replicas.target, model="default") as client:
        scoring = asyncio.gather(*(client.score(*as_lists(b)) for b in batches))
        # The first micro-batch holds the first lane, so the next must go to the second.
        await eventually(lambda: counts[1][0] > 0, "a micro-batch on the second replica")
        release.set()
        results = await scoring
    assert counts[0][0] > 0, counts
    model = replicas[0].scorer.model
    for batch, logprobs in zip(batches, results, strict=True):
        assert_scores_match(model, batch, logprobs)


async def test_an_update_goes_live_on_every_replica_together(two_replicas, rng):
    replicas = two_replicas.service.device_side.registry.replicas("default")
    new = make_model("qwen2", tied=True, seed=int(rng.integers(2**31)))
    batches = [random_sequences(rng, 2) for _ in range(8)]
    async with AsyncLogprobClient(two_replicas.target, model="default") as client:
        result = await client.update_weights("default", new.state_dict())
        assert [(r.info.version, r.info.fingerprint) for r in replicas] == [(result.version, result.fingerprint)] * 2
        assert all(model_fingerprint(r.scorer.model) == result.fingerprint for r in replicas)
        results = await asyncio.gather(*(client.score(*as_lists(b), min_version=result.version) for b in batches))
    for batch, logprobs in zip(batches, results, strict=True):  # by the new weights, on either replica
        assert_scores_match(new.eval(), batch, logprobs)


async def test_a_sparse_delta_reaches_every_replica_bit_for_bit(two_replicas, rng, monkeypatch):
    """A delta's changed copies are staged for each replica, a few tensors at a time (batches of
    3 here): every replica then holds what a dense push of the same weights would give."""
    monkeypatch.setattr(weights_update, "SPARSE_BATCH_TENSORS", 3)
    replicas = two_replicas.service.device_side.registry.replicas("default")
    base = {k: v.detach().clone() for k, v in replicas[0].scorer.model.state_dict().items()}
    step, by_storage = {}, {}
    for name, tensor in replicas[0].scorer.model.state_dict().items():  # 2% of each weight's elements
        key = tensor.data_ptr()
        if key not in by_storage:  # tied names are one weight: changed alike
            flat = tensor.detach().clone().reshape(-1)
            where = torch.from_numpy(rng.choice(flat.numel(), max(1, flat.numel() // 50), replace=False))
            flat[where] += torch.from_numpy(rng.standard_normal(where.numel()).astype(np.float32))
            by_storage[key] = flat.reshape(tensor.shape)
        step[name] = by_storage[key]
    async with AsyncLogprobClient(two_replicas.target, model="default") as client:
        await client.update_weights("default", base, delta=True)  # nothing held yet: dense
        result = await client.update_weights("default", step, delta=True)
        assert client.deltas["default"].last["sparse"] > 3
    expected = make_model("qwen2", tied=True, seed=0)
    expected.load_state_dict(step)
    assert result.fingerprint == model_fingerprint(expected)
    assert [model_fingerprint(r.scorer.model) for r in replicas] == [result.fingerprint] * 2


async def test_list_models_and_the_metric_name_every_replicas_device(two_replicas):
    from logprob_service.observability.metrics import ModelsCollector

    async with AsyncLogprobClient(two_replicas.target, model="default") as client:
        (info,) = await client.list_models()
    assert info.device == "cpu,cpu"
    (family, _) = ModelsCollector().collect()
    assert "cpu,cpu" in {sample.labels["device"] for sample in family.samples if sample.labels["model"] == "default"}
