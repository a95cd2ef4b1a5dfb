"""Channel options: message limits, and gRPC's own retry policy.

Retries use gRPC's service-config retry policy rather than a hand-written loop: it retries only
UNAVAILABLE and RESOURCE_EXHAUSTED, with exponential backoff and jitter, honours the server's
``grpc-retry-pushback-ms`` hint, and never retries past the call's deadline. gRPC does not retry
the stream RPC (a call is committed once responses have flowed): ``client.score_many`` sends the
requests a broken stream left unanswered again on a new stream, with the same backoff (or the
server's hint, when longer).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import grpc

from .security import PathLike, make_channel, read_token, tls_credentials

MiB = 1024**2
SERVICE = "logprob.v1.LogprobService"
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
INITIAL_BACKOFF_S, MAX_BACKOFF_S, BACKOFF_MULTIPLIER = 0.1, 5.0, 2


def retry_service_config(
    max_attempts: int = 5, initial_backoff_s: float = INITIAL_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S
) -> str:
    policy = {
        "maxAttempts": max_attempts,  # gRPC caps this at 5
        "initialBackoff": f"{initial_backoff_s}s",
        "maxBackoff": f"{max_backoff_s}s",
        "backoffMultiplier": BACKOFF_MULTIPLIER,
        "retryableStatusCodes": sorted(code.name for code in RETRYABLE_CODES),
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


def backoff_s(retry: int) -> float:
    """Delay before retry number ``retry`` (1, 2, ...) as gRPC's retry policy draws it: uniform in
    [0, min(max backoff, initial backoff * multiplier^(retry - 1))]. For what the policy cannot
    retry itself (a broken stream, ``client.score_many``)."""
    return random.uniform(0, min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * BACKOFF_MULTIPLIER ** (retry - 1)))


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
    target: str,
    *,
    aio: bool,
    max_attempts: int = 5,
    options: Sequence[tuple[str, Any]] | None = None,
    tls: bool = False,
    tls_ca_file: PathLike | None = None,
    tls_cert_file: PathLike | None = None,
    tls_key_file: PathLike | None = None,
    tls_server_name: str | None = None,
    token: str | None = None,
    token_file: PathLike | None = None,
) -> grpc.Channel | grpc.aio.Channel:
    """The channel both clients use: blocking (``aio=False``) or asyncio; plaintext, or TLS when
    ``tls`` or any ``tls_*`` option is given; sending ``token`` on every call (``security.py``)."""
    merged = channel_options(max_attempts=max_attempts, extra=list(options or []))
    credentials = tls_credentials(
        tls=tls, ca_file=tls_ca_file, cert_file=tls_cert_file, key_file=tls_key_file, server_name=tls_server_name
    )
    if tls_server_name is not None:
        merged.append(("grpc.ssl_target_name_override", tls_server_name))
    return make_channel(target, aio=aio, options=merged, credentials=credentials, token=read_token(token, token_file))
