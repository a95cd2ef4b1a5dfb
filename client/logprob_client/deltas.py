"""Delta pushes: ``WeightDeltas`` holds the bytes last pushed of a model and sends only what
changed since, each tensor sparse, dense or not at all.

It compares up to ``LOOKAHEAD`` tensors ahead of the one it sends (copies held on a GPU: all of a
push's tensors together, while its calls start), with ``compare``; its calls are split and framed
as a dense push's are (``streams``, ``logprob_proto.framing``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_proto.framing import MAX_SPARSE_ELEMENTS, Message, dense_pieces, sparse_pieces

from .compare import (
    Compared,
    Member,
    changed_count,
    changes,
    compare_group,
    count_group,
    device_bits,
    device_groups,
    held_pool,
    set_elements,
    unchanged_or_dense,
    warm_up,
)
from .errors import FailedPrecondition, LogprobError
from .streams import (
    DEFAULT_CHUNK_BYTES,
    call_messages,
    check_push,
    push_calls,
    raw_bytes,
    read_ahead,
    tensors_pool,
)


class WeightDeltas:
    """What the server holds of one model (host copies of the raw bytes last pushed, and their
    version), to push only what changed since: ``LogprobClient.update_weights(..., delta=True)``.

    Per tensor, the changed elements (compared bit for bit) go sparse, as uint32 indices and their
    values, when those bytes are at most ``sparse_below`` of the dense ones; else the tensor goes
    dense. Unchanged tensors are not sent. The first push (and one after ``reset``) is dense.

    Holds the model's size: in host memory, or with ``on_device``, each torch tensor's copy on that
    tensor's own device, where it is compared (a trainer's GPU compares a model in milliseconds and
    copies only the changes to the host; in host memory a push reads the model's size twice). That
    costs the trainer's GPU the model's size in memory, and the changes of a push are brought to
    one host buffer, page-locked when held on a GPU. Page-locking it took 0.2-0.35 s for a 1.5B
    model's 2% delta on an H100, so it is made ahead, on a thread of its own after each push (while
    the trainer steps), large enough for ``expect_changed`` of the held elements or 1.25x the last
    push's changes, whichever is more (for a 7B bf16 model at 2%: 0.84 GB of host memory); a push
    whose changes are larger makes a larger one then. A push's tensors must not change until it
    returns: those held on a device are counted, then compared again.
    """

    def __init__(self, sparse_below: float = 0.5, *, on_device: bool = False, expect_changed: float = 0.02) -> None:
        if not 0 <= sparse_below <= 1:
            raise ValueError(f"sparse_below must be in [0, 1], got {sparse_below}")
        if not 0 <= expect_changed <= 1:
            raise ValueError(f"expect_changed must be in [0, 1], got {expect_changed}")
        self.sparse_below = sparse_below
        self.on_device = on_device
        self.expect_changed = expect_changed
        # The host buffer the changes of held torch tensors land in, page-locked when they are
        # held on a GPU (made and used on the held pool's thread), and the bytes of it the last
        # push used.
        self._landing: Any = None
        self._landing_pinned = False
        self._landed = 0
        self._warmed: set[tuple[Any, Any]] = set()  # (device, dtype) of held copies, compared once ahead
        self.version: int | None = None  # the version the server made of the last push
        # name -> raw bytes as pushed: host uint8, or (on_device) a torch tensor of integers
        self._held: dict[str, Any] = {}
        # Of the stream in flight, what ``held`` becomes: a dense tensor's bytes, or a sparse one's
        # (changed indices, their new values), as ``held`` keeps them.
        self._pending: dict[str, Any] = {}
        self.last: dict[str, int] = {}  # of the last push built: tensors sent dense, sparse, unchanged
        # Of the push being built: held torch tensors' comparisons, made together (_compare_held)
        self._compared: dict[str, concurrent.futures.Future[Compared]] = {}
        self._applying: concurrent.futures.Future[None] | None = None  # the last push's changes, going in
        self._lock = threading.Lock()  # a push's streams are read on threads of their own

    @property
    def held(self) -> dict[str, Any]:
        """What the server holds: each tensor's raw bytes as last pushed (uint8 arrays; with
        ``on_device``, a torch tensor's as a flat integer tensor on its device)."""
        self._applied()
        return self._held

    def reset(self) -> None:
        """Forget what the server holds: the next push is dense and full."""
        self._applied()
        self.version, self._held = None, {}

    def update_streams(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int,
        partial: bool,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        streams: int = 1,
        pack: bool = True,
    ) -> list[Iterator[Message]]:
        """The calls of the next push, as ``update_streams`` makes them (each read lazily, its
        tensors compared up to ``LOOKAHEAD`` ahead of the one it sends)."""
        check_push(version, chunk_bytes, streams)
        self._applied()
        self._pending, self.last = {}, {"dense": 0, "sparse": 0, "unchanged": 0}
        header = pb.UpdateWeightsHeader(model=model, version=version, partial=partial)
        if self.version is not None:
            header.partial, header.base_version = True, self.version
        groups, header = push_calls(weights, streams, header)
        self._compared = self._compare_held(groups) if self.on_device else {}
        return [
            call_messages(
                header,
                filter(None, (self._pieces(c, chunk_bytes) for c in read_ahead(group, self._compare))),
                chunk_bytes,
                pack,
            )
            for group in groups
        ]

    def _compare_held(self, groups: list[Iterable[tuple[str, Any]]]) -> dict[str, concurrent.futures.Future[Compared]]:
        """The comparisons of the torch tensors the push holds a copy of (when its tensors are
        listed: over more than one call), queued on their devices together, on one thread of
        their own (``_compare_all``) while the calls start; each call's first tensors first."""
        listed = [group for group in groups if isinstance(group, list)]
        held: dict[str, tuple[Any, tuple[Any, Any]]] = {}  # name -> (tensor, (held copy, its bits now))
        for row in itertools.zip_longest(*listed):
            for name, tensor in filter(None, row):
                if name not in held and (pair := self._held_bits(name, tensor)) is not None:
                    held[name] = tensor, pair
        futures: dict[str, concurrent.futures.Future[Compared]] = {name: concurrent.futures.Future() for name in held}
        if held:  # its own dict: the calls take theirs out of the one returned
            held_pool().submit(self._compare_all, held, dict(futures))
        return futures

    def _compare_all(
        self, held: dict[str, tuple[Any, tuple[Any, Any]]], futures: dict[str, concurrent.futures.Future[Compared]]
    ) -> None:
        """``_compare_held``'s work: first the count of each tensor's changed elements, read with
        one wait per device, then (at those counts: no wait) the changes of those that go sparse,
        in groups (``compare_group``), copied into one page-locked host buffer without waiting.
        The sending waits for each group's copy (``Compared.copied``)."""
        import torch

        try:
            counts = self._count_changes({name: pair for name, (_, pair) in held.items()})
            members = []
            for name, (tensor, (old, bits)) in held.items():
                count = counts[name]
                if count and not self._dense_pays(count, bits.element_size(), bits.nbytes):
                    members.append(Member(name, tensor, old, bits, count))
                else:
                    futures[name].set_result(unchanged_or_dense(name, tensor, bits, unchanged=not count))
            groups = device_groups(members, lambda m: m.bits)
            # Each group's place in the buffer: its indices (int32), then its values, each at a
            # multiple of 8 bytes (a view of a dtype starts at a multiple of its size).
            places, end = [], 0
            for group in groups:
                count, itemsize = sum(m.count for m in group), group[0].bits.element_size()
                values_at = end + -(-4 * count // 8) * 8
                places.append((end, values_at, count))
                end = values_at + -(-count * itemsize // 8) * 8
            if not groups:
                return
            buffer = self._land(end, any(m.bits.is_cuda for m in members))
            for group, (indices_at, values_at, count) in zip(groups, places, strict=True):
                dtype = group[0].bits.dtype
                indices = buffer[indices_at : indices_at + 4 * count].view(torch.int32)
                values = buffer[values_at : values_at + count * group[0].bits.element_size()].view(dtype)
                for compared in compare_group(group, indices, values):
                    futures[compared.name].set_result(compared)
        except BaseException as error:  # the calls waiting for these raise it
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)

    @staticmethod
    def _count_changes(held: dict[str, tuple[Any, Any]]) -> dict[str, int]:
        """How many elements of each tensor's held copy and bits (``_held_bits``) differ, counted
        on their devices in groups (``count_group``), read with one wait per device."""
        import torch

        by_device: dict[Any, tuple[list[str], list[Any]]] = {}
        for group in device_groups(list(held.items()), lambda item: item[1][1]):
            names, counts = by_device.setdefault(group[0][1][1].device, ([], []))
            names.extend(name for name, _ in group)
            counts.append(count_group([pair for _, pair in group]))
        return {
            name: count
            for names, counts in by_device.values()
            for name, count in zip(names, torch.cat(counts).tolist(), strict=True)
        }

    def _land(self, nbytes: int, pinned: bool) -> Any:
        """``nbytes`` of the buffer a push's changes land in (on the held pool's thread): the one
        made ahead, if it is large enough."""
        self._landed = nbytes
        self._make_landing(nbytes, pinned)
        return self._landing[:nbytes]

    def _make_landing(self, nbytes: int, pinned: bool) -> None:
        """A landing buffer of at least ``nbytes``, page-locked if ``pinned`` (on the held pool's thread)."""
        import torch

        if self._landing is None or self._landing.numel() < nbytes or self._landing_pinned != pinned:
            self._landing = None  # the old one goes back first
            self._landing = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._landing_pinned = pinned

    def _land_ahead(self) -> None:
        """After a push, if some held copies are torch tensors, on the held pool's thread: the
        comparison's kernels run once on each device and element size not seen before
        (``warm_up``), and the next push's landing buffer made (see the class's docstring)."""
        held = [t for t in self._held.values() if not isinstance(t, np.ndarray)]
        if not held:
            return
        if kinds := {(t.device, t.dtype) for t in held} - self._warmed:
            self._warmed |= kinds
            held_pool().submit(warm_up, sorted(kinds, key=str))
        expected = sum(
            math.ceil(self.expect_changed * t.numel()) * (4 + t.element_size()) + 16  # 16: each part's alignment
            for t in held
            if self._sparse_may_pay(t.nbytes, tuple(t.shape))
        )
        nbytes, pinned = max(expected, math.ceil(1.25 * self._landed)), any(t.is_cuda for t in held)
        if nbytes:
            held_pool().submit(self._make_landing, nbytes, pinned)

    def _compare(self, named: tuple[str, Any]) -> Compared:
        """A tensor's bytes, and what changed in them since the held copy (on a worker thread)."""
        name, tensor = named
        compared = self._compared.pop(name, None)
        if compared is not None:
            return compared.result()
        if self.on_device and type(tensor).__module__.startswith("torch"):
            return self._compare_on_device(name, tensor)
        dtype, shape, data = raw_bytes(tensor)
        new = np.frombuffer(data, dtype=np.uint8)
        old = self._held.get(name) if self.version is not None else None
        itemsize = new.nbytes // max(1, math.prod(shape))
        element = f"<u{itemsize}"  # compared bit for bit, one element at a time
        if not isinstance(old, np.ndarray) or old.nbytes != new.nbytes or not self._sparse_may_pay(new.nbytes, shape):
            return Compared(name, dtype, shape, new.nbytes, new, None, None)
        indices, values = changes(old.view(element), new.view(element))
        if self._dense_pays(indices.size, itemsize, new.nbytes):
            return Compared(name, dtype, shape, new.nbytes, new, None, None)
        return Compared(name, dtype, shape, new.nbytes, new, indices, values)

    def _held_bits(self, name: str, tensor: Any) -> tuple[Any, Any] | None:
        """A torch tensor's held copy and its bits as they are now (flat integers of its element
        size), if it has a held copy of its dtype, size and device and sparse may pay; else None."""
        import torch

        old = self._held.get(name) if self.version is not None else None
        if not isinstance(old, torch.Tensor):
            return None
        bits = device_bits(tensor)
        if (old.dtype, old.shape, old.device) != (bits.dtype, bits.shape, bits.device):
            return None
        return (old, bits) if self._sparse_may_pay(bits.nbytes, tuple(tensor.shape)) else None

    def _compare_on_device(self, name: str, tensor: Any) -> Compared:
        """``_compare`` of a torch tensor not compared with the others (a lazy iterable's): counted
        alone (a wait), and its changes, if it goes sparse, copied to host memory of its own."""
        import torch

        held = self._held_bits(name, tensor)
        if held is None:
            return unchanged_or_dense(name, tensor, device_bits(tensor), unchanged=False)
        old, bits = held
        count = int(changed_count(old, bits))
        if not count or self._dense_pays(count, bits.element_size(), bits.nbytes):
            return unchanged_or_dense(name, tensor, bits, unchanged=not count)
        indices, values = torch.empty(count, dtype=torch.int32), torch.empty(count, dtype=bits.dtype)
        return compare_group([Member(name, tensor, old, bits, count)], indices, values)[0]

    @staticmethod
    def _sparse_may_pay(nbytes: int, shape: tuple[int, ...]) -> bool:
        return nbytes > 0 and math.prod(shape) <= MAX_SPARSE_ELEMENTS

    def _dense_pays(self, changed: int, itemsize: int, nbytes: int) -> bool:
        return (4 + itemsize) * changed > self.sparse_below * nbytes  # uint32 indices and the values

    def _pieces(self, c: Compared, chunk_bytes: int) -> Iterator[Message] | None:
        """The pieces a tensor goes in: sparse, dense, or None when the server holds it already."""
        if c.changed is not None and not c.changed.size:
            self._count("unchanged")
            return None
        if c.changed is None:
            self._count("dense")
            # A copy: the caller may change its tensor after the push.
            self._pending[c.name] = new = c.new.copy() if isinstance(c.new, np.ndarray) else c.new.clone()
            data = new if isinstance(new, np.ndarray) else raw_bytes(new)[2]  # from the device
            return dense_pieces(c.name, c.dtype, c.shape, memoryview(data).cast("B"), chunk_bytes)
        self._count("sparse")
        if c.copied is not None:
            c.copied.synchronize()
        # What the server will hold there: values are a copy (on the device too).
        self._pending[c.name] = c.on_device or (c.changed, c.values)
        return sparse_pieces(c.name, c.dtype, c.shape, c.changed, c.values.view(np.uint8), chunk_bytes)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.last[kind] += 1

    def pushed(self, version: int) -> None:
        """The push went live as ``version``: the server now holds what it sent. The held copies
        of sparse tensors take their changes on a worker thread, after the push has returned;
        the next push (or ``reset``) waits for that first."""
        sparse = {name: sent for name, sent in self._pending.items() if isinstance(sent, tuple)}
        self._held.update((name, sent) for name, sent in self._pending.items() if not isinstance(sent, tuple))
        self.version, self._pending = version, {}
        self._applying = tensors_pool().submit(self._apply, sparse)
        self._land_ahead()

    def _apply(self, sparse: dict[str, tuple[Any, Any]]) -> None:
        for name, (changed, values) in sparse.items():
            held = self._held[name]
            if isinstance(held, np.ndarray):
                set_elements(held.view(values.dtype), changed, values)
            else:
                held[changed] = values

    def _applied(self) -> None:
        """Waits until the last push's changes are in the held copies."""
        if self._applying is not None:
            self._applying.result()
            self._applying = None

    def stale(self, error: LogprobError) -> bool:
        """Whether ``error`` refused a push because the server no longer holds the base version (a
        restart, another pusher): then ``reset``, and push again dense."""
        return isinstance(error, FailedPrecondition) and error.message.startswith("header.base_version")
