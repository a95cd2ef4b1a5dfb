"""The client package stands alone: no torch or transformers at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_client_imports_without_torch_or_transformers():
    code = (
        "import sys, logprob_client; "
        "from logprob_client import LogprobClient, AsyncLogprobClient; "
        "bad = [m for m in ('torch', 'transformers', 'logprob_service') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
