"""The Makefile's install step, by dry run (``make -n``): it installs again when TORCH_SPEC changes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
INSTALL = "scripts/install.sh"


def dry_run(venv: Path, torch_spec: str) -> str:
    """What ``make install`` would run with this venv and TORCH_SPEC."""
    done = subprocess.run(
        [MAKE, "-n", "-C", str(ROOT), f"VENV={venv}", f"TORCH_SPEC={torch_spec}", "install"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(MAKE is None, reason="no make on this machine")
def test_a_changed_torch_spec_installs_again(tmp_path):
    """``make serve TORCH_SPEC=torch`` after a first install kept the CPU build: the stamp's date
    alone decided, and it was newer than pyproject.toml and the install script."""
    venv = tmp_path / "venv"
    first = dry_run(venv, "torch==2.13.0")
    assert INSTALL in first and f"echo 'torch==2.13.0' > {venv}/.installed" in first
    venv.mkdir()
    (venv / ".installed").write_text("torch==2.13.0\n")  # what that install leaves
    assert INSTALL not in dry_run(venv, "torch==2.13.0")
    again = dry_run(venv, "torch")
    assert f'TORCH_SPEC="torch" EXTRAS=dev EDITABLE=1 {INSTALL}' in again
    assert f"echo 'torch' > {venv}/.installed" in again
