"""Shared fixtures: the source tree on sys.path, Triton's interpreter off the GPU, seeds, and a
real server on loopback (``running``: create_server on port 0, CPU, float32, serving ``default``,
builtin:tiny-llama, and ``gemma``, a small random Gemma 2 saved as a Hugging Face checkpoint
directory and loaded from it, the way users serve their own models).

Seeds. No test draws an unseeded random number, so no run of the suite fails by chance and
every failure can be replayed:

* ``seed``: each test's seed. By default a stable hash of the test's id, so every run of the
  suite sees the same inputs and different tests see different ones. A failing test's report
  shows its seed and the command that replays it.
* ``LOGPROB_TEST_SEED=N``: every selected test runs with seed N (the replay).
* ``LOGPROB_TEST_SEEDS=K`` (or ``A-B``): each test marked ``numerical`` runs once per seed in
  ``range(K)`` (or ``A..B``): the sweep ``make test-sweep`` runs to check that no tolerance
  holds by luck.
* ``rng``: a ``numpy.random.Generator`` seeded with ``seed``. The global generators of
  ``random``, numpy and torch are seeded from it too, before each test, for code that draws from
  them.

Parallel runs. ``make test`` runs the suite over pytest-xdist workers, a file to a worker. A test
marked ``serial`` measures time (a latency, a rate, a refusal "at once") and runs alone: it waits
for the other workers' tests in progress, and they wait for it (a lock file per run, below).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from tests.helpers.seeds import SEED_ENV, session_seed, stable_seed

ROOT = Path(__file__).resolve().parent.parent
# Tests run against the source tree even when the package is not installed (e.g. on the GPU box).
for sub in ("service", "client"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before the
# kernels are defined (at import of ops.lm_head), hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from logprob_service.observability.metrics import start_metrics_server  # noqa: E402  (after sys.path)

from tests.helpers.models import make_model  # noqa: E402
from tests.helpers.server import settings, start, stop, test_settings  # noqa: E402

SWEEP_ENV = "LOGPROB_TEST_SEEDS"
_SEED = pytest.StashKey[int]()


def sweep_seeds(spec: str) -> list[int]:
    """``"200"`` -> 0..199; ``"1000-1199"`` -> 1000..1199."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if match is None:
        raise pytest.UsageError(f"{SWEEP_ENV}={spec!r}: expected a count K or a range A-B")
    first, last = match.groups()
    return list(range(int(first))) if last is None else list(range(int(first), int(last) + 1))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "numerical: checks scores or tensors against a reference within a derived tolerance "
        f"(swept over many seeds by `make test-sweep`, {SWEEP_ENV})",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    spec = os.environ.get(SWEEP_ENV)
    if spec and metafunc.definition.get_closest_marker("numerical") is not None:
        metafunc.parametrize("seed", sweep_seeds(spec), ids=lambda s: f"seed={s}", indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``--dist loadfile --no-loadscope-reorder``), the order in
    which files go to the workers: the image test first, since its build takes minutes of one worker
    that the others' files then fill, then the files of more tests before those of fewer (xdist's
    own order, which would queue the image's one test last, to run alone at the end)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    per_file = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.get_closest_marker("image") is None, -per_file[item.path]))


@contextlib.contextmanager
def _run_alone(config: pytest.Config, alone: bool) -> Iterator[None]:
    """Under pytest-xdist, a reader-writer lock over the run's workers: a ``serial`` test holds it
    alone, every other test shares it. The gate gives a waiting serial test precedence, so that
    the other workers' next tests queue behind it rather than keep the lock shared for ever."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing runs beside the test
        yield
        return
    # The run's temporary directory, which its workers share (each has its own below it). POSIX
    # record locks (lockf), a process's own: a child forked during a test does not hold them on.
    run = config._tmp_path_factory.getbasetemp().parent
    with open(run / "serial.gate", "a+") as gate, open(run / "serial.lock", "a+") as lock:
        if alone:
            fcntl.lockf(gate, fcntl.LOCK_EX)
            fcntl.lockf(lock, fcntl.LOCK_EX)
        else:
            fcntl.lockf(gate, fcntl.LOCK_SH)
            fcntl.lockf(lock, fcntl.LOCK_SH)
            fcntl.lockf(gate, fcntl.LOCK_UN)
        yield  # closing the files releases the locks


# Outside pytest-timeout's wrapper: the wait for the lock is no part of a test's time.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _run_alone(item.config, item.get_closest_marker("serial") is not None):
        return (yield)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    if hasattr(request, "param"):  # a sweep
        value = int(request.param)
    elif os.environ.get(SEED_ENV):
        value = int(os.environ[SEED_ENV])
    else:
        value = stable_seed(request.node.nodeid)
    request.node.stash[_SEED] = value
    return value


@pytest.fixture(autouse=True)
def _seed_global_generators(seed: int) -> None:
    # Not ``seed`` itself: a test's own ``torch.Generator().manual_seed(seed)`` would then draw the
    # very numbers torch's global generator draws.
    derived = stable_seed(f"global generators:{seed}")
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    seed = item.stash.get(_SEED, None)
    if report.failed and seed is not None:
        nodeid = re.sub(r"-seed=\d+|seed=\d+-?", "", item.nodeid).replace("[]", "")  # a sweep's id, less its seed
        report.sections.append(
            ("seed", f"this test ran with seed {seed}; replay it with: {SEED_ENV}={seed} python -m pytest '{nodeid}'")
        )
    return report


@pytest.fixture(scope="session")
def gemma_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma2-checkpoint")
    make_model("gemma2", tied=True, seed=session_seed("gemma2-checkpoint")).save_pretrained(path)
    return path


@pytest_asyncio.fixture
async def running(gemma_checkpoint: Path):
    server = await start(test_settings(gemma_checkpoint))
    yield server
    await stop(server)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied Llama checkpoint (float32, seeded): the starting weights of the weight-update tests."""
    path = tmp_path_factory.mktemp("llama-checkpoint")
    make_model("llama", tied=False, seed=session_seed("llama-checkpoint")).save_pretrained(path)
    return path


@pytest_asyncio.fixture
async def policy_server(llama_checkpoint: Path):
    """A server of ``llama_checkpoint`` as model "policy" (CPU, float32)."""
    server = await start(settings({"policy": str(llama_checkpoint)}))
    yield server
    await stop(server)


@pytest_asyncio.fixture
async def receivers_server(llama_checkpoint: Path):
    """A server of ``llama_checkpoint`` as model "policy" with 2 weight receivers (CPU, float32)."""
    server = await start(settings({"policy": str(llama_checkpoint)}, weight_receivers=2))
    yield server
    await stop(server)


@pytest.fixture(scope="session")
def metrics_url():
    """/metrics of this process (the series are process-wide), on a free port, as a server serves it."""
    server = start_metrics_server("127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()
