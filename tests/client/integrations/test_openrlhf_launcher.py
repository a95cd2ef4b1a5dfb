"""The OpenRLHF launcher's own command line, on a machine without OpenRLHF (tests/frameworks runs
it with OpenRLHF): --help lists its flags, and a missing Ray or OpenRLHF is one line saying what
to install, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytest.importorskip("torch", reason="the integration imports torch")


def launcher(*args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m logprob_client.integrations.openrlhf ARGS``, with the modules ``block`` unimportable."""
    code = (
        "import sys, runpy; "
        + "".join(f"sys.modules[{name!r}] = None; " for name in block)
        + "runpy.run_module('logprob_client.integrations.openrlhf', run_name='__main__', alter_sys=True)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)


def test_help_lists_the_launchers_flags_and_where_openrlhf_s_are():
    done = launcher("--help")
    assert done.returncode == 0, done.stderr
    assert "is required" not in done.stdout + done.stderr
    for flag in ("--ref.service_address", "--ref.service_model", "--ref.service_timeout_s", "train_ppo_ray --help"):
        assert flag in done.stdout, flag


def test_without_ray_the_launcher_says_what_to_install():
    done = launcher("--ref.service_address", "127.0.0.1:1", "--actor.model_name_or_path", "m", block=("ray",))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert "needs OpenRLHF and Ray on this machine: pip install openrlhf==" in done.stderr
