"""Tensors a caller on this host hands over by CUDA IPC (UpdateWeightsFromIpc).

The caller (``logprob_client.ipc``) sends, for each tensor, the fields of torch's ``reduce_tensor``
(a cudaIpcMemHandle of its allocation, torch's reference counter of it, an event after its last
write) and its GPU's UUID. This module checks that the handles can be valid here (same host by
Linux boot id, a GPU this process sees, peer access from it to the server's GPU, a storage that
holds the tensor) and maps each tensor with torch's own ``rebuild_cuda_tensor``: no pickle, and
no copy here (``worker.staging`` copies it device to device). The mapping keeps the caller's
memory alive, by torch's reference counter, until the mapped tensor is freed.

CUDA IPC needs the two processes to share an IPC namespace: in containers, ``--ipc=host`` (Docker)
or one pod (Kubernetes: containers of a pod share it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from logprob_service.domain import SharedTensor
from logprob_service.errors import FailedPrecondition, InvalidArgument
from logprob_service.models.loading import DTYPES

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def boot_id() -> str:
    """This host's Linux boot id (the same in every container of the host); "" where there is none."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@functools.cache
def _devices_by_uuid() -> dict[str, int]:
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def source_device(tensor: SharedTensor) -> torch.device:
    """This process's index of the GPU holding ``tensor`` (by UUID: indices differ between processes)."""
    index = _devices_by_uuid().get(tensor.handle.device_uuid)
    if index is None:
        raise FailedPrecondition(
            f"tensor {tensor.name!r}: its GPU {tensor.handle.device_uuid!r} is not one this server sees "
            f"({len(_devices_by_uuid())} visible; CUDA_VISIBLE_DEVICES must include it)"
        )
    return torch.device("cuda", index)


def check_shared(caller_boot_id: str, device: torch.device, tensors: Sequence[SharedTensor]) -> None:
    """That every tensor can be mapped here and copied to ``device``; raises before any is opened."""
    if device.type != "cuda":
        raise FailedPrecondition(f"UpdateWeightsFromIpc: this server's model runs on {device}; CUDA IPC needs a GPU")
    here = boot_id()
    if not caller_boot_id or caller_boot_id != here:
        raise FailedPrecondition(
            f"boot_id: the caller's host ({caller_boot_id or 'none sent'!r}) is not this server's ({here!r}); "
            "CUDA IPC works only on one host: push over gRPC (update_weights) or by broadcast instead"
        )
    for t in tensors:
        source = source_device(t)
        if source != device and not torch.cuda.can_device_access_peer(device.index, source.index):
            raise FailedPrecondition(
                f"tensor {t.name!r}: the server's {device} has no peer access to {source}, where it lies; "
                "push it over gRPC instead"
            )
        needed = (t.handle.storage_offset + math.prod(t.shape)) * DTYPES[t.dtype].itemsize
        if t.handle.storage_offset < 0 or needed > t.handle.storage_size_bytes:
            raise InvalidArgument(
                f"tensor {t.name!r}: its storage holds {t.handle.storage_size_bytes} bytes, but the tensor needs "
                f"{needed} from element {t.handle.storage_offset} on"
            )


def open_shared(tensor: SharedTensor) -> torch.Tensor:
    """The caller's tensor, mapped into this process (its memory: copy it before the call returns)."""
    dtype = DTYPES[tensor.dtype]
    device = source_device(tensor)
    if math.prod(tensor.shape) == 0:
        return torch.empty(tensor.shape, dtype=dtype, device=device)
    h = tensor.handle
    strides = [math.prod(tensor.shape[i + 1 :]) for i in range(len(tensor.shape))]
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(tensor.shape),
            tuple(strides),
            h.storage_offset,
            torch.storage.TypedStorage,
            dtype,
            device.index,
            h.storage_handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            False,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle,
            h.event_sync_required,
        )
    except RuntimeError as err:  # torch raises CUDA's and its own IPC errors as RuntimeError
        # A state of the two processes (no shared IPC namespace, the caller gone), not of the
        # request: callers such as TRL's RemotePolicy fall back to gRPC on FAILED_PRECONDITION.
        raise FailedPrecondition(
            f"tensor {tensor.name!r}: its CUDA IPC handle does not open here ({err}); the caller must be another "
            "process of this host, sharing its IPC namespace, and keep the tensor alive until the call returns"
        ) from None
