"""Page-locked host memory that received weight bytes pass through on their way to a device:
``slots`` (each device's few page-locked slots that ``staging`` copies pieces through), and
``page_lock`` (memory page-locked in place, a weight receiver's shared slots, from which
``staging`` copies pieces straight to the device; ``page_locked`` tells such a piece).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import mmap
import queue
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


# Page-locked slots per device that received bytes pass through: a copy to the device from pageable
# memory blocks the calling thread and goes through the driver's own small page-locked buffer; from
# page-locked memory it is an asynchronous transfer on the staging stream, overlapping the next
# pieces' arrival. 8 x 4 MiB: more pieces in flight than receiving threads, for 32 MiB of host memory.
STAGING_SLOT_BYTES = 4 << 20
SLOT_COUNT = 8


@dataclass
class Slot:
    host: torch.Tensor  # STAGING_SLOT_BYTES of page-locked uint8
    done: torch.cuda.Event  # recorded after the copy that last read it


class Slots:
    def __init__(self) -> None:
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for _ in range(SLOT_COUNT):
            self._free.put(
                Slot(torch.empty(STAGING_SLOT_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
            )

    def take(self) -> Slot:
        """A free slot, once the copy that last read it is done (blocks without the GIL)."""
        slot = self._free.get()
        slot.done.synchronize()
        return slot

    def give(self, slot: Slot) -> None:
        self._free.put(slot)


@functools.cache
def slots(device: torch.device) -> Slots:
    """``device``'s slots, made at their first use."""
    with torch.cuda.device(device):
        return Slots()


# Host memory page-locked in place by ``page_lock``: (first address, end address) of each range;
# replaced, not changed, so that the receiving threads read it without a lock.
_LOCKED: frozenset[tuple[int, int]] = frozenset()
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context


def page_locked(piece: np.ndarray) -> bool:
    if not (locked := _LOCKED):
        return False
    start = piece.ctypes.data
    return any(first <= start and start + piece.nbytes <= end for first, end in locked)


def _cudart_call(name: str, *args: int) -> None:
    """CUDA's runtime function ``name`` on a thread of its own, raising RuntimeError if it fails:
    a failure also leaves CUDA's last error set in the thread that called, where the check after a
    later kernel launch on that thread would raise it."""
    cudart = torch.cuda.cudart()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logprob-cudart") as one:
        error = one.submit(getattr(cudart, name), *args).result()
    if error != cudart.cudaError.success:
        raise RuntimeError(f"{name}: {cudart.cudaGetErrorString(error)}")


def page_lock(buffer: mmap.mmap) -> Callable[[], None] | None:
    """Page-locks ``buffer`` (writable host memory that received messages lie in: a weight
    receiver's shared slots) in place, for every CUDA device, so that pieces lying there are
    copied to a device straight from it (no copy through the page-locked slots); returns what
    undoes it, to call before the memory goes. None where there is no CUDA device, or (logged)
    where CUDA refuses: pieces then go through the slots."""
    if not torch.cuda.is_available():
        return None
    view = np.frombuffer(buffer, dtype=np.uint8)
    first, end = view.ctypes.data, view.ctypes.data + view.nbytes
    del view  # not held: the memory's owner closes it
    try:
        _cudart_call("cudaHostRegister", first, end - first, _HOST_REGISTER_PORTABLE)
    except RuntimeError as err:
        log.warning("%d bytes of received messages' memory not page-locked in place (%s)", end - first, err)
        return None
    global _LOCKED
    _LOCKED = _LOCKED | {(first, end)}

    def unlock() -> None:
        global _LOCKED
        _LOCKED = _LOCKED - {(first, end)}
        _cudart_call("cudaHostUnregister", first)

    return unlock
