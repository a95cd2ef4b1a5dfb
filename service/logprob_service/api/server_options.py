"""The gRPC server's options, for the serving process and its weight receivers (no torch here)."""

from __future__ import annotations

from typing import Any

from logprob_service.config import Settings


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    """gRPC server options: message limits, keepalive, connection age."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # Announced in HTTP/2 SETTINGS: a client's RPCs beyond it wait for a free stream.
        ("grpc.max_concurrent_streams", settings.max_concurrent_rpcs_per_connection),
        # Accept the clients' keepalive pings (logprob_client.channel pings every 30 s, idle or not).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    if settings.max_connection_age_s > 0:
        # A GOAWAY after this age (gRPC adds +-10% jitter) makes clients reconnect and re-resolve
        # their target, so a client balancing over a DNS name finds replicas added since it
        # connected. In-flight calls finish on the old connection: no grace limit is set.
        options.append(("grpc.max_connection_age_ms", round(settings.max_connection_age_s * 1000)))
    return options
