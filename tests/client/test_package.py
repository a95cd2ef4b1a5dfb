"""The client package stands alone: no torch, transformers or TRL at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    "module,missing,hint",
    [
        ("logprob_client.losses", "torch", "needs torch: pip install torch"),
        ("logprob_client.integrations.trl", "trl", 'needs TRL: pip install "logprob-service[trl]"'),
    ],
)
def test_optional_modules_say_what_to_install(module, missing, hint):
    # sys.modules[name] = None makes `import name` fail, as on an install without it.
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and f"ImportError: {module} {hint}" in done.stderr, done.stderr
