"""The trainer's side of weight updates by broadcast (InitWeightsUpdateGroup, UpdateWeightsFromDistributed).

The trainer (rank 0) hosts a TCP store and a process group of its own with the server (the
convention of vLLM's and SGLang's ``init_weights_update_group``), then pushes each update by
naming its tensors over gRPC and broadcasting them through the group: NCCL between GPUs (NVLink,
InfiniBand), gloo on the CPU. gRPC carries only names, shapes and the outcome.

    with LogprobClient("scorer:50051") as client, WeightBroadcaster(client, master_port=29600) as sync:
        sync.push("policy", policy.state_dict(), version=step)

Needs torch (imported here only). One server per broadcaster (world size 2).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from logprob_proto import logprob_pb2 as pb

from .errors import LogprobError, error_from_rpc
from .streams import UpdateResult, named_tensors

# Both sides key the group's store under this prefix (the server's worker.collectives).
STORE_PREFIX = "logprob-weights"
# How long close() waits for the server's refusal to leave before leaving with it (its leave
# answers only once this side has left too).
LEAVE_ANSWER_S = 1.0


class WeightBroadcaster:
    """Rank 0 of a weight-update group with one server, for pushes of a blocking ``LogprobClient``.

    ``master_address``: where the server reaches this process's TCP store (this host's address as
    the server sees it); ``backend``: "nccl" (tensors on a GPU) or "gloo"; ``device``: where
    tensors are broadcast from (default: cuda for nccl, cpu for gloo); ``timeout_s``: how long a
    join or a broadcast waits for the other side.
    """

    def __init__(
        self,
        client: Any,
        *,
        master_port: int,
        master_address: str = "127.0.0.1",
        group_name: str = "trainer",
        backend: str = "nccl",
        device: str | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self.client = client
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self.group: Any = None
        self._store: Any = None

    def connect(self) -> pb.InitWeightsUpdateGroupResponse:
        """Host the store, make the server join as rank 1, join as rank 0; returns once both are in."""
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore(
            "0.0.0.0", self.master_port, 2, is_master=True, wait_for_workers=False, timeout=timeout
        )
        request = pb.InitWeightsUpdateGroupRequest(
            master_address=self.master_address,
            master_port=self.master_port,
            rank_offset=1,
            world_size=2,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        joined = self.client._stub.InitWeightsUpdateGroup.future(request, timeout=self.timeout_s + 30)
        store = dist.PrefixStore(f"{STORE_PREFIX}/{self.group_name}", self._store)
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, 0, 2, options)
        self._broadcast(torch.zeros(1, device=self.device))  # the server's first receive: both are in
        try:
            return joined.result()
        except Exception as err:  # grpc.RpcError
            raise error_from_rpc(err) from None

    def _broadcast(self, tensor: Any) -> None:
        import torch
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def push(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int = 0,
        partial: bool = False,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Push ``weights`` (torch tensors in the served dtypes) to ``model``: their names, dtypes
        and shapes over gRPC, checked by the server before anything is broadcast, then the tensors
        through the group, in order; returns once they are live (UpdateWeights' guarantees)."""
        if self.group is None:
            self.connect()
        tensors = [(name, tensor.detach().to(self.device).contiguous()) for name, tensor in named_tensors(weights)]
        request = pb.DistributedUpdateRequest(
            header=pb.UpdateWeightsHeader(model=model, version=version, partial=partial),
            group_name=self.group_name,
            tensors=[
                pb.TensorSpec(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=t.shape)
                for name, t in tensors
            ],
        )
        responses = self.client._stub.UpdateWeightsFromDistributed(request, timeout=timeout or self.client.timeout)
        try:
            if next(responses).WhichOneof("kind") != "ready":
                raise LogprobError("the server answered an update from the group without `ready`")
            for _, tensor in tensors:
                self._broadcast(tensor)
            return UpdateResult.from_proto(next(responses).done)
        except LogprobError:
            raise
        except Exception as err:  # grpc.RpcError: the server refused or failed the update
            if hasattr(err, "code"):
                raise error_from_rpc(err) from None
            raise

    def close(self) -> None:
        """Leave the group with the server (DestroyWeightsUpdateGroup): NCCL tears a group down on
        both ranks together, so each side's shutdown waits for the other's. Where the server
        answers at once that it cannot (gone, or it dropped the group), this side aborts alone."""
        if self.group is not None:
            request = pb.DestroyWeightsUpdateGroupRequest(group_name=self.group_name)
            leaving = self.client._stub.DestroyWeightsUpdateGroup.future(request, timeout=self.timeout_s)
            try:
                leaving.result(timeout=LEAVE_ANSWER_S)
            except grpc.FutureTimeoutError:
                pass  # the server is leaving and waits for this side
            except grpc.RpcError:
                self.group.abort()
                self.group = None
            if self.group is not None:
                self.group.shutdown()
                with contextlib.suppress(grpc.RpcError):
                    leaving.result()
        self.group = self._store = None

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
