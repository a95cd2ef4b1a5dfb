"""GPU memory of this process per CUDA device, as torch's caching allocator counts it.

The peak of one micro-batch is measured by resetting torch's peak counter before it and reading
the counter after it (``micro_batch_peak``). A reset would lose the peak since start, so this
module folds the counter into a running maximum before every reset: ``peak_allocated`` is the
peak since start (or since ``reset_peak``) however many micro-batches reset the counter in
between. Code that wants a peak while the service runs in its process (the benchmarks) reads it
here, not from ``torch.cuda.max_memory_allocated``.

Nothing here initializes CUDA: every function is called with a device that already holds a model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from logprob_service.stats import MemorySnapshot

_lock = threading.Lock()  # the device thread resets while the metrics thread reads
_folded: dict[int, int] = {}  # device index -> highest allocated bytes before torch's last reset


@dataclass
class PeakMeter:
    """Filled when the ``micro_batch_peak`` block ends; None off CUDA."""

    bytes: int | None = None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _fold(index: int) -> None:
    """Keep the highest peak torch has counted since its last reset (caller holds the lock)."""
    _folded[index] = max(_folded.get(index, 0), torch.cuda.max_memory_allocated(index))


@contextlib.contextmanager
def micro_batch_peak(device: torch.device) -> Iterator[PeakMeter]:
    """Measure the highest allocated bytes on ``device`` while the block runs (weights included).

    The caching allocator counts allocations when the host enqueues work, so the peak is known
    as soon as the micro-batch's kernels are enqueued, before the device has run them.
    """
    meter = PeakMeter()
    if device.type != "cuda":
        yield meter
        return
    index = _index(device)
    with _lock:
        _fold(index)
        torch.cuda.reset_peak_memory_stats(index)
    try:
        yield meter
    finally:
        meter.bytes = torch.cuda.max_memory_allocated(index)


def peak_allocated(device: torch.device) -> int:
    index = _index(device)
    with _lock:
        return max(_folded.get(index, 0), torch.cuda.max_memory_allocated(index))


def reset_peak(device: torch.device) -> None:
    """Start the peak since-start count afresh (benchmarks, between measured runs)."""
    index = _index(device)
    with _lock:
        _folded[index] = 0
        torch.cuda.reset_peak_memory_stats(index)


def snapshot(device: torch.device) -> MemorySnapshot:
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(
        allocated=torch.cuda.memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
        free=free,
        total=total,
        peak_allocated=peak_allocated(device),
    )
