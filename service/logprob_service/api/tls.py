"""The gRPC port's transport: plaintext, TLS or mutual TLS (the warning when a port is exposed
without them is ``security.exposure``'s, which the HTTP edge shares).

Plaintext stays the default for loopback development.
"""

from __future__ import annotations

import grpc

from logprob_service.settings.model import Settings


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
