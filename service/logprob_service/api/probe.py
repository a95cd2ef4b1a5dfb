"""``logprob-service probe``: is the server SERVING? Asked of its standard gRPC health service.

The container image's HEALTHCHECK runs it. Exit 0 when SERVING, 1 otherwise (NOT_SERVING while
models load and warm up, an unknown service name, or no answer: a draining server has closed its
port), with one line on stdout saying which: Docker's health checks know these two codes only.
Kubernetes probes the same health service natively (``grpc:`` probes, deploy/k8s).
"""

from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logprob_service.config import load_settings

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def default_address() -> str:
    """The address of the server this environment configures: host and port from the same
    settings ``serve`` reads (``LOGPROB_*`` environment, ``LOGPROB_CONFIG`` file), and loopback
    when the server binds every interface."""
    settings = load_settings(os.environ.get("LOGPROB_CONFIG"))
    host = "127.0.0.1" if settings.host in _WILDCARDS else settings.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{settings.port}"


def check(address: str, service: str = "", timeout_s: float = 5.0) -> tuple[bool, str]:
    """(serving, what the server answered or why there was no answer)."""
    with grpc.insecure_channel(address) as channel:
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


def main(address: str | None, service: str, timeout_s: float) -> int:
    serving, message = check(address or default_address(), service, timeout_s)
    print(message, flush=True)
    return 0 if serving else 1
