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
from logprob_client.weights import WeightDeltas
from logprob_service.api import receiver_process, tensor_pieces
from logprob_service.engine.weights import update as weights_update
from logprob_service.models.weights import model_fingerprint
from logprob_service.offline import OfflineScorer
from logprob_service.worker import pinned, staging
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


RECEIVERS = pytest.mark.parametrize("receivers", [0, 2], ids=["to-the-port", "through-2-receivers"])


@RECEIVERS
@pytest.mark.parametrize("reserve", [0, 10**15], ids=["staged-on-gpu", "staged-on-host"])
async def test_pieces_through_small_page_locked_slots_land_bit_for_bit(tmp_path, reserve, receivers, rng, monkeypatch):
    """Pieces read as views of the received messages (no size floor here) and written through
    4 KiB page-locked slots, 10,000-byte pieces over 3 streams: a piece spans several slots and
    slots wrap mid-tensor. The weights that go live are the pushed ones, bit for bit (fingerprint),
    pushed to the server's port or through weight receivers (read in their shared memory, which
    is page-locked in place: staged on the GPU, every piece goes to it straight from there)."""
    monkeypatch.setattr(tensor_pieces, "MIN_VIEWED_BYTES", 0)
    monkeypatch.setattr(pinned, "STAGING_SLOT_BYTES", 4096)
    ways = {"through the slots": 0, "in place": 0}

    def counted(way, method):
        def call(*args, **kwargs):
            ways[way] += 1
            return method(*args, **kwargs)

        return call

    monkeypatch.setattr(staging.DeviceStager, "_upload", counted("through the slots", staging.DeviceStager._upload))
    monkeypatch.setattr(staging.DeviceStager, "_copy_locked", counted("in place", staging.DeviceStager._copy_locked))
    make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).save_pretrained(tmp_path)
    new = make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16)
    cfg = {
        "device": "cuda",
        "dtype": "bfloat16",
        "update_staging_reserve_bytes": reserve,
        "weight_receivers": receivers,
    }
    running = await start(settings({"policy": str(tmp_path)}, **cfg))
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            result = await client.update_weights("policy", new.state_dict(), chunk_bytes=10_000, streams=3)
        assert result.staged_on == ("cpu" if reserve else "cuda:0")
        assert (running.service.receivers.forwarded if receivers else 0) == (3 if receivers else 0)
        assert result.fingerprint == model_fingerprint(new)
        if reserve:  # staged on the host: written there, by neither way
            assert ways == {"through the slots": 0, "in place": 0}
        elif receivers:
            assert ways["through the slots"] == 0 and ways["in place"] > 0
        else:
            assert ways["through the slots"] > 0 and ways["in place"] == 0
    finally:
        await stop(running)


def test_memory_page_locked_in_place_goes_to_the_device_straight_from_there(rng):
    """``pinned.page_lock`` of a receiver's shared memory: pieces lying there are recognised and
    copied to the device from there, bit for bit; once unlocked, they are not recognised."""
    size = 1 << 20
    memory = receiver_process.SharedMemory(2, size)
    unlock = pinned.page_lock(memory.buffer)
    assert unlock is not None
    data = rng.integers(0, 256, size, dtype=np.uint8)
    memory.buffer[size:] = data.tobytes()
    piece = np.frombuffer(memory.buffer, np.uint8, size, size)
    assert pinned.page_locked(piece) and pinned.page_locked(piece[5:99])
    assert not pinned.page_locked(data)
    target = torch.empty(size, dtype=torch.uint8, device="cuda")
    staging.DeviceStager(torch.device("cuda:0"), 0)._copy_locked(target, piece)
    assert torch.equal(target.cpu(), torch.from_numpy(data))
    unlock()
    assert not pinned.page_locked(piece)
    del piece
    memory.close()


@RECEIVERS
@pytest.mark.parametrize("batch", [3, weights_update.SPARSE_BATCH_TENSORS], ids=["batches-of-3", "one-batch"])
@pytest.mark.parametrize("on_device", [False, True], ids=["client-holds-on-host", "client-holds-on-gpu"])
@pytest.mark.parametrize("reserve", [0, 10**15], ids=["staged-on-gpu", "staged-on-host"])
async def test_a_sparse_delta_on_cuda_lands_bit_for_bit_as_a_dense_push(
    tmp_path, reserve, on_device, batch, receivers, rng, monkeypatch
):
    """The changed copies of the live weights are made on the GPU, some tensors at a time (or on
    the host without room): either way, the weights that go live are those a dense push of the
    same tensors makes. The client's tensors are on the GPU, its copies held (and compared) on the
    host or on the GPU; the delta goes to the server's port or through weight receivers."""
    monkeypatch.setattr(weights_update, "SPARSE_BATCH_TENSORS", batch)
    make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).save_pretrained(tmp_path)
    first = make_model("qwen2", tied=True, seed=new_seed(rng), dtype=torch.bfloat16).state_dict()
    step, by_storage = {}, {}
    for name, tensor in first.items():  # 2% of each weight's elements (at least one) changed
        if tensor.data_ptr() not in by_storage:  # tied names are one weight: changed alike
            flat = tensor.clone().reshape(-1)
            where = torch.from_numpy(rng.choice(flat.numel(), max(1, flat.numel() // 50), replace=False))
            flat[where] += torch.from_numpy(rng.standard_normal(where.numel()).astype(np.float32)).to(flat.dtype)
            by_storage[tensor.data_ptr()] = flat.reshape(tensor.shape)
        step[name] = by_storage[tensor.data_ptr()]
    first, step = ({n: t.cuda() for n, t in w.items()} for w in (first, step))
    cfg = {"device": "cuda", "dtype": "bfloat16", "update_staging_reserve_bytes": reserve}
    sparse, dense = await start(settings({"policy": str(tmp_path)}, weight_receivers=receivers, **cfg)), None
    try:
        dense = await start(settings({"policy": str(tmp_path)}, **cfg))
        sequences = random_sequences(rng, 8)
        async with (
            AsyncLogprobClient(sparse.target, model="policy") as by_delta,
            AsyncLogprobClient(dense.target, model="policy") as by_dense,
        ):
            by_delta.deltas["policy"] = WeightDeltas(on_device=on_device)
            await by_delta.update_weights("policy", first, delta=True)  # nothing held yet: dense
            result = await by_delta.update_weights("policy", step, delta=True)
            held = by_delta.deltas["policy"].held.values()
            assert all((isinstance(h, torch.Tensor) and h.is_cuda) == on_device for h in held)
            assert by_delta.deltas["policy"].last["sparse"] > 0 and result.staged_on == ("cpu" if reserve else "cuda:0")
            want = await by_dense.update_weights("policy", step)
            assert result.fingerprint == want.fingerprint
            got, expected = await by_delta.score(*as_lists(sequences)), await by_dense.score(*as_lists(sequences))
        for g, w in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, w)  # the same weights, the same kernels: bit for bit
    finally:
        await stop(sparse)
        if dense is not None:
            await stop(dense)


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
        # As exact as PEFT's own bfloat16 forward of base + adapter (tests/helpers/tolerances.py).
        ScoreReference(peft, sequences, dtype=torch.bfloat16).check(got)
    finally:
        await stop(running)


def test_the_comparisons_warm_up_runs_on_the_gpu_and_leaves_nothing_to_wait_for():
    """``WeightDeltas``' warm-up (run after a push, on a thread of its own, where a failure would go
    unseen) on each element size held on a GPU: it runs through, and its copies are done."""
    from logprob_client import compare

    cuda = torch.device("cuda:0")
    compare.warm_up([(cuda, dtype) for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64)])
    assert torch.cuda.current_stream(cuda).query()
