"""The queue of scoring work and how micro-batches are formed from it: synchronous, no I/O.

Every admitted request is cut into *units* (some of its sequences, always scored together): one
unit when it fits a micro-batch, else balanced parts (``partition.plan_micro_batches``,
Karmarkar-Karp). Units wait in arrival order. ``take`` forms the next micro-batch: first fit,
in arrival order, among units sharing the oldest eligible unit's ``BatchKey``, under
``max_batch_tokens`` real tokens (no padding: the batch is packed) and ``max_batch_sequences``;
a unit too big for the room left gives the sequences that fit and keeps its place with the rest,
so micro-batches fill up to the budget.

Weight swaps hold a model's work: while a swap of model M waits (M in ``held``), M's units whose
request has not started are not eligible, while those of a request already partly launched are
(a request finishes on the weights it started with). The asyncio loop (``scheduler``) owns the
clock, the futures and the device; this class only decides, so tests drive it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from logprob_service.domain import ScoreJob, ScoreResult, SequenceScores
from logprob_service.engine.partition import plan_micro_batches
from logprob_service.errors import DeadlineExceeded


@dataclass(frozen=True)
class BatchKey:
    """Work batches together only when all of these match."""

    model: str
    temperature: float
    return_entropy: bool


@dataclass(eq=False)
class Request:
    """One admitted request: its job, its results as they come, and how to end it.

    ``done`` says whether it is over (answered, failed, or its caller gone); ``fail`` and
    ``complete`` end it (all three given by the loop that owns the caller's future)."""

    job: ScoreJob
    done: Callable[[], bool]
    fail: Callable[[BaseException], None]
    complete: Callable[[ScoreResult], None]
    arrived_ns: int = field(default_factory=time.perf_counter_ns)
    first_launch_ns: int | None = None
    compute_ns: int = 0
    model_version: int = 0
    scores: list[SequenceScores | None] = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.scores = [None] * len(self.job.sequences)
        self.remaining = len(self.job.sequences)

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.job.model, self.job.temperature, self.job.return_entropy)

    @property
    def started(self) -> bool:
        return self.first_launch_ns is not None


@dataclass(eq=False)
class Unit:
    """Some sequences of one request, always scored in the same micro-batch."""

    request: Request
    indices: list[int]
    tokens: int


class BatchQueue:
    def __init__(self, *, max_batch_tokens: int, max_batch_sequences: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences
        self.units: list[Unit] = []  # waiting, in arrival order

    def push(self, request: Request) -> None:
        """Queue ``request``'s sequences as units (one, or balanced parts if it is larger than a micro-batch)."""
        job = request.job
        if job.num_tokens <= self.max_batch_tokens and len(job.sequences) <= self.max_batch_sequences:
            parts = [list(range(len(job.sequences)))]
        else:
            parts = plan_micro_batches(
                [s.num_tokens for s in job.sequences],
                max_tokens=self.max_batch_tokens,
                max_sequences=self.max_batch_sequences,
            )
        for indices in parts:
            self.units.append(Unit(request, indices, sum(job.sequences[i].num_tokens for i in indices)))

    def drop_dead(self, now: float) -> list[Unit]:
        """Fail the requests whose deadline (``time.monotonic``) passed while queued; drop and return
        the units of every request that is over (failed, answered, or its caller gone)."""
        alive, dropped = [], []
        for unit in self.units:
            request = unit.request
            deadline = request.job.deadline
            if not request.done() and deadline is not None and now >= deadline:
                request.fail(
                    DeadlineExceeded(
                        f"request {request.job.request_id}: deadline passed while queued; nothing was computed"
                    )
                )
            (dropped if request.done() else alive).append(unit)
        self.units = alive
        return dropped

    @staticmethod
    def eligible(unit: Unit, held: Collection[str]) -> bool:
        """Whether ``unit`` may be launched now: not when its model is held for a swap and its
        request has not started (a started one must finish on the weights it started with)."""
        return unit.request.job.model not in held or unit.request.started

    def first_eligible(self, held: Collection[str] = ()) -> Unit | None:
        return next((unit for unit in self.units if self.eligible(unit, held)), None)

    def holds_started_work(self, model: str, held: Collection[str]) -> bool:
        """Whether ``model`` has queued units that may still run although it is held: a swap of it must wait."""
        return any(unit.request.job.model == model and self.eligible(unit, held) for unit in self.units)

    def fills_a_batch(self, first: Unit, held: Collection[str] = ()) -> bool:
        """Whether the eligible work sharing ``first``'s key fills a micro-batch's token budget."""
        key = first.request.key
        tokens = sum(u.tokens for u in self.units if u.request.key == key and self.eligible(u, held))
        return tokens >= self.max_batch_tokens

    def take(self, held: Collection[str] = ()) -> list[Unit]:
        """The next micro-batch (removed from the queue); needs an eligible unit. A unit larger than
        the budget (a sequence longer than it: ``plan_micro_batches`` puts each alone) goes alone."""
        first = self.first_eligible(held)
        assert first is not None, "take needs an eligible unit"
        if first.tokens > self.max_batch_tokens:
            self.units.remove(first)
            return [first]
        chosen: list[Unit] = []
        rest: list[Unit] = []
        tokens = sequences = 0
        for unit in self.units:
            left: Unit | None = unit
            if unit.request.key == first.request.key and self.eligible(unit, held):
                taken, left = self._fit(unit, self.max_batch_tokens - tokens, self.max_batch_sequences - sequences)
                if taken is not None:
                    chosen.append(taken)
                    tokens += taken.tokens
                    sequences += len(taken.indices)
            if left is not None:
                rest.append(left)
        self.units = rest
        return chosen

    @staticmethod
    def _fit(unit: Unit, room_tokens: int, room_sequences: int) -> tuple[Unit | None, Unit | None]:
        """Split ``unit`` into the sequences that fit the room (in order) and the rest."""
        if unit.tokens <= room_tokens and len(unit.indices) <= room_sequences:
            return unit, None
        sequences = unit.request.job.sequences
        taken: list[int] = []
        used = 0
        for i in unit.indices:
            if len(taken) == room_sequences or used + sequences[i].num_tokens > room_tokens:
                break
            taken.append(i)
            used += sequences[i].num_tokens
        if not taken:
            return None, unit
        left = unit.indices[len(taken) :]
        return Unit(unit.request, taken, used), Unit(unit.request, left, unit.tokens - used)


def owners_of(units: list[Unit]) -> list[tuple[Request, int]]:
    """(request, sequence index) of each position in a micro-batch made of ``units``."""
    return [(unit.request, i) for unit in units for i in unit.indices]


def requests_of(owners: list[tuple[Request, Any]]) -> list[Request]:
    """The distinct requests among ``owners``, in order."""
    return list(dict.fromkeys(request for request, _ in owners))
