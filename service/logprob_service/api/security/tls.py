"""The gRPC port's transport: plaintext, TLS or mutual TLS, and a loud warning when exposed.

Plaintext stays the default for loopback development. Bound to any other address, the server
warns at startup for each protection it lacks: without TLS, tokens, token ids, scores and
weights cross the network readable by anyone on the path; without tokens, anyone who can reach
the port can score and replace model weights.
"""

from __future__ import annotations

import ipaddress

import grpc

from logprob_service.config import Settings


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings' PEM files, or None for plaintext."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    client_ca = settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warnings(host: str, *, tls: bool, auth: bool) -> list[str]:
    """What a server bound to ``host`` lacks, one line each; none on loopback."""
    if is_loopback(host):
        return []
    warnings = []
    if not tls:
        warnings.append(
            f"gRPC on {host} is PLAINTEXT and reachable from other machines: tokens, token ids, scores and "
            "weight updates cross the network unencrypted. Set tls_cert_file and tls_key_file (SECURITY.md)."
        )
    if not auth:
        warnings.append(
            f"gRPC on {host} has NO AUTHENTICATION: anyone who can reach the port can score and replace "
            "model weights. Set auth_tokens_file or LOGPROB_AUTH_TOKENS (SECURITY.md)."
        )
    return warnings
