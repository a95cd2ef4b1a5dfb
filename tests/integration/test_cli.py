"""The server as users start it: a subprocess through the CLI, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import urllib.request

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient, InvalidRequest, LogprobClient
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.waiting import wait_until


@pytest.fixture
def cli_server(tmp_path):
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "config.yaml"
    # File < env < flags: the file asks for port 1 and 2 sequences, env overrides the port, the flag the limit.
    config.write_text("port: 1\nmax_sequences_per_request: 2\nmodels:\n  ref: builtin:tiny-llama\n")
    proc = launch(
        "--config",
        str(config),
        "--max-sequences-per-request",
        "3",
        "--device",
        "cpu",
        "--grace-period-s",
        str(GRACE_S),
        "--metrics-port",
        str(metrics_port),
        "--log-level",
        "DEBUG",
        "--log-format",
        "json",
        env={"LOGPROB_PORT": str(port)},
    )
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, proc)
        yield proc, target, metrics_port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


GRACE_S = 120  # the drain's upper bound (it ends as soon as the work in flight is done)


def queued_requests(metrics_port: int) -> float:
    """``logprob_queue_requests`` summed over models, from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(s.value for f in families if f.name == "logprob_queue_requests" for s in f.samples)


def test_cli_serves_scores_and_drains_on_sigterm(cli_server, rng):
    proc, target, metrics_port = cli_server
    with LogprobClient(target, model="ref") as client:
        models = client.list_models()
        assert [m.name for m in models] == ["ref"]
        assert models[0].limits.max_sequences_per_request == 3  # the flag beat the file
        prompts = [rng.integers(0, 4096, 12).tolist() for _ in range(3)]
        completions = [rng.integers(0, 4096, 9).tolist() for _ in range(3)]
        first = client.score(prompts, completions)
        assert [len(x) for x in first] == [9, 9, 9] and all(np.isfinite(x).all() for x in first)
        with pytest.raises(InvalidRequest):
            client.score([[1]], [[99999]])

        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'logprob_requests_total{code="OK",model="ref",protocol="grpc",rpc="ScoreTokens"} 1.0' in scraped
        refused = 'logprob_requests_total{code="INVALID_ARGUMENT",model="ref",protocol="grpc",rpc="ScoreTokens"} 1.0'
        assert refused in scraped
        # 3 x 21 tokens, plus the warm-up's 16.
        assert 'logprob_tokens_scored_total{model="ref"} 79.0' in scraped
        assert 'logprob_request_duration_seconds_count{model="ref"} 2.0' in scraped  # warm-up + one scored

        # A request in flight when SIGTERM arrives still completes; the process then exits 0.
        results = {}

        def long_call():
            prompts = [rng.integers(0, 4096, 3000).tolist()] * 3
            results["in_flight"] = client.score(prompts, [[1] * 1000] * 3)

        worker = threading.Thread(target=long_call)
        worker.start()
        # SIGTERM once the call is in the server's queue (its gauge says so), not after a guess.
        wait_until(lambda: queued_requests(metrics_port) >= 1, "the long call to reach the server")
        proc.send_signal(signal.SIGTERM)
        # The drain waits for it up to the grace period, which leaves a loaded machine room: on an
        # idle one the call takes about a second, and the drain ends with it.
        worker.join(GRACE_S + 30)
        assert [x.shape for x in results["in_flight"]] == [(1000,)] * 3
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    lines = [json.loads(line) for line in output.splitlines()]  # --log-format json: every line is JSON
    messages = [line["message"] for line in lines]
    assert any("draining" in m for m in messages) and "stopped" in messages
    requests = [line for line in lines if line["logger"] == "logprob_service.requests"]
    ok = [r for r in requests if r["status"] == "OK" and r["rpc"] == "ScoreTokens"]
    bad = [r for r in requests if r["status"] == "INVALID_ARGUMENT"]
    assert len(ok) == 2 and len(bad) == 1, requests  # the first call, the in-flight one; the invalid one
    assert {r["level"] for r in ok} == {"DEBUG"} and bad[0]["level"] == "WARNING"
    assert ok[0]["model"] == "ref" and ok[0]["sequences"] == 3 and ok[0]["tokens"] == 63
    assert ok[0]["total_ms"] >= ok[0]["compute_ms"] > 0 and ok[0]["queue_ms"] >= 0 and ok[0]["request_id"]
    assert "99999" in bad[0]["error"] and bad[0]["tokens"] == 2


def test_cli_rejects_bad_settings_with_a_clear_message():
    proc = launch("--max-batch-tokens", "0", "--metrics-port", "0")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert output == "logprob-service: --max-batch-tokens 0: Input should be greater than or equal to 1\n"


def test_cli_exits_nonzero_when_a_model_cannot_load(tmp_path):
    checkpoint = tmp_path / "not-a-checkpoint"
    checkpoint.mkdir()
    proc = launch("--model", f"bad={checkpoint}", "--port", str(free_port()), "--metrics-port", "0")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "not-a-checkpoint" in output


def test_cli_refuses_a_forced_kernel_this_host_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("this host can run the Triton kernel")
    pytest.importorskip("triton")
    proc = launch(
        "--logprob-kernel", "triton", "--port", str(free_port()), "--metrics-port", "0", env={"TRITON_INTERPRET": "0"}
    )
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "logprob_kernel: 'triton' needs a CUDA device" in output


def test_device_cuda_without_a_usable_gpu_exits_at_once_saying_why():
    if torch.cuda.is_available():
        pytest.skip("CUDA starts here")
    proc = launch("--device", "cuda", "--port", str(free_port()), "--metrics-port", "0")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "device 'cuda' asked for, but CUDA cannot start here" in output
    assert "Fix: " in output and "--device cpu" in output


def startup_errors(output: str) -> list[str]:
    """The CLI's own lines of ``output`` (the server's log lines aside); asserts there is no traceback."""
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if line.startswith("logprob-service: ")]


async def test_a_second_server_on_the_port_exits_2_and_the_first_keeps_serving(running):
    """gRPC's SO_REUSEPORT let a second server start on the port and serve: new connections went
    to either, each with its own models."""
    proc = launch("--port", str(running.port), "--metrics-port", "0", "--device", "cpu")
    try:
        output, _ = await asyncio.to_thread(proc.communicate, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 2
    assert startup_errors(output) == [
        f"logprob-service: cannot listen on 127.0.0.1:{running.port} (--port): Address already in use "
        "(another server on this port?)"
    ]
    async with AsyncLogprobClient(running.target) as client:
        assert [m.name for m in await client.list_models()] == ["default", "gemma"]


def test_a_metrics_port_in_use_exits_2_naming_the_flag():
    """It was a traceback ending in ``OSError: [Errno 98] Address already in use``, exit code 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = launch("--port", str(free_port()), "--metrics-port", str(port), "--device", "cpu")
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert startup_errors(output) == [
        f"logprob-service: cannot serve metrics on 127.0.0.1:{port} (--metrics-port; 0 turns metrics off): "
        "Address already in use"
    ]
