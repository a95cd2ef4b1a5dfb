"""The container image, built from the Dockerfile and run as ``docker run`` runs it.

CI's machines reach no container registry, so the image is built on a Debian bookworm base made
on the machine (mmdebstrap) with the CPU build of torch: ``BASE=debian scripts/build-image.sh``,
which changes nothing else in the Dockerfile. Podman builds it but cannot start containers here
(crun's setrlimit is refused), so the test runs the image the way a container engine would, from
parts: the container's root filesystem (``podman create`` + ``podman mount``: a writable layer
over the image), new mount and PID namespaces (``unshare``: the server is PID 1, as in a
container, where a signal without a handler is ignored), /proc and a minimal /dev, then
``chroot`` as the image's USER, in its WORKDIR, with its ENV and nothing else, running its
ENTRYPOINT. The network namespace is the host's, so the server is told to bind 127.0.0.1 on free
ports (``docker run -e`` overrides) instead of 0.0.0.0:50051. The HEALTHCHECK command runs
inside, as the engine runs it (``nsenter``, like ``docker exec``).

Checked: the health check passes; the client, from outside, gets scores equal to the float64
reference of the builtin model computed here, within tests/helpers/tolerances.py's bound;
/metrics serves the logprob_ series; the server runs as uid 10001 from the /data layout; the
image holds the gpu extra (nvidia-cudnn-frontend), which the server on CPU never loads; SIGTERM
with a call in flight drains: the call is answered and the process exits 0 within the grace
period. The image's size and build time are printed in pytest's summary.

Needs root, podman, mmdebstrap or debootstrap (.ci/run installs them), and 12 GB of free disk
where podman writes (the build's peak use was 9.3 GB); skipped otherwise, saying why. The image
and what its build left are removed afterwards, except the Debian base (~120 MB), kept for the
next run; LOGPROB_KEEP_IMAGE=1 keeps the image too. Not marked ``numerical``: `make test-sweep`
would build the image once per seed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from logprob_client import LogprobClient
from logprob_service.models.builtin import build_builtin
from logprob_service.models.weights import model_fingerprint
from logprob_service.settings.model import Settings
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.models import ScoreReference, as_sequences
from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-image.sh"
# Per run: two test runs on one machine (two checkouts) must not remove each other's image.
IMAGE = f"localhost/logprob-service:image-test-{os.getpid()}"
CONTAINER = f"logprob-image-test-{os.getpid()}"
IMAGE_UID = 10001  # the Dockerfile's USER, which deploy/k8s and the README name too
BUILD_TIMEOUT_S = 600  # measured (2026-11-23, 2 cores): the Debian base 32 s, the build 154-189 s
# The build's peak disk use, measured (2026-11-25, CPU torch, a 2.4 GB image): 9.3 GB, most of it
# while podman commits the layer; with a margin for the image to grow.
BUILD_DISK_BYTES = 12 * 10**9
START_TIMEOUT_S = 120  # loading and warming up builtin:tiny-llama takes seconds
GRACE_S = Settings.model_fields["grace_period_s"].default  # the image does not set it

pytestmark = pytest.mark.image


def unavailable() -> str | None:
    """Why the image cannot be built and run here, or None."""
    if os.geteuid() != 0:
        return "needs root (podman's storage, mmdebstrap, chroot and namespaces); CI runs as root"
    hint = "apt-get install podman mmdebstrap (.ci/run installs them when it can)"
    for tool in ("podman", "unshare", "nsenter", "chroot"):
        if shutil.which(tool) is None:
            return f"no {tool} here: {hint}"
    if shutil.which("mmdebstrap") is None and shutil.which("debootstrap") is None:
        return f"no mmdebstrap or debootstrap here to make the Debian base image: {hint}"
    info = subprocess.run(["podman", "info", "--format", "json"], capture_output=True, text=True, timeout=120)
    if info.returncode != 0:
        return f"podman does not work here: {info.stderr.strip()[-500:]}"
    store = json.loads(info.stdout)["store"]
    return short_of_disk(store["graphRoot"], store.get("imageCopyTmpDir") or "/var/tmp")


def short_of_disk(*paths: str) -> str | None:
    """Why the build would run out of disk where podman writes (its storage, its blobs' scratch
    folder), or None: the build's peak use is several times the image (the layer being written,
    its blob, the committed copy), and a CI machine's free disk varies from run to run."""
    for path in paths:
        free = shutil.disk_usage(path).free
        if free < BUILD_DISK_BYTES:
            return (
                f"the build needs {BUILD_DISK_BYTES / 1e9:.0f} GB free where podman writes, "
                f"and {path} has {free / 1e9:.1f} GB free"
            )
    return None


def podman(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Summary:
    """A pytest plugin that prints the image test's figures in the terminal summary."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.lines:
            terminalreporter.section("container image")
            for line in self.lines:
                terminalreporter.write_line(line)


@dataclass(frozen=True)
class ImageConfig:
    """What a container engine takes from the image to run it (``podman image inspect``)."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    user: str
    healthcheck: list[str]
    stop_signal: str
    size: int

    @classmethod
    def of(cls, image: str) -> ImageConfig:
        (info,) = json.loads(podman("image", "inspect", image))
        config = info["Config"]
        return cls(
            entrypoint=config.get("Entrypoint") or [],
            cmd=config.get("Cmd") or [],
            env=dict(item.split("=", 1) for item in config.get("Env") or []),
            workdir=config.get("WorkingDir") or "/",
            user=config.get("User") or "0",
            healthcheck=(info.get("Healthcheck") or config.get("Healthcheck") or {}).get("Test") or [],
            stop_signal=config.get("StopSignal") or "SIGTERM",
            size=info["Size"],
        )


def build(log: Path) -> float:
    """Build IMAGE with the build script; the seconds it took."""
    # The script's other knobs as it sets them for BASE=debian, whatever this shell exports.
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "ENGINE")} | {
        "BASE": "debian",
        "IMAGE": IMAGE,
    }
    start = time.monotonic()
    with log.open("w") as out:
        # --layers=false: one build, nothing to reuse; intermediate images would only cost commits (~1 min).
        command = [str(BUILD_SCRIPT), "--layers=false"]
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # a timeout here or pytest-timeout's: nothing of the build may outlive the test
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = log.read_text()
    base_failed = re.search(r"^build-image: (mmdebstrap|debootstrap) failed: (.*)", output, re.MULTILINE | re.DOTALL)
    if base_failed:  # the Debian mirror, not the Dockerfile
        pytest.skip(f"could not make the Debian base image: {base_failed.group(2).strip()}")
    assert code is not None, f"the build took over {BUILD_TIMEOUT_S} s:\n{output[-4000:]}"
    assert code == 0, f"the build failed ({code}):\n{output[-4000:]}"
    return time.monotonic() - start


@pytest.fixture(scope="module")
def summary(request: pytest.FixtureRequest) -> Summary:
    plugin = Summary()
    request.config.pluginmanager.register(plugin, "image-test-summary")
    return plugin


@pytest.fixture(scope="module")
def image(summary: Summary, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageConfig]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    log = tmp_path_factory.mktemp("image") / "build.log"
    try:
        seconds = build(log)
        config = ImageConfig.of(IMAGE)
        summary.lines.append(
            f"{IMAGE}: {config.size / 1e9:.2f} GB (uncompressed; Debian bookworm base, CPU torch); "
            f"BASE=debian scripts/build-image.sh took {seconds:.0f} s:"
        )
        summary.lines += [line for line in log.read_text().splitlines() if re.match(r"build-image: (made|built)", line)]
        yield config
    finally:
        if os.environ.get("LOGPROB_KEEP_IMAGE") != "1":
            started = time.monotonic()
            # The image, then any other image its build committed (a stage's), which the build's log
            # names ("--> ID" after each commit); the Debian base stays, nobody else's images are touched.
            subprocess.run(["podman", "rmi", "--force", IMAGE], capture_output=True, timeout=300)
            commits = re.findall(r"^--> ([0-9a-f]{11,64})$", log.read_text() if log.exists() else "", re.MULTILINE)
            for commit in commits:  # one by one: the last is the image, gone already
                subprocess.run(["podman", "rmi", "--force", commit], capture_output=True, timeout=300)
            summary.lines.append(f"removed the image and its build's layers in {time.monotonic() - started:.0f} s")


def passwd_ids(root: Path, user: str) -> tuple[int, int, str]:
    """uid, gid and home of a Dockerfile USER (``uid[:gid]`` or names), from the image's own
    /etc/passwd and /etc/group, as a container engine resolves it (a uid without an entry: gid 0, /)."""
    name, _, group = user.partition(":")
    entries = [line.split(":") for line in (root / "etc/passwd").read_text().splitlines() if line]
    entry = next((e for e in entries if name in (e[0], e[2])), None)
    uid = int(entry[2]) if entry else int(name)
    gid, home = (int(entry[3]), entry[5]) if entry else (0, "/")
    if group:
        groups = [line.split(":") for line in (root / "etc/group").read_text().splitlines() if line]
        gid = next((int(g[2]) for g in groups if group in (g[0], g[2])), None)
        gid = int(group) if gid is None else gid
    return uid, gid, home


# Run in the new mount namespace before the entrypoint: /dev as container engines make it (a
# tmpfs with the usual device nodes, /dev/shm), then the image's root and user.
SETUP = r"""
root=$1 ids=$2; shift 2
mount -t tmpfs -o nosuid,mode=755 dev "$root/dev"
for node in null zero full random urandom tty; do
  : >"$root/dev/$node" && mount --bind "/dev/$node" "$root/dev/$node"
done
mkdir "$root/dev/shm" && mount -t tmpfs -o nosuid,nodev,mode=1777 shm "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
exec chroot --userspec="$ids" --groups="${ids#*:}" "$root" "$@"
"""


class Container:
    """IMAGE run the way a container engine runs it, without one (the module's docstring says how)."""

    def __init__(self, image: ImageConfig, env: dict[str, str], log: Path) -> None:
        self.image = image
        self.overrides = env
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # the server's, on the host

    def __enter__(self) -> Container:
        subprocess.run(["podman", "rm", "--force", "--volumes", CONTAINER], capture_output=True, timeout=120)
        # --no-healthcheck: the test runs the health check itself; podman would want systemd timers.
        podman("create", "--name", CONTAINER, "--no-healthcheck", IMAGE)
        try:
            self.root = Path(podman("mount", CONTAINER))
            self.uid, self.gid, home = passwd_ids(self.root, self.image.user)
        except BaseException:
            self.__exit__()
            raise
        self.env = {"HOME": home, **self.image.env, **self.overrides}  # an engine sets HOME from /etc/passwd
        return self

    def run(self) -> None:
        """Start the entrypoint; return once it is running (as PID 1 of its namespace)."""
        namespaces = ["unshare", "--mount", "--pid", "--fork", "--kill-child", f"--mount-proc={self.root}/proc"]
        setup = ["sh", "-ec", SETUP, "sh", str(self.root), f"{self.uid}:{self.gid}"]
        environment = ["/usr/bin/env", "-i", "-C", self.image.workdir, *(f"{k}={v}" for k, v in self.env.items())]
        command = [*namespaces, *setup, *environment, *self.image.entrypoint, *self.image.cmd]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        wait_until(lambda: self.proc.poll() is not None or children.read_text().split(), "unshare to fork")
        assert self.proc.poll() is None, self.output()
        self.pid = int(children.read_text().split()[0])

    def exec(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """``argv`` inside the running container, as its user with its environment (``docker exec``)."""
        enter = ["nsenter", f"--target={self.pid}", "--mount", "--pid", "--root", "--wd"]
        user = [f"--setuid={self.uid}", f"--setgid={self.gid}"]
        environment = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in self.env.items())]
        return subprocess.run([*enter, *user, *environment, *argv], capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        """What ``docker stop`` does first: the image's STOPSIGNAL to the entrypoint."""
        os.kill(self.pid, signal.Signals[self.image.stop_signal])

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)  # unshare exits with the entrypoint's status

    def output(self) -> str:
        return self.log.read_text()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.pid > 0:
                os.kill(self.pid, signal.SIGKILL)  # PID 1 of the namespace: everything in it goes too
            self.proc.kill()  # and unshare's --kill-child, in case the server had not started
            self.proc.wait(30)
        subprocess.run(["podman", "umount", CONTAINER], capture_output=True, timeout=120)
        subprocess.run(["podman", "rm", "--force", "--volumes", CONTAINER], capture_output=True, timeout=120)


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_the_image_serves_scores_metrics_and_health_and_drains_on_sigterm(image, summary, tmp_path, rng):
    # What the Dockerfile promises: its entrypoint, health check, user and /data layout.
    assert image.entrypoint == ["logprob-service", "serve"] and image.healthcheck[0] == "CMD"
    assert image.stop_signal == "SIGTERM"
    assert image.user == f"{IMAGE_UID}:{IMAGE_UID}" and image.workdir == "/data"
    assert image.env["HF_HOME"].startswith("/data/") and image.env["TRITON_CACHE_DIR"].startswith("/data/")

    port, metrics_port = free_port(), free_port()
    # The image asks for the GPU (LOGPROB_DEVICE=cuda); this machine has none, so the CPU on purpose.
    assert image.env["LOGPROB_DEVICE"] == "cuda"
    env = {
        "LOGPROB_HOST": "127.0.0.1",
        "LOGPROB_PORT": str(port),
        "LOGPROB_METRICS_PORT": str(metrics_port),
        "LOGPROB_DEVICE": "cpu",
    }
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with Container(image, env, tmp_path / "serve.log") as container:
        # The build's mounts (scripts/build-image.sh) left nothing behind, and /data is the user's.
        assert not (container.root / "root" / "find-links").exists() and not (container.root / "etc/pip.conf").exists()
        for sub in ("", "models", "hf", "cache"):
            assert (container.root / "data" / sub).stat().st_uid == IMAGE_UID, sub
        venv = subprocess.run(["du", "-sb", container.root / "opt/venv"], capture_output=True, text=True, timeout=60)
        summary.lines.append(
            f"/opt/venv (the project, torch and the rest): {int(venv.stdout.split()[0]) / 1e9:.2f} GB of it"
        )
        # The GPU image's extras, gpu included (the Dockerfile's EXTRAS): installed here too, where
        # the CPU server never imports them.
        (site,) = (container.root / "opt/venv/lib").glob("python3*/site-packages")
        assert list(site.glob("nvidia_cudnn_frontend-*.dist-info")), "no nvidia-cudnn-frontend: the gpu extra"

        started = time.monotonic()
        container.run()

        # The HEALTHCHECK command, until it passes: the engine runs it every --interval (15 s), the
        # test every second (more often, each probe's own start would slow the server's on 2 cores).
        probes: list[subprocess.CompletedProcess] = []
        while not probes or probes[-1].returncode != 0:
            assert container.proc.poll() is None, f"the server exited:\n{container.output()}"
            assert time.monotonic() - started < START_TIMEOUT_S, (probes[-1:], container.output())
            time.sleep(1.0 if probes else 0)
            probes.append(container.exec(image.healthcheck[1:], timeout=30))
        assert probes[-1].stdout.strip() == "SERVING"
        summary.lines.append(f"healthy {time.monotonic() - started:.1f} s after the start, at probe {len(probes)}")

        # Serving, so the process is the server by now (no longer the setup before its exec).
        cmdline = Path(f"/proc/{container.pid}/cmdline").read_text().split("\0")
        assert cmdline[-3:-1] == ["/opt/venv/bin/logprob-service", "serve"], cmdline
        status = dict(line.split(":", 1) for line in Path(f"/proc/{container.pid}/status").read_text().splitlines())
        assert status["Uid"].split() == [str(IMAGE_UID)] * 4 and status["Gid"].split() == [str(IMAGE_UID)] * 4
        assert status["NSpid"].split()[-1] == "1"  # PID 1 in its namespace, as in a container

        # Scores through the client, from outside, against the builtin model built here.
        model = build_builtin("tiny-llama")
        prompts = [rng.integers(0, 4096, int(n)).tolist() for n in rng.integers(1, 40, 6)]
        completions = [rng.integers(0, 4096, int(n)).tolist() for n in rng.integers(1, 40, 6)]
        with LogprobClient(f"127.0.0.1:{port}") as client:
            (info,) = client.list_models()
            assert (info.source, info.device, info.dtype) == ("builtin:tiny-llama", "cpu", "float32")
            assert info.fingerprint == model_fingerprint(model)  # the very weights built here
            logprobs = client.score(prompts, completions)
            assert [x.shape for x in logprobs] == [(len(c),) for c in completions]
            assert all(np.isfinite(x).all() for x in logprobs)
            ScoreReference(model, as_sequences(prompts, completions)).check(logprobs)
            # Scored without cuDNN's frontend: on CPU the server never loads the gpu extra.
            maps = Path(f"/proc/{container.pid}/maps").read_text()
            assert "/site-packages/cudnn/" not in maps and "/site-packages/torch/" in maps

            samples = metric_samples(metrics_url)
            assert {name for name, _ in samples if name.startswith("logprob_")} >= {
                "logprob_requests_total",
                "logprob_tokens_scored_total",
            }
            ok = (("code", "OK"), ("model", info.name), ("protocol", "grpc"), ("rpc", "ScoreTokens"))
            assert samples[("logprob_requests_total", ok)] == 1.0

            # SIGTERM with a call in flight (the queue gauge counts it until it is answered).
            result: dict[str, object] = {}

            def long_call() -> None:
                try:
                    result["logprobs"] = client.score([rng.integers(0, 4096, 1000).tolist()] * 3, [[1] * 500] * 3)
                except Exception as err:  # reported by the assertion below
                    result["error"] = err

            worker = threading.Thread(target=long_call, daemon=True)
            worker.start()
            in_flight = ("logprob_queue_requests", (("model", info.name),))
            wait_until(lambda: metric_samples(metrics_url).get(in_flight, 0) >= 1, "the long call to reach the server")
            signalled = time.monotonic()
            container.stop()
            worker.join(GRACE_S + 30)
            assert "logprobs" in result, (result.get("error"), container.output())
            assert [x.shape for x in result["logprobs"]] == [(500,)] * 3  # answered during the drain
        code = container.wait(GRACE_S + 30)
        drained = time.monotonic() - signalled
        log = container.output()
        assert code == 0, log
        assert drained < GRACE_S, log
        assert "shutting down: draining" in log and any(line.endswith(": stopped") for line in log.splitlines()), log
        summary.lines.append(f"SIGTERM with a call in flight: drained and exited 0 in {drained:.1f} s")
