"""Admission, micro-batching and ordering of scoring work (asyncio side; never runs torch).

Every request's sequences enter one queue, bounded by tokens (``max_queued_tokens``), and each
client identity (``identity.py``) may hold at most ``max_queued_tokens_per_client`` of them, so
one trainer cannot fill the queue and starve the others. Past either limit a request is refused
at once with RESOURCE_EXHAUSTED, a message naming the limit, and a retry hint from the measured
throughput. A request larger than one micro-batch is split into balanced parts
(``partition.plan_micro_batches``, Karmarkar-Karp) up front; each part is a work unit.

The batching loop forms micro-batches of units that share a model, temperature and entropy
flag, first-fit in arrival order, under ``max_batch_tokens`` real tokens (no padding: the batch
is packed) and ``max_batch_sequences``. When the device is idle it waits up to ``max_wait_ms``
after the oldest unit's arrival for more work to fill the batch. Two micro-batches are kept in
flight, so the next one is packed and enqueued while the device computes the current one.
Units whose caller went away or whose deadline passed are dropped before they reach the device.
Results are scattered back by sequence index, so every response is in request order however
its sequences were batched.

Weight swaps (``swap``) run in the batching loop, on the device thread, between micro-batches.
While a swap of a model waits, that model's requests not yet started stay queued, and those
already partly launched finish on the old weights first: every response is scored by one
version, the one it reports. A request with ``min_version`` waits for that version first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from logprob_service.domain import ScoreJob, ScoreResult, SequenceScores, Timings
from logprob_service.engine.partition import plan_micro_batches
from logprob_service.errors import DeadlineExceeded, FailedPrecondition, Overloaded, Unavailable
from logprob_service.models.registry import ModelRegistry
from logprob_service.observability import metrics
from logprob_service.worker.executor import DeviceExecutor, Part

log = logging.getLogger(__name__)

_MIN_RETRY_S, _MAX_RETRY_S = 0.05, 30.0
PIPELINE_DEPTH = 2  # micro-batches in flight: one computing, one being packed and enqueued


@dataclass(frozen=True)
class BatchKey:
    """Work batches together only when all of these match."""

    model: str
    temperature: float
    return_entropy: bool


@dataclass(eq=False)
class _Request:
    job: ScoreJob
    future: asyncio.Future[ScoreResult]
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

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(eq=False)
class _Unit:
    """Some sequences of one request, always scored in the same micro-batch."""

    request: _Request
    indices: list[int]
    tokens: int


@dataclass(eq=False)
class _Swap:
    """A weight swap waiting for its model's started requests to finish."""

    apply: Callable[[], None]  # runs on the device thread
    done: asyncio.Future[None]


@dataclass(eq=False)
class _Launched:
    """A micro-batch handed to the device: who owns each of its sequences, and its parts."""

    units: list[_Unit]
    owners: list[tuple[_Request, int]]  # (request, sequence index) of each position in the batch
    start_ns: int = field(default_factory=time.perf_counter_ns)
    model_version: int = 0
    parts: list[Part] = field(default_factory=list)
    error: Exception | None = None

    @property
    def requests(self) -> list[_Request]:
        return list(dict.fromkeys(request for request, _ in self.owners))


class Scheduler:
    def __init__(
        self,
        registry: ModelRegistry,
        executor: DeviceExecutor,
        *,
        max_queued_tokens: int,
        max_queued_tokens_per_client: int,
        max_batch_tokens: int,
        max_batch_sequences: int,
        max_wait_ms: float,
        max_version_wait_s: float = 300.0,
    ) -> None:
        self._registry = registry
        self._executor = executor
        self._max_queued_tokens = max_queued_tokens
        self._max_queued_tokens_per_client = max_queued_tokens_per_client
        self._max_batch_tokens = max_batch_tokens
        self._max_batch_sequences = max_batch_sequences
        self._max_wait_s = max_wait_ms / 1000
        self._queued_tokens = 0  # admitted, not yet scored or dropped
        self._client_tokens: Counter[str] = Counter()  # the same, per client identity (none at 0)
        self._units: list[_Unit] = []  # waiting, in arrival order
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self._tokens_per_s = 0.0  # moving average of measured throughput
        self._max_version_wait_s = max_version_wait_s
        self._swaps: dict[str, _Swap] = {}  # model -> its pending weight swap
        self._version_changed = asyncio.Condition()
        metrics.observe_limits(
            max_batch_tokens=max_batch_tokens,
            max_batch_sequences=max_batch_sequences,
            max_queued_tokens=max_queued_tokens,
        )

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="logprob-scheduler")

    async def close(self) -> None:
        for swap in self._swaps.values():
            swap.done.set_exception(Unavailable("the server is shutting down; the weights were not swapped"))
        self._swaps.clear()
        tasks = [t for t in (self._loop_task, *self._in_flight) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None

    async def swap(self, model: str, apply: Callable[[], None]) -> None:
        """Run ``apply`` (which replaces ``model``'s weights) on the device thread between
        micro-batches, once the requests of ``model`` already started have been launched."""
        if model in self._swaps:
            raise RuntimeError(f"a swap of model {model!r} is already pending")  # WeightUpdater serializes them
        swap = _Swap(apply, asyncio.get_running_loop().create_future())
        self._swaps[model] = swap
        self._wake.set()
        try:
            await asyncio.shield(swap.done)  # once started, a swap runs to its end
        except asyncio.CancelledError:
            if self._swaps.get(model) is swap:  # not started: it never will, and the model's queue moves on
                del self._swaps[model]
                self._wake.set()
            raise
        async with self._version_changed:
            self._version_changed.notify_all()

    async def _wait_for_version(self, job: ScoreJob) -> None:
        if job.min_version <= 0:
            return
        served = self._registry.get(job.model)
        if served.info.version >= job.min_version:
            return
        timeout = self._max_version_wait_s
        if job.deadline is not None:
            timeout = min(timeout, job.deadline - time.monotonic())
        try:
            async with self._version_changed:
                await asyncio.wait_for(
                    self._version_changed.wait_for(lambda: served.info.version >= job.min_version), max(timeout, 0)
                )
        except TimeoutError:
            raise FailedPrecondition(
                f"min_version: model {job.model!r} is at version {served.info.version}; version "
                f"{job.min_version} did not go live within {max(timeout, 0):.1f} s"
            ) from None

    async def submit(self, job: ScoreJob) -> ScoreResult:
        """Queue ``job`` and wait for its result. Cancelling the caller drops its queued work."""
        await self._wait_for_version(job)
        tokens = job.num_tokens
        if self._queued_tokens + tokens > self._max_queued_tokens:
            raise Overloaded(
                f"server queue holds {self._queued_tokens} tokens; this request's {tokens} would pass "
                f"max_queued_tokens={self._max_queued_tokens}",
                retry_after_s=self._retry_after_s(self._queued_tokens + tokens - self._max_queued_tokens),
            )
        held, cap = self._client_tokens[job.client], self._max_queued_tokens_per_client
        if held + tokens > cap:
            raise Overloaded(
                f"client {job.client!r} has {held} tokens queued; this request's {tokens} would pass "
                f"max_queued_tokens_per_client={cap}",
                retry_after_s=self._retry_after_s(held + tokens - cap),
            )
        request = _Request(job, asyncio.get_running_loop().create_future())
        for indices in self._split(job):
            self._units.append(_Unit(request, indices, sum(job.sequences[i].num_tokens for i in indices)))
        self._account(job, tokens)
        metrics.queue_changed(job.model, requests=1)
        self._wake.set()
        try:
            return await request.future
        finally:
            metrics.queue_changed(job.model, requests=-1)
            # A cancelled caller (its task's cancellation also cancels the future): its queued work goes at once.
            if request.future.cancelled() or not request.future.done():
                request.future.cancel()
                self._drop_dead()

    def _split(self, job: ScoreJob) -> list[list[int]]:
        if job.num_tokens <= self._max_batch_tokens and len(job.sequences) <= self._max_batch_sequences:
            return [list(range(len(job.sequences)))]
        return plan_micro_batches(
            [s.num_tokens for s in job.sequences],
            max_tokens=self._max_batch_tokens,
            max_sequences=self._max_batch_sequences,
        )

    def _account(self, job: ScoreJob, tokens: int) -> None:
        self._queued_tokens += tokens
        self._client_tokens[job.client] += tokens
        if not self._client_tokens[job.client]:
            del self._client_tokens[job.client]
        metrics.queue_changed(job.model, tokens=tokens)

    def _retry_after_s(self, excess_tokens: int) -> float:
        if self._tokens_per_s <= 0:
            return 1.0
        return min(_MAX_RETRY_S, max(_MIN_RETRY_S, excess_tokens / self._tokens_per_s))

    # The batching loop.

    async def _run(self) -> None:
        while True:
            while len(self._in_flight) >= PIPELINE_DEPTH:
                await asyncio.wait(self._in_flight, return_when=asyncio.FIRST_COMPLETED)
            # The next batch is formed only once the previous launch has returned (its kernels are
            # queued), so deadlines and cancellations are checked right before each launch.
            batch = await self._launch(await self._next_batch())
            task = asyncio.create_task(self._finish(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _next_batch(self) -> list[_Unit]:
        while True:
            self._drop_dead()
            await self._run_due_swaps()
            timeout = None
            first = self._first_eligible()
            if first is not None:
                waited = (time.perf_counter_ns() - first.request.arrived_ns) / 1e9
                device_idle = not self._in_flight
                if not device_idle or waited >= self._max_wait_s or self._fills_a_batch(first):
                    return self._take()
                timeout = self._max_wait_s - waited
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def _drop_dead(self) -> None:
        """Drop units whose caller went away; fail and drop those whose deadline passed."""
        now = time.monotonic()
        alive = []
        for unit in self._units:
            request = unit.request
            deadline = request.job.deadline
            if not request.future.done() and deadline is not None and now >= deadline:
                request.fail(
                    DeadlineExceeded(
                        f"request {request.job.request_id}: deadline passed while queued; nothing was computed"
                    )
                )
            if request.future.done():
                self._account(request.job, -unit.tokens)
            else:
                alive.append(unit)
        self._units = alive

    def _eligible(self, unit: _Unit) -> bool:
        """Whether ``unit`` may be launched now: not when its model waits for a swap and its request
        has not started (a started one must finish on the weights it started with)."""
        return unit.request.job.model not in self._swaps or unit.request.first_launch_ns is not None

    def _first_eligible(self) -> _Unit | None:
        return next((unit for unit in self._units if self._eligible(unit)), None)

    async def _run_due_swaps(self) -> None:
        """Swap the weights of every model with a pending swap and no started request queued."""
        for model, swap in list(self._swaps.items()):
            if any(unit.request.job.model == model and self._eligible(unit) for unit in self._units):
                continue
            del self._swaps[model]
            try:
                await self._executor.run(swap.apply)
            except Exception as err:
                swap.done.set_exception(err)
            else:
                swap.done.set_result(None)

    def _fills_a_batch(self, first: _Unit) -> bool:
        key = first.request.key
        tokens = sum(u.tokens for u in self._units if u.request.key == key and self._eligible(u))
        return tokens >= self._max_batch_tokens

    def _take(self) -> list[_Unit]:
        """First fit, in arrival order, among units sharing the oldest unit's key. A unit too big
        for the room left gives the sequences that fit and keeps its place with the rest, so
        micro-batches fill up to the budget. (Units never mix an over-long sequence with others:
        ``plan_micro_batches`` puts each alone, and it is then scored alone.)"""
        first = self._first_eligible()
        assert first is not None, "_take needs an eligible unit"
        if first.tokens > self._max_batch_tokens:
            self._units.remove(first)
            return [first]
        chosen: list[_Unit] = []
        rest: list[_Unit] = []
        tokens = sequences = 0
        for unit in self._units:
            left: _Unit | None = unit
            if unit.request.key == first.request.key and self._eligible(unit):
                taken, left = self._fit(unit, self._max_batch_tokens - tokens, self._max_batch_sequences - sequences)
                if taken is not None:
                    chosen.append(taken)
                    tokens += taken.tokens
                    sequences += len(taken.indices)
            if left is not None:
                rest.append(left)
        self._units = rest
        return chosen

    @staticmethod
    def _fit(unit: _Unit, room_tokens: int, room_sequences: int) -> tuple[_Unit | None, _Unit | None]:
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
        return _Unit(unit.request, taken, used), _Unit(unit.request, left, unit.tokens - used)

    async def _launch(self, units: list[_Unit]) -> _Launched:
        """Hand one micro-batch to the device thread; returns once its work is enqueued."""
        batch = _Launched(units=units, owners=[(unit.request, i) for unit in units for i in unit.indices])
        key = units[0].request.key
        metrics.observe_batch(key.model, tokens=sum(unit.tokens for unit in units), sequences=len(batch.owners))
        for request in batch.requests:
            request.first_launch_ns = request.first_launch_ns or batch.start_ns
        try:
            served = self._registry.get(key.model)
            batch.model_version = served.info.version
            batch.parts = await self._executor.launch(
                served,
                [request.job.sequences[i] for request, i in batch.owners],
                temperature=key.temperature,
                return_entropy=key.return_entropy,
            )
        except Exception as err:
            batch.error = err
        return batch

    async def _finish(self, batch: _Launched) -> None:
        """Wait for a launched micro-batch's results and scatter them back to their requests."""
        try:
            if batch.error is not None:
                raise batch.error
            for part in batch.parts:
                if part.error is not None:
                    for position in part.indices:
                        batch.owners[position][0].fail(part.error)
                    continue
                for position, scores in zip(part.indices, await self._executor.fetch(part.launched)):
                    request, i = batch.owners[position]
                    request.scores[i] = scores
                    request.remaining -= 1
        except Exception as err:  # a bug or a device fault: this batch's requests fail, the loop goes on
            log.exception("micro-batch of %d sequences failed", len(batch.owners), exc_info=err)
            for request in batch.requests:
                request.fail(err)
        finally:
            elapsed_ns = time.perf_counter_ns() - batch.start_ns
            for unit in batch.units:
                self._account(unit.request.job, -unit.tokens)
            self._observe_throughput(sum(unit.tokens for unit in batch.units), elapsed_ns)
            for request in batch.requests:
                request.compute_ns += elapsed_ns
                request.model_version = batch.model_version
                if request.remaining == 0:
                    self._complete(request)

    def _complete(self, request: _Request) -> None:
        if request.future.done():
            return
        job = request.job
        now = time.perf_counter_ns()
        timings = Timings(
            queue_ns=(request.first_launch_ns or now) - request.arrived_ns,
            compute_ns=request.compute_ns,
            total_ns=now - request.arrived_ns,
        )
        metrics.observe_scored(job.model, job.num_tokens, len(job.sequences), timings)
        request.future.set_result(
            ScoreResult(
                request_id=job.request_id,
                model=job.model,
                model_version=request.model_version,
                scores=request.scores,  # type: ignore[arg-type]  # all filled: remaining == 0
                tokens=job.num_tokens,
                timings=timings,
            )
        )

    def _observe_throughput(self, tokens: int, elapsed_ns: int) -> None:
        rate = tokens / max(elapsed_ns, 1) * 1e9
        self._tokens_per_s = rate if self._tokens_per_s == 0 else 0.8 * self._tokens_per_s + 0.2 * rate
