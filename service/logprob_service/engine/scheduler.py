"""The scheduler loop: admitted work to micro-batches on the devices, results back to each request.

``submit`` waits for the request's ``min_version`` if it has one, plans its micro-batches
(``BatchQueue.plan``: what it costs as it runs), admits it (``Admission``: budget, fair share and
deadline), queues it and waits for its result. The loop
takes micro-batches from the one queue (its clients in turn: ``BatchQueue``'s deficit
round-robin) and hands each to a device's worker (``Executor``): a
*lane* per device, each holding a replica of every model (data parallel). A micro-batch goes to
the lane with the least work (token-equivalents) in flight among those with room, so a device
that computes faster (or got shorter batches) takes more. When a device is idle the loop waits up to
``max_wait_ms`` after the oldest unit's arrival for more work to fill a batch, but no longer than
``max_wait_quiet_ms`` after the last request arrived: requests sent together (a trainer's step,
a call split into RPCs) arrive in a burst and are batched, and a lone request is not held for
work that is not coming. Two micro-batches
are kept in flight per lane, so the next one is packed and enqueued while the device computes
the current one. Units whose caller went away or whose deadline passed are
dropped before they reach the device. Results are scattered back by sequence index, so every
response is in request order however its sequences were batched.

Weight swaps (``swap``) run in the loop, on every lane's device thread at once, between
micro-batches: while a swap of a model waits, the queue holds that model's requests not yet
started, and those already partly launched finish on the old weights first; no micro-batch of
the model is launched on any lane until every replica has swapped. Every response is scored by
one version, the one it reports, whichever replica scored it. The loop never runs torch: the
executors do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from logprob_service.domain import ScoreJob, ScoreResult, SequenceScores, Timings
from logprob_service.engine import slices
from logprob_service.engine.admission import Admission
from logprob_service.engine.batch_queue import TAIL_FRACTION, BatchQueue, Request, RequestSlice, owners_of, requests_of
from logprob_service.engine.interfaces import Executor, Launch
from logprob_service.engine.registry import ModelRegistry
from logprob_service.errors import FailedPrecondition, LogprobError, Unavailable
from logprob_service.stats import NO_STATS, BatchLaunched, Limits, QueueChanged, RequestScored, StatsSink

log = logging.getLogger(__name__)

# A min_version wait ends this long before the request's deadline (at most; a share of a short one).
VERSION_WAIT_MARGIN_S, VERSION_WAIT_MARGIN_SHARE = 1.0, 0.2
PIPELINE_DEPTH = 2  # micro-batches in flight: one computing, one being packed and enqueued


@dataclass(eq=False)
class _Swap:
    """A weight swap waiting for its model's started requests to finish."""

    apply: Callable[[int], None]  # apply(lane): on that lane's device thread, for its replica
    done: asyncio.Future[None]


@dataclass(eq=False)
class _Lane:
    """One device: its worker, and the micro-batches in flight on it with their cost."""

    index: int
    executor: Executor
    in_flight: dict[asyncio.Task[None], int] = field(default_factory=dict)
    last_finish_ns: int = 0  # when its last micro-batch's results were back

    @property
    def cost(self) -> int:
        return sum(self.in_flight.values())

    @property
    def has_room(self) -> bool:
        return len(self.in_flight) < PIPELINE_DEPTH

    def add(self, task: asyncio.Task[None], cost: int) -> None:
        self.in_flight[task] = cost
        task.add_done_callback(lambda t: self.in_flight.pop(t, None))

    def finished(self, start_ns: int) -> int:
        """A micro-batch launched at ``start_ns`` is done: how long it held the device (since its
        launch, or since the one before it on this device was done, whichever is later)."""
        now = time.perf_counter_ns()
        busy_ns = now - max(start_ns, self.last_finish_ns)
        self.last_finish_ns = now
        return busy_ns


@dataclass(eq=False)
class _Launched:
    """A micro-batch handed to the device: who owns each of its sequences, and its parts."""

    units: list[RequestSlice]
    tokens: int = 0  # run on the device (a prompt shared by several sequences once)
    cost: int = 0  # token-equivalents (costs.run_costs)
    start_ns: int = field(default_factory=time.perf_counter_ns)
    model_version: int = 0
    parts: list[Launch] = field(default_factory=list)
    error: Exception | None = None

    def __post_init__(self) -> None:
        self.owners = owners_of(self.units)  # (request, sequence index) of each position in the batch
        self.requests = requests_of(self.owners)


def _finite(scores: SequenceScores) -> bool:
    return bool(np.isfinite(scores.logprobs).all()) and (
        scores.entropies is None or bool(np.isfinite(scores.entropies).all())
    )


def _nonfinite_scores(job: ScoreJob, sequence: int, version: int) -> LogprobError:
    """A request whose scores came out NaN or infinite: weights that hold such values (loaded
    without the update's check), or a fault. INTERNAL: no change to the request helps."""
    return LogprobError(
        f"model {job.model!r} version {version} scored NaN or infinite log-probabilities for sequence {sequence} "
        "of this request; its weights may hold non-finite values (the server keeps serving)"
    )


def _request(job: ScoreJob, future: asyncio.Future[ScoreResult]) -> Request:
    """A queued request that ends by settling ``future`` (once: a cancelled caller's future stays cancelled)."""

    def fail(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def complete(result: ScoreResult) -> None:
        if not future.done():
            future.set_result(result)

    return Request(job, done=future.done, fail=fail, complete=complete)


class Scheduler:
    def __init__(
        self,
        registry: ModelRegistry,
        executors: Sequence[Executor],
        *,
        max_queued_tokens: int,
        max_queued_tokens_per_client: int,
        max_batch_tokens: int,
        max_batch_sequences: int,
        max_wait_ms: float,
        max_wait_quiet_ms: float | None = None,
        max_version_wait_s: float = 300.0,
        share_prompts: bool = False,
        stats: StatsSink = NO_STATS,
    ) -> None:
        self._registry = registry
        self._lanes = [_Lane(i, executor) for i, executor in enumerate(executors)]
        self._stats = stats
        self.admission = Admission(
            max_queued_tokens=max_queued_tokens,
            max_queued_tokens_per_client=max_queued_tokens_per_client,
            # Smaller micro-batches (the warm-up's, a lone small request's) are mostly fixed cost:
            # their time says little about how fast queued work goes.
            min_measured_cost=max_batch_tokens // TAIL_FRACTION,
            turn_tokens=max_batch_tokens,  # the queue's round-robin quantum
            in_flight_tokens=PIPELINE_DEPTH * len(executors) * max_batch_tokens,
            devices=len(executors),
            stats=stats,
        )
        self.queue = BatchQueue(
            max_batch_tokens=max_batch_tokens, max_batch_sequences=max_batch_sequences, share_prompts=share_prompts
        )
        self._max_wait_s = max_wait_ms / 1000
        # None: no quiet limit, the idle device waits max_wait_ms whatever comes.
        self._quiet_s = self._max_wait_s if max_wait_quiet_ms is None else max_wait_quiet_ms / 1000
        self._last_arrival_ns = 0
        self._max_version_wait_s = max_version_wait_s
        self._wake = asyncio.Event()
        self._not_launching = asyncio.Event()
        self._not_launching.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._swaps: dict[str, _Swap] = {}  # model -> its pending weight swap
        self._version_changed = asyncio.Condition()
        stats.record(Limits(max_batch_tokens, max_batch_sequences, max_queued_tokens))

    async def between_launches(self, max_wait_s: float) -> None:
        """Returns when no micro-batch is being launched (or after ``max_wait_s``): a device
        thread launching one runs Python for each kernel, and anything else that holds the
        interpreter lock meanwhile (reading a weight push) delays it."""
        if not self._not_launching.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._not_launching.wait(), max_wait_s)

    @property
    def pending_swaps(self) -> set[str]:
        """The models whose weight swap waits for their started requests."""
        return set(self._swaps)

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="logprob-scheduler")

    async def close(self) -> None:
        for swap in self._swaps.values():
            swap.done.set_exception(Unavailable("the server is shutting down; the weights were not swapped"))
        self._swaps.clear()
        tasks = [t for t in (self._loop_task, *self._in_flight()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None

    async def swap(self, model: str, apply: Callable[[int], None]) -> None:
        """Run ``apply(lane)`` (which replaces the weights of ``model``'s replica on that lane) on
        every lane's device thread between micro-batches, once the requests of ``model`` already
        started have been launched; returns when every replica has swapped."""
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
            # Give up before the deadline, by a share of it, so that the caller gets this
            # FAILED_PRECONDITION (naming both versions) rather than its own DEADLINE_EXCEEDED.
            remaining = job.deadline - time.monotonic()
            timeout = min(timeout, remaining - min(VERSION_WAIT_MARGIN_S, VERSION_WAIT_MARGIN_SHARE * remaining))
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
        future: asyncio.Future[ScoreResult] = asyncio.get_running_loop().create_future()
        request = _request(job, future)
        units = await slices.run(self.queue.plan_steps(request))  # handing the loop back between slices
        self.admission.admit(job, request.cost, time.monotonic())
        self.queue.add(units)
        self._last_arrival_ns = request.arrived_ns
        self._stats.record(QueueChanged(job.model, requests=1))
        self._wake.set()
        try:
            return await future
        finally:
            self._stats.record(QueueChanged(job.model, requests=-1))
            # However it ended (answered, failed, or its caller cancelled, which cancels the
            # future), none of its work stays queued.
            future.cancel()
            self._release(request.job, self.queue.discard(request))

    # The batching loop.

    async def _run(self) -> None:
        while True:
            while self._freest_lane() is None:
                await asyncio.wait(self._in_flight(), return_when=asyncio.FIRST_COMPLETED)
            # The next batch is formed only once the previous launch has returned (its kernels are
            # queued), so deadlines and cancellations are checked right before each launch.
            units = await self._next_batch()
            lane = self._freest_lane()  # lanes only free up while the batch formed: there is one
            assert lane is not None
            batch = await self._launch(units, lane)
            lane.add(asyncio.create_task(self._finish(batch, lane)), batch.cost)

    def _freest_lane(self) -> _Lane | None:
        """The lane with room and the least work in flight (the first such), or None."""
        free = [lane for lane in self._lanes if lane.has_room]
        return min(free, key=lambda lane: (lane.cost, lane.index), default=None)

    def _in_flight(self) -> list[asyncio.Task[None]]:
        return [task for lane in self._lanes for task in lane.in_flight]

    async def _next_batch(self) -> list[RequestSlice]:
        while True:
            # Cleared before the state is looked at, not after: what comes meanwhile (a swap or a
            # request while a swap runs on the device, below) sets it again and is seen at once.
            # Cleared after, such a wake was lost, and a model held for a swap that nothing woke
            # the loop to run waited for good (tests/engine/test_lanes.py).
            self._wake.clear()
            self._drop_dead()
            await self._run_due_swaps()
            timeout = None
            first = self.queue.first_eligible(self._swaps)
            if first is not None:
                now = time.perf_counter_ns()
                waited = (now - first.request.arrived_ns) / 1e9
                quiet = (now - self._last_arrival_ns) / 1e9
                device_idle = any(not lane.in_flight for lane in self._lanes)
                if (
                    not device_idle
                    or waited >= self._max_wait_s
                    or quiet >= self._quiet_s
                    or self.queue.fills_a_batch(first, self._swaps)
                ):
                    return self.queue.take(self._swaps, spread=len(self._lanes))
                timeout = min(self._max_wait_s - waited, self._quiet_s - quiet)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def _drop_dead(self) -> None:
        for request, admitted in self.queue.drop_dead(time.monotonic()):
            self._release(request.job, admitted)

    def _release(self, job: ScoreJob, admitted: int) -> None:
        """``admitted`` token-equivalents of ``job``'s queued work were dropped."""
        if admitted:
            self.admission.release(job, admitted)

    async def _run_due_swaps(self) -> None:
        """Swap the weights of every model with a pending swap and no started request queued."""
        for model, swap in list(self._swaps.items()):
            if self.queue.holds_started_work(model, self._swaps):
                continue
            del self._swaps[model]
            # Every replica at once; none of the model's micro-batches launches meanwhile.
            outcomes = await asyncio.gather(
                *(lane.executor.run(functools.partial(swap.apply, lane.index)) for lane in self._lanes),
                return_exceptions=True,
            )
            errors = [e for e in outcomes if isinstance(e, BaseException)]
            if errors:
                swap.done.set_exception(errors[0])
            else:
                swap.done.set_result(None)

    async def _launch(self, units: list[RequestSlice], lane: _Lane) -> _Launched:
        """Hand one micro-batch to ``lane``'s device thread; returns once its work is enqueued."""
        batch = _Launched(units)
        key = units[0].request.key
        sequences = [request.job.sequences[i] for request, i in batch.owners]
        # The whole micro-batch: prompts shared across units count once.
        batch.cost = self.queue.cost(sequences)
        batch.tokens = self.queue.tokens(sequences)
        shared = sum(s.num_tokens for s in sequences) - batch.tokens
        for request in batch.requests:
            request.first_launch_ns = request.first_launch_ns or batch.start_ns
        self._not_launching.clear()
        try:
            served = self._registry.replicas(key.model)[lane.index]
            device = str(served.device)
            self._stats.record(BatchLaunched(key.model, batch.tokens, len(sequences), shared, device))
            batch.model_version = served.info.version
            batch.parts = await lane.executor.launch(served, sequences, key.options)
        except Exception as err:
            batch.error = err
        finally:
            self._not_launching.set()
        return batch

    async def _finish(self, batch: _Launched, lane: _Lane) -> None:
        """Wait for a launched micro-batch's results and scatter them back to their requests."""
        whole = False  # every part of it computed: its time measures the throughput
        try:
            if batch.error is not None:
                raise batch.error
            for part in batch.parts:
                if part.error is not None:
                    for position in part.indices:
                        batch.owners[position][0].fail(part.error)
                    continue
                for position, scores in zip(part.indices, await lane.executor.fetch(part.launched)):
                    request, i = batch.owners[position]
                    if not _finite(scores):
                        request.fail(_nonfinite_scores(request.job, i, batch.model_version))
                    request.scores[i] = scores
                    request.remaining -= 1
            whole = all(part.error is None for part in batch.parts)
        except Exception as err:  # a bug or a device fault: this batch's requests fail, the loop goes on
            log.exception("micro-batch of %d sequences failed", len(batch.owners), exc_info=err)
            for request in batch.requests:
                request.fail(err)
        finally:
            elapsed_ns = time.perf_counter_ns() - batch.start_ns
            busy_ns = lane.finished(batch.start_ns)
            for unit in batch.units:
                self.admission.release(unit.request.job, unit.admitted)
            if whole:
                self.admission.observe(sum(unit.admitted for unit in batch.units), busy_ns)
            for request in batch.requests:
                request.compute_ns += elapsed_ns
                request.model_version = batch.model_version
                if request.remaining == 0:
                    self._complete(request)

    def _complete(self, request: Request) -> None:
        if request.done():
            return
        job = request.job
        now = time.perf_counter_ns()
        timings = Timings(
            queue_ns=(request.first_launch_ns or now) - request.arrived_ns,
            compute_ns=request.compute_ns,
            total_ns=now - request.arrived_ns,
        )
        self._stats.record(RequestScored(job.model, job.num_tokens, len(job.sequences), timings))
        request.complete(
            ScoreResult(
                request_id=job.request_id,
                model=job.model,
                model_version=request.model_version,
                scores=request.scores,  # type: ignore[arg-type]  # all filled: remaining == 0
                tokens=job.num_tokens,
                timings=timings,
            )
        )
