"""The HTTP edge as a server: its connections, ``logprob-service serve --http-port`` beside gRPC
with SIGTERM draining both, and a port already taken named at start-up."""

from __future__ import annotations

import signal
import socket
import time

import httpx
import pytest
from logprob_service.settings.errors import StartupError

from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.server import settings, start, stop


async def test_answers_leave_at_once_nagle_off_on_every_connection(served):
    """Nagle's algorithm is off on the edge's connections: with it on, an answer's body waited
    for the client's delayed ACK of its headers, 40 ms a request (a listening socket made with
    proto 0 kept asyncio from turning it off)."""
    async with httpx.AsyncClient(base_url=served.base) as http:
        assert (await http.get("/v1/models")).status_code == 200  # the connection stays open (keep-alive)
        connections = list(served.running.service.http.server.server_state.connections)
        assert connections
        for connection in connections:
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_a_taken_port_is_named_at_start_up():
    running = await start(settings({"default": "builtin:tiny-llama"}))
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(StartupError, match=rf"cannot serve HTTP on 127.0.0.1:{port} \(--http-port"):
                await running.service.start_http("127.0.0.1", port)
    finally:
        await stop(running)


def wait_healthy(base: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base}/health never answered 200")


def test_serve_with_http_port_answers_both_edges_and_drains_on_sigterm(tmp_path, rng):
    port, http_port = free_port(), free_port()
    log = (tmp_path / "server.log").open("w")
    proc = launch(
        "--device", "cpu", "--port", str(port), "--http-port", str(http_port), "--metrics-port", "0",
        "--drain-notice-s", "3", "--grace-period-s", "10",
        stdout=log,
    )  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        wait_healthy(base)
        ids = rng.integers(1, 4096, 12).tolist()
        body = {"model": "default", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["prompt_logprobs"]) == 12
        proc.send_signal(signal.SIGTERM)
        # Through the drain notice: /health and new work 503 while the edge still takes calls.
        deadline = time.monotonic() + 2.5
        while httpx.get(f"{base}/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
            time.sleep(0.05)
        refused = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert f"HTTP listening on 127.0.0.1:{http_port}" in text, text[-2000:]


def test_an_exposed_http_port_warns_of_what_it_lacks():
    from logprob_service.security.exposure import exposure_warnings

    assert exposure_warnings("127.0.0.1", tls=False, auth=False, edge="HTTP") == []
    plaintext, open_door = exposure_warnings("0.0.0.0", tls=False, auth=False, edge="HTTP")
    assert plaintext.startswith("HTTP on 0.0.0.0 is PLAINTEXT") and "weight" not in plaintext
    assert open_door.startswith("HTTP on 0.0.0.0 has NO AUTHENTICATION") and "can score" in open_door


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from tests.helpers.certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


async def test_tls_and_mutual_tls_as_the_grpc_port(pki):
    """The HTTP edge takes the gRPC port's certificate and, with client CAs, asks callers for one."""
    import ssl

    from tests.http.conftest import serve_both

    both = await serve_both(tls_cert_file=pki.server.cert, tls_key_file=pki.server.key, tls_client_ca_file=pki.ca)
    base = both.base.replace("http://", "https://")
    try:
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        trusted.load_cert_chain(str(pki.client.cert), str(pki.client.key))
        async with httpx.AsyncClient(base_url=base, verify=trusted) as http:
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == "default"
        anonymous = ssl.create_default_context(cafile=str(pki.ca))
        async with httpx.AsyncClient(base_url=base, verify=anonymous) as http:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await http.get("/v1/models")
        rogue = ssl.create_default_context(cafile=str(pki.ca))
        rogue.load_cert_chain(str(pki.rogue_client.cert), str(pki.rogue_client.key))
        async with httpx.AsyncClient(base_url=base, verify=rogue) as http:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await http.get("/v1/models")
        async with httpx.AsyncClient(base_url=both.base) as http:  # plaintext to a TLS port
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError)):
                await http.get("/health")
    finally:
        await stop(both.running)
