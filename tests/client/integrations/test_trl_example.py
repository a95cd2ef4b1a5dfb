"""examples/grpo_remote_reference.py runs as documented: it starts a local service, trains with
TRL against it, and prints the KL and the loss of every step (and the reward of every step that
generated); its defaults fit the service ``make serve`` runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from logprob_service.settings.model import Settings

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "grpo_remote_reference.py"
STEP_LINE = re.compile(r"^step +(\d+) +kl ([0-9.]+) +loss ([-+][0-9.]+)(?: +reward ([0-9.]+))?$", re.M)


def test_grpo_remote_reference_example_prints_kl_and_loss_per_step():
    """With ``num_iterations=2`` TRL generates every other step, and logs no reward on the steps
    between: the example's callback raised ``KeyError: 'reward'`` there."""
    pytest.importorskip("trl", reason="the example needs trl: pip install trl==1.16.0")
    path = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3", "--beta", "0.1", "--num-iterations", "2"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [(int(s), float(kl), float(loss), reward) for s, kl, loss, reward in STEP_LINE.findall(done.stdout)]
    assert [s for s, *_ in steps] == [1, 2, 3], done.stdout
    assert steps[0][1] == 0.0  # the policy starts as the reference
    assert all(kl > 0 for _, kl, _, _ in steps[1:]), "after an update the policy differs from the served reference"
    assert [bool(reward) for *_, reward in steps] == [True, False, True], "a reward where TRL generated"


def test_the_examples_defaults_fit_make_serve():
    """``--target localhost:50051`` alone works against ``make serve`` (a server with its default
    models): the example's reference is the model it serves, the policy the example trains."""
    pytest.importorskip("trl", reason="the example needs trl: pip install trl==1.16.0")
    spec = importlib.util.spec_from_file_location("grpo_remote_reference", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    served = Settings.model_fields["models"].default_factory()
    assert served == {"default": "builtin:tiny-llama"}  # what the example's policy is built from
    assert example.argument_parser().parse_args(["--target", "localhost:50051"]).reference in served
