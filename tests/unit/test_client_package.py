"""The client package stands alone: no torch, transformers or TRL at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_client_imports_without_torch_transformers_or_trl():
    code = (
        "import sys, logprob_client; "
        "from logprob_client import LogprobClient, AsyncLogprobClient; "
        "bad = [m for m in ('torch', 'transformers', 'trl', 'logprob_service') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
