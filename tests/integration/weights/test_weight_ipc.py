"""Weights by CUDA IPC (UpdateWeightsFromIpc): what can be checked without a GPU.

A real server on loopback refuses, before it opens any handle, tensors the model cannot take
(INVALID_ARGUMENT naming the tensor), a caller on another host and a server on the CPU
(FAILED_PRECONDITION), with its weights and version untouched. ``worker.ipc``'s checks of the
caller's GPUs (by UUID, peer access, the storage's size) run against a stated set of GPUs. The
pushes themselves, on one GPU and across two, are tests/gpu/test_weight_ipc_cuda.py.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from logprob_client.ipc import boot_id as client_boot_id
from logprob_client.ipc import ipc_request
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.domain import IpcHandle, SharedTensor
from logprob_service.errors import FailedPrecondition, InvalidArgument
from logprob_service.worker import ipc

from tests.helpers.models import make_model
from tests.helpers.seeds import session_seed
from tests.helpers.server import settings, start, stop

UUID = "GPU-0000"


@pytest.fixture
async def served(tmp_path):
    make_model("llama", tied=False, seed=session_seed("llama-ipc")).save_pretrained(tmp_path)
    running = await start(settings({"policy": str(tmp_path)}))
    yield running
    await stop(running)


def ipc_tensor(name: str, dtype: str, shape: tuple[int, ...], size_bytes: int | None = None, offset: int = 0):
    """A handle as a caller on GPU ``UUID`` would send it (its bytes are not a real allocation's)."""
    size = size_bytes if size_bytes is not None else (torch.Size(shape).numel() + offset) * 4
    return pb.IpcTensor(
        name=name,
        dtype=dtype,
        shape=shape,
        device_uuid=UUID,
        storage_offset=offset,
        storage_handle=b"\x01" * 64,
        storage_size_bytes=size,
        ref_counter_handle=b"/torch_ipc_counter",
        event_handle=b"\x02" * 64,
        event_sync_required=True,
    )


async def push(target: str, tensors: list[pb.IpcTensor], boot_id: str) -> grpc.aio.AioRpcError:
    request = pb.IpcUpdateRequest(
        header=pb.UpdateWeightsHeader(model="policy", partial=True), boot_id=boot_id, tensors=tensors
    )
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.LogprobServiceStub(channel).UpdateWeightsFromIpc(request, timeout=30)
    return caught.value


async def test_tensors_the_model_cannot_take_are_refused_before_any_handle_is_opened(served):
    weights = served.scorer("policy").model.state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    shape = tuple(weights[name].shape)
    live = served.service.device_side.registry.get("policy").info
    version, fingerprint = live.version, live.fingerprint
    cases = [
        ([ipc_tensor("model.layers.0.no_such.weight", "float32", shape)], "model.layers.0.no_such.weight"),
        ([ipc_tensor(name, "float32", (shape[0], shape[1] + 1))], name),
        ([ipc_tensor(name, "float16", shape)], name),
        ([ipc_tensor(name, "float32", shape), ipc_tensor(name, "float32", shape)], "named twice"),
    ]
    for tensors, fragment in cases:
        err = await push(served.target, tensors, client_boot_id())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert fragment in err.details()
    # A server on the CPU takes no IPC push, from this host or any other.
    good = [ipc_tensor(name, "float32", shape)]
    for boot_id in (client_boot_id(), "another-host"):
        err = await push(served.target, good, boot_id)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cpu" in err.details()
    live = served.service.device_side.registry.get("policy").info
    assert (live.version, live.fingerprint) == (version, fingerprint)


def shared(name: str, shape: tuple[int, ...], size_bytes: int, offset: int = 0, uuid: str = UUID) -> SharedTensor:
    handle = IpcHandle(uuid, offset, b"\x01" * 64, size_bytes, 0, b"", 0, b"", False)
    return SharedTensor(name, "bfloat16", shape, handle)


@pytest.fixture
def two_gpus(monkeypatch):
    """This process sees GPUs UUID (index 0) and "GPU-0001" (index 1), with peer access between
    them as ``peers`` says."""
    peers = {"access": True}
    monkeypatch.setattr(ipc, "_devices_by_uuid", lambda: {UUID: 0, "GPU-0001": 1})
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: peers["access"])
    return peers


def test_the_callers_host_and_gpus_are_checked_before_any_handle_is_opened(two_gpus):
    server = torch.device("cuda", 0)
    fits = shared("w", (4, 8), 4 * 8 * 2)
    ipc.check_shared(ipc.boot_id(), server, [fits, shared("v", (2,), 8, offset=2, uuid="GPU-0001")])

    with pytest.raises(FailedPrecondition, match="boot_id: the caller's host"):
        ipc.check_shared("another-host", server, [fits])
    with pytest.raises(FailedPrecondition, match="runs on cpu"):
        ipc.check_shared(ipc.boot_id(), torch.device("cpu"), [fits])
    with pytest.raises(FailedPrecondition, match="tensor 'x': its GPU 'GPU-0009' is not one this server sees"):
        ipc.check_shared(ipc.boot_id(), server, [fits, shared("x", (4,), 8, uuid="GPU-0009")])
    # The storage must hold the tensor: 4 x 8 bf16 from element 1 on needs 66 bytes.
    with pytest.raises(InvalidArgument, match="tensor 'w': its storage holds 64 bytes, but the tensor needs 66"):
        ipc.check_shared(ipc.boot_id(), server, [shared("w", (4, 8), 64, offset=1)])
    two_gpus["access"] = False
    ipc.check_shared(ipc.boot_id(), server, [fits])  # on the server's own GPU: no peer access needed
    with pytest.raises(FailedPrecondition, match="tensor 'v': the server's cuda:0 has no peer access to cuda:1"):
        ipc.check_shared(ipc.boot_id(), server, [shared("v", (2,), 8, uuid="GPU-0001")])


def test_a_handle_that_does_not_open_is_a_failed_precondition_naming_the_tensor(two_gpus, monkeypatch):
    """No shared IPC namespace, or the caller gone: a state of the processes, which TRL's
    RemotePolicy falls back to gRPC on, not a malformed request."""

    def refuse(*args):
        raise RuntimeError("CUDA error: invalid argument")  # what torch raises for such a handle

    monkeypatch.setattr(ipc, "rebuild_cuda_tensor", refuse)
    with pytest.raises(FailedPrecondition, match="tensor 'w': its CUDA IPC handle does not open here"):
        ipc.open_shared(shared("w", (4, 8), 4 * 8 * 2))


def test_a_host_without_a_boot_id_is_never_taken_for_the_servers(monkeypatch):
    ipc.boot_id.cache_clear()
    monkeypatch.setattr(ipc, "BOOT_ID", ipc.BOOT_ID.with_name("no-such-file"))
    try:
        assert ipc.boot_id() == ""
        with pytest.raises(FailedPrecondition, match="none sent"):
            ipc.check_shared("", torch.device("cuda", 0), [])
    finally:
        ipc.boot_id.cache_clear()


def test_the_client_hands_over_only_cuda_tensors():
    with pytest.raises(ValueError, match="tensor 'w' is on cpu: update_weights_ipc hands over CUDA tensors only"):
        ipc_request("policy", {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="tensor 'v' is on ndarray"):
        ipc_request("policy", [("v", np.ones(2))])
    with pytest.raises(ValueError, match="version must be >= 0"):
        ipc_request("policy", {}, version=-1)
