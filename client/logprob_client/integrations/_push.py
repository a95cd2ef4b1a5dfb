"""A trainer's weights pushed to one served model by the transport that fits where both run: what
the verl checkpoint-engine plugin (``verl_checkpoint``) does with the actor's named tensors, kept
free of verl so that it runs (and is tested on a GPU) without it.

Transports (``WeightPusher.transport``):

- ``ipc``: CUDA IPC, the service on this host (``LogprobClient.update_weights_ipc``): only handles
  cross gRPC, the server copies device to device;
- ``nccl``: a broadcast through a weight-update group with the service
  (``collective.WeightBroadcaster``; gloo for CPU tensors), this process hosting the group's store
  at ``master_address:master_port``;
- ``grpc``: sparse deltas over gRPC (``update_weights(..., delta=True)``): after the first (dense)
  push, only what changed, from host copies; works across hosts;
- ``auto`` (default): ``ipc`` for CUDA tensors, falling back to ``grpc`` for good where the server
  answers that it cannot map them (another host, no peer access); ``grpc`` for CPU tensors.

Tensors are cast to the served model's dtype as they come (an FSDP actor exports its float32
master weights; the served model runs in the trainer's compute dtype), and for ``grpc`` copied to
the host at once, so a push holds the model's size on the GPU only where it goes by IPC or NCCL.
Torch is imported only where a push runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..client import LogprobClient
from ..collective import WeightBroadcaster
from ..errors import FailedPrecondition
from ..streams import UpdateResult
from ._served import ServiceConfigError, normalize_dtype

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "ipc", "nccl", "grpc")
# How long the weight-update group's join and each broadcast wait for the other side: within the
# server's max_group_timeout_s (300 s by default; a join asking more is refused), apart from a
# push's own deadline (a large model's gRPC push may need longer).
GROUP_TIMEOUT_S = 120.0


class WeightPusher:
    """Pushes full sets of named tensors to ``model`` (served in ``dtype``) through ``client``;
    each push goes live as the model's next version. ``setting`` is how the transport settings are
    spelled in the trainer's config, for messages."""

    def __init__(
        self,
        client: LogprobClient,
        model: str,
        dtype: str,
        *,
        transport: str = "auto",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 600.0,
        setting: str = "transport",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ServiceConfigError(f"{setting}.transport={transport!r}: it is one of {', '.join(TRANSPORTS)}")
        if transport == "nccl" and not 0 < int(master_port) < 65536:
            raise ServiceConfigError(
                f"{setting}.transport=nccl needs {setting}.master_port (a free port on this host, where the "
                f"service joins the weight-update group; and {setting}.master_address, this host as the "
                "service sees it)"
            )
        if transport == "ipc":
            import torch

            if not torch.cuda.is_available():
                raise ServiceConfigError(
                    f"{setting}.transport=ipc hands over CUDA tensors, and this process sees no CUDA device: "
                    "use auto or grpc"
                )
        self.client, self.model, self.transport = client, model, transport
        self.dtype_name = normalize_dtype(dtype)
        self.master_address, self.master_port, self.timeout_s = master_address, int(master_port), timeout_s
        self._ipc_refused = False  # auto: the server could not map this process's CUDA tensors
        self.last_transport = ""  # the transport the last push went by ("" before the first)
        self._broadcaster: WeightBroadcaster | None = None

    def resolve(self, tensor: Any) -> str:
        """The transport a push of tensors like ``tensor`` takes."""
        if self.transport != "auto":
            return self.transport
        return "ipc" if tensor.is_cuda and not self._ipc_refused else "grpc"

    def stage(self, tensor: Any, transport: str) -> Any:
        """``tensor`` as it is sent: detached, in the served dtype, on the host for gRPC."""
        import torch

        t = tensor.detach()
        if t.is_floating_point():
            t = t.to(getattr(torch, self.dtype_name))
        return t.cpu() if transport == "grpc" else t.contiguous()

    def push(self, weights: Iterable[tuple[str, Any]]) -> UpdateResult:
        """Stage ``weights`` (every tensor of the model) and push them; the live version's result."""
        staged: list[tuple[str, Any]] = []
        transport = ""
        for name, tensor in weights:
            transport = transport or self.resolve(tensor)
            staged.append((name, self.stage(tensor, transport)))
        if not staged:
            raise ValueError("a push needs the model's tensors; none were given")
        return self.push_staged(staged, transport)

    def push_staged(self, staged: list[tuple[str, Any]], transport: str) -> UpdateResult:
        self.last_transport = transport
        if transport == "ipc":
            try:
                return self.client.update_weights_ipc(self.model, staged, timeout=self.timeout_s)
            except FailedPrecondition as err:
                if self.transport != "auto":
                    raise
                log.warning("CUDA IPC refused (%s): weights go to %r as deltas over gRPC from now on", err, self.model)
                self._ipc_refused = True
                return self.push_staged([(name, t.cpu()) for name, t in staged], "grpc")
        if transport == "nccl":
            if self._broadcaster is None:
                backend = "nccl" if staged[0][1].is_cuda else "gloo"
                self._broadcaster = WeightBroadcaster(
                    self.client,
                    master_port=self.master_port,
                    master_address=self.master_address,
                    backend=backend,
                    device=str(staged[0][1].device),
                    timeout_s=min(self.timeout_s, GROUP_TIMEOUT_S),
                )
            return self._broadcaster.push(self.model, staged, timeout=self.timeout_s)
        return self.client.update_weights(self.model, staged, delta=True, timeout=self.timeout_s)

    def close(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
