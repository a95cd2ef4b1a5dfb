"""What a connection to the HTTP edge may hold: a deadline for each request's head and body, a cap
on open connections below the open-file limit, a cap on the body bytes held over all connections,
and a caller identity that X-Forwarded-For sets only from a named proxy.

Idle and half-sent connections stayed open for good: 3,000 of them took a server with 1,024
descriptors past its limit, new gRPC clients could not connect, and "Too many open files" filled
the log. Forty 60 MB bodies at once took 2.5 GB. Any caller on loopback picked its own fair-share
identity with X-Forwarded-For.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
import time

import httpx
import pytest
import pytest_asyncio
from logprob_service.api.probe import check as health_check
from logprob_service.http import connections

from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.server import stop
from tests.http.conftest import serve_both

MiB = 1024**2
COMPLETION = {"model": "default", "max_tokens": 1, "prompt_logprobs": 0, "prompt": [1, 2, 3]}


@pytest_asyncio.fixture
async def strict():
    both = await serve_both(http_header_timeout_s=0.5, http_body_timeout_s=0.5)
    yield both
    await stop(both.running)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bytes, float]:
    """What the server sent before it closed the connection, and when it closed it."""
    start, received = time.monotonic(), b""
    async with asyncio.timeout(seconds):
        while chunk := await reader.read(65536):
            received += chunk
    return received, time.monotonic() - start


async def test_silent_and_half_sent_connections_are_closed_at_the_head_deadline(strict):
    port = int(strict.base.rsplit(":", 1)[1])
    sends = {
        "nothing": b"",
        "one byte": b"P",
        "a partial head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
    }
    for what, data in sends.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        received, after = await closed_within(reader, 5.0)
        assert received == b"" and after < 3.0, (what, received, after)
        writer.close()


async def test_a_body_nobody_reads_cannot_hold_the_connection(strict):
    """A route that answers without reading the body (a GET): the endless chunked body after it
    keeps no connection open past the head deadline."""
    port = int(strict.base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")

    async def trickle() -> None:
        while True:
            writer.write(b"5\r\nhello\r\n")
            await asyncio.sleep(0.05)

    sender = asyncio.create_task(trickle())
    try:
        received, after = await closed_within(reader, 5.0)
    finally:
        sender.cancel()
        writer.close()
    assert received.startswith(b"HTTP/1.1 200") and after < 3.0, (received[:60], after)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_not_all_sent_in_time_is_408_and_its_connection_closed(strict, framing):
    port = int(strict.base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    length = "Content-Length: 1000" if framing == "content-length" else "Transfer-Encoding: chunked"
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{length}\r\n\r\n".encode())
    writer.write(b"{" if framing == "content-length" else b"1\r\n{\r\n")
    received, after = await closed_within(reader, 5.0)
    writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
    assert b"http_body_timeout_s" in body and after < 3.0, (body, after)


async def test_connections_past_the_cap_are_answered_503_and_grpc_and_the_rest_serve_on():
    both = await serve_both(http_max_connections=4)
    port = int(both.base.rsplit(":", 1)[1])
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    try:
        server = both.running.service.http.server
        for _ in range(100):
            if len(server.server_state.connections) == 4:
                break
            await asyncio.sleep(0.02)
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            received, _ = await closed_within(reader, 5.0)
            writer.close()
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"http_max_connections" in body, received
        assert len(server.server_state.connections) == 4
        assert both.running.service.http.limits.refused == 3
        assert (await asyncio.to_thread(health_check, both.target, "", 5.0))[0]  # gRPC takes new clients
        _, writer = held.pop()
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=both.base) as http:
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
    finally:
        for _, writer in held:
            writer.close()
        await stop(both.running)


async def test_bodies_held_at_once_are_capped_over_all_connections():
    both = await serve_both(http_max_body_bytes=MiB, http_max_buffered_body_bytes=2 * MiB)
    port = int(both.base.rsplit(":", 1)[1])
    bodies = both.running.service.http.bodies
    slow = []
    try:
        for _ in range(2):  # two bodies of nearly 1 MiB each, never finished
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {MiB}\r\n\r\n".encode())
            writer.write(b" " * (MiB - 1000))
            slow.append(writer)
        for _ in range(500):
            if bodies.held >= 2 * (MiB - 1000):
                break
            await asyncio.sleep(0.02)
        assert bodies.held == 2 * (MiB - 1000)
        async with httpx.AsyncClient(base_url=both.base) as http:
            refused = await http.post("/v1/completions", json={**COMPLETION, "prompt": [1] * 1000})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            assert "http_max_buffered_body_bytes=2097152" in refused.json()["error"]["message"]
            for writer in slow:
                writer.close()
            for _ in range(500):
                if bodies.held == 0:
                    break
                await asyncio.sleep(0.02)
            assert bodies.held == 0
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert bodies.held == 0
    finally:
        for writer in slow:
            writer.close()
        await stop(both.running)


@pytest.mark.parametrize(("trusted", "client"), [((), "127.0.0.1"), (("127.0.0.1",), "10.9.8.7")])
async def test_x_forwarded_for_names_the_caller_only_from_a_trusted_proxy(caplog, trusted, client):
    """Without ``http_trusted_proxies`` the header is ignored: a caller on loopback can no longer
    choose the identity its fair share is counted under."""
    both = await serve_both(http_trusted_proxies=trusted)
    try:
        caplog.set_level(logging.WARNING, logger="logprob_service.requests")
        async with httpx.AsyncClient(base_url=both.base) as http:
            answer = await http.post(
                "/v1/completions", json={**COMPLETION, "prompt": []}, headers={"x-forwarded-for": "10.9.8.7"}
            )
        assert answer.status_code == 400
        (line,) = [r for r in caplog.records if r.name == "logprob_service.requests"]
        assert line.fields["client"] == client
    finally:
        await stop(both.running)


def test_the_connection_cap_is_derived_from_the_open_file_limit(monkeypatch):
    limits = {"soft": 1024}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], 1 << 20))
    assert connections.connection_cap(7) == 7
    assert connections.connection_cap(0) == (1024 - connections.RESERVED_FDS) // 2
    limits["soft"] = 1 << 20
    assert connections.connection_cap(0) == connections.MAX_DERIVED_CONNECTIONS
    limits["soft"] = 256
    assert connections.connection_cap(0) == 16


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(monkeypatch):
    set_to = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 65536))
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: set_to.append(value))
    assert connections.raise_open_file_limit() == (1024, 65536) and set_to == [(65536, 65536)]


async def test_accept_errors_are_logged_once_in_a_while(caplog):
    """Out of descriptors, asyncio's accept loop reports every retry with a traceback: one line
    every ACCEPT_ERROR_LOG_S instead; other errors still reach the loop's handler."""
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    others = []
    loop.set_exception_handler(lambda _, context: others.append(context))
    try:
        connections.quiet_accept_errors(loop)
        connections.quiet_accept_errors(loop)  # once is enough
        handler = loop.get_exception_handler()
        emfile = OSError(24, "Too many open files")
        with caplog.at_level(logging.WARNING, logger="logprob_service.http.connections"):
            for _ in range(50):
                handler(loop, {"message": "socket.accept() out of system resource", "exception": emfile})
            handler(loop, {"message": "something else", "exception": ValueError("x")})
        (line,) = caplog.records
        assert "Too many open files" in line.getMessage() and line.exc_info is None
        assert [c["message"] for c in others] == ["something else"]
    finally:
        loop.set_exception_handler(before)


def test_half_open_connections_past_the_open_file_limit_leave_grpc_and_the_log_alone(tmp_path):
    """A server with 640 descriptors and 800 half-open HTTP connections: the HTTP edge holds at
    most (640 - 512) / 2 = 64 of them and answers the rest 503, so new gRPC clients connect, the log
    holds no flood of accept errors, and once the connections go HTTP serves again."""
    port, http_port = free_port(), free_port()
    log_path = tmp_path / "server.log"

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (640, 640))

    proc = launch(
        "--device", "cpu", "--port", str(port), "--http-port", str(http_port), "--metrics-port", "0",
        "--http-header-timeout-s", "60", "--grace-period-s", "5", "--drain-notice-s", "0",
        stdout=log_path.open("w"), preexec_fn=few_descriptors,
    )  # fmt: skip
    held = []
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        for i in range(800):
            sock = socket.create_connection(("127.0.0.1", http_port), timeout=10)
            sock.sendall(b"P" if i % 2 else b"")
            held.append(sock)
        time.sleep(1.0)
        assert health_check(f"127.0.0.1:{port}", timeout_s=5)[0], "a new gRPC client could not connect"
        for sock in held:
            sock.close()
        held.clear()
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=COMPLETION, timeout=10)
            except httpx.TransportError:
                answer = None
            if answer is not None and answer.status_code == 200:
                break
            assert time.monotonic() < deadline, answer
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        for sock in held:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "open-file limit: 640" in log and "at most 64 connections" in log, log[-3000:]
    assert "HTTP connections at their limit of 64" in log
    floods = [line for line in log.splitlines() if "Too many open files" in line or "out of system resource" in line]
    assert len(floods) <= 2, floods[:5]


def test_settings_name_the_http_limits_and_refuse_a_buffer_smaller_than_a_body():
    from logprob_service.settings.model import Settings

    settings = Settings(http_trusted_proxies="10.0.0.1, 10.1.0.0/16", http_max_connections=100)
    assert settings.http_trusted_proxies == ("10.0.0.1", "10.1.0.0/16") and settings.http_max_connections == 100
    with pytest.raises(ValueError, match=r"http_max_buffered_body_bytes .* must not be below http_max_body_bytes"):
        Settings(http_max_body_bytes=8 * MiB, http_max_buffered_body_bytes=4 * MiB)
