"""A delta push's comparison: which elements of each tensor changed since the last push, and
applying them to the copy held (``deltas.WeightDeltas``).

On the host, numpy compares in parallel parts (``changes``, ``set_elements``); copies held on a
GPU are compared there with torch, a group of tensors at a time (``compare_group``). torch is
imported only when tensors are given.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
# split over the threads and each part's temporaries stay in cache.
PART_ELEMENTS = 1 << 20


@functools.cache
def _parts_pool() -> concurrent.futures.ThreadPoolExecutor:
    # numpy compares, finds and moves elements without the GIL: threads go at the memory's speed.
    return concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="logprob-delta")


@functools.cache
def held_pool() -> concurrent.futures.ThreadPoolExecutor:
    # One thread: torch's calls on several took turns at the interpreter, slower than one alone.
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logprob-delta-held")


def changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the flat arrays ``old`` and ``new`` (one size and dtype, at most ``MAX_SPARSE_ELEMENTS``)
    differ: the indices (ascending, uint32, as they travel) and ``new``'s values there, found in
    parallel parts."""

    def part(start: int) -> tuple[np.ndarray, np.ndarray]:
        piece = new[start : start + PART_ELEMENTS]
        where = np.flatnonzero(old[start : start + PART_ELEMENTS] != piece)
        return (where + start).astype(np.uint32), piece[where]

    parts = list(_parts_pool().map(part, range(0, new.size, PART_ELEMENTS)))
    if not parts:
        return np.empty(0, np.uint32), new[:0].copy()
    return np.concatenate([i for i, _ in parts]), np.concatenate([v for _, v in parts])


def set_elements(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """``target[indices] = values`` for the flat array ``target`` and distinct ``indices``, in parallel parts."""

    def part(start: int) -> None:
        target[indices[start : start + PART_ELEMENTS]] = values[start : start + PART_ELEMENTS]

    list(_parts_pool().map(part, range(0, indices.size, PART_ELEMENTS)))


@dataclass(frozen=True)
class Compared:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    new: Any  # its raw bytes: host uint8, maybe the caller's memory; or on its device, as integers
    # The changed elements' indices (uint32); None: send it dense (nothing held to compare, or
    # sparse would not pay: ``WeightDeltas._dense_pays``).
    changed: np.ndarray | None
    values: np.ndarray | None  # their new values
    on_device: tuple[Any, Any] | None = None  # changed and values on the tensor's device (on_device)
    copied: Any = None  # a CUDA event: changed and values are in host memory once it has passed


@dataclass(frozen=True)
class Member:
    """A held torch tensor that goes sparse: its held copy and its bits now (``_held_bits``), and
    how many of its elements changed."""

    name: str
    tensor: Any
    old: Any
    bits: Any
    count: int


# torch's integer dtype of each element size, to compare tensors bit for bit on their device.
_TORCH_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


# Elements compared at once to count a tensor's changes: count_nonzero sums an int64 of each (8
# bytes an element), so a 1.5B model's embedding counted whole took 1.74 GiB of the trainer's GPU,
# which a trainer beside a server may not have free.
COUNT_ELEMENTS = 1 << 24


def changed_count(old: Any, bits: Any) -> Any:
    """How many elements of the flat tensors ``old`` and ``bits`` differ: a 0-d tensor where they
    lie, not read (counted ``COUNT_ELEMENTS`` at a time)."""
    import torch

    parts = [torch.count_nonzero(o != b) for o, b in zip(old.split(COUNT_ELEMENTS), bits.split(COUNT_ELEMENTS))]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


# Elements of held tensors counted and compared together (``count_group``, ``compare_group``): their
# held copies and bits are each joined into one tensor (a copy on their device), so that counting,
# finding, gathering and copying their changes is a few torch calls for them all. Called per tensor,
# a 1.5B model's 2% delta made ~3,700 calls, which took 0.25-0.35 s of the comparing thread during
# a push (H100), taking turns at the interpreter with the sending threads. Grouped, 0.027 s alone,
# and still 0.16-0.22 s during a push, for the same reason (benchmarks/RESULTS.md). The joined copies, the
# comparison's mask and the count's running sum take ~0.3 GiB of the device at most, in bf16. A
# tensor larger than this is a group of its own, not copied.
GROUP_ELEMENTS = 1 << 25


def device_groups(items: list[T], bits: Callable[[T], Any]) -> list[list[T]]:
    """``items`` in their order, in groups of one device and element size (of their ``bits``), of
    at most ``GROUP_ELEMENTS`` elements (or one tensor)."""
    groups: list[list[T]] = []
    size, kind = 0, None
    for item in items:
        b = bits(item)
        if not groups or (b.device, b.dtype) != kind or size + b.numel() > GROUP_ELEMENTS:
            groups.append([])
            size, kind = 0, (b.device, b.dtype)
        groups[-1].append(item)
        size += b.numel()
    return groups


def _to_device(values: list[int], device: Any) -> Any:
    """``values`` as an int64 tensor on ``device``, without waiting: from page-locked memory on a
    GPU (a copy from pageable memory waits for the device's work queued before it)."""
    import torch

    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def count_group(pairs: list[tuple[Any, Any]]) -> Any:
    """How many elements differ in each (held copy, bits) pair of one device and element size: a
    tensor of the counts where they lie, not read."""
    import torch

    if len(pairs) == 1:
        return changed_count(*pairs[0]).view(1)
    old, new = torch.cat([o for o, _ in pairs]), torch.cat([b for _, b in pairs])
    ends = _to_device(list(itertools.accumulate(b.numel() for _, b in pairs)), new.device)
    differ = torch.cumsum(old != new, 0, dtype=torch.int32)[ends - 1]  # how many up to each tensor's end
    return torch.diff(differ, prepend=differ.new_zeros(1))


def compare_group(members: list[Member], indices: Any, values: Any) -> list[Compared]:
    """The changes of ``members`` (one device and element size), found together: where their held
    copies and bits (joined, if more than one) differ, at their counted number (``nonzero_static``:
    no wait), each made an index into its own tensor; those and the new values gathered there are
    copied to ``indices`` (int32) and ``values`` in host memory, without waiting on a GPU (the
    sending waits for ``Compared.copied``)."""
    import torch

    joined = len(members) > 1
    old = torch.cat([m.old for m in members]) if joined else members[0].old
    new = torch.cat([m.bits for m in members]) if joined else members[0].bits
    total = sum(m.count for m in members)
    changed = torch.nonzero_static(old != new, size=total).view(-1)
    changed_values = new[changed]
    if joined:  # each position less its tensor's start in the joined tensor
        starts = _to_device(list(itertools.accumulate((m.bits.numel() for m in members[:-1]), initial=0)), new.device)
        counts = _to_device([m.count for m in members], new.device)
        changed = changed - torch.repeat_interleave(starts, counts, output_size=total)
    # To the host as the uint32s they travel as (int32 wraps to the same bits): half the bytes.
    indices.copy_(changed.to(torch.int32), non_blocking=True)
    values.copy_(changed_values, non_blocking=True)
    copied = None
    if new.is_cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(new.device))
    host_indices, host_values = indices.numpy().view(np.uint32), values.numpy()
    compared, at = [], 0
    for m in members:
        part = slice(at, at + m.count)
        at += m.count
        compared.append(
            Compared(
                m.name,
                str(m.tensor.dtype).removeprefix("torch."),
                tuple(m.tensor.shape),
                m.bits.nbytes,
                m.bits,
                host_indices[part],
                host_values[part],
                (changed[part], changed_values[part]),
                copied,
            )
        )
    return compared


def warm_up(kinds: list[tuple[Any, Any]]) -> None:
    """Counts and compares tiny tensors of each (device, integer dtype) of ``kinds`` as a push
    would: CUDA loads a kernel's code at its first launch, and a process's first delta push, whose
    comparison launches kernels its dense pushes did not, took 0.06-0.26 s longer than the next
    ones (H100, benchmarks/RESULTS.md)."""
    import torch

    for device, dtype in kinds:
        old = torch.zeros(8, dtype=dtype, device=device)
        bits = old.clone()
        bits[3] = 1
        count_group([(old, bits)]).tolist()  # one tensor: counted alone
        counts = count_group([(old, bits), (old, bits)]).tolist()  # joined
        members = [Member("warm-up", bits, old, bits, count) for count in counts]
        pinned = device.type == "cuda"
        indices = torch.empty(sum(counts), dtype=torch.int32, pin_memory=pinned)
        compare_group(members, indices, torch.empty(sum(counts), dtype=dtype, pin_memory=pinned))
        if pinned:
            torch.cuda.synchronize(device)


def unchanged_or_dense(name: str, tensor: Any, bits: Any, *, unchanged: bool) -> Compared:
    """The ``Compared`` of a torch tensor (``bits``: its ``device_bits``) that does not go sparse."""
    dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
    return Compared(name, dtype, shape, bits.nbytes, bits, np.empty(0, np.uint32) if unchanged else None, None)


def device_bits(tensor: Any) -> Any:
    """A torch tensor's elements as flat integers of their size, where it lies (compared so, bit for bit)."""
    import torch

    flat = tensor.detach().reshape(-1).contiguous()
    return flat.view(getattr(torch, _TORCH_BITS[flat.element_size()]))
