"""Listening: one server per port (gRPC's SO_REUSEPORT is off), and a port that cannot be had is a
StartupError naming the address and the flag (the CLI prints it as one line and exits 2)."""

from __future__ import annotations

import grpc
import pytest
from logprob_service.api.server_options import listen, server_options
from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings


def try_to_bind(server: grpc.aio.Server, address: str) -> int:
    try:
        return server.add_insecure_port(address)
    except RuntimeError:  # "Failed to bind" (grpcio of old returned 0)
        return 0


async def test_a_port_the_server_listens_on_is_not_shared():
    """gRPC sets SO_REUSEPORT by default: a second server on the port started and the kernel
    split new connections between the two."""
    ours = grpc.aio.server(options=server_options(Settings()))
    port = listen(ours, "127.0.0.1", 0, None, "--port")
    await ours.start()
    try:
        other = grpc.aio.server()  # gRPC's defaults
        assert try_to_bind(other, f"127.0.0.1:{port}") == 0
    finally:
        await ours.stop(None)


async def test_a_port_in_use_is_refused_naming_the_address_and_the_flag():
    # Another gRPC server with gRPC's defaults (SO_REUSEPORT on), such as a server of an older release.
    first = grpc.aio.server()
    port = first.add_insecure_port("127.0.0.1:0")
    await first.start()
    try:
        second = grpc.aio.server(options=server_options(Settings()))
        with pytest.raises(StartupError) as info:
            listen(second, "127.0.0.1", port, None, "--port")
        assert str(info.value) == (
            f"cannot listen on 127.0.0.1:{port} (--port): Address already in use (another server on this port?)"
        )
    finally:
        await first.stop(None)


async def test_an_address_of_no_interface_here_is_refused():
    server = grpc.aio.server(options=server_options(Settings()))
    with pytest.raises(StartupError, match=r"^cannot listen on 192\.0\.2\.1:5005 \(--port\): Cannot assign requested"):
        listen(server, "192.0.2.1", 5005, None, "--port")  # TEST-NET-1: documentation only


def test_connections_are_bounded_by_streams_and_keepalive():
    """gRPC's own connection discipline (docs/security.md): a cap on concurrent streams per
    connection, and keepalive pings that drop a peer gone silent in about 80 s."""
    options = dict(server_options(Settings(max_concurrent_rpcs_per_connection=64)))
    assert options["grpc.max_concurrent_streams"] == 64
    assert options["grpc.keepalive_time_ms"] == 60_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.keepalive_permit_without_calls"] == 1 and options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.max_connection_age_ms"] == 300_000
