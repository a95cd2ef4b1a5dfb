"""The benchmarks' one timing harness, and what every report starts and ends with.

* ``time_calls``: wall time of whole calls, the device synchronized around each, median of the
  timed runs after warm-up, with the peak memory they allocated beyond what was there before
  (what a caller waits for: scoring passes, attention calls).
* ``time_kernel``: device time of a kernel, ``triton.testing.do_bench``'s median with the L2 cache
  flushed before each run (what an op costs on its own), and ``peak_extra_bytes`` of one run.
* ``matmul_tflops``: the bf16 matmul rate of this device, measured in the same run as the figures
  it is compared with (H200s vary 736-807 TFLOP/s across runs).
* ``run_environment`` / ``publish``: the report's header (device, versions, date, command) and its
  output (printed last, and written to ``$OUT`` when set).

The scripts run as ``PYTHONPATH=service:client python3 benchmarks/bench_X.py``, so this folder is
``sys.path[0]`` and ``from harness import ...`` finds this module (benchmarks/ is not a package).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from logprob_service.worker import gpu_memory

GiB = 1024**3


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Synchronize, then return the caching allocator's free blocks to the device (CUDA only)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    """Start a peak-memory measurement (CUDA only). Through ``gpu_memory``, not torch directly: a
    server in this process resets torch's peak counter at every micro-batch to measure each one."""
    if device.type == "cuda":
        gpu_memory.reset_peak(device)


def peak_allocated(device: torch.device) -> int:
    """Highest bytes allocated on ``device`` since ``reset_peak``, across the server's own resets."""
    return gpu_memory.peak_allocated(device)


def run_environment(device: torch.device) -> list[str]:
    """Report lines: the device, the library versions, the date (UTC) and the command that ran."""
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    command = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} {Path(sys.executable).name} {shlex.join(sys.argv)}"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return [
        f"device: {device_name}",
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
        f"date: {now}",
        f"command: {command}",
    ]


def publish(report: str, name: str) -> None:
    """Print ``report`` (the run's last output) and, when ``OUT`` is set, write it to ``$OUT/name``."""
    print(report)
    if out_dir := os.environ.get("OUT"):
        path = Path(out_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report)
        print(f"written: {path}", file=sys.stderr)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    times_ms: list[float]
    peak_extra_bytes: int | None  # None off CUDA
    out: Any  # the last run's result


def time_calls(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> Timing:
    """``fn`` run ``warmup`` times, then timed ``repeats`` times, each synchronized before and after."""
    release(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for _ in range(warmup):
        out = fn()
        del out
    release(device)
    reset_peak(device)
    times_ms: list[float] = []
    out = None
    for _ in range(repeats):
        out = None  # free the previous output before the next run
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    peak = peak_allocated(device) - base if device.type == "cuda" else None
    return Timing(statistics.median(times_ms), times_ms, peak, out)


def time_kernel(fn: Callable[[], Any], *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median device milliseconds of ``fn`` (``triton.testing.do_bench``: L2 flushed before each run)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """Peak bytes one run of ``fn`` allocates beyond what was allocated before it, and its result."""
    release(device)
    base = torch.cuda.memory_allocated(device)
    reset_peak(device)
    out = fn()
    synchronize(device)
    return peak_allocated(device) - base, out


def matmul_tflops(device: torch.device, size: int = 8192) -> float:
    """bf16 TFLOP/s of a ``size``^3 matmul on ``device``, now (the yardstick of a run)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    ms = time_kernel(lambda: a @ b)
    return 2 * size**3 / (ms * 1e-3) / 1e12
