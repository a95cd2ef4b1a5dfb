"""The gRPC server's options and how it listens, for the serving process and its weight
receivers (no torch here)."""

from __future__ import annotations

import errno
import socket
from typing import Any

import grpc

from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings

# The server's own keepalive pings (docs/security.md).
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    """gRPC server options: message limits, streams per connection, keepalive, connection age."""
    options: list[tuple[str, Any]] = [
        # gRPC sets SO_REUSEPORT by default: a second server on the same port started and served,
        # the kernel splitting new connections between the two (and their different models).
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # Announced in HTTP/2 SETTINGS: a client's RPCs beyond it wait for a free stream.
        ("grpc.max_concurrent_streams", settings.max_concurrent_rpcs_per_connection),
        # Accept the clients' keepalive pings (logprob_client.channel pings every 30 s, idle or not).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # Ping every connection this often, and drop one whose peer does not answer within the
        # timeout: a client that vanished (host down, cable cut) frees its descriptor and streams in
        # about 80 s instead of gRPC's default 2 hours.
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),  # also on a connection with no calls (gRPC stops after 2)
    ]
    if settings.max_connection_age_s > 0:
        # A GOAWAY after this age (gRPC adds +-10% jitter) makes clients reconnect and re-resolve
        # their target, so a client balancing over a DNS name finds replicas added since it
        # connected. In-flight calls finish on the old connection: no grace limit is set.
        options.append(("grpc.max_connection_age_ms", round(settings.max_connection_age_s * 1000)))
    return options


def listen(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None, flag: str) -> int:
    """Add ``host:port`` to ``server`` (with TLS when ``credentials``) and return the port bound;
    raises StartupError naming the address and ``flag`` when it cannot be listened on."""
    address = f"{host}:{port}"
    problem = _bind_problem(host, port)
    if problem is None:
        try:
            bound = (
                server.add_insecure_port(address)
                if credentials is None
                else server.add_secure_port(address, credentials)
            )
        except RuntimeError:  # "Failed to bind", after a log line of gRPC's own saying why
            bound = 0
        if bound:
            return bound
        problem = "gRPC could not bind it"
    raise StartupError(f"cannot listen on {address} ({flag}): {problem}")


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, found by binding it as gRPC does (SO_REUSEADDR:
    a port left in TIME_WAIT is free), or None. Asked first, since gRPC's own failure says only
    "Failed to bind"."""
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"cannot resolve {host!r}: {err.strerror}"
    problem = None
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as err:
                in_use = " (another server on this port?)" if err.errno == errno.EADDRINUSE else ""
                problem = problem or f"{err.strerror}{in_use}"
                continue
        return None  # gRPC listens on every address of the host it can bind: one is enough
    return problem
