"""How ``RemotePolicy`` pushes the old policy's weights: CUDA IPC where it can, else gRPC deltas.

A fake client stands in for the service: it records which push each step used, and refuses IPC
(FAILED_PRECONDITION, as a service on another host does) when told to. The weights are marked as
GPU tensors by a subclass, so the choice runs here without a GPU; the pushes themselves are
``_push.WeightPusher``'s, tested against a real service (test_trl.py over gRPC,
tests/gpu/test_verl_push_cuda.py by CUDA IPC).
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("trl", reason="trl is optional: pip install trl==1.16.0 (CI gets it via the dev extra)")

import torch
from logprob_client import FailedPrecondition
from logprob_client.integrations.trl import RemotePolicy


class OnGpu(torch.Tensor):
    """A host tensor that says it is on a GPU (only ``is_cuda`` is read of it)."""

    @property
    def is_cuda(self) -> bool:
        return True


class Policy(torch.nn.Module):
    def __init__(self, on_gpu: bool) -> None:
        super().__init__()
        self.on_gpu = on_gpu
        self.w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7)

    def state_dict(self, *args, **kwargs):
        w = self.w.detach()
        return {"w": w.as_subclass(OnGpu) if self.on_gpu else w}


class Service:
    timeout = 60.0  # the client's deadline, which the pushes take

    def __init__(self, same_host: bool) -> None:
        self.same_host = same_host
        self.pushes: list[str] = []

    def update_weights_ipc(self, model, weights, *, timeout):
        if not self.same_host:
            raise FailedPrecondition("boot_id: the caller's host is not this server's")
        return self.pushed("ipc", weights, timeout)

    def update_weights(self, model, weights, *, delta, timeout):
        assert delta
        return self.pushed("grpc", weights, timeout)

    def pushed(self, transport, weights, timeout):
        assert timeout == self.timeout and [(name, t.dtype) for name, t in weights] == [("w", torch.bfloat16)]
        self.pushes.append(transport)
        return type("Result", (), {"version": len(self.pushes)})()


def sync_steps(policy: RemotePolicy, on_gpu: bool, steps: int) -> list[int]:
    return [policy.sync(Policy(on_gpu), step, "bfloat16") for step in range(steps)]


def test_a_gpu_policy_goes_by_ipc_to_a_service_on_this_host():
    service = Service(same_host=True)
    policy = RemotePolicy(service, model="policy")
    assert sync_steps(policy, on_gpu=True, steps=3) == [1, 2, 3]
    assert service.pushes == ["ipc"] * 3 and policy.served.pusher.last_transport == "ipc"


def test_a_refused_ipc_push_falls_back_to_grpc_for_good(caplog):
    service = Service(same_host=False)
    policy = RemotePolicy(service, model="policy")
    with caplog.at_level(logging.WARNING, logger="logprob_client.integrations._push"):
        assert sync_steps(policy, on_gpu=True, steps=3) == [1, 2, 3]
    (warning,) = [r.getMessage() for r in caplog.records]  # once, not at every push
    assert "boot_id" in warning and warning.endswith("weights go to 'policy' as deltas over gRPC from now on")
    assert service.pushes == ["grpc"] * 3 and policy.served.pusher.last_transport == "grpc"


def test_a_host_policy_and_the_grpc_transport_never_try_ipc():
    for on_gpu, transport in ((False, "auto"), (True, "grpc")):
        service = Service(same_host=True)
        policy = RemotePolicy(service, model="policy", transport=transport)
        sync_steps(policy, on_gpu=on_gpu, steps=2)
        assert service.pushes == ["grpc", "grpc"]


def test_the_same_step_is_pushed_once():
    service = Service(same_host=True)
    policy = RemotePolicy(service, model="policy")
    assert [policy.sync(Policy(True), step, "bfloat16") for step in (0, 0, 1, 1)] == [1, 1, 2, 2]


def test_the_ipc_transport_raises_a_refusal_and_unknown_transports_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # WeightPusher refuses "ipc" without CUDA
    policy = RemotePolicy(Service(same_host=False), model="policy", transport="ipc")
    with pytest.raises(FailedPrecondition, match="boot_id"):
        sync_steps(policy, on_gpu=True, steps=1)
    with pytest.raises(ValueError, match="transport must be 'auto', 'ipc' or 'grpc', got 'nccl'"):
        RemotePolicy(Service(same_host=True), model="policy", transport="nccl")
