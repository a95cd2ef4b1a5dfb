"""What the framework tests share: a tiny random Qwen2 saved as a Hugging Face checkpoint, served
by ``logprob-service serve`` in a subprocess (CPU, float32) as users run it, and a scrape of that
server's metrics. These tests run in an environment of their own (scripts/install-frameworks.sh:
the frameworks installed ``--no-deps`` with what their tested modules import); each test module
skips, saying why, where its framework is not importable."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.helpers.models import COMMON
from tests.helpers.processes import free_port, launch, wait_serving

# The test suite's tiny shapes (tests/helpers/models.py), as a Qwen2: a trainer's model.path.
QWEN2 = COMMON


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 of two layers as an HF checkpoint directory (what a trainer's model.path names)."""
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(20261126)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2)).save_pretrained(path)
    return path


@dataclass
class Served:
    target: str
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        """A counter's value from the server's /metrics (0 when absent)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, _, value = line.rpartition(" ")
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total


@pytest.fixture(scope="session")
def served(qwen_dir: Path) -> Iterator[Served]:
    """The service, serving the checkpoint as ``ref`` and ``policy`` and builtin:tiny-llama (another
    vocabulary) as ``tiny``, float32 on the CPU."""
    port, metrics_port = free_port(), free_port()
    proc = launch(
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--device", "cpu", "--dtype", "float32",
        "--model", f"ref={qwen_dir}", "--model", f"policy={qwen_dir}", "--model", "tiny=builtin:tiny-llama",
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        yield Served(f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def use_cpu_platform() -> None:
    """verl 0.9.1 knows no CPU platform (it falls back to CUDA's when no accelerator answers): give
    it one, so that its workers run in this process. Only what its workers call of the device
    module is there; memory figures are 0."""
    import types

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    device = types.SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        device_count=lambda: 1,
        set_device=lambda index: None,
        synchronize=lambda index=None: None,
        empty_cache=lambda: None,
        max_memory_allocated=lambda *a, **k: 0,
        max_memory_reserved=lambda *a, **k: 0,
        memory_allocated=lambda *a, **k: 0,
        memory_reserved=lambda *a, **k: 0,
        reset_peak_memory_stats=lambda *a, **k: None,
        mem_get_info=lambda *a, **k: (0, 0),
        get_device_name=lambda *a, **k: "CPU",  # verl's flops counter (mfu) asks
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = device

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):
            import contextlib

            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    set_platform(CpuPlatform())


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """verl's workers expect torch.distributed: one CPU process, gloo (per test module)."""
    use_cpu_platform()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
