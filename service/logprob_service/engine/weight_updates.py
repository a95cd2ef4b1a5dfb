"""Weight updates (UpdateWeights, LoadWeights): assemble, check, stage, then swap at once.

One update of one model:
  header   the model's update slot is taken (one update per model at a time; another is ABORTED),
           the new version checked (above the live one; 0 means live + 1)
  tensors  each tensor's name, dtype and shape are checked against the live weight at its first
           piece (INVALID_ARGUMENT naming it); each piece, checked to come in order and fit, is
           written on a receiving thread straight to where the tensor is staged (on the device
           while ``staging_reserve_bytes`` stay free there, else in host memory), overlapping the
           reception of the next pieces; once complete the tensor is digested (queued), and
           probed for NaN and infinities (``check_finite_weights``)
  commit   the tensor count is checked, and for a full update that every weight came; the
           digests are read back (a tensor holding a NaN or an infinity is INVALID_ARGUMENT);
           then the scheduler swaps the staged tensors in between two micro-batches, and the
           version and fingerprint go live with them
Anything that fails before the swap (a bad tensor, a stream that ends or breaks before its
commit, a cancelled call) drops the staged tensors: the live weights and version are untouched.
LoadWeights reads only regular files, each checked after its symlinks are followed
(``safetensors_files``).

An update may come over several streams at once (``UpdateHeader.streams``): they join one
``_Session`` by its ``update_id``, each carries its own tensors and commit, and the update goes
live when the last commits; every stream is answered with the same outcome, and a failure of any
fails them all.

Nothing here sees protobuf (``api.wire`` turns the stream's messages into the objects below) or
a tensor (``Staging``, ``worker.staging``, makes and stages them).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from logprob_service.config import DEFAULT_MAX_GROUP_TIMEOUT_S, DEFAULT_UPDATE_IDLE_TIMEOUT_S
from logprob_service.domain import DTYPE_BYTES, SharedTensor, SparseChanges
from logprob_service.engine.interfaces import JoinGroup, Received, ServedModel, Staging, UpdatableWeights, WeightGroup
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.validation import validate_version
from logprob_service.errors import Aborted, FailedPrecondition, InvalidArgument, LogprobError, Overloaded
from logprob_service.stats import NO_STATS, StatsSink, WeightsUpdated

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class UpdateHeader:
    model: str
    version: int  # 0: the live version + 1
    partial: bool  # only some weights come; the others keep their live values
    base_version: int | None = None  # the version sparse tensors change (must be the live one)
    streams: int = 1  # the update comes over this many streams together, named by update_id
    update_id: str = ""

    def __post_init__(self) -> None:
        validate_version("version", self.version)
        if self.base_version is not None:
            validate_version("base_version", self.base_version)


@dataclass(frozen=True)
class TensorPiece:
    """Bytes ``[offset, offset + len(data))`` of one tensor's raw little-endian, C-order bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    data: bytes | memoryview  # a view of the received message, where the wire allows

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class SparsePiece:
    """Some of the ``changed`` elements in which one tensor differs from the base version: their flat
    indices (little-endian uint32, ascending) and new values; ``offset`` of them came before."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    changed: int
    indices: bytes | memoryview
    values: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.indices) + len(self.values)


@dataclass(frozen=True)
class Commit:
    tensor_count: int


UpdateMessage = UpdateHeader | TensorPiece | SparsePiece | Commit


@dataclass(frozen=True)
class GroupSpec:
    """A trainer's weight-update group to join (InitWeightsUpdateGroup)."""

    master_address: str
    master_port: int
    rank: int
    world_size: int
    name: str
    backend: str  # "nccl", "gloo", or "" (by device)
    timeout_s: float  # 0: DEFAULT_GROUP_TIMEOUT_S (at most the server's max_group_timeout_s)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a group's rank 0 will broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class Ready:
    """An update from a group is checked: rank 0 may broadcast."""


@dataclass(frozen=True)
class UpdateOutcome:
    model: str
    version: int
    fingerprint: str
    tensors: int
    bytes: int
    staged_on: str  # "cuda:0", "cpu", or "cuda:0+cpu" when device memory ran short midway
    total_ns: int
    swap_ns: int


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """The raw bytes of a whole tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * DTYPE_BYTES[dtype]


class _Assembly:
    """One tensor's bytes, arriving in order: checked here, written where they are staged (``into``)
    on the receiving threads."""

    def __init__(self, first: TensorPiece, into: Received) -> None:
        self.name, self.dtype_name, self.shape = first.name, first.dtype, first.shape
        self.nbytes = tensor_nbytes(first.dtype, self.shape)
        self.into = into
        self.writes: list[concurrent.futures.Future[None]] = []
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.nbytes

    @property
    def progress(self) -> str:
        return f"{self.received} of its {self.nbytes} bytes"

    def write(self, piece: TensorPiece, writers: concurrent.futures.Executor) -> concurrent.futures.Future[None]:
        """Check ``piece`` and submit its write; returns the write."""
        if piece.dtype != self.dtype_name or piece.shape != self.shape:
            raise InvalidArgument(
                f"tensor {self.name!r}: a piece says dtype {piece.dtype} shape {list(piece.shape)}, "
                f"its first piece said {self.dtype_name} {list(self.shape)}"
            )
        if piece.offset != self.received:
            raise InvalidArgument(
                f"tensor {self.name!r}: piece at byte offset {piece.offset}, expected {self.received} "
                "(pieces of a tensor must come in order)"
            )
        end = self.received + len(piece.data)
        if end > self.nbytes:
            raise InvalidArgument(
                f"tensor {self.name!r}: piece ends at byte {end}, past the tensor's {self.nbytes} bytes"
            )
        self.writes.append(writers.submit(self.into.write, piece.offset, piece.data))
        self.received = end
        return self.writes[-1]

    def finish(self) -> tuple[list[Any], Any]:
        """Once its writes are done (raising the first that failed): ``Received.finish``."""
        for write in self.writes:
            write.result()
        return self.into.finish()


class _SparseAssembly:
    """One sparse tensor's changed elements, arriving in order: flat indices and their values' bytes."""

    def __init__(self, first: SparsePiece, live: Any, replica_lives: Sequence[Any] = ()) -> None:
        self.name, self.dtype_name, self.shape, self.changed = first.name, first.dtype, first.shape, first.changed
        self.live = live  # the weight the changes apply to (opaque here: the stager's tensor)
        self.replica_lives = replica_lives  # the same weight on the other devices, lane by lane
        self.itemsize = DTYPE_BYTES[first.dtype]
        self.numel = math.prod(self.shape)
        if self.numel > MAX_SPARSE_ELEMENTS:
            raise InvalidArgument(
                f"tensor {self.name!r}: {self.numel} elements are more than uint32 indices reach; send it dense"
            )
        if self.changed > self.numel:  # checked before the arrays below are allocated for them
            raise InvalidArgument(
                f"tensor {self.name!r}: changed {self.changed} is more than its {self.numel} elements (the limit)"
            )
        self.indices = np.empty(self.changed, dtype=np.uint32)
        self.values = np.empty(self.changed * self.itemsize, dtype=np.uint8)
        self.received = 0
        self.last = -1  # the last index received
        self.writes: list[concurrent.futures.Future[None]] = []

    @property
    def complete(self) -> bool:
        return self.received == self.changed

    @property
    def nbytes(self) -> int:
        return self.indices.nbytes + self.values.nbytes

    @property
    def progress(self) -> str:
        return f"{self.received} of its {self.changed} changed elements"

    def write(self, piece: SparsePiece, writers: concurrent.futures.Executor) -> concurrent.futures.Future[None]:
        """Check ``piece``'s fields and the ends of its indices, and submit the rest: the check
        that its indices ascend, and their and the values' copy, on a writer thread (on the event
        loop, a 1.5B model's 2% delta spent ~70 ms so). Returns that write."""
        where = f"tensor {self.name!r}"
        if (piece.dtype, piece.shape, piece.changed) != (self.dtype_name, self.shape, self.changed):
            raise InvalidArgument(
                f"{where}: a piece says dtype {piece.dtype} shape {list(piece.shape)} changed {piece.changed}, its "
                f"first piece said {self.dtype_name} {list(self.shape)} changed {self.changed}"
            )
        if piece.offset != self.received:
            raise InvalidArgument(
                f"{where}: piece at changed element {piece.offset}, expected {self.received} "
                "(pieces of a tensor must come in order)"
            )
        if len(piece.indices) % 4:
            raise InvalidArgument(f"{where}: {len(piece.indices)} bytes of indices are not whole uint32s")
        n = len(piece.indices) // 4
        if len(piece.values) != n * self.itemsize:
            raise InvalidArgument(
                f"{where}: {n} indices but {len(piece.values)} bytes of values ({n * self.itemsize} expected)"
            )
        start, end, previous = self.received, self.received + n, self.last
        if end > self.changed:
            raise InvalidArgument(f"{where}: piece ends at changed element {end}, past the {self.changed} announced")
        if n:
            # Above the index before and the last in range: with strictly ascending indices
            # (checked by the write), then all are.
            first, last = int.from_bytes(piece.indices[:4], "little"), int.from_bytes(piece.indices[-4:], "little")
            if not (first > previous and last < self.numel):
                raise self._out_of_order(np.frombuffer(piece.indices, dtype="<u4"), start, previous)
            self.last = last
        self.received = end
        self.writes.append(writers.submit(self._write, piece, start, previous))
        return self.writes[-1]

    def _write(self, piece: SparsePiece, start: int, previous: int) -> None:
        indices = np.frombuffer(piece.indices, dtype="<u4")
        if not (indices[1:] > indices[:-1]).all():
            raise self._out_of_order(indices, start, previous)
        self.indices[start : start + indices.size] = indices
        self.values[start * self.itemsize : (start + indices.size) * self.itemsize] = np.frombuffer(
            piece.values, np.uint8
        )

    def _out_of_order(self, indices: np.ndarray, start: int, previous: int) -> InvalidArgument:
        """The error of a piece whose indices (the first at changed element ``start``, after
        index ``previous``) do not all ascend strictly within the tensor: found again, for the
        message."""
        wide = indices.astype(np.int64)
        j = int(np.flatnonzero((np.diff(wide, prepend=previous) <= 0) | (wide >= self.numel))[0])
        return InvalidArgument(
            f"tensor {self.name!r}: changed element {start + j} has index {indices[j]}, out of [0, {self.numel}) or "
            "not above the index before it (indices ascend strictly across a tensor's pieces)"
        )

    def finish(self) -> SparseChanges:
        """Once its writes are done (raising the first that failed): its changes to ``live``."""
        for write in self.writes:
            write.result()
        return SparseChanges(self.live, self.indices, self.values, self.dtype_name)


# Sparse pieces name elements with uint32 indices.
MAX_SPARSE_ELEMENTS = 2**32
# Complete sparse tensors are staged together once this many wait, or this many changed elements
# (the rest at commit): staged alone, a tensor cost ~0.5 ms of torch calls; a 1.5B model's 338
# tensors took 0.26 s so and 0.12 s in batches of this size (H100), which still overlap the rest
# of the push's arrival.
SPARSE_BATCH_TENSORS = 64
SPARSE_BATCH_CHANGES = 1 << 23
# Pieces of an update received but not yet written where they are staged, at most: each holds its
# message's memory meanwhile (4 MiB from this project's client).
WRITES_IN_FLIGHT = 8


class _Stream:
    """What one stream of an update has brought: the tensor it is in the middle of, and how many it
    completed (its commit counts them)."""

    def __init__(self) -> None:
        self.assembly: _Assembly | _SparseAssembly | None = None
        self.tensors: list[str] = []


class _Update:
    """One update in progress: its checked, staged tensors and their digests."""

    def __init__(
        self,
        replicas: Sequence[ServedModel],
        header: UpdateHeader,
        staging: Staging,
        pool: concurrent.futures.ThreadPoolExecutor,
        writers: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.replicas = replicas  # the model on each device (lane order); the first is checked against
        self.served = replicas[0]
        self.header = header
        self.targets: list[UpdatableWeights] = [r.updatable() for r in replicas]
        self.target = self.targets[0]
        self.staging = staging
        self.stagers = [staging.stager(r.device) for r in replicas]
        self.pool = pool
        self.writers = writers
        # name -> (its staged copy on each replica's device, the pending digest of its bytes)
        self.staged: dict[str, concurrent.futures.Future[tuple[list[Any], Any]]] = {}
        self.writes: collections.deque[concurrent.futures.Future[None]] = collections.deque()  # not yet waited for
        self.sparse_waiting: list[_SparseAssembly] = []  # complete, not yet staged (``stage_sparse``)
        self.jobs: list[concurrent.futures.Future[Any]] = []  # everything given to the pool (``abandon``)
        self.bytes = 0

    def add_piece(self, piece: TensorPiece | SparsePiece, stream: _Stream) -> None:
        a = stream.assembly
        sparse = isinstance(piece, SparsePiece)
        if a is not None and (piece.name != a.name or sparse != isinstance(a, _SparseAssembly)):
            kind = "a sparse piece" if sparse else "a dense piece"
            raise InvalidArgument(f"tensor {a.name!r}: only {a.progress} came before {kind} of tensor {piece.name!r}")
        if a is None:
            live = self.check_new(piece.name, piece.dtype, piece.shape)
            if isinstance(piece, SparsePiece):
                self._check_base(piece.name)
                others = [t.check(piece.name, piece.dtype, piece.shape) for t in self.targets[1:]]
                a = stream.assembly = _SparseAssembly(piece, live, others)
            else:
                into = self.stagers[0].receive(piece.dtype, piece.shape, self.stagers[1:])
                a = stream.assembly = _Assembly(piece, into)
            self.staged[a.name] = concurrent.futures.Future()  # named: a second tensor of that name is refused
        self.writes.append(a.write(piece, self.writers))  # type: ignore[arg-type]  # the kinds match: checked above
        if a.complete:
            stream.assembly = None
            stream.tensors.append(a.name)
            if isinstance(a, _SparseAssembly):
                # Staged together with others (``SPARSE_BATCH_*``) on the pool.
                self.sparse_waiting.append(a)
                if (
                    len(self.sparse_waiting) >= SPARSE_BATCH_TENSORS
                    or sum(w.changed for w in self.sparse_waiting) >= SPARSE_BATCH_CHANGES
                ):
                    self.stage_sparse()
            else:
                self._submit(a.name, a.nbytes, a.finish)

    async def room(self) -> None:
        """Waits while more than ``WRITES_IN_FLIGHT`` pieces are still being written (raising a
        write's error): the stream is read no faster than its bytes reach their place. Writes
        already done are taken without an await, which would cost a trip through the event loop
        for every message."""
        while True:
            while self.writes and self.writes[0].done():
                self.writes.popleft().result()
            if len(self.writes) <= WRITES_IN_FLIGHT:
                return
            # Taken once done (above, here or by another stream of the update): a write this call's
            # cancellation interrupts stays for ``abandon``.
            await asyncio.wrap_future(self.writes[0])

    def _check_base(self, name: str) -> None:
        base, live = self.header.base_version, self.served.info.version
        if base is None:
            raise InvalidArgument(f"tensor {name!r}: comes sparse, but the header names no base_version it changes")
        if base != live:
            raise FailedPrecondition(
                f"header.base_version: tensor {name!r} changes version {base}, but model "
                f"{self.served.info.name!r} serves version {live}; push it dense (a full update)"
            )

    def add_tensor(self, name: str, dtype: str, shape: tuple[int, ...], tensor: Any) -> None:
        """A whole tensor at once (read from a file)."""
        self.check_new(name, dtype, shape)
        self.stage(name, tensor_nbytes(dtype, shape), lambda: tensor)

    def check_all(self, tensors: list[TensorSpec] | list[SharedTensor]) -> None:
        """``check_new`` of each tensor an update names up front (its tensors come afterwards)."""
        seen: set[str] = set()
        for t in tensors:
            if t.name in seen:
                raise InvalidArgument(f"tensor {t.name!r}: named twice in one update")
            seen.add(t.name)
            self.check_new(t.name, t.dtype, t.shape)

    def check_new(self, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
        """The live weight ``name`` stands for, once checked to be new to this update and to fit."""
        if name in self.staged:
            raise InvalidArgument(f"tensor {name!r}: sent twice in one update")
        if dtype not in DTYPE_BYTES:
            raise InvalidArgument(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"tensor {name!r}: negative dimension in shape {list(shape)}")
        return self.target.check(name, dtype, shape)

    def stage(self, name: str, nbytes: int, make: Callable[[], Any], *, copy: bool = False) -> None:
        """Stage the tensor ``make`` returns: made, hashed and copied on the pool, off the loop.
        ``nbytes``: what the update received for it; ``copy``: the tensor is not the update's own
        (a caller's memory), so it is copied even where it already lies on the device."""
        self._submit(name, nbytes, lambda: self._stage(make(), copy))

    def _stage(self, tensor: Any, copy: bool) -> tuple[list[Any], Any]:
        first, digest = self.stagers[0].stage(tensor, copy=copy)
        # The other replicas' copies come from the tensor itself (a caller's memory or the host).
        return [first, *(stager.stage(tensor, copy=True, digest=False)[0] for stager in self.stagers[1:])], digest

    def stage_sparse(self) -> None:
        """Stages the sparse tensors complete so far, together, on the pool: the changed copy of
        each replica's live weight (on its device while it has room); the first replica's are
        digested."""
        batch, self.sparse_waiting = self.sparse_waiting, []
        if not batch:
            return
        self.bytes += sum(a.nbytes for a in batch)
        job = self.pool.submit(self._stage_changes, batch)
        self.jobs.append(job)
        for i, a in enumerate(batch):
            job.add_done_callback(functools.partial(_settle_one, self.staged[a.name], i))

    def _stage_changes(self, batch: list[_SparseAssembly]) -> list[tuple[list[Any], Any]]:
        changes = [a.finish() for a in batch]
        first = self.stagers[0].stage_changes(changes)
        others = [
            stager.stage_changes(
                [replace(c, live=a.replica_lives[k]) for c, a in zip(changes, batch, strict=True)],
                digest=False,
            )
            for k, stager in enumerate(self.stagers[1:])
        ]
        return [([copy, *(o[i][0] for o in others)], digest) for i, (copy, digest) in enumerate(first)]

    def _submit(self, name: str, nbytes: int, job: Callable[[], tuple[list[Any], Any]]) -> None:
        self.bytes += nbytes
        submitted = self.pool.submit(job)
        self.jobs.append(submitted)
        if name in self.staged:  # a received tensor, named when its first piece came
            submitted.add_done_callback(functools.partial(_settle, self.staged[name]))
        else:
            self.staged[name] = submitted

    async def staged_tensors(self) -> dict[str, tuple[list[Any], Any]]:
        """Every staged (copy per replica, digest), once all are in place. If one failed, the
        others not yet started are cancelled, and those running and the copies they queued are
        waited for, before the error is raised: no staging work, which may read a caller's
        memory, outlives the call."""
        self.stage_sparse()
        try:
            staged = {name: await asyncio.wrap_future(future) for name, future in self.staged.items()}
        except BaseException:
            await self.abandon()
            raise
        for stager in self.stagers[1:]:
            await asyncio.to_thread(stager.finish, [])
        digests = await asyncio.to_thread(
            self.stagers[0].finish, [digest for _, digest in staged.values()], list(staged)
        )
        return {name: (copies, digest) for (name, (copies, _)), digest in zip(staged.items(), digests, strict=True)}

    async def abandon(self) -> None:
        """Cancels the staging not yet started and waits for what runs (its writes, its copies):
        nothing staged for a failed update, which may read a caller's memory, outlives it. Only
        work given to the pools is waited for, each run or cancelled: a tensor's own future in
        ``staged`` settles from its job, or never, where the tensor never came whole."""
        for job in self.jobs:
            job.cancel()
        await _ended([*self.writes, *self.jobs])
        for stager in self.stagers:
            await asyncio.to_thread(stager.finish, [])

    @staticmethod
    def check_commit(stream: _Stream, commit: Commit) -> None:
        """That a stream's commit comes after whole tensors, as many as it counts."""
        if stream.assembly is not None:
            a = stream.assembly
            raise Aborted(f"tensor {a.name!r}: the commit came after only {a.progress}; nothing applied")
        if commit.tensor_count != len(stream.tensors):
            raise InvalidArgument(
                f"commit.tensor_count: {commit.tensor_count}, but {len(stream.tensors)} tensors came; nothing applied"
            )

    def check_complete(self) -> None:
        """That a full update brought every weight."""
        if not self.header.partial:
            missing = self.target.missing(self.staged)
            if missing:
                shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
                raise InvalidArgument(
                    f"tensor {missing[0]!r}: a full update (partial=false) lacks {len(missing)} of the "
                    f"model's weights: {shown}; nothing applied"
                )

    def ended_early(self, stream: _Stream) -> Aborted:
        where = (
            f"in tensor {stream.assembly.name!r} ({stream.assembly.progress})"
            if stream.assembly is not None
            else f"after tensor {stream.tensors[-1]!r} ({len(stream.tensors)} tensors)"
            if stream.tensors
            else "before any tensor"
        )
        return Aborted(
            f"the update stream of model {self.served.info.name!r} ended {where}, before its commit; nothing applied"
        )


async def _ended(futures: Sequence[concurrent.futures.Future[Any]]) -> None:
    """Returns once every one of ``futures`` is done: run, failed or cancelled. Not
    ``concurrent.futures.wait``: it counts a cancelled future as done only once an executor has
    taken it up, so it waits forever for one that no executor holds (a tensor's future in
    ``_Update.staged``, or a job a pool's shutdown dropped); waiting so for a cancelled push once
    held the model's update slot, and the process's exit, for good."""
    if futures:
        await asyncio.wait([asyncio.wrap_future(f) for f in futures])


def _settle_one(target: concurrent.futures.Future[Any], i: int, source: concurrent.futures.Future[Any]) -> None:
    """``target`` takes item ``i`` of ``source``'s result, or its error."""
    if source.cancelled() or source.exception() is not None:
        _settle(target, source)
    elif not target.cancelled() and target.set_running_or_notify_cancel():
        target.set_result(source.result()[i])


def _settle(target: concurrent.futures.Future[Any], source: concurrent.futures.Future[Any]) -> None:
    """``target`` takes ``source``'s result or error (unless it was cancelled meanwhile)."""
    if target.cancelled() or not target.set_running_or_notify_cancel():
        return
    if source.cancelled():
        target.set_exception(concurrent.futures.CancelledError())
    elif (error := source.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())


# How long the streams of one update have to arrive, counted from the first.
STREAMS_JOIN_S = 30.0
# InitWeightsUpdateGroup's timeout_s when the request gives none (the server's max_group_timeout_s
# if lower).
DEFAULT_GROUP_TIMEOUT_S = 120.0
# Joins of trainers' groups in progress at once, at most; more are refused (RESOURCE_EXHAUSTED).
# Each holds a thread until it ends, which a join blocked connecting to a TCP store that does not
# answer does only at its timeout: nothing can interrupt it.
MAX_PENDING_JOINS = 4
# Updates over several streams remembered once ended, so that a stream coming late gets its answer.
ENDED_SESSIONS_KEPT = 64
# An update stream yielding to micro-batch launches (``yield_to_launches``) reads its next message
# after at most this long, so that it goes on, slowly, even when launches follow each other.
LAUNCH_YIELD_MAX_S = 0.1


class StreamIdle(Aborted):
    """No message of an update stream came within the server's ``update_idle_timeout_s``: the
    update is aborted and the model's update slot freed. The client holds the stream open without
    sending, so the stream is answered at once, not read to its end first."""


async def _on_daemon_thread(
    fn: Callable[[], T], *, ended: Callable[[], None] = lambda: None, orphaned: Callable[[T], None] = lambda _: None
) -> T:
    """``fn()``, run on a daemon thread of its own: a call blocked where nothing can interrupt it
    (a join's connect to a trainer's TCP store, up to its timeout) then holds neither a thread of
    the event loop's default executor, which the server's other work needs, nor the process's exit,
    which waits for that executor's threads. Cancelled, this returns at once; ``fn`` runs on, and
    ``orphaned`` takes what it returns, which no caller will. ``ended``: called once ``fn`` has
    returned or raised. Both are called on the event loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        ended()
        if done.cancelled():
            if error is None:
                orphaned(result)
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as err:
            error = err
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="logprob-group", daemon=True).start()
    return await done


class _Session:
    """An update coming over several streams (``UpdateHeader.streams``): the update they all feed,
    how many have come and committed, and the outcome every stream is answered with."""

    def __init__(self, update: _Update, header: UpdateHeader, start_ns: int) -> None:
        self.update, self.header, self.start_ns = update, header, start_ns
        self.joined, self.committed = 1, 0
        self.outcome: asyncio.Future[UpdateOutcome] = asyncio.get_running_loop().create_future()
        self._timer = asyncio.get_running_loop().call_later(STREAMS_JOIN_S, self._check_joined)
        self.on_end: Callable[[], None] = lambda: None  # releases the model's update slot
        self.commit: asyncio.Future[UpdateOutcome] | None = None  # the swap, once every stream committed

    def join(self, header: UpdateHeader) -> None:
        """Another stream of the update. One too many is refused alone; one whose header differs
        from the first's fails the update (its streams disagree on what it is)."""
        if self.joined == self.header.streams:
            raise InvalidArgument(
                f"header.streams: update {header.update_id!r} already has its {self.header.streams} streams"
            )
        if header != self.header:
            self.fail(
                InvalidArgument(
                    f"header: a stream of update {header.update_id!r} says {header}, its first stream said "
                    f"{self.header}; nothing applied"
                )
            )
            self.check()
        self.joined += 1

    def _check_joined(self) -> None:
        if self.joined < self.header.streams:
            self.fail(
                Aborted(
                    f"header.streams: only {self.joined} of the {self.header.streams} streams of update "
                    f"{self.header.update_id!r} came within {STREAMS_JOIN_S:g} s; nothing applied"
                )
            )

    def check(self) -> None:
        """Raises the update's failure, if a stream failed it."""
        if self.outcome.done() and self.outcome.exception() is not None:
            raise self.outcome.exception()  # type: ignore[misc]

    def settle(self, commit: asyncio.Future[UpdateOutcome]) -> None:
        """The commit is done: its outcome, or its failure, is every stream's answer."""
        if commit.cancelled():
            self.fail(Aborted(f"update {self.header.update_id!r}: its commit was cancelled (the server stopping)"))
        elif (error := commit.exception()) is not None:
            self.fail(error)
        elif not self.outcome.done():
            self.outcome.set_result(commit.result())
            self.end()

    def fail(self, error: BaseException) -> None:
        """The update fails for every stream: ``error`` becomes each stream's answer."""
        if not isinstance(error, LogprobError):
            error = Aborted(
                f"a stream of update {self.header.update_id!r} broke off ({type(error).__name__}); nothing applied"
            )
        elif isinstance(error, StreamIdle):
            error = Aborted(error.message)  # the other streams may still be sending: read to their ends
        if not self.outcome.done():
            self.outcome.set_exception(error)
            self.outcome.exception()  # retrieved: streams that already returned never read it
            self.end()

    def end(self) -> None:
        self._timer.cancel()
        self.on_end()


def _one_digest_per_weight(target: UpdatableWeights, digests: dict[str, Any]) -> dict[str, Any]:
    """The staged tensors' digests by the name each weight is fingerprinted under. Tied names (an
    lm_head that is the input embedding) are one weight: sent under both, they must carry the same
    bytes, else which one lands would depend on the order the calls of a push arrive in."""
    by_weight: dict[str, tuple[str, Any]] = {}
    for name, digest in digests.items():
        first, first_digest = by_weight.setdefault(target.canonical(name), (name, digest))
        if first_digest != digest:
            raise InvalidArgument(
                f"tensor {name!r}: is the same weight as {first!r} (tied), which came with other bytes; "
                "send one of the two names, or both with equal bytes"
            )
    return {weight: digest for weight, (_, digest) in by_weight.items()}


class WeightUpdater:
    """Runs the weight updates of a server's models (asyncio side; the swap runs on the device thread)."""

    def __init__(
        self,
        registry: ModelRegistry,
        scheduler: Scheduler,
        staging: Staging,
        *,
        join_group: JoinGroup | None = None,
        yield_to_launches: bool = False,
        load_roots: Sequence[Path] = (),
        idle_timeout_s: float = DEFAULT_UPDATE_IDLE_TIMEOUT_S,
        max_group_timeout_s: float = DEFAULT_MAX_GROUP_TIMEOUT_S,
        stats: StatsSink = NO_STATS,
    ) -> None:
        """``load_roots``: the directories (resolved) LoadWeights may read under, with the served
        checkpoints' own; empty: anywhere outside /proc, /sys and /dev."""
        self._registry = registry
        self._load_roots = tuple(load_roots)
        self._scheduler = scheduler
        self._staging = staging
        self._join_group = join_group
        self._stats = stats
        self._updating: set[str] = set()
        self._sessions: dict[str, _Session] = {}  # updates over several streams, by model
        self._ended: collections.OrderedDict[str, LogprobError | None] = collections.OrderedDict()  # by update_id
        self._yield_to_launches = yield_to_launches
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="logprob-stage")
        # Received pieces are written where they are staged on these, without the GIL, while the
        # event loop receives the next ones.
        self._writers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="logprob-receive")
        self._groups: dict[str, WeightGroup] = {}  # joined trainers' groups, by name
        self._joins = 0  # joins in progress (their threads, whose calls may have ended)
        self._idle_timeout_s = idle_timeout_s
        self._max_group_timeout_s = max_group_timeout_s
        self._past_commit: set[asyncio.Task[UpdateOutcome]] = set()  # updates past their commit (``settled``)

    def updating(self, model: str) -> bool:
        """Whether an update of ``model`` is in progress (its header came; its swap is not done)."""
        return model in self._updating

    async def update(self, messages: AsyncIterator[UpdateMessage]) -> UpdateOutcome:
        """An UpdateWeights stream: a header, tensor pieces, a commit; or one of the streams of an
        update that comes over several."""
        start = time.perf_counter_ns()
        first = await self._next_message(messages, "before its header")
        if not isinstance(first, UpdateHeader):
            raise InvalidArgument("header: the first message of an update stream must be its header")
        if first.streams > 1:
            return await self._update_in_session(first, messages, start)
        with self._updating_model(first) as update:
            await self._receive(update, messages)
            return await self._commit(update, start)

    async def _receive(
        self, update: _Update, messages: AsyncIterator[UpdateMessage], session: _Session | None = None
    ) -> None:
        """One stream's tensors, up to its commit (checked)."""
        stream = _Stream()
        while True:
            if self._yield_to_launches:
                await self._scheduler.between_launches(LAUNCH_YIELD_MAX_S)
            message = await self._next_message(messages, f"in an update of model {update.served.info.name!r}")
            if message is None:
                break
            if session is not None:
                session.check()
            if isinstance(message, TensorPiece | SparsePiece):
                update.add_piece(message, stream)
                await update.room()
            elif isinstance(message, Commit):
                update.check_commit(stream, message)
                return
            else:
                raise InvalidArgument("header: a second header in one update stream")
        raise update.ended_early(stream)

    async def _next_message(self, messages: AsyncIterator[UpdateMessage], where: str) -> UpdateMessage | None:
        """The stream's next message (None at its end), if it comes within the idle limit: a client
        that holds a stream open without sending would otherwise hold the model's update slot (and
        the other streams of its update) for as long as it likes."""
        try:
            async with asyncio.timeout(self._idle_timeout_s) as idle:
                return await anext(messages, None)
        except TimeoutError:
            if not idle.expired():
                raise
            raise StreamIdle(
                f"update stream: no message came for {self._idle_timeout_s:g} s {where} (the server's "
                "update_idle_timeout_s); nothing applied"
            ) from None

    async def _update_in_session(
        self, header: UpdateHeader, messages: AsyncIterator[UpdateMessage], start: int
    ) -> UpdateOutcome:
        """One of the streams of an update: it starts the session or joins it, brings its tensors,
        commits; the last to commit swaps the update in; every stream answers with its outcome."""
        if not header.update_id:
            raise InvalidArgument(f"header.update_id: empty; an update over {header.streams} streams needs an id")
        name = self._registry.replicas(header.model)[0].info.name
        session = self._sessions.get(name)
        if header.update_id in self._ended:
            # A stream that comes after its update ended gets the update's failure, if it failed.
            raise self._ended[header.update_id] or InvalidArgument(
                f"header.update_id: update {header.update_id!r} already went live"
            )
        if session is not None and session.header.update_id == header.update_id:
            session.join(header)
        else:
            update = self._start_update(header)
            session = self._sessions[name] = _Session(update, header, start)
            session.on_end = functools.partial(self._end_session, name, session)
        try:
            await self._receive(session.update, messages, session)
            session.committed += 1
            if session.committed == header.streams:
                # The update is whole, and goes live even if this stream's call is cancelled
                # meanwhile (every stream is then answered with the outcome).
                session.commit = self._go_live(session.update, session.start_ns)
                session.commit.add_done_callback(session.settle)
        except BaseException as err:
            session.fail(err)  # the other streams' answer; this one's is its own error
            raise
        return await asyncio.shield(session.outcome)

    def _end_session(self, name: str, session: _Session) -> None:
        # Only the failure is kept: the session holds the update's staged tensors.
        failed = session.outcome.done() and session.outcome.exception()
        self._ended[session.header.update_id] = failed if isinstance(failed, LogprobError) else None
        while len(self._ended) > ENDED_SESSIONS_KEPT:
            self._ended.popitem(last=False)
        if self._sessions.get(name) is session:
            del self._sessions[name]
            self._end_update(name)

    async def load(self, header: UpdateHeader, path: str) -> UpdateOutcome:
        """A LoadWeights request: the tensors of the safetensors files at ``path``."""
        start = time.perf_counter_ns()
        # On a thread: a path's lookups may wait on a slow filesystem.
        files = await asyncio.to_thread(self._checkpoint_files, path)
        with self._updating_model(header) as update:
            for file in files:  # one file in host memory at a time (checkpoint shards are a few GB)
                for name, dtype, shape, tensor in await asyncio.to_thread(self._staging.read_file, file):
                    update.add_tensor(name, dtype, shape, tensor)
            return await self._commit(update, start)

    def _checkpoint_files(self, path: str) -> list[Path]:
        roots = self._load_roots
        if roots:  # confined: the served checkpoints may always be read again
            roots = (*roots, *_served_checkpoint_dirs(served.info.source for served in self._registry))
        return safetensors_files(path, roots)

    async def join_group(self, spec: GroupSpec) -> WeightGroup:
        """Join a trainer's group (replacing one of the same name); returns once every rank is in."""
        if self._join_group is None:
            raise FailedPrecondition("InitWeightsUpdateGroup: this server takes no weights by broadcast")
        if not 0 < spec.rank < spec.world_size:
            raise InvalidArgument(
                f"rank_offset: {spec.rank} must be in [1, world_size={spec.world_size}) (0 is the trainer)"
            )
        limit = self._max_group_timeout_s
        if not 0 <= spec.timeout_s <= limit:  # NaN too
            raise InvalidArgument(
                f"timeout_s: {spec.timeout_s} is not in [0, {limit:g}] seconds (the server's max_group_timeout_s; "
                f"0: {min(DEFAULT_GROUP_TIMEOUT_S, limit):g})"
            )
        if self._joins >= MAX_PENDING_JOINS:
            raise Overloaded(
                f"InitWeightsUpdateGroup: {self._joins} joins of weight groups are in progress, the most at once",
                retry_after_s=1.0,
            )
        device = next(iter(self._registry)).device
        join = functools.partial(
            self._join_group,
            device,
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=spec.rank,
            world_size=spec.world_size,
            name=spec.name,
            backend=spec.backend,
            timeout_s=spec.timeout_s or min(DEFAULT_GROUP_TIMEOUT_S, limit),
        )
        self._joins += 1  # until its thread ends, which may be after its call did
        # A join whose call ends first (cancelled, past its deadline) leaves the group it joins.
        group = await _on_daemon_thread(join, ended=self._join_ended, orphaned=lambda group: group.close())
        # Joined: only now does it replace a group of that name (one that failed to join leaves
        # the trainer's working group in place).
        if (old := self._groups.pop(spec.name, None)) is not None:
            old.close()
        self._groups[spec.name] = group
        log.info("joined weight group %r as rank %d of %d (%s)", spec.name, spec.rank, spec.world_size, group.backend)
        return group

    def _join_ended(self) -> None:
        self._joins -= 1

    async def leave_group(self, name: str) -> None:
        """Leave the group ``name`` together with its rank 0 (returns once both have left)."""
        group = self._groups.pop(name, None)
        if group is None:
            raise FailedPrecondition(f"group_name: no weight group {name!r} joined ({self._joined()})")
        # Waits for the trainer (NCCL's shutdown): not on a thread the process's exit would wait for.
        await _on_daemon_thread(functools.partial(group.close, graceful=True))
        log.info("left weight group %r", name)

    def _joined(self) -> str:
        return ", ".join(map(repr, self._groups)) or "none"

    async def update_from_group(
        self, header: UpdateHeader, group_name: str, tensors: list[TensorSpec]
    ) -> AsyncIterator[Ready | UpdateOutcome]:
        """An update whose tensors rank 0 of ``group_name`` broadcasts: yields ``Ready`` once every
        tensor is checked, then the outcome once they are live. A broadcast that fails (the trainer
        went away, the group's timeout passed) aborts the update and closes the group."""
        start = time.perf_counter_ns()
        group = self._groups.get(group_name)
        if group is None:
            raise FailedPrecondition(
                f"group_name: no weight group {group_name!r} joined ({self._joined()}); "
                "call InitWeightsUpdateGroup first"
            )
        with self._updating_model(header) as update:
            update.check_all(tensors)
            yield Ready()
            for i, spec in enumerate(tensors):
                try:
                    received = await asyncio.to_thread(group.receive, spec.dtype, spec.shape)
                except BaseException as err:
                    # A dead trainer, a timeout, or this call cancelled midway: the two sides no longer
                    # agree on what comes next through the group, so it is closed (which also ends a
                    # receive still waiting in its thread).
                    self._groups.pop(group_name, None)
                    group.close()
                    if not isinstance(err, Exception):
                        raise
                    raise Aborted(
                        f"tensor {spec.name!r}: its broadcast from rank 0 of group {group_name!r} failed after "
                        f"{i} of {len(tensors)} tensors ({err}); nothing applied, the group is closed"
                    ) from None
                update.stage(spec.name, tensor_nbytes(spec.dtype, spec.shape), lambda t=received: t)
            yield await self._commit(update, start)

    async def update_from_ipc(self, header: UpdateHeader, boot_id: str, tensors: list[SharedTensor]) -> UpdateOutcome:
        """An update whose tensors lie in a caller's GPU memory on this host (UpdateWeightsFromIpc):
        every tensor is checked, and the caller's host and GPUs too, before any is opened; each is
        then copied device to device into staging, and they are swapped in as UpdateWeights'."""
        start = time.perf_counter_ns()
        with self._updating_model(header) as update:
            update.check_all(tensors)
            self._staging.check_shared(boot_id, update.served.device, tensors)
            for t in tensors:
                update.stage(
                    t.name, tensor_nbytes(t.dtype, t.shape), lambda t=t: self._staging.open_shared(t), copy=True
                )
            return await self._commit(update, start)

    @contextlib.contextmanager
    def _updating_model(self, header: UpdateHeader) -> Iterator[_Update]:
        """The model's one update slot, and the update started in it; released on any exit."""
        update = self._start_update(header)
        try:
            yield update
        finally:
            self._end_update(update.served.info.name)

    def _start_update(self, header: UpdateHeader) -> _Update:
        """The update, started in the model's one update slot (``_end_update`` releases it)."""
        replicas = self._registry.replicas(header.model)
        served = replicas[0]
        name, live = served.info.name, served.info.version
        if name in self._updating:
            raise Aborted(f"model: another update of {name!r} is in progress; retry when it is done")
        dependents = self._registry.lora_models_of(name)
        if dependents:
            raise FailedPrecondition(
                f"model: {name!r} is the shared base of the LoRA models {', '.join(map(repr, dependents))}; "
                "update their adapters instead"
            )
        version = header.version or live + 1
        if version <= live:
            raise FailedPrecondition(f"version: {version} is not above model {name!r}'s live version {live}")
        update = _Update(
            replicas,
            UpdateHeader(name, version, header.partial, header.base_version),
            self._staging,
            self._pool,
            self._writers,
        )
        self._updating.add(name)
        return update

    def _end_update(self, name: str) -> None:
        self._updating.discard(name)

    async def _commit(self, update: _Update, start_ns: int) -> UpdateOutcome:
        """The update goes live (``_go_live``). Cancelling this call does not stop it: the
        cancellation waits for its end, so that the model's update slot is held until then."""
        going = self._go_live(update, start_ns)
        try:
            return await asyncio.shield(going)
        except asyncio.CancelledError:
            await asyncio.wait([going])  # a second cancellation (the server stopping) ends this wait
            raise

    def _go_live(self, update: _Update, start_ns: int) -> asyncio.Task[UpdateOutcome]:
        """An update whose commit came, checked, swapped in and logged by a task of its own: it
        goes live or fails whatever becomes of the calls that brought it (a caller may cancel
        right after sending its commit), and ``settled`` waits for it."""
        task = asyncio.ensure_future(self._swap_in(update, start_ns))
        self._past_commit.add(task)
        task.add_done_callback(self._gone_live)
        return task

    def _gone_live(self, task: asyncio.Task[UpdateOutcome]) -> None:
        self._past_commit.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the call that brought it may be gone

    async def settled(self) -> None:
        """Returns once every update whose commit came before has gone live or failed: ListModels
        answers after them, so a caller whose push was cancelled or timed out after its commit
        learns from it whether the push went live."""
        if self._past_commit:
            await asyncio.wait(set(self._past_commit))

    async def _swap_in(self, update: _Update, start_ns: int) -> UpdateOutcome:
        update.check_complete()
        staged = await update.staged_tensors()
        served, version = update.served, update.header.version
        digests = _one_digest_per_weight(update.target, {name: digest for name, (_, digest) in staged.items()})
        swap_ns = [0] * len(update.replicas)

        def apply(lane: int) -> None:
            """On ``lane``'s device thread: its replica takes its copies and the new version."""
            t0 = time.perf_counter_ns()
            update.targets[lane].apply({name: copies[lane] for name, (copies, _) in staged.items()})
            update.replicas[lane].updated(version, digests)
            swap_ns[lane] = time.perf_counter_ns() - t0

        await self._scheduler.swap(served.info.name, apply)
        outcome = UpdateOutcome(
            model=served.info.name,
            version=served.info.version,
            fingerprint=served.info.fingerprint,
            tensors=len(staged),
            bytes=update.bytes,
            staged_on="+".join(sorted(set().union(*(stager.places for stager in update.stagers)))) or "none",
            total_ns=time.perf_counter_ns() - start_ns,
            swap_ns=max(swap_ns),
        )
        self._stats.record(WeightsUpdated(outcome.model, outcome.bytes, outcome.total_ns, outcome.swap_ns))
        log.info("model %r: version %d live (%s)", outcome.model, outcome.version, outcome)
        return outcome

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._writers.shutdown(wait=False, cancel_futures=True)
        for group in self._groups.values():
            group.close()
        self._groups.clear()


# Where LoadWeights never reads, wherever a path's symlinks lead: kernel interfaces and devices,
# whose files block in open (a FIFO), never end (/dev/urandom), or are the server's own memory and
# environment (/proc/self/mem, /proc/self/environ).
FORBIDDEN_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
# A path longer than this is cut in the middle where a message shows it (a caller may send 5,000
# characters; the log line and the status need not repeat them).
SHOWN_PATH_CHARS = 200


def _shown_path(path: str | Path) -> str:
    """``path`` quoted for a message, its middle cut when it is long."""
    text = str(path)
    if len(text) > SHOWN_PATH_CHARS:
        text = f"{text[:120]}...({len(text)} characters)...{text[-60:]}"
    return repr(text)


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def _resolve(name: Path, where: str, roots: Sequence[Path]) -> tuple[Path, os.stat_result]:
    """``name`` with its symlinks followed, and its stat, once checked to lie outside
    ``FORBIDDEN_ROOTS`` and, when any are given, under one of ``roots``. ``where``: how messages
    name it."""
    try:
        resolved = name.expanduser().resolve(strict=True)
        info = resolved.stat()
    except FileNotFoundError:
        raise InvalidArgument(f"path: {where} does not exist on the server") from None
    except (OSError, RuntimeError, ValueError) as err:  # too long, a symlink loop, no such user (~x), a NUL
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise InvalidArgument(f"path: {where} cannot be resolved on the server ({reason})") from None
    where += _leads_to(name, resolved)
    if any(resolved.is_relative_to(forbidden) for forbidden in FORBIDDEN_ROOTS):
        raise InvalidArgument(f"path: {where} is under /proc, /sys or /dev, which LoadWeights never reads")
    if roots and not any(resolved.is_relative_to(root) for root in roots):
        raise InvalidArgument(
            f"path: {where} is outside the directories LoadWeights may read "
            f"(load_weights_roots and the served checkpoints: {', '.join(map(str, roots))})"
        )
    return resolved, info


def safetensors_files(path: str, roots: Sequence[Path] = ()) -> list[Path]:
    """The .safetensors files ``path`` names: itself, or those in its directory (an HF checkpoint,
    sharded or not, or a PEFT adapter directory), each with its symlinks followed and checked to be
    a regular file outside /proc, /sys and /dev, and under one of ``roots`` (resolved) when any
    are given; else INVALID_ARGUMENT naming ``path`` and the file. Nothing is opened here:
    ``Staging.read_file`` opens each without blocking and checks that it opened that file."""
    where = _shown_path(path)
    top, info = _resolve(Path(path), where, roots)
    if stat.S_ISDIR(info.st_mode):
        try:
            names = sorted(top.glob("*.safetensors"))
        except OSError as err:
            raise InvalidArgument(f"path: {where} cannot be listed on the server ({err.strerror})") from None
        if not names:
            raise InvalidArgument(f"path: {where} holds no .safetensors files")
        return [_regular_file(name, f"{where}: its file {name.name!r}", roots) for name in names]
    if Path(path).suffix == ".safetensors":
        return [_regular(Path(path), top, info, where)]
    raise InvalidArgument(f"path: {where} is neither a .safetensors file nor a directory on the server")


def _regular_file(name: Path, where: str, roots: Sequence[Path]) -> Path:
    return _regular(name, *_resolve(name, where, roots), where)


def _regular(name: Path, resolved: Path, info: os.stat_result, where: str) -> Path:
    """``resolved`` (``name``'s symlinks followed), once ``info`` (its stat) shows a regular file."""
    if not stat.S_ISREG(info.st_mode):
        where += _leads_to(name, resolved)
        raise InvalidArgument(f"path: {where} is {_file_kind(info.st_mode)}, not a regular file")
    return resolved


def _leads_to(name: Path, resolved: Path) -> str:
    return "" if resolved == name else f" (it leads to {_shown_path(resolved)})"


def _served_checkpoint_dirs(sources: Iterable[str]) -> list[Path]:
    """The local directories among the served models' ``sources`` (a checkpoint directory, or a
    LoRA model's ``BASE+ADAPTER_DIR``), resolved: LoadWeights may always read them again."""
    dirs = []
    for source in sources:
        for candidate in (source, source.partition("+")[2]):
            if candidate and os.path.isdir(os.path.expanduser(candidate)):
                dirs.append(Path(candidate).expanduser().resolve())
    return dirs
