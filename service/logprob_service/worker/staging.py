"""The device side of weight updates: tensors from received bytes or from files, their digests,
and staging them where the swap will read them from.

``engine.weights`` runs the update's protocol (slots, versions, checks, commit, swap) and
calls this through the ``engine.interfaces.Staging`` protocol, so the engine touches no tensor.

Received bytes go straight to where they are staged: each piece of a tensor is copied (on a
receiving thread, without the GIL) into a page-locked slot, from which the staging stream copies
it into the tensor's staged place on the device while the next pieces arrive. A piece that lies
in host memory page-locked in place (``pinned.page_lock``: a weight receiver's shared slots) is copied
to the device straight from there. No tensor is first assembled in host memory; on the host, the
staged tensor is the buffer the pieces land in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from logprob_service.domain import SharedTensor, SparseChanges
from logprob_service.errors import InvalidArgument
from logprob_service.models.loading import DTYPES
from logprob_service.models.weights import PendingDigest, TensorDigest, dtype_name, pending_digest, settle
from logprob_service.ops import finite
from logprob_service.ops.digest import BLOCK_BYTES, packed_lanes
from logprob_service.worker import ipc, pinned

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """A staged tensor's pending digest, and the probe of whether it holds a NaN or an infinity
    (``ops.finite``; None where not checked), both read back by ``DeviceStager.finish``."""

    digest: PendingDigest
    probe: torch.Tensor | None


class DeviceStager:
    """Puts one update's complete tensors where the swap will read them from: the device while it
    has room, else host memory. The copies and digests are queued on a stream of their own and
    waited for once, by ``finish``, not tensor by tensor: a 7B model has ~340 tensors, and a wait
    per tensor cost more than its bytes."""

    def __init__(self, device: torch.device, reserve_bytes: int, check_finite: bool = True) -> None:
        self.device = device
        self.reserve_bytes = reserve_bytes
        self.check_finite = check_finite  # ``finish`` refuses tensors that hold a NaN or an infinity
        # Staging copies run on their own stream, so they do not wait behind the scoring kernels.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.places: set[str] = set()
        self._lock = threading.Lock()
        self._room: int | None = None  # device bytes this update may still stage (None: not yet asked)
        self._reading: list[torch.Tensor] = []  # GPU sources the queued copies read: alive until finish

    def stage(
        self, tensor: torch.Tensor, *, copy: bool = False, digest: bool = True
    ) -> tuple[torch.Tensor, Pending | None]:
        """The staged copy of ``tensor`` and the digest of its bytes (None without ``digest``: a
        replica's copy of bytes another stager digests), queued (on a worker thread): on a GPU, on
        the staging stream, where the digest reads the staged copy, or the host copy's bytes in
        chunks brought to the GPU, never hashed on the host. ``copy``: ``tensor`` is not the
        update's own (a caller's GPU memory), so it is copied even where it already lies."""
        tensor = tensor.contiguous()
        if self.stream is None:
            self.places.add("cpu")
            return (tensor.clone() if copy else tensor), (self._pending(tensor) if digest else None)
        # What wrote ``tensor`` on this thread's stream of its device comes first: a sparse
        # update's changed copy, or the caller's work an IPC tensor's event stands for.
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device if tensor.is_cuda else self.device))
        return self._queue(tensor, copy, digest)

    def _queue(self, tensor: torch.Tensor, copy: bool, digest: bool) -> tuple[torch.Tensor, Pending | None]:
        """``stage`` on a GPU, once the staging stream waits for what wrote ``tensor``."""
        assert self.stream is not None
        staged: torch.Tensor | None = None
        with torch.cuda.stream(self.stream):
            if self._take_room(tensor.nbytes):
                try:
                    staged, place = tensor.to(self.device, copy=copy), str(self.device)
                except torch.OutOfMemoryError:
                    pass  # the room was taken meanwhile: keep this one in host memory
            if staged is None:
                # To pageable host memory: the copy is done when ``to`` returns.
                staged, place = tensor.to("cpu", copy=copy), "cpu"
            pending = self._pending(staged) if digest else None
        with self._lock:
            self.places.add(place)
            if tensor.is_cuda:
                self._reading.append(tensor)
        return staged, pending

    def receive(self, dtype: str, shape: tuple[int, ...], replicas: Sequence[DeviceStager] = ()) -> Received:
        """Where the bytes of a tensor that arrives in pieces go: see ``Received``; ``replicas``
        stage a copy each (other devices' replicas of the model). No torch call here: the engine
        asks on its event loop."""
        return Received(self, DTYPES[dtype], shape, replicas)

    def copy_of(self, staged: torch.Tensor, source: DeviceStager) -> torch.Tensor:
        """``stage`` of a copy of ``staged`` (another stager's tensor, undigested), after ``source``'s
        staging stream has written it."""
        if self.stream is None:
            return self.stage(staged, copy=True, digest=False)[0]
        if source.stream is not None:
            self.stream.wait_stream(source.stream)
        return self._queue(staged, True, False)[0]

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """The flat uint8 place of a received tensor: on the device while it has room, else in host
        memory; allocated on the staging stream, which writes it."""
        if self.stream is not None and self._take_room(nbytes):
            with torch.cuda.stream(self.stream), contextlib.suppress(torch.OutOfMemoryError):
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _upload(self, target: torch.Tensor, offset: int, *parts: np.ndarray) -> None:
        """``target[offset:]`` (on the device) takes the bytes of ``parts`` (uint8), one after
        another, through the page-locked slots, each slot filled before it goes: small parts
        share one trip."""
        assert self.stream is not None
        slots = pinned.slots(self.device)
        slot, filled = None, 0
        for part in parts:
            start = 0
            while start < part.size:
                if slot is None:
                    slot, filled = slots.take(), 0
                n = min(part.size - start, pinned.STAGING_SLOT_BYTES - filled)
                np.copyto(slot.host[filled : filled + n].numpy(), part[start : start + n])  # without the GIL
                filled, start = filled + n, start + n
                if filled == pinned.STAGING_SLOT_BYTES:
                    self._send(slot, filled, target[offset : offset + filled])
                    offset, slot = offset + filled, None
        if slot is not None:
            self._send(slot, filled, target[offset : offset + filled])

    def _copy_locked(self, target: torch.Tensor, piece: np.ndarray) -> None:
        """``target`` (on the device) takes the bytes of ``piece``, which lies in page-locked host
        memory, straight from there; returns once they are read (its memory may be reused then).
        Blocks without the GIL."""
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            target.copy_(torch.from_numpy(piece), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()

    def _send(self, slot: pinned.Slot, nbytes: int, target: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            target.copy_(slot.host[:nbytes], non_blocking=True)
            slot.done.record(self.stream)
        pinned.slots(self.device).give(slot)

    def _pending(self, staged: torch.Tensor) -> Pending:
        """The digest and the probe (``check_finite``) of a staged tensor, queued: on a GPU server
        on the current stream, the staging stream where they are called."""
        return Pending(pending_digest(staged, self.device), finite.probe(staged) if self.check_finite else None)

    def _staged(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """A received tensor, complete: its digest queued after the copies that wrote it."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            pending = self._pending(tensor)
        with self._lock:
            self.places.add(str(tensor.device))
        return tensor, pending

    def stage_changes(
        self, changes: Sequence[SparseChanges], *, digest: bool = True
    ) -> list[tuple[torch.Tensor, Pending | None]]:
        """``stage`` of a copy of each ``live`` weight with the elements at its flat ``indices``
        (uint32) set to its ``values`` (raw bytes of its ``dtype``): bit for bit the tensors a
        dense update would send (a sparse update). While the device has room the copies are made
        there, together (``_changed_copies``), so only the changes cross from host memory; else
        in host memory, one by one."""
        staged: list[tuple[torch.Tensor, Pending | None] | None] = [None] * len(changes)
        together: dict[torch.dtype, list[int]] = {}  # on the device, by dtype
        for i, c in enumerate(changes):
            live = c.live.detach()
            if self.stream is not None and live.is_cuda and self._take_room(live.nbytes):
                together.setdefault(live.dtype, []).append(i)
            else:
                changed = live.to("cpu", copy=True).contiguous()
                where = torch.from_numpy(c.indices.view(np.int32)).to(torch.int64) & 0xFFFFFFFF
                changed.view(-1)[where] = torch.from_numpy(c.values).view(DTYPES[c.dtype])
                staged[i] = self.stage(changed, digest=digest)
        if together:
            # The live weights were last written by a swap on another stream: that comes first.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for group in together.values():
                    copies, lanes, probes = self._changed_copies([changes[i] for i in group])
                    for k, (i, copy) in enumerate(zip(group, copies, strict=True)):
                        pending = None
                        if digest:
                            lane = PendingDigest(dtype_name(copy.dtype), tuple(copy.shape), lanes[k])
                            pending = Pending(lane, None if probes is None else probes[k])
                        staged[i] = copy, pending
            with self._lock:
                self.places.add(str(self.device))
        return staged  # type: ignore[return-value]  # every one filled

    def _changed_copies(
        self, changes: Sequence[SparseChanges]
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """Copies of the ``live`` weights (one dtype, on this device) with their changes, their
        digests' lanes (``packed_lanes``), and (``check_finite``) a probe of each one's changed
        values (``ops.finite.segment_probes``: the rest is the live weight, which went live
        checked or was loaded at start-up), queued on the staging stream with a few calls for all
        of them: one copy of the weights into one buffer, one upload of every change, one scatter,
        one digest. A tensor at a time took ~0.5 ms of torch calls each: 0.26 s for a 1.5B
        model's 338 tensors, against 0.12-0.14 s so with a digest per tensor (0.08 s of it), and
        0.05 s with the digests packed (H100).

        In the buffer each copy starts at a multiple of ``BLOCK_BYTES``, zeros after it (as
        ``packed_lanes`` reads them). Uploaded as one buffer: the values, then (at a multiple of 8
        bytes) each tensor's start in the copies and its count of changes (int64), then the
        indices (uint32). A change's place in the copies is its tensor's start plus its index."""
        lives = [c.live.detach().reshape(-1) for c in changes]
        numels = [t.numel() for t in lives]
        per_block = BLOCK_BYTES // lives[0].element_size()  # elements (of 1, 2, 4 or 8 bytes) per block
        spans = [-(-n // per_block) * per_block for n in numels]
        zeros = torch.zeros(
            max(s - n for s, n in zip(spans, numels, strict=True)), dtype=lives[0].dtype, device=self.device
        )
        copies = torch.cat(
            [part for live, s, n in zip(lives, spans, numels, strict=True) for part in (live, zeros[: s - n])]
        )
        values = [c.values.reshape(-1).view(np.uint8) for c in changes]
        value_bytes = sum(v.size for v in values)
        at = -(-value_bytes // 8) * 8
        starts = np.cumsum([0, *spans[:-1]], dtype=np.int64)
        counts = np.array([c.indices.size for c in changes], dtype=np.int64)
        indices = [c.indices.reshape(-1).view(np.uint8) for c in changes]
        upload = torch.empty(
            at + starts.nbytes + counts.nbytes + sum(i.size for i in indices), dtype=torch.uint8, device=self.device
        )
        parts = [*values, np.zeros(at - value_bytes, np.uint8), starts.view(np.uint8), counts.view(np.uint8), *indices]
        self._upload(upload, 0, *parts)
        meta = upload[at : at + starts.nbytes + counts.nbytes].view(torch.int64)
        where = upload[at + starts.nbytes + counts.nbytes :].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        where += torch.repeat_interleave(meta[: len(changes)], meta[len(changes) :], output_size=where.numel())
        new_values = upload[:value_bytes].view(copies.dtype)
        copies[where] = new_values
        lanes = packed_lanes(copies.view(torch.uint8), [n * copies.element_size() for n in numels])
        probes = finite.segment_probes(new_values, meta[len(changes) :]) if self.check_finite else None
        views = [
            copies[int(start) : int(start) + n].view(c.live.shape)
            for start, n, c in zip(starts, numels, changes, strict=True)
        ]
        return views, lanes, probes

    def finish(self, pending: Sequence[Pending], names: Sequence[str] = ()) -> list[TensorDigest]:
        """Waits until every tensor staged so far is in place (their sources may go once this
        returns), then reads the digests of ``pending``; on a worker thread. With
        ``check_finite``, INVALID_ARGUMENT naming (by ``names``, in ``pending``'s order) the
        tensors that hold a NaN or an infinity."""
        if self.stream is not None:
            self.stream.synchronize()
            with self._lock:
                self._reading.clear()
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            digests = settle([p.digest for p in pending])
            bad = [names[i] if i < len(names) else f"#{i}" for i in finite.nonfinite([p.probe for p in pending])]
        if bad:
            more = f" (as do {len(bad) - 1} more: {', '.join(map(repr, bad[1:6]))}{', ...' if len(bad) > 6 else ''})"
            raise InvalidArgument(
                f"tensor {bad[0]!r}: holds NaN or infinite values{more if len(bad) > 1 else ''}; nothing applied "
                "(this server refuses non-finite weights: check_finite_weights)"
            )
        return digests

    def _take_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit on the device with ``reserve_bytes`` left free, counted from
        the free memory when the update's first tensor came (asking the driver per tensor costs)."""
        with self._lock:
            if self._room is None:
                free, _ = torch.cuda.mem_get_info(self.device)
                # Memory torch's allocator holds but no tensor uses is free to this process too.
                cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                self._room = free + cached - self.reserve_bytes
            if nbytes > self._room:
                return False
            self._room -= nbytes
            return True


class Received:
    """One tensor arriving in pieces (an UpdateWeights stream): ``write`` each piece's bytes at its
    offset, from any receiving thread, in any order; once every write has returned, ``finish``
    gives the staged tensor and its pending digest. The place is allocated at the first write."""

    def __init__(
        self, stager: DeviceStager, dtype: torch.dtype, shape: tuple[int, ...], replicas: Sequence[DeviceStager]
    ) -> None:
        self.stager, self.dtype, self.shape, self.replicas = stager, dtype, shape, replicas
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._place: torch.Tensor | None = None
        self._lock = threading.Lock()

    def _target(self) -> torch.Tensor:
        with self._lock:
            if self._place is None:
                self._place = self.stager._allocate(self.nbytes)
            return self._place

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Bytes ``[offset, offset + len(data))`` of the tensor (checked by the engine to fit)."""
        target, piece = self._target(), np.frombuffer(data, dtype=np.uint8)
        if target.is_cuda and pinned.page_locked(piece):
            self.stager._copy_locked(target[offset : offset + piece.size], piece)
        elif target.is_cuda:
            self.stager._upload(target, offset, piece)
        else:
            np.copyto(target[offset : offset + piece.size].numpy(), piece)

    def finish(self) -> tuple[list[torch.Tensor], Pending]:
        """The staged tensor and each replica's copy of it, and the pending digest of its bytes."""
        staged, pending = self.stager._staged(self._target().view(self.dtype).view(self.shape))
        return [staged, *(replica.copy_of(staged, self.stager) for replica in self.replicas)], pending


class Staging:
    """The engine's ``Staging``: what it needs of tensors during an update."""

    def __init__(self, reserve_bytes: int, check_finite: bool = True) -> None:
        self.reserve_bytes = reserve_bytes
        self.check_finite = check_finite

    def stager(self, device: torch.device) -> DeviceStager:
        return DeviceStager(device, self.reserve_bytes, self.check_finite)

    @staticmethod
    def check_shared(boot_id: str, device: torch.device, tensors: Sequence[SharedTensor]) -> None:
        ipc.check_shared(boot_id, device, tensors)

    @staticmethod
    def open_shared(tensor: SharedTensor) -> torch.Tensor:
        return ipc.open_shared(tensor)

    @staticmethod
    def read_file(file: Path) -> list[tuple[str, str, tuple[int, ...], torch.Tensor]]:
        """(name, dtype, shape, tensor) of every tensor of the safetensors file ``file``: a regular
        file's path with its symlinks followed, as ``engine.weights.files.safetensors_files``
        checked it. Opened without blocking (a FIFO's open would wait for a writer, in a call that
        holds the interpreter lock), and read only if what was opened is a regular file at that
        very path: a path changed since its check is refused, not followed."""
        from safetensors import SafetensorError, safe_open

        fd = _open_regular(file)
        try:
            # The file through the descriptor checked (safe_open takes a path): what was checked is read.
            with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
                tensors = [(name, f.get_tensor(name)) for name in f.keys()]
        except (SafetensorError, OSError) as err:
            raise InvalidArgument(f"path: {str(file)!r} is not a readable safetensors file: {err}") from None
        finally:
            os.close(fd)
        return [(name, dtype_name(t.dtype), tuple(t.shape), t) for name, t in tensors]


def _open_regular(file: Path) -> int:
    """A descriptor of ``file`` opened for reading, once checked to be the regular file at that path."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        raise InvalidArgument(f"path: {str(file)!r} cannot be opened on the server ({err.strerror})") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as err:
        os.close(fd)
        raise InvalidArgument(f"path: {str(file)!r} cannot be opened on the server ({err.strerror})") from None
    if not regular or opened != str(file):
        os.close(fd)
        raise InvalidArgument(
            f"path: {str(file)!r} changed while it was being opened (it is now {opened!r}"
            f"{'' if regular else ', not a regular file'}); nothing read"
        )
    return fd
