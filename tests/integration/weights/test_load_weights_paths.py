"""LoadWeights and the files a path leads to (issue 38, items 2 and 9): FIFOs, devices, kernel
files, directories named like files, paths the filesystem cannot resolve, and the
``load_weights_roots`` setting. Each is refused at once with INVALID_ARGUMENT naming ``path`` and
the file, logged once without a traceback, and the server keeps answering.

The FIFO case runs ``logprob-service serve`` in a subprocess: a thread blocked in a FIFO's open
while it holds the interpreter lock froze the whole process (health checks timed out, SIGTERM did
not stop it), which only a separate process shows and survives.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from logprob_client import AsyncLogprobClient, InvalidRequest
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api.probe import check as health_check
from logprob_service.cli import build_parser, settings_from_args
from logprob_service.settings.model import Settings

from tests.helpers.models import make_model, random_sequences
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.server import as_lists, assert_scores_match, new_seed, settings, start, stop

GRACE_S = 5.0
# A refusal is a few system calls; the bound only has to tell "at once" from "blocked until the
# call's deadline" on a loaded 2-core machine.
PROMPT_S = 10.0
CALL_TIMEOUT_S = 30.0


async def load_status(target: str, path: str, model: str = "default") -> tuple[grpc.StatusCode, str, float]:
    """A LoadWeights call of ``path`` by a plain stub (no retries): its status, details and seconds taken."""
    async with grpc.aio.insecure_channel(target) as channel:
        start = time.monotonic()
        try:
            await pb_grpc.LogprobServiceStub(channel).LoadWeights(
                pb.LoadWeightsRequest(model=model, path=path), timeout=CALL_TIMEOUT_S
            )
            code, details = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details()
        return code, details, time.monotonic() - start


def fifo_checkpoints(root: Path) -> dict[str, Path]:
    """Paths that lead to a FIFO: a checkpoint directory holding one as its weights file, one
    holding a symlink to one elsewhere, and the symlink itself."""
    (root / "fifo-dir").mkdir()
    os.mkfifo(root / "fifo-dir" / "model.safetensors")
    os.mkfifo(root / "elsewhere.fifo")
    (root / "link-dir").mkdir()
    (root / "link-dir" / "model.safetensors").symlink_to(root / "elsewhere.fifo")
    return {
        "a directory holding a FIFO": root / "fifo-dir",
        "a directory holding a symlink to a FIFO": root / "link-dir",
        "a symlink to a FIFO": root / "link-dir" / "model.safetensors",
    }


async def test_a_fifo_is_refused_at_once_and_the_server_still_answers_and_stops(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    proc = launch(
        "--model", "default=builtin:tiny-llama", "--device", "cpu", "--metrics-port", "0",
        "--grace-period-s", str(GRACE_S),
        env={"LOGPROB_PORT": str(port)},
        stdout=log.open("w"),
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, proc)
        for what, path in fifo_checkpoints(tmp_path).items():
            code, details, took = await load_status(target, str(path))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
            assert details.startswith("path: ") and "a FIFO" in details and str(path) in details, (what, details)
            assert took < PROMPT_S, (what, took)
            assert health_check(target, timeout_s=5)[0], f"health after {what}"
        proc.send_signal(signal.SIGTERM)
        # Within the drain time, and a margin for tearing down on a loaded machine.
        assert proc.wait(GRACE_S + 15) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
async def tiny():
    running = await start(settings({"default": "builtin:tiny-llama"}))
    yield running
    await stop(running)


def bad_paths(root: Path) -> dict[str, tuple[str, str]]:
    """Paths LoadWeights must refuse, each with a piece of the message that says why."""
    for name, target in (("environ", "/proc/self/environ"), ("urandom", "/dev/urandom"), ("mem", "/proc/self/mem")):
        (root / name).mkdir()
        (root / name / "model.safetensors").symlink_to(target)
    (root / "nested" / "x.safetensors").mkdir(parents=True)
    (root / "loop.safetensors").symlink_to(root / "loop.safetensors")
    (root / "dangling").mkdir()
    (root / "dangling" / "model.safetensors").symlink_to(root / "nowhere")
    (root / "empty").mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock.safetensors"))
    return {
        "a symlink to /proc/self/environ": (str(root / "environ"), "under /proc, /sys or /dev"),
        "a symlink to /dev/urandom": (str(root / "urandom"), "under /proc, /sys or /dev"),
        "a symlink to /proc/self/mem, named": (str(root / "mem" / "model.safetensors"), "under /proc, /sys or /dev"),
        "/proc/self/environ itself": ("/proc/self/environ", "under /proc, /sys or /dev"),
        "a directory named x.safetensors": (str(root / "nested"), "'x.safetensors' is a directory"),
        "a symlink loop": (str(root / "loop.safetensors"), "cannot be resolved"),
        "a dangling symlink": (str(root / "dangling"), "does not exist"),
        "a socket": (str(root / "sock.safetensors"), "is a socket"),
        "an empty directory": (str(root / "empty"), "holds no .safetensors files"),
        "5,000 characters": ("/" + "a" * 4999, "cannot be resolved on the server (File name too long)"),
        "a user that does not exist": ("~no-such-user-here/model.safetensors", "cannot be resolved"),
        "a NUL byte": (str(root / "x\0y.safetensors"), "cannot be resolved"),
    }


async def test_paths_to_what_is_not_a_regular_file_are_invalid_arguments_logged_once(tiny, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="logprob_service")
    for what, (path, why) in bad_paths(tmp_path).items():
        caplog.clear()
        code, details, took = await load_status(tiny.target, path)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
        assert details.startswith("path: ") and why in details, (what, details)
        assert took < PROMPT_S, (what, took)
        failed = [r for r in caplog.records if r.name == "logprob_service.requests" and r.getMessage() == "failed"]
        assert len(failed) == 1 and failed[0].exc_info is None, (what, caplog.records)
        # A long path is cut where it is shown: the log line does not carry its 5,000 characters.
        assert len(failed[0].fields["error"]) < 1000, what
    assert tiny.service.device_side.registry.get("default").info.version == 0


async def test_load_weights_roots_confine_the_files_read_with_the_served_checkpoints(llama_checkpoint, tmp_path, rng):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    new = make_model("llama", tied=False, seed=new_seed(rng))
    new.save_pretrained(allowed / "step-1")
    new.save_pretrained(outside / "step-1")
    (allowed / "sneaky").mkdir()
    (allowed / "sneaky" / "model.safetensors").symlink_to(outside / "step-1" / "model.safetensors")
    running = await start(settings({"policy": str(llama_checkpoint)}, load_weights_roots=[allowed]))
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            for path in (outside / "step-1", allowed / "sneaky"):
                with pytest.raises(InvalidRequest, match=r"path: .* is outside the directories LoadWeights may read"):
                    await client.load_weights("policy", str(path))
            assert (await client.load_weights("policy", str(allowed / "step-1"))).version == 1
            sequences = random_sequences(rng, 3)
            assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))
            # The served checkpoint may always be read again (back to the start of a run).
            assert (await client.load_weights("policy", str(llama_checkpoint))).version == 2
    finally:
        await stop(running)


def test_load_weights_roots_are_existing_directories_from_a_list_the_environment_or_a_flag(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("LOGPROB_LOAD_WEIGHTS_ROOTS", f"{tmp_path / 'a'}, {tmp_path / 'b'}")
    assert Settings().load_weights_roots == (tmp_path / "a", tmp_path / "b")
    assert Settings(load_weights_roots=str(tmp_path / "a")).load_weights_roots == (tmp_path / "a",)
    assert Settings(load_weights_roots=[]).load_weights_roots == ()
    flags = ["serve", "--load-weights-roots", f"{tmp_path / 'b'},{tmp_path / 'a'}", "--no-check-finite-weights"]
    from_flags = settings_from_args(build_parser().parse_args(flags))
    assert from_flags.load_weights_roots == (tmp_path / "b", tmp_path / "a") and not from_flags.check_finite_weights
    with pytest.raises(ValueError, match="is not a directory"):
        Settings(load_weights_roots=[tmp_path / "missing"])


async def test_paths_outside_the_roots_get_one_answer_whether_they_exist_or_not(tmp_path):
    """Outside ``load_weights_roots`` a caller cannot probe the server's disk: a file, a directory,
    a symlink and a path that does not exist all get the same answer (its path aside), which never
    says where a symlink leads; inside the roots a missing path is named missing."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    (allowed / "link").symlink_to(outside)
    running = await start(settings({"default": "builtin:tiny-llama"}, load_weights_roots=[allowed]))
    try:
        answers = {}
        for path in (outside, outside / "model.safetensors", outside / "missing", "/nowhere/at/all", allowed / "link"):
            code, details, _ = await load_status(running.target, str(path))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            answers[str(path)] = details.replace(repr(str(path)), "PATH")
        assert len(set(answers.values())) == 1, answers
        assert "outside the directories LoadWeights may read, or does not exist" in next(iter(answers.values()))
        code, details, _ = await load_status(running.target, str(allowed / "missing"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not exist on the server" in details, details
    finally:
        await stop(running)


async def test_files_with_no_tensors_are_refused_and_the_version_stays(tiny, tmp_path):
    """A directory of safetensors files holding no tensor "loaded" and raised the version with 0
    tensors: refused, naming the path."""
    from safetensors.numpy import save_file

    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file({}, str(empty / name))
    code, details, _ = await load_status(tiny.target, str(empty))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert f"path: {str(empty)!r} holds no tensors" in details
    assert tiny.service.device_side.registry.get("default").info.version == 0
