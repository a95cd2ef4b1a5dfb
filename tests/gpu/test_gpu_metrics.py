"""The GPU memory series on CUDA: the gauges are torch.cuda's figures, each micro-batch's peak is
observed, and the per-micro-batch resets of torch's peak counter keep the peak since start.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from logprob_service.worker import gpu_memory

from tests.helpers.calls import call, request
from tests.helpers.metrics import value
from tests.helpers.server import start, stop, test_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MiB = 1024**2


def test_micro_batch_peak_forgets_earlier_peaks_but_the_peak_since_start_keeps_them():
    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.memory_allocated(device)
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    del big
    with gpu_memory.micro_batch_peak(device) as meter:
        small = torch.empty(MiB, dtype=torch.uint8, device=device)
    assert before + MiB <= meter.bytes < before + 256 * MiB
    assert gpu_memory.peak_allocated(device) >= before + 256 * MiB
    del small


async def test_gpu_memory_gauges_are_torch_cuda_figures():
    running = await start(test_settings(None, models={"default": "builtin:tiny-llama"}, device="cuda"))
    info = running.service.device_side.registry.get("default").info
    device = torch.device(info.device)
    label = {"device": info.device}
    batches = (
        value("logprob_gpu_memory_batch_peak_bytes_count", **label),
        value("logprob_gpu_memory_batch_peak_bytes_sum", **label),
    )
    try:
        await call(running.target, request(([1, 2, 3], [4, 5])))
        torch.cuda.synchronize(device)
        # The server is idle: a scrape now reads what torch.cuda reads.
        assert value("logprob_gpu_memory_allocated_bytes", **label) == torch.cuda.memory_allocated(device)
        assert value("logprob_gpu_memory_reserved_bytes", **label) == torch.cuda.memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        assert value("logprob_gpu_memory_total_bytes", **label) == total
        # Free memory is the whole device's: another process may move it a little in between.
        assert value("logprob_gpu_memory_free_bytes", **label) == pytest.approx(free, abs=64 * MiB)
        # One micro-batch; its peak holds at least the weights, and the peak since start is higher.
        weights = sum(p.numel() * p.element_size() for p in running.scorer("default").model.parameters())
        count = value("logprob_gpu_memory_batch_peak_bytes_count", **label) - batches[0]
        peak = value("logprob_gpu_memory_batch_peak_bytes_sum", **label) - batches[1]
        assert count == 1 and weights <= peak <= total
        assert value("logprob_gpu_memory_peak_allocated_bytes", **label) >= peak
    finally:
        await stop(running)
