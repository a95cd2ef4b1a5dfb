"""TLS and bearer tokens for the client's channel (``channel.open_channel``).

TLS is on when ``tls=True`` or any ``tls_*`` option is given: ``tls_ca_file`` verifies the
server against that CA instead of the system's roots; ``tls_cert_file`` + ``tls_key_file``
present a client certificate (mutual TLS); ``tls_server_name`` is the name the server's
certificate must carry when the target's host differs from it (gRPC's
``grpc.ssl_target_name_override``, e.g. for an IP address or a tunnel).

A token (``token``, or ``token_file`` holding it) goes as ``authorization: Bearer <token>``
metadata on every call. It is added by a client interceptor, not by gRPC call credentials:
gRPC refuses to send call credentials on a plaintext channel, and a plaintext channel on
loopback, to a server that requires tokens, is a setup that must work (local development, a
sidecar). gRPC's retries resend the metadata of the call they retry.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import grpc

PathLike = str | os.PathLike[str]


def read_token(token: str | None, token_file: PathLike | None) -> str | None:
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token_file is not None:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"token_file {str(token_file)!r} is empty")
    return token


def tls_credentials(
    *,
    tls: bool,
    ca_file: PathLike | None,
    cert_file: PathLike | None,
    key_file: PathLike | None,
    server_name: str | None,
) -> grpc.ChannelCredentials | None:
    """Channel credentials for TLS, or None for a plaintext channel."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("tls_cert_file and tls_key_file go together (the client certificate and its key)")
    if not (tls or ca_file or cert_file or server_name):
        return None

    def read(path: PathLike | None) -> bytes | None:
        return Path(path).read_bytes() if path is not None else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file), private_key=read(key_file), certificate_chain=read(cert_file)
    )


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._header],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioBearerToken:
    """Adds the token to every call of its kind on an asyncio channel. grpc.aio files an
    interceptor under the first of the four kinds it is an instance of (``aio/_channel.py``), so
    one class of all four would add it to unary calls only: one subclass per kind."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return details._replace(metadata=metadata)


class _AioUnaryUnaryToken(_AioBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStreamToken(_AioBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnaryToken(_AioBearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStreamToken(_AioBearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


_AIO_TOKENS = (_AioUnaryUnaryToken, _AioUnaryStreamToken, _AioStreamUnaryToken, _AioStreamStreamToken)


def make_channel(
    target: str,
    *,
    aio: bool,
    options: list[tuple[str, Any]],
    credentials: grpc.ChannelCredentials | None,
    token: str | None,
) -> grpc.Channel | grpc.aio.Channel:
    """A plaintext or TLS channel that sends ``token`` (when given) on every call."""
    if aio:
        interceptors = [kind(token) for kind in _AIO_TOKENS] if token is not None else None
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    channel = (
        grpc.insecure_channel(target, options=options)
        if credentials is None
        else grpc.secure_channel(target, credentials, options=options)
    )
    return grpc.intercept_channel(channel, _BearerToken(token)) if token is not None else channel
