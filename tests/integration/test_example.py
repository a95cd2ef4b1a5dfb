"""examples/grpo_remote_reference.py runs as documented: it starts a local service, trains with
TRL against it, and prints the KL and the loss of every step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step +(\d+) +kl ([0-9.]+) +loss ([-+][0-9.]+) +reward ([0-9.]+)$", re.M)


def test_grpo_remote_reference_example_prints_kl_and_loss_per_step():
    pytest.importorskip("trl", reason="the example needs trl: pip install 'logprob-service[trl]'")
    path = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_remote_reference.py"), "--steps", "3", "--beta", "0.1"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [(int(s), float(kl), float(loss)) for s, kl, loss, _ in STEP_LINE.findall(done.stdout)]
    assert [s for s, _, _ in steps] == [1, 2, 3], done.stdout
    assert steps[0][1] == 0.0  # the policy starts as the reference
    assert all(kl > 0 for _, kl, _ in steps[1:]), "after an update the policy differs from the served reference"
