"""Weights handed to a server on this host by CUDA IPC (UpdateWeightsFromIpc).

A trainer on the server's node need not send its weights' bytes at all: for each GPU tensor it
sends the fields of torch's ``reduce_tensor`` (a cudaIpcMemHandle of the tensor's allocation,
torch's reference counter of it, an event after its last write) and its GPU's UUID; the server
maps the tensors, copies them device to device (on one GPU, or across GPUs by NVLink/P2P) and
swaps them in. gRPC carries a few hundred bytes per tensor. The tensors must stay alive and
unchanged until the call returns (``LogprobClient.update_weights_ipc`` holds them meanwhile).

Both processes must share an IPC namespace (in containers: ``--ipc=host``, or one Kubernetes pod).
Needs torch (imported here only).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from logprob_proto import logprob_pb2 as pb

from .streams import named_tensors

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def boot_id() -> str:
    """This host's Linux boot id, which the server compares with its own ("" where there is none)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def ipc_request(
    model: str, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], *, version: int = 0, partial: bool = False
) -> tuple[pb.IpcUpdateRequest, list[Any]]:
    """The request for ``weights`` (CUDA torch tensors in the served dtypes), and the tensors it
    points into, which the caller keeps alive until the call returns."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if version < 0:
        raise ValueError(f"version must be >= 0 (0: the live version + 1), got {version}")
    kept: list[torch.Tensor] = []
    tensors = []
    for name, tensor in named_tensors(weights):
        if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda):
            where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"tensor {name!r} is on {where}: update_weights_ipc hands over CUDA tensors only")
        t = tensor.detach().contiguous()
        kept.append(t)
        (_, _, _, offset, _, dtype, device, handle, size, storage_offset, _, counter, counter_offset, event, sync) = (
            reduce_tensor(t)[1]
        )
        tensors.append(
            pb.IpcTensor(
                name=name,
                dtype=str(dtype).removeprefix("torch."),
                shape=t.shape,
                device_uuid=str(torch.cuda.get_device_properties(device).uuid),
                storage_offset=offset,
                storage_handle=handle or b"",
                storage_size_bytes=size,
                storage_offset_bytes=storage_offset,
                ref_counter_handle=counter or b"",
                ref_counter_offset=counter_offset or 0,
                event_handle=event or b"",
                event_sync_required=bool(sync),
            )
        )
    header = pb.UpdateWeightsHeader(model=model, version=version, partial=partial)
    return pb.IpcUpdateRequest(header=header, boot_id=boot_id(), tensors=tensors), kept
