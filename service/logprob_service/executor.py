"""The device worker: one thread per device runs every torch call, so the asyncio loop never does.

CUDA work is serialized on that thread: concurrent forwards would only contend for the same
GPU and multiply peak memory.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import Overloaded
from .jobs import ScoreJob, SequenceScores
from .models.registry import ServedModel


@dataclass(frozen=True)
class Computed:
    scores: list[SequenceScores]
    model_version: int
    compute_ns: int


class DeviceExecutor:
    def __init__(self, name: str = "device") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"logprob-{name}")

    async def run(self, served: ServedModel, job: ScoreJob) -> Computed:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _compute, served, job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _compute(served: ServedModel, job: ScoreJob) -> Computed:
    start = time.perf_counter_ns()
    try:
        # score() copies results to host memory, which waits for the device: the time is real.
        scores = served.scorer.score(job.sequences, temperature=job.temperature, return_entropy=job.return_entropy)
    except torch.OutOfMemoryError:
        scores = None  # handled below, once the traceback no longer holds the failed batch's tensors
    if scores is None:
        torch.cuda.empty_cache()  # hand the failed batch's blocks back before the next job
        raise Overloaded(
            f"request {job.request_id}: out of device memory scoring {job.num_tokens} tokens "
            f"in {len(job.sequences)} sequences; send fewer tokens per request",
            retry_after_s=1.0,
        )
    return Computed(scores=scores, model_version=served.info.version, compute_ns=time.perf_counter_ns() - start)
