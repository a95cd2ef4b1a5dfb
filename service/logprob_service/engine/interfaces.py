"""What the engine needs from the layers below it, as protocols.

The worker (``worker.executor``, ``worker.staging``) and the models (``models.served``) implement
them; the engine names only these, so it imports neither torch nor those layers, and its tests
drive it with plain fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from logprob_service.domain import ModelInfo, ScoreOptions, SequenceScores, SharedTensor, SparseChanges, TokenSequence

T = TypeVar("T")


class UpdatableWeights(Protocol):
    """The live tensors an update of one model may replace, by name."""

    def check(self, name: str, dtype: str, shape: tuple[int, ...], *, sparse: bool = False) -> object:
        """Raise ``InvalidArgument`` naming the tensor when it is not one of the weights or does not
        fit (``sparse``: when its changes come as a sparse delta of the live weight)."""

    def canonical(self, name: str) -> str:
        """The name a weight is fingerprinted under (tied weights answer to several names)."""

    def missing(self, names: Iterable[str]) -> list[str]:
        """The weights a full update would still lack after ``names``."""

    def apply(self, staged: Mapping[str, Any]) -> Mapping[str, Any]:
        """Copy the staged tensors into the live weights (on the device thread, between micro-batches);
        returns the digests of live weights that differ from what was staged (a quantized weight
        that took a dense tensor), which replace the staged ones'."""


class ServedModel(Protocol):
    """A loaded model as the engine sees it."""

    info: ModelInfo

    @property
    def device(self) -> Any: ...

    def updatable(self) -> UpdatableWeights: ...

    def updated(self, version: int, digests: Mapping[str, Any]) -> None:
        """Record a swap: the new version, and the digests of the tensors it replaced."""


class Launch(Protocol):
    """A launched micro-batch part: its sequences (by position in the micro-batch), and either
    its pending results or the error that kept it from running."""

    indices: list[int]
    launched: Any
    error: Exception | None


class Executor(Protocol):
    """The device worker: every call on the device runs on its one thread, in order."""

    async def launch(self, served: Any, sequences: Sequence[TokenSequence], options: ScoreOptions) -> list[Launch]:
        """Enqueue a micro-batch's scoring with ``options`` on the device; returns once it is enqueued."""

    async def fetch(self, launched: Any) -> list[SequenceScores]:
        """Wait for a launched part's results."""

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread after everything launched before it (a weight swap)."""

    def shutdown(self) -> None:
        """End the device thread (the engine's ``close``)."""


class Received(Protocol):
    """One tensor whose bytes arrive in pieces (``Stager.receive``)."""

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Bytes ``[offset, offset + len(data))`` of the tensor, written where it is staged; called
        on a receiving thread, several at once, in any order."""

    def finish(self) -> tuple[list[Any], Any]:
        """Once every ``write`` has returned: the staged tensor and each replica's copy, and the
        pending digest of its bytes (all queued); called on a worker thread."""


class Stager(Protocol):
    """Where one update's tensors wait for their swap: on the device while it has room, else in host memory."""

    places: set[str]  # where it staged them so far ("cuda:0", "cpu")

    def receive(self, dtype: str, shape: tuple[int, ...], replicas: Sequence[Any] = ()) -> Received:
        """Where a tensor's pieces go as they arrive, staged at once (no host copy of the whole
        tensor first), and copied by ``replicas`` (the other devices' stagers) once complete."""

    def stage(self, tensor: Any, *, copy: bool = False, digest: bool = True) -> tuple[Any, Any]:
        """(the staged copy, the pending digest of its bytes or None without ``digest``), both
        queued; called on a worker thread. ``copy``: a copy even where ``tensor`` already lies
        where it would be staged (it is not the update's own)."""

    def stage_changes(self, changes: Sequence[SparseChanges], *, digest: bool = True) -> list[tuple[Any, Any]]:
        """``stage`` of a copy of each change's ``live`` weight with its changed elements set:
        a sparse update's tensors, staged together."""

    def finish(self, pending: Sequence[Any], names: Sequence[str] = ()) -> list[Any]:
        """Waits until everything staged so far is in place (its sources may go), then the digests
        of ``pending`` (``models.weights.TensorDigest``); called on a worker thread. Raises
        ``InvalidArgument`` naming (by ``names``, in ``pending``'s order) the tensors that hold a
        NaN or an infinity, where the staging checks (``check_finite_weights``)."""


class Staging(Protocol):
    """The tensors of weight updates (``worker.staging``)."""

    def stager(self, device: Any) -> Stager: ...

    def read_file(self, file: Path) -> list[tuple[str, str, tuple[int, ...], Any]]:
        """(name, dtype, shape, tensor) of every tensor of a safetensors file: a regular file's
        resolved path (``weights.files.safetensors_files``), opened without blocking and read only
        if it is still that file (INVALID_ARGUMENT naming it otherwise)."""

    def check_shared(self, boot_id: str, device: Any, tensors: Sequence[SharedTensor]) -> None:
        """That ``tensors`` of a caller on host ``boot_id`` can be opened and copied to ``device``:
        one host, GPUs this process sees, peer access (FAILED_PRECONDITION / INVALID_ARGUMENT)."""

    def open_shared(self, tensor: SharedTensor) -> Any:
        """The caller's tensor, mapped into this process (its memory, not a copy); called on a worker thread."""


class WeightGroup(Protocol):
    """This server's rank in a torch.distributed group with a trainer (``worker.collectives``)."""

    rank: int
    world_size: int
    backend: str
    device: Any

    def receive(self, dtype: str, shape: tuple[int, ...]) -> Any:
        """The next tensor rank 0 broadcasts, on the server's device (blocks; raises past the timeout)."""

    def close(self, *, graceful: bool = False) -> None:
        """Leave the group: with rank 0 (``graceful``, which waits for it), or alone."""


class JoinGroup(Protocol):
    """Join a trainer's group (``worker.collectives.WeightGroup``); blocks until every rank is in."""

    def __call__(
        self,
        device: Any,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        backend: str,
        timeout_s: float,
    ) -> WeightGroup: ...
