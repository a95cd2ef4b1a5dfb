"""Admission and ordering of scoring work (asyncio side; never runs torch).

Every request enters one FIFO queue bounded by tokens (``max_queued_tokens``): past it, the
request is refused at once with RESOURCE_EXHAUSTED and a retry hint derived from the measured
throughput. A worker coroutine hands jobs to the device executor one at a time, dropping those
whose caller went away (cancelled) or whose deadline passed (DEADLINE_EXCEEDED) before they
reach the device.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from . import metrics
from .errors import DeadlineExceeded, Overloaded
from .executor import DeviceExecutor
from .jobs import ScoreJob, ScoreResult, Timings
from .models.registry import ModelRegistry

log = logging.getLogger(__name__)

_MIN_RETRY_S, _MAX_RETRY_S = 0.05, 30.0


@dataclass
class _Pending:
    job: ScoreJob
    arrived_ns: int
    future: asyncio.Future[ScoreResult] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Scheduler:
    def __init__(self, registry: ModelRegistry, executor: DeviceExecutor, *, max_queued_tokens: int) -> None:
        self._registry = registry
        self._executor = executor
        self._max_queued_tokens = max_queued_tokens
        self._queued_tokens = 0
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._tokens_per_s = 0.0  # moving average of measured device throughput

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="logprob-scheduler")

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    async def submit(self, job: ScoreJob) -> ScoreResult:
        """Queue ``job`` and wait for its result. Cancelling the caller removes the job."""
        tokens = job.num_tokens
        if self._queued_tokens + tokens > self._max_queued_tokens:
            raise Overloaded(
                f"server queue holds {self._queued_tokens} tokens; this request's {tokens} would pass "
                f"max_queued_tokens={self._max_queued_tokens}",
                retry_after_s=self._retry_after_s(self._queued_tokens + tokens - self._max_queued_tokens),
            )
        pending = _Pending(job=job, arrived_ns=time.perf_counter_ns())
        self._queued_tokens += tokens
        metrics.QUEUED_TOKENS.set(self._queued_tokens)
        self._queue.put_nowait(pending)
        try:
            return await pending.future
        finally:
            pending.future.cancel()  # no-op when done; marks a cancelled caller's job as dead

    def _retry_after_s(self, excess_tokens: int) -> float:
        if self._tokens_per_s <= 0:
            return 1.0
        return min(_MAX_RETRY_S, max(_MIN_RETRY_S, excess_tokens / self._tokens_per_s))

    async def _run(self) -> None:
        while True:
            pending = await self._queue.get()
            try:
                await self._process(pending)
            finally:
                self._queued_tokens -= pending.job.num_tokens
                metrics.QUEUED_TOKENS.set(self._queued_tokens)

    async def _process(self, pending: _Pending) -> None:
        job = pending.job
        if pending.future.done():  # the caller went away while the job was queued
            return
        if job.deadline is not None and time.monotonic() >= job.deadline:
            pending.future.set_exception(
                DeadlineExceeded(f"request {job.request_id}: deadline passed while queued; nothing was computed")
            )
            return
        started_ns = time.perf_counter_ns()
        try:
            served = self._registry.get(job.model)
            computed = await self._executor.run(served, job)
        except Exception as err:  # delivered to the caller; the worker goes on with the next job
            if not pending.future.done():
                pending.future.set_exception(err)
            return
        self._observe_throughput(job.num_tokens, computed.compute_ns)
        metrics.observe_scored(job.model, job.num_tokens, len(job.sequences))
        if pending.future.done():
            return
        now_ns = time.perf_counter_ns()
        pending.future.set_result(
            ScoreResult(
                request_id=job.request_id,
                model=job.model,
                model_version=computed.model_version,
                scores=computed.scores,
                tokens=job.num_tokens,
                timings=Timings(
                    queue_ns=started_ns - pending.arrived_ns,
                    compute_ns=computed.compute_ns,
                    total_ns=now_ns - pending.arrived_ns,
                ),
            )
        )

    def _observe_throughput(self, tokens: int, compute_ns: int) -> None:
        rate = tokens / max(compute_ns, 1) * 1e9
        self._tokens_per_s = rate if self._tokens_per_s == 0 else 0.8 * self._tokens_per_s + 0.2 * rate
