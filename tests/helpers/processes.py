"""``logprob-service serve`` in a subprocess on loopback, as users run it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from logprob_service.api.probe import check as health_check

ROOT = Path(__file__).resolve().parents[2]


def leave_rank() -> NoReturn:
    """End a spawned rank whose work is done and whose process group is destroyed, skipping the
    interpreter's teardown: in CI a rank of test_moe_tensor_parallel aborted as it left ("terminate
    called without an active exception", SIGABRT, while its peer was still alive), 2 runs of 4, not
    reproduced alone; a C++ thread torn down at exit. Its results are on disk by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early with {proc.returncode}"
        if health_check(target, timeout_s=1)[0]:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{target} never became SERVING")


def launch(*args: str, env: dict | None = None, stdout=subprocess.PIPE, preexec_fn=None) -> subprocess.Popen:
    """``logprob-service serve`` in a subprocess; its output to ``stdout`` (read it, or the server
    blocks once the pipe is full; a file does not fill); ``preexec_fn`` runs in the child before
    the server starts (e.g. to lower its limits)."""
    path = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "logprob_service.cli", "serve", *args],
        env=full_env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec_fn,
    )
