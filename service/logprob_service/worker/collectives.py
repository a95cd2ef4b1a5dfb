"""A torch.distributed group shared with a trainer, to receive weights by broadcast.

RL frameworks sync a policy's weights into their inference servers this way (vLLM's and SGLang's
``init_weights_update_group`` / ``update_weights_from_distributed``): the trainer, rank 0, hosts a
TCP store; each server joins as a further rank; every tensor is broadcast from rank 0 in an order
both sides agreed on. The group is a process group of its own, built on that store (not
torch.distributed's default group, which a server may need for itself), so it can be joined,
dropped and joined again while the server runs. ``logprob_client.collective`` is the trainer's side.

``engine.weights`` runs the update's protocol and holds the group as an opaque object
(``engine.interfaces.WeightGroup``): the engine touches no tensor.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from logprob_service.errors import InvalidArgument
from logprob_service.models.loading import DTYPES

STORE_PREFIX = "logprob-weights"  # the trainer's side uses the same: both see one key space per group
BACKENDS = ("nccl", "gloo")


class WeightGroup:
    """This server's rank in a group with a trainer: joined at construction, tensors received by
    ``receive`` in broadcast order. Not thread-safe: one update receives at a time."""

    def __init__(
        self,
        device: torch.device,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        self.device, self.rank, self.world_size = device, rank, world_size
        self.backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if self.backend not in BACKENDS:
            raise InvalidArgument(f"backend: {backend!r} is not one of {', '.join(BACKENDS)} (empty: by device)")
        if self.backend == "nccl" and device.type != "cuda":
            raise InvalidArgument(f"backend: nccl needs a CUDA device; this server runs on {device}")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        except (RuntimeError, OSError) as err:  # DistNetworkError is a RuntimeError
            raise InvalidArgument(
                f"master_address: no TCP store of a trainer at {master_address}:{master_port} within {timeout_s:g} s "
                f"({err})"
            ) from None
        store = dist.PrefixStore(f"{STORE_PREFIX}/{name}", store)
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(device)
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        self._broadcast(torch.zeros(1, device=device))  # every rank is in: the trainer's first broadcast

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()  # received, before anyone reads it

    def receive(self, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The next tensor rank 0 broadcasts, on this server's device; raises once the group's
        timeout passes without it."""
        tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
        self._broadcast(tensor)
        return tensor

    def close(self, *, graceful: bool = False) -> None:
        """Leave the group (a broken one included). ``graceful``: rank 0 leaves at the same time
        (NCCL's shutdown waits for every rank); otherwise it is aborted here alone (the trainer
        is gone, or broke the protocol)."""
        try:
            if graceful:
                self.group.shutdown()
            else:
                self.group.abort()
        except RuntimeError:
            pass  # already broken or shut down: nothing left to release
