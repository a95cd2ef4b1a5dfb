"""Shared fixtures: small random models of several architectures, fresh random inputs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Tests run against the source tree even when the package is not installed (e.g. on the GPU box).
for sub in ("service", "client"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
