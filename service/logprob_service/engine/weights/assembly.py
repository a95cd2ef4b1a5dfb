"""One tensor of an update, arriving in pieces: each piece checked to come in order and fit, and
written where the tensor is staged (dense), or gathered as changed elements (sparse)."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from logprob_service.domain import DTYPE_BYTES, SparseChanges, SparsePiece, TensorPiece, tensor_nbytes
from logprob_service.engine.interfaces import Received
from logprob_service.errors import InvalidArgument


class Assembly:
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


class SparseAssembly:
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


# Sparse pieces name elements with uint32 indices: the wire's rule, as ``logprob_proto.framing``
# states it for the client; the engine may not import that (no protobuf below the edge).
MAX_SPARSE_ELEMENTS = 2**32
