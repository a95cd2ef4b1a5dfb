"""Weights by CUDA IPC (UpdateWeightsFromIpc) from a trainer process on one GPU, and across two.

The trainer is a process of its own (CUDA IPC maps another process's memory). An IPC push lands
bit for bit as a gRPC push of the same weights (equal fingerprints, and equal scores: the same
bf16 weights through the same kernels, with --deterministic on); the server copies the tensors,
so the trainer changing them after the call changes nothing served. A handle that does not open
is refused naming the tensor, with the old weights live. Skipped without a GPU.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import grpc
import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient, LogprobClient
from logprob_client.ipc import boot_id
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.models import make_model, random_sequences
from tests.helpers.server import as_lists, new_seed, settings, start, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def trainer(target: str, device: str, seed: int, spec: list, sequences: tuple, results: mp.Queue) -> None:
    """New weights on ``device``: pushed by IPC, then changed in place, then the originals pushed
    again over gRPC; the scores after each push."""
    try:
        generator = torch.Generator(device).manual_seed(seed)
        weights = {n: (torch.randn(s, device=device, generator=generator) * 0.02).to(d) for n, s, d in spec}
        originals = {n: t.cpu() for n, t in weights.items()}
        with LogprobClient(target, model="policy", timeout=120) as client:
            by_ipc = client.update_weights_ipc("policy", weights)
            for t in weights.values():
                t.add_(1.0)  # the server holds its own copy now
            torch.cuda.synchronize()
            ipc_scores = client.score(*sequences)
            by_grpc = client.update_weights("policy", originals)
            grpc_scores = client.score(*sequences)
        results.put((by_ipc, by_grpc, ipc_scores, grpc_scores))
    except BaseException as err:  # the test process shows what went wrong here
        results.put(err)
        raise


@pytest.mark.parametrize("trainer_device", ["cuda:0", "cuda:1"], ids=["same-gpu", "other-gpu"])
async def test_an_ipc_push_lands_as_a_grpc_push_of_the_same_weights(tmp_path, trainer_device, rng):
    if torch.device(trainer_device).index >= torch.cuda.device_count():
        pytest.skip(f"needs {trainer_device}")
    model = make_model("llama", tied=False, seed=new_seed(rng), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    spec = [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]
    sequences = as_lists(random_sequences(rng, 6))
    running = await start(settings({"policy": str(tmp_path)}, device="cuda:0", dtype="bfloat16"))
    try:
        context = mp.get_context("spawn")
        results = context.Queue()
        args = (running.target, trainer_device, new_seed(rng), spec, sequences, results)
        process = context.Process(target=trainer, args=args)
        process.start()
        outcome = await asyncio.to_thread(results.get, timeout=300)
        await asyncio.to_thread(process.join, 60)
    finally:
        await stop(running)
    if isinstance(outcome, BaseException):
        raise outcome
    by_ipc, by_grpc, ipc_scores, grpc_scores = outcome
    assert (by_ipc.version, by_grpc.version) == (1, 2)  # the model starts at version 0
    assert by_ipc.tensors == len(spec) and by_ipc.staged_on == "cuda:0"
    assert by_ipc.fingerprint == by_grpc.fingerprint
    for a, b in zip(ipc_scores, grpc_scores, strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: the same weights, kernels and batch


async def test_a_handle_that_does_not_open_is_refused_with_the_old_weights_live(tmp_path, rng):
    model = make_model("llama", tied=False, seed=new_seed(rng), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    name, weight = next(iter(model.state_dict().items()))
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    garbage = np.random.default_rng(new_seed(rng)).bytes(64)
    running = await start(settings({"policy": str(tmp_path)}, device="cuda:0", dtype="bfloat16"))
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            before = (await client.list_models())[0]
            tensor = pb.IpcTensor(
                name=name,
                dtype="bfloat16",
                shape=weight.shape,
                device_uuid=uuid,
                storage_handle=garbage,
                storage_size_bytes=weight.numel() * 2,
            )
            request = pb.IpcUpdateRequest(
                header=pb.UpdateWeightsHeader(model="policy", partial=True), boot_id=boot_id(), tensors=[tensor]
            )
            async with grpc.aio.insecure_channel(running.target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await pb_grpc.LogprobServiceStub(channel).UpdateWeightsFromIpc(request, timeout=60)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"tensor {name!r}: its CUDA IPC handle does not open here" in caught.value.details()
            after = (await client.list_models())[0]
            assert (after.version, after.fingerprint) == (before.version, before.fingerprint)
            await client.score(*as_lists(random_sequences(rng, 2)))  # still serving
    finally:
        await stop(running)
