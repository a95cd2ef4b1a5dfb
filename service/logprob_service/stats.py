"""What the engine, the worker and the weight updates report, as plain records.

They call ``stats.record(...)`` on the sink they were given; ``observability.metrics`` turns the
records into Prometheus series. So nothing below the observability layer imports a metrics
library, and a test or an offline run passes ``NO_STATS`` (or a list's ``append``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from logprob_service.domain import ModelInfo, Timings


@dataclass(frozen=True)
class Limits:
    """The scheduler's batch and queue limits, once at start."""

    max_batch_tokens: int
    max_batch_sequences: int
    max_queued_tokens: int


@dataclass(frozen=True)
class QueueChanged:
    """Requests and tokens admitted (positive) or answered, dropped or scored (negative)."""

    model: str
    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class BatchLaunched:
    model: str
    tokens: int  # real tokens run, no padding (a prompt shared by several sequences once)
    sequences: int
    shared_tokens: int = 0  # prompt tokens not run: another sequence of the micro-batch had the prompt
    device: str = ""  # the device that ran it ("cuda:1")


@dataclass(frozen=True)
class RequestScored:
    """One request scored; ``timings`` are the very figures its response carries."""

    model: str
    tokens: int
    sequences: int
    timings: Timings


@dataclass(frozen=True)
class BatchMemory:
    """Peak bytes allocated on a device while a micro-batch was launched (weights included)."""

    device: str
    peak_bytes: int


@dataclass(frozen=True)
class WeightsUpdated:
    """A weight update went live: its bytes, first message to end of swap, and the swap alone."""

    model: str
    bytes: int
    total_ns: int
    swap_ns: int


@dataclass(frozen=True)
class RefusalHeld:
    """A refused call held before its answer (``security.refusals``), on its edge ("grpc", "http")."""

    edge: str


Stat = Limits | QueueChanged | BatchLaunched | RequestScored | BatchMemory | WeightsUpdated | RefusalHeld


class StatsSink(Protocol):
    def record(self, stat: Stat) -> None: ...


class _NoStats:
    def record(self, stat: Stat) -> None:
        pass


NO_STATS: StatsSink = _NoStats()


@dataclass(frozen=True)
class MemorySnapshot:
    """One device's memory, in bytes."""

    allocated: int  # held by live tensors (torch.cuda.memory_allocated)
    reserved: int  # held by the caching allocator, allocated or not (torch.cuda.memory_reserved)
    free: int  # free on the device, for every process (cudaMemGetInfo)
    total: int  # the device's memory (cudaMemGetInfo)
    peak_allocated: int  # highest ``allocated`` since start or ``reset_peak``


class ServerView(Protocol):
    """What the metrics read at scrape time: the served models as the engine describes them, and
    the memory of the GPUs they run on (by device name): a server's engine (``LogprobEngine``)."""

    def models(self) -> list[ModelInfo]: ...

    def device_memory(self) -> dict[str, MemorySnapshot]: ...
