"""The Makefile, by dry run (``make -n``): what each target installs, and when it installs again."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
INSTALL = "scripts/install.sh"
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make on this machine")


def dry_run(venv: Path, target: str, *variables: str) -> str:
    """What ``make TARGET`` would run with this venv and these variables."""
    done = subprocess.run(
        [MAKE, "-n", "-C", str(ROOT), f"VENV={venv}", *variables, target], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_changed_torch_spec_installs_again(tmp_path):
    """``make serve TORCH_SPEC=torch`` after a first install kept the CPU build: the stamp's date
    alone decided, and it was newer than pyproject.toml and the install script."""
    venv = tmp_path / "venv"
    first = dry_run(venv, "install", "TORCH_SPEC=torch==2.13.0")
    assert INSTALL in first and f"echo 'torch==2.13.0' > {venv}/.installed-dev" in first
    venv.mkdir()
    (venv / ".installed-dev").write_text("torch==2.13.0\n")  # what that install leaves
    assert INSTALL not in dry_run(venv, "install", "TORCH_SPEC=torch==2.13.0")
    again = dry_run(venv, "install", "TORCH_SPEC=torch")
    assert f'TORCH_SPEC="torch" TORCH_INDEX="" EXTRAS=dev EDITABLE=1 {INSTALL}' in again
    cpu = dry_run(venv, "install", "TORCH_SPEC=torch==2.13.0", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    assert 'TORCH_INDEX="https://download.pytorch.org/whl/cpu" EXTRAS=dev' in cpu


def test_serve_installs_the_server_alone_and_test_the_dev_set(tmp_path):
    """`make serve` pulled the dev extra (TRL, the test tools, a separate triton, which has no
    macOS wheel); now the server extra alone, unless the dev set is installed already."""
    venv = tmp_path / "venv"
    serve = dry_run(venv, "serve")
    assert f"EXTRAS=server EDITABLE=1 {INSTALL}" in serve and "EXTRAS=dev" not in serve
    assert f"{venv}/bin/logprob-service serve --http-port 8000" in serve
    assert f"EXTRAS=dev EDITABLE=1 {INSTALL}" in dry_run(venv, "test")
    venv.mkdir()
    (venv / ".installed-dev").write_text("torch==2.13.0\n")
    assert INSTALL not in dry_run(venv, "serve")  # the dev set holds the server


def test_make_help_lists_every_target_with_what_it_does():
    names = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    done = subprocess.run([MAKE, "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines()}
    assert {"serve", "test", "install", "lint", "docs", "image", "help"} <= listed
    assert set(names) - {"FORCE"} <= listed | {"FORCE"}, set(names) - listed


def test_the_makefile_says_where_torch_comes_from():
    text = (ROOT / "Makefile").read_text()
    assert "CPU build of torch by default" not in text  # PyPI's Linux torch is the CUDA build
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
