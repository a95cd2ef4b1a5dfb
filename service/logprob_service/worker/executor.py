"""The device worker: every torch call runs on one device thread, so the asyncio loop never does.

``launch`` packs a micro-batch and enqueues its scoring on the device thread; it returns as soon
as the kernels are queued, so the thread is free to pack and enqueue the next micro-batch while
the device computes this one. ``fetch`` waits for the results on a second thread.

A CUDA out-of-memory error while launching splits the micro-batch in half and retries each half,
down to a single sequence; only a sequence that cannot fit alone fails (RESOURCE_EXHAUSTED,
naming its length). The failed attempt's memory is handed back before the retry.

On CUDA, the peak memory allocated while each micro-batch is launched is reported as a
``stats.BatchMemory`` (``gpu_memory.micro_batch_peak``; the allocator counts allocations as work
is enqueued).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from logprob_service.domain import ScoreOptions, SequenceScores, TokenSequence
from logprob_service.errors import LogprobError, Overloaded
from logprob_service.models.scorer import CausalLMScorer, Launched
from logprob_service.models.served import ServedModel
from logprob_service.stats import NO_STATS, BatchMemory, StatsSink
from logprob_service.worker import gpu_memory
from logprob_service.worker.packing import pack

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LaunchGroup:
    """Some sequences of a micro-batch (by position), launched together or failed together."""

    indices: list[int]
    launched: Launched | None = None
    error: LogprobError | None = None


def launch_splitting_on_oom(
    scorer: CausalLMScorer,
    sequences: Sequence[TokenSequence],
    indices: list[int],
    options: ScoreOptions,
) -> list[LaunchGroup]:
    """Launch ``sequences[indices]`` as one packed batch, halving it on out-of-memory."""
    try:
        batch = pack([sequences[i] for i in indices], share_prompts=scorer.options.share_prompts)
        return [LaunchGroup(indices, launched=scorer.launch(batch, options))]
    except torch.OutOfMemoryError:
        pass  # handled below, once the traceback no longer holds the failed attempt's tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if len(indices) == 1:
        seq = sequences[indices[0]]
        room = ""
        if scorer.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(scorer.device)
            room = f" ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free on {scorer.device} with the models loaded)"
        return [
            LaunchGroup(
                indices,
                error=Overloaded(
                    f"a sequence of {seq.num_tokens} tokens ({len(seq.prompt_ids)} prompt + "
                    f"{len(seq.completion_ids)} completion) does not fit in device memory even alone{room}",
                    retry_after_s=5.0,
                ),
            )
        ]
    half = len(indices) // 2
    log.warning("out of device memory on %d sequences: retrying as two halves", len(indices))
    return launch_splitting_on_oom(scorer, sequences, indices[:half], options) + launch_splitting_on_oom(
        scorer, sequences, indices[half:], options
    )


def launch_measured(
    scorer: CausalLMScorer,
    sequences: Sequence[TokenSequence],
    options: ScoreOptions,
    *,
    stats: StatsSink = NO_STATS,
) -> list[LaunchGroup]:
    """``launch_splitting_on_oom`` over all of ``sequences``, observing its peak device memory."""
    with gpu_memory.micro_batch_peak(scorer.device) as peak:
        parts = launch_splitting_on_oom(scorer, sequences, list(range(len(sequences))), options)
    if peak.bytes is not None:
        stats.record(BatchMemory(str(scorer.device), peak.bytes))
    return parts


class DeviceExecutor:
    """The engine's ``Executor``: one device thread for every torch call, one thread to wait for results."""

    def __init__(self, stats: StatsSink = NO_STATS, device: torch.device | None = None) -> None:
        self._stats = stats
        # The device thread's current device is its GPU: kernels (Triton's among them) launch
        # there, whichever GPU the other lanes' threads drive.
        on_gpu = device is not None and device.type == "cuda"
        initializer = functools.partial(torch.cuda.set_device, device) if on_gpu else None
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprob-device", initializer=initializer)
        self._fetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprob-fetch", initializer=initializer)

    async def launch(
        self, served: ServedModel, sequences: Sequence[TokenSequence], options: ScoreOptions
    ) -> list[LaunchGroup]:
        def launch() -> list[LaunchGroup]:
            served.activate()  # a LoRA model and its base share one model: select which one scores
            return launch_measured(served.scorer, sequences, options, stats=self._stats)

        return await self.run(launch)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread, after everything launched before it (e.g. a weight swap)."""
        return await asyncio.get_running_loop().run_in_executor(self._device, fn)

    async def fetch(self, launched: Launched) -> list[SequenceScores]:
        return await asyncio.get_running_loop().run_in_executor(self._fetch, launched.fetch)

    def shutdown(self) -> None:
        self._device.shutdown(wait=True, cancel_futures=True)
        self._fetch.shutdown(wait=True, cancel_futures=True)
