"""Shared fixtures: small random models of several architectures, fresh random inputs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Tests run against the source tree even when the package is not installed (e.g. on the GPU box).
for sub in ("service", "client"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before the
# kernels are defined (at import of ops.fused_logprobs), hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
