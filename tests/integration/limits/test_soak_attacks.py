"""Soak under attack: well-behaved scoring clients, one over gRPC and one over HTTP, against a server
subprocess (CLI, CPU, builtin tiny-llama, bearer tokens so that each client is a fair-share client
of its own) first alone, then while it is hit, all at once, by (``tests/helpers/attacks.py``, a
process of its own):

- a 6 MB ``/generate`` body of a million ``[1,2]`` inputs and an 8 MB gRPC message of a million
  one-token sequences, each sent again as soon as it is refused;
- 2,000 connections to the HTTP port that never finish their head (fewer where this process's
  hard open-file limit does not allow them: the test says so);
- a ``ScoreTokensStream`` that sends top-k 256 requests and never reads;
- a client holding its whole fair share queued (``max_queued_tokens_per_client``, the default
  2 Mi tokens);
- a top-k 256 flood: gRPC calls past the answer limits, HTTP calls within them.

Then SIGTERM, with the attack on. ``LOGPROB_SOAK_ONLY=hog,flood`` runs only those attacks (by
their functions' names in ``tests/helpers/attacks.py``), to find which one moves a figure.

Marked ``soak``: the suite leaves it out, and CI runs it in a pytest of its own before the suite
(``make test PYTEST_ARGS="-m soak"``, about 25 s of both cores), since it measures latency against
an unloaded run (once, beside the suite's other worker, it gave 2.4x); ``serial`` as well. Seen
on the 2-core CPU machine, 2026-11-29: p99 ratios 0.95-1.35 over three runs on an idle machine,
1.5-1.67 with a third process spinning a core beside it.

The server's micro-batch is 256 tokens (``--max-batch-tokens``): about 20 ms on this CPU, what a
64 Ki-token micro-batch takes on a GPU, so "a few micro-batches" (what the fair share promises a
small call behind another client's backlog) is small against a call, as it is there.

What must hold: each good client's p99 latency under attack is within 2x of its unloaded p99
(or of a floor, below), the server's resident memory stays within ``RSS_BOUND`` of what it held
unloaded, and the server exits within 10 s of SIGTERM.

The memory bound, from the limits this server runs with (the flags below):

- HTTP bodies held at once: at most ``http_max_buffered_body_bytes`` (32 MiB);
- answers: one request's at most ``max_answer_bytes`` (4 MiB) by its estimate; a JSON answer
  takes up to 6x its size while it is built (the settings model's ``max_answer_bytes``) and one is built
  at a time (on the event loop), so 24 MiB; the flood's two HTTP calls and the good clients'
  answers in flight or in the transport: 4 more, 16 MiB;
- the unread stream: its pending answers at most ``max_stream_answer_bytes`` (4 MiB), and what
  gRPC's transport holds of the requests held back (HTTP/2's window, 64 KiB a stream) and of
  answers (the same): under 1 MiB;
- the gRPC message of a million sequences: at most ``max_message_bytes`` (16 MiB) received, and
  protobuf's parse of it, 160 bytes a sequence (measured: 160 MB for the million, the parse gRPC
  does before any handler; ``max_sequences_per_request`` refuses it right after), one at a time:
  176 MiB;
- queued work: ``max_queued_tokens`` (4 Mi) tokens at 8 bytes an id and as much again for each
  sequence's arrays and bookkeeping (4,096-sequence requests of 64 tokens: under 1 byte a token),
  64 MiB; micro-batches in flight (two, ``max_batch_tokens`` tokens each) with their top-k 256
  results (8 bytes an entry) and activations: 2 x 4,096 x 256 x 8 B = 16 MiB, and tiny-llama's
  activations for 4,096 tokens (under 16 MiB);
- 2,000 connections' buffers (uvicorn's protocol objects and a partial head each, 64 KiB at
  most): under 128 MiB.

That is about 480 MiB; with glibc's arenas (freed memory not given back at once: one per thread,
64 MiB each at most, the server runs a few threads beyond the loop) the bound is 640 MiB over the
unloaded peak. Before the limits, the million-sequence body alone took 3.3 GB and an unread
stream 1 GB a minute.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.processes import ROOT, free_port, launch, wait_serving

pytestmark = [pytest.mark.soak, pytest.mark.serial]

MiB = 2**20
VOCAB = 4096  # builtin:tiny-llama's
CONNECTIONS = 2000  # half-open connections wanted
CLIENTS = ("good-grpc", "good-http", "big", "stream", "hog", "flood")
PHASE_S = 5.0  # each measured phase
RSS_BOUND = 640 * MiB  # over the unloaded peak: the module's docstring derives it
SIGTERM_S = 10.0
# The smallest unloaded p99 the 2x is taken of. Under attack a good call waits, by the fair share,
# for the micro-batches in flight (two) and runs in one filled with others' work: three 256-token
# micro-batches, about 20 ms each on the 2-core CPU machine. An unloaded p99 below that (an idle
# machine) would make the test measure the packing itself, not the attacks.
FLOOR_S = 0.06
GRACE_S = 3.0
# LOGPROB_SOAK_ONLY=hog,flood: only those attacks (diagnosis; the module docstring).
ONLY = tuple(filter(None, os.environ.get("LOGPROB_SOAK_ONLY", "").split(",")))


def server_args(port: int, http_port: int, tokens_file) -> list[str]:
    return [
        "--device", "cpu", "--port", str(port), "--http-port", str(http_port), "--metrics-port", "0",
        "--auth-tokens-file", str(tokens_file),
        "--max-batch-tokens", "256",
        "--max-answer-bytes", str(4 * MiB), "--max-stream-answer-bytes", str(4 * MiB),
        "--max-message-bytes", str(16 * MiB),
        "--http-max-body-bytes", str(8 * MiB), "--http-max-buffered-body-bytes", str(32 * MiB),
        "--grace-period-s", str(GRACE_S), "--drain-notice-s", "0.5",
    ]  # fmt: skip


def connections_allowed() -> int:
    """Raise this process's soft open-file limit for the attack's connections (its child inherits
    it) and say how many it may hold: CONNECTIONS, or fewer under a low hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CONNECTIONS + 256  # and the rest of the attack process: its gRPC and HTTP clients
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    return min(CONNECTIONS, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)


class RssSampler(threading.Thread):
    """The server's resident memory every 50 ms, and its peak since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.path, self.peak, self.running = f"/proc/{pid}/statm", 0, True
        self.page = os.sysconf("SC_PAGE_SIZE")

    def run(self) -> None:
        while self.running:
            try:
                with open(self.path) as statm:
                    self.peak = max(self.peak, int(statm.read().split()[1]) * self.page)
            except (OSError, IndexError):
                return
            time.sleep(0.05)

    def reset(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


async def good_clients(target: str, base: str, tokens: dict[str, str], seconds: float, rng) -> dict[str, list[float]]:
    """Each good client's latencies over ``seconds``: one call at a time, each 4 sequences of
    16 + 16 tokens (gRPC) or 4 prompts of 32 tokens (HTTP ``/v1/completions``)."""
    latencies: dict[str, list[float]] = {"grpc": [], "http": []}
    end = time.monotonic() + seconds

    async def over_grpc() -> None:
        metadata = (("authorization", f"Bearer {tokens['good-grpc']}"),)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            while time.monotonic() < end:
                ids = rng.integers(3, VOCAB, (4, 32))
                request = pb.ScoreRequest(
                    sequences=[pb.Sequence(prompt_ids=row[:16], completion_ids=row[16:]) for row in ids]
                )
                begun = time.perf_counter()
                response = await stub.ScoreTokens(request, metadata=metadata, timeout=30)
                latencies["grpc"].append(time.perf_counter() - begun)
                assert [len(s.logprobs) for s in response.scores] == [16] * 4

    async def over_http() -> None:
        headers = {"authorization": f"Bearer {tokens['good-http']}"}
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as http:
            while time.monotonic() < end:
                body = {"model": "default", "prompt": rng.integers(3, VOCAB, (4, 32)).tolist(), "max_tokens": 1}
                body["prompt_logprobs"] = 0
                begun = time.perf_counter()
                answer = await http.post("/v1/completions", json=body)
                latencies["http"].append(time.perf_counter() - begun)
                assert answer.status_code == 200, answer.text

    await asyncio.gather(over_grpc(), over_http())
    return latencies


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def test_scoring_clients_keep_their_latency_while_the_server_is_attacked(tmp_path, rng):
    tokens = {name: secrets.token_urlsafe(24) for name in CLIENTS}
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(
        json.dumps({"tokens": [{"name": n, "scopes": ["score"], "token": t} for n, t in tokens.items()]})
    )
    connections = connections_allowed()
    port, http_port = free_port(), free_port()
    target, base = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    log_path = tmp_path / "server.log"
    proc = launch(*server_args(port, http_port, tokens_file), stdout=log_path.open("w"))
    attacker = None
    rss = RssSampler(proc.pid)
    try:
        wait_serving(target, proc)
        asyncio.run(good_clients(target, base, tokens, 1.0, rng))  # warm: both edges, both clients
        rss.start()
        rss.reset()
        unloaded = asyncio.run(good_clients(target, base, tokens, PHASE_S, rng))
        unloaded_rss = rss.reset()

        options = dict(
            grpc_target=target, http_base=base, connections=connections, share_tokens=2_097_152,
            flood_tokens=350, max_s=60.0, only=ONLY,
            tokens={name: tokens[name] for name in ("big", "stream", "hog", "flood")},
        )  # fmt: skip
        attacker = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.attacks", json.dumps(options)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), str(ROOT)])},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert attacker.stdout.readline().strip() == "ready"
        attacked = asyncio.run(good_clients(target, base, tokens, PHASE_S, rng))
        attacked_rss = rss.reset()

        begun = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        exit_s = time.monotonic() - begun
        rss.running = False
        report, _ = attacker.communicate(timeout=30)
        attacks = json.loads(report)
    finally:
        rss.running = False
        for p in (proc, attacker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    ratios = {edge: p99(attacked[edge]) / max(p99(unloaded[edge]), FLOOR_S) for edge in unloaded}
    seen = attacks["seen"]
    print(f"p99 under attack / unloaded (floor {FLOOR_S * 1000:.0f} ms): {ratios}; connections: {connections}")
    assert not attacks["failed"], attacks
    if not ONLY:  # every attack happened, and was answered as its limit says
        assert seen["half_open"]["opened"] >= connections and seen["stream"]["written"] > 0, seen
        assert seen["big_http"]["400"] and seen["big_grpc"]["INVALID_ARGUMENT"], seen
        assert seen["hog"]["RESOURCE_EXHAUSTED"] and seen["flood_past"]["INVALID_ARGUMENT"], seen
        assert seen["flood_within"]["200"], seen
    assert all(ratio <= 2.0 for ratio in ratios.values()), (ratios, unloaded, attacked)
    assert attacked_rss - unloaded_rss <= RSS_BOUND, (unloaded_rss / MiB, attacked_rss / MiB)
    assert code == 0 and exit_s < SIGTERM_S, (code, exit_s)
