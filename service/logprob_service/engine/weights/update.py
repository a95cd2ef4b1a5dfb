"""One update of one model: its streams' pieces assembled, checked and staged on the pools, its
digests read back, and what it drops when it fails."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from logprob_service.domain import (
    DTYPE_BYTES,
    Commit,
    SharedTensor,
    SparsePiece,
    TensorPiece,
    TensorSpec,
    UpdateHeader,
    tensor_nbytes,
)
from logprob_service.engine.interfaces import ServedModel, Staging, UpdatableWeights
from logprob_service.engine.weights.assembly import Assembly, SparseAssembly
from logprob_service.errors import Aborted, FailedPrecondition, InvalidArgument

# Complete sparse tensors are staged together once this many wait, or this many changed elements
# (the rest at commit): staged alone, a tensor cost ~0.5 ms of torch calls; a 1.5B model's 338
# tensors took 0.26 s so and 0.12 s in batches of this size (H100), which still overlap the rest
# of the push's arrival.
SPARSE_BATCH_TENSORS = 64
SPARSE_BATCH_CHANGES = 1 << 23
# Pieces of an update received but not yet written where they are staged, at most: each holds its
# message's memory meanwhile (4 MiB from this project's client).
WRITES_IN_FLIGHT = 8


class Stream:
    """What one stream of an update has brought: the tensor it is in the middle of, and how many it
    completed (its commit counts them)."""

    def __init__(self) -> None:
        self.assembly: Assembly | SparseAssembly | None = None
        self.tensors: list[str] = []


class Update:
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
        self.sparse_waiting: list[SparseAssembly] = []  # complete, not yet staged (``stage_sparse``)
        self.jobs: list[concurrent.futures.Future[Any]] = []  # everything given to the pool (``abandon``)
        self.bytes = 0

    def add_piece(self, piece: TensorPiece | SparsePiece, stream: Stream) -> None:
        a = stream.assembly
        sparse = isinstance(piece, SparsePiece)
        if a is not None and (piece.name != a.name or sparse != isinstance(a, SparseAssembly)):
            kind = "a sparse piece" if sparse else "a dense piece"
            raise InvalidArgument(f"tensor {a.name!r}: only {a.progress} came before {kind} of tensor {piece.name!r}")
        if a is None:
            live = self.check_new(piece.name, piece.dtype, piece.shape, sparse=sparse)
            if isinstance(piece, SparsePiece):
                self._check_base(piece.name)
                others = [t.check(piece.name, piece.dtype, piece.shape, sparse=True) for t in self.targets[1:]]
                a = stream.assembly = SparseAssembly(piece, live, others)
            else:
                into = self.stagers[0].receive(piece.dtype, piece.shape, self.stagers[1:])
                a = stream.assembly = Assembly(piece, into)
            self.staged[a.name] = concurrent.futures.Future()  # named: a second tensor of that name is refused
        self.writes.append(a.write(piece, self.writers))  # type: ignore[arg-type]  # the kinds match: checked above
        if a.complete:
            stream.assembly = None
            stream.tensors.append(a.name)
            if isinstance(a, SparseAssembly):
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

    def check_new(self, name: str, dtype: str, shape: tuple[int, ...], *, sparse: bool = False) -> Any:
        """The live weight ``name`` stands for, once checked to be new to this update and to fit."""
        if name in self.staged:
            raise InvalidArgument(f"tensor {name!r}: sent twice in one update")
        if dtype not in DTYPE_BYTES:
            raise InvalidArgument(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"tensor {name!r}: negative dimension in shape {list(shape)}")
        return self.target.check(name, dtype, shape, sparse=sparse)

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

    def _stage_changes(self, batch: list[SparseAssembly]) -> list[tuple[list[Any], Any]]:
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
    def check_commit(stream: Stream, commit: Commit) -> None:
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

    def ended_early(self, stream: Stream) -> Aborted:
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
    ``Update.staged``, or a job a pool's shutdown dropped); waiting so for a cancelled push once
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


def one_digest_per_weight(target: UpdatableWeights, digests: dict[str, Any]) -> dict[str, Any]:
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
