"""Why CUDA cannot start here, in one message a user can act on.

A server asked for a GPU (``--device cuda``) on a node whose driver is too old for the installed
torch, or with no GPU passed to its container, must stop at start-up and say so: the CUDA version
torch was built for, the driver's version (read without CUDA: the kernel module's version file,
else ``nvidia-smi``), and what to change. ``--device auto`` falls back to the CPU with the same
reason as a warning.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import torch

# NVIDIA's minimum Linux driver of each CUDA line that PyTorch publishes wheels for (the CUDA
# toolkit release notes, "CUDA Toolkit and Corresponding Driver Versions"; docs/deployment.md).
MIN_DRIVER = {"12.6": "560.28.03", "12.8": "570.26", "13.0": "580.65.06"}
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
_FIX = (
    "Fix: a torch built for a CUDA this driver supports (the image: --build-arg TORCH_CUDA=cu126, cu128 or cu130; "
    "docs/deployment.md, 'GPU drivers'), a newer driver, or --device cpu to serve on the CPU on purpose."
)


def driver_version(version_file: Path = DRIVER_VERSION_FILE) -> str | None:
    """The NVIDIA driver's version, e.g. ``570.86.15``; None where no driver is found."""
    try:
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", version_file.read_text())
    except OSError:
        found = None
    if found:
        return found.group(1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def _start_error() -> str:
    """What torch says when it starts CUDA here (its first line)."""
    try:
        torch.cuda.init()
    except Exception as err:  # torch raises RuntimeError or AssertionError, with the driver's reason
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return "no CUDA device is visible" if torch.cuda.device_count() == 0 else "CUDA started"


def why_cuda_unusable(driver: str | None = None, cuda: str | None = None) -> str:
    """Why CUDA cannot be used, what torch and the driver are, and the fix. ``driver`` and
    ``cuda`` (torch's CUDA version) default to this host's: tests pass their own."""
    cuda = cuda if cuda is not None else torch.version.cuda
    driver = driver if driver is not None else driver_version()
    if cuda is None:
        return (
            f"torch {torch.__version__} is a CPU build (no CUDA). Fix: install a CUDA build of torch "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu128; docs/deployment.md), "
            "or --device cpu to serve on the CPU on purpose."
        )
    needs = f", which needs an NVIDIA driver >= {MIN_DRIVER[cuda]}" if cuda in MIN_DRIVER else ""
    if driver is None:
        return (
            f"{_start_error()}; torch {torch.__version__} is built for CUDA {cuda}{needs}; no NVIDIA driver found "
            f"(no {DRIVER_VERSION_FILE}, no nvidia-smi). Fix: run on a GPU node with the GPU given to the container "
            "(docker run --gpus all; Kubernetes: an nvidia.com/gpu limit and the NVIDIA runtime), "
            "or --device cpu to serve on the CPU on purpose."
        )
    return f"{_start_error()}; torch {torch.__version__} is built for CUDA {cuda}{needs}; driver {driver}. {_FIX}"
