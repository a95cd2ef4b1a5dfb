"""Channel options: message limits, and gRPC's own retry policy.

Retries use gRPC's service-config retry policy rather than a hand-written loop: it retries only
UNAVAILABLE and RESOURCE_EXHAUSTED, with exponential backoff and jitter, honours the server's
``grpc-retry-pushback-ms`` hint, and never retries past the call's deadline. The stream RPC is
not retried (its requests are not idempotent once responses have flowed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

MiB = 1024**2
SERVICE = "logprob.v1.LogprobService"


def retry_service_config(max_attempts: int = 5, initial_backoff_s: float = 0.1, max_backoff_s: float = 5.0) -> str:
    policy = {
        "maxAttempts": max_attempts,  # gRPC caps this at 5
        "initialBackoff": f"{initial_backoff_s}s",
        "maxBackoff": f"{max_backoff_s}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
    }
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": SERVICE, "method": m} for m in ("ScoreTokens", "ListModels")],
                    "retryPolicy": policy,
                }
            ]
        }
    )


def channel_options(
    *, max_message_bytes: int = 256 * MiB, max_attempts: int = 5, extra: list[tuple[str, Any]] | None = None
) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if max_attempts >= 2:  # gRPC's retry policy needs at least 2 attempts; 1 means no retries
        options += [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", retry_service_config(max_attempts=max_attempts)),
            # A retried call must keep its request: let the buffer hold a large scoring request.
            ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
            ("grpc.retry_buffer_size", 4 * max_message_bytes),
        ]
    else:
        options.append(("grpc.enable_retries", 0))
    return options + list(extra or [])


def open_channel(
    target: str, *, aio: bool, max_attempts: int = 5, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.Channel | grpc.aio.Channel:
    """The channel both clients use: blocking (``aio=False``) or asyncio."""
    merged = channel_options(max_attempts=max_attempts, extra=list(options or []))
    return (grpc.aio if aio else grpc).insecure_channel(target, options=merged)
