"""``logprob-service probe``: is the server SERVING? Asked of its standard gRPC health service.

The container image's HEALTHCHECK runs it. Exit 0 when SERVING, 1 otherwise (NOT_SERVING while
models load and warm up, an unknown service name, or no answer: a draining server has closed its
port), with one line on stdout saying which: Docker's health checks know these two codes only.

It reads the settings ``serve`` reads (``LOGPROB_*`` environment, ``LOGPROB_CONFIG`` file): the
address, and whether the port speaks TLS. With TLS on it trusts the server's own certificate file
(a self-signed certificate, or a chain that ends in its root) and the client CA file, or the CA
given with ``--tls-ca-file``, and checks the certificate's chain, not the name it was issued for:
the probe dials loopback, which a certificate for a cluster name does not carry. With mutual TLS
it presents the server's own certificate, or the pair given. The health service needs no token.
Kubernetes' ``grpc:`` probes speak plaintext only: with TLS on, an ``exec`` probe runs this
command (docs/deployment.md).
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logprob_service.settings.model import Settings, load_settings

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


@dataclass(frozen=True)
class ProbeTls:
    """What the probe needs to speak TLS to a server: the roots it trusts, and its own pair for
    mutual TLS (None: it presents none)."""

    roots: bytes
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def of(
        cls,
        settings: Settings,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
    ) -> ProbeTls | None:
        """The TLS the server of ``settings`` speaks, None for plaintext; ``ca_file``,
        ``cert_file`` and ``key_file`` replace what the probe takes from the server's settings."""
        if settings.tls_cert_file is None:
            return None
        trusted = [ca_file] if ca_file is not None else [settings.tls_cert_file, settings.tls_client_ca_file]
        roots = b"".join(path.read_bytes() for path in trusted if path is not None)
        if settings.tls_client_ca_file is None and cert_file is None:
            return cls(roots)
        return cls(roots, cert_file or settings.tls_cert_file, key_file or settings.tls_key_file)

    def credentials(self) -> grpc.ChannelCredentials:
        pair = {}
        if self.cert_file is not None and self.key_file is not None:
            pair = {"private_key": self.key_file.read_bytes(), "certificate_chain": self.cert_file.read_bytes()}
        return grpc.ssl_channel_credentials(root_certificates=self.roots, **pair)

    def server_name(self, address: str, timeout_s: float) -> str:
        """A name the server's certificate carries (its first DNS name, else IP address), read
        from a TLS handshake that checks the chain against the roots: gRPC then checks the
        certificate against that name, as a client dialling it by that name would."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False  # the chain is checked here; the name is what is read
        context.load_verify_locations(cadata=self.roots.decode())
        context.set_alpn_protocols(["h2"])
        if self.cert_file is not None and self.key_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        host, _, port = address.rpartition(":")
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock,
            context.wrap_socket(sock) as tls,
        ):
            peer = tls.getpeercert() or {}
        names = peer.get("subjectAltName", ())
        for kind in ("DNS", "IP Address"):
            for found, value in names:
                if found == kind:
                    return str(value)
        subject = dict(item for rdn in peer.get("subject", ()) for item in rdn)
        return str(subject.get("commonName", host))


def default_address(settings: Settings) -> str:
    """The address of the server ``settings`` configure, loopback when it binds every interface."""
    host = "127.0.0.1" if settings.host in _WILDCARDS else settings.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{settings.port}"


def check(address: str, service: str = "", timeout_s: float = 5.0, tls: ProbeTls | None = None) -> tuple[bool, str]:
    """(serving, what the server answered or why there was no answer)."""
    try:
        channel = (
            grpc.insecure_channel(address)
            if tls is None
            else grpc.secure_channel(
                address,
                tls.credentials(),
                options=[("grpc.ssl_target_name_override", tls.server_name(address, timeout_s))],
            )
        )
    except (OSError, ValueError) as err:  # the TLS handshake: refused, a chain the roots do not sign
        return False, f"no answer from {address}: TLS: {err}"
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # the health service does not know the name
                return False, f"SERVICE_UNKNOWN: {service!r}"
            return False, f"no answer from {address}: {err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def main(
    address: str | None,
    service: str,
    timeout_s: float,
    ca_file: Path | None = None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
) -> int:
    settings = load_settings(os.environ.get("LOGPROB_CONFIG"))
    tls = ProbeTls.of(settings, ca_file, cert_file, key_file)
    serving, message = check(address or default_address(settings), service, timeout_s, tls)
    print(message, flush=True)
    return 0 if serving else 1
