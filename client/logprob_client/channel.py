"""The channel both clients use: one target or many replicas, load balancing, retries, keepalive.

Everything here is gRPC's own machinery, set through channel options and the service config:

- **Replicas.** A target that resolves to several addresses (``dns:///name:port``, e.g. a
  Kubernetes headless Service, or a list of ``host:port``) is balanced with gRPC's
  ``round_robin`` policy: one connection per replica, each RPC to the next ready one. The parts
  of a large ``score()`` call (``split.py``) are separate RPCs, so they spread over the replicas.
- **Health.** gRPC's client-side health checking: a stream to each replica's health service
  (``grpc.health.v1``, open without a token) tells the channel when a replica is loading or
  draining, and ``round_robin`` sends it nothing until it says SERVING again. A draining replica
  is left before it stops taking calls, so no call is cut off by its shutdown. A server without
  the health service counts as healthy.
- **Retries.** gRPC's service-config retry policy rather than a hand-written loop: it retries
  only UNAVAILABLE and RESOURCE_EXHAUSTED, with exponential backoff and jitter, honours the
  server's ``grpc-retry-pushback-ms`` hint, never retries past the call's deadline, and a retry
  is a fresh pick, so it goes to another replica (a draining or killed one answers UNAVAILABLE).
  gRPC does not retry the stream RPC (a call is committed once responses have flowed):
  ``client.score_many`` sends the requests a broken stream left unanswered again on a new
  stream, with the same backoff (or the server's hint, when longer; ``resume.py``).
- **Keepalive.** Pings on idle connections too, so a replica that vanished without closing its
  connections (a lost node) is noticed and skipped. The interval stays above the server's
  ``grpc.http2.min_ping_interval_without_data_ms``, or the server would close the connection
  for pinging too often.
- **Security.** TLS / mutual TLS credentials and the bearer token sent on every call
  (``security.py``).
- **Weight pushes over connections of their own.** One HTTP/2 connection carries a push's
  parallel streams no faster than one (measured on loopback: 1.6 GB/s either way, 2.3-2.6 GB/s
  over four connections), so each stream of a push gets a connection of its own
  (``own_connection``), ``pick_first``: every one reaches the same server, the first address the
  target resolves to. These channels have retries off: gRPC never retries a push (its method has
  no retry policy), and a channel with retries on holds each call's messages for a replay, which
  cost a quarter to a third of a stream's rate.
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import grpc

from .security import PathLike, make_channel, read_token, tls_credentials

MiB = 1024**2
SERVICE = "logprob.v1.LogprobService"
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
INITIAL_BACKOFF_S, MAX_BACKOFF_S, BACKOFF_MULTIPLIER = 0.1, 5.0, 2
# Client pings every 30 s; the server accepts one every 10 s or more (server.py).
KEEPALIVE_TIME_MS = 30_000


def service_config(
    max_attempts: int = 5,
    initial_backoff_s: float = INITIAL_BACKOFF_S,
    max_backoff_s: float = MAX_BACKOFF_S,
    *,
    pick_first: bool = False,
) -> dict[str, Any]:
    """``round_robin`` over the addresses the target resolves to whose health service says
    SERVING (``pick_first``: the first address that connects, for a weight push's streams), and,
    for ``max_attempts`` >= 2, the retry policy of the unary RPCs."""
    config: dict[str, Any] = (
        {"loadBalancingConfig": [{"pick_first": {}}]}
        if pick_first
        else {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SERVICE}}
    )
    if max_attempts >= 2:  # gRPC's retry policy needs at least 2 attempts; 1 means no retries
        policy = {
            "maxAttempts": max_attempts,  # gRPC caps this at 5
            "initialBackoff": f"{initial_backoff_s}s",
            "maxBackoff": f"{max_backoff_s}s",
            "backoffMultiplier": BACKOFF_MULTIPLIER,
            "retryableStatusCodes": sorted(code.name for code in RETRYABLE_CODES),
        }
        config["methodConfig"] = [
            {"name": [{"service": SERVICE, "method": m} for m in ("ScoreTokens", "ListModels")], "retryPolicy": policy}
        ]
    return config


def backoff_s(retry: int) -> float:
    """Delay before retry number ``retry`` (1, 2, ...) as gRPC's retry policy draws it: uniform in
    [0, min(max backoff, initial backoff * multiplier^(retry - 1))]. For what the policy cannot
    retry itself (a broken stream, ``client.score_many``)."""
    return random.uniform(0, min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * BACKOFF_MULTIPLIER ** (retry - 1)))


def channel_options(
    *,
    max_message_bytes: int = 256 * MiB,
    max_attempts: int = 5,
    extra: list[tuple[str, Any]] | None = None,
    own_connection: bool = False,
) -> list[tuple[str, Any]]:
    """The clients' channel options; ``own_connection``: a channel that shares no connection with
    the others, keeps to one server (``pick_first``) and never retries, for one stream of a weight push."""
    if own_connection:
        max_attempts = 1
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.service_config", json.dumps(service_config(max_attempts=max_attempts, pick_first=own_connection))),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle connection (gRPC stops after 2)
    ]
    if max_attempts >= 2:
        options += [
            ("grpc.enable_retries", 1),
            # A retried call must keep its request: let the buffer hold a large scoring request.
            ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
            ("grpc.retry_buffer_size", 4 * max_message_bytes),
        ]
    else:
        options.append(("grpc.enable_retries", 0))
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))  # channels to one target share connections otherwise
    return options + list(extra or [])


def channel_target(target: str | Sequence[str]) -> str:
    """The gRPC target for one target string or a list of ``host:port`` replicas.

    A string is any gRPC target and passes through unchanged (``host:port``,
    ``dns:///host:port``, ``ipv4:a:p,b:p``, ...). A list of several ``host:port`` becomes one
    ``ipv4:`` (or ``ipv6:``) address-list target, gRPC's own syntax for a fixed set of backends:
    gRPC Python has no resolver for a list of names, so host names are resolved here, once, one
    address each (the IPv4 one when every replica has one). A name whose addresses change is
    better given alone as ``dns:///name:port``, which gRPC re-resolves.
    """
    if isinstance(target, str):
        return target
    replicas = list(target)
    if not replicas:
        raise ValueError("target: the list of replicas is empty")
    if len(replicas) == 1:
        return replicas[0]
    resolved = [_resolve(i, replica) for i, replica in enumerate(replicas)]
    for scheme, family in (("ipv4", socket.AF_INET), ("ipv6", socket.AF_INET6)):
        if all(family in addresses for addresses in resolved):
            return f"{scheme}:" + ",".join(addresses[family] for addresses in resolved)
    raise ValueError(f"target: the replicas {replicas} share no address family (all IPv4 or all IPv6)")


def _resolve(index: int, replica: str) -> dict[socket.AddressFamily, str]:
    """``replica`` ("host:port", "[v6]:port") as its first "address:port" in each family."""
    host, sep, port = replica.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not sep or not host or not port.isdigit() or "/" in replica or (":" in host and not bracketed):
        raise ValueError(f"target[{index}]: {replica!r} is not host:port (a list holds plain host:port replicas)")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"target[{index}]: cannot resolve {host!r}: {err}") from None
    addresses: dict[socket.AddressFamily, str] = {}
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and family not in addresses:
            ip = sockaddr[0]
            addresses[family] = f"{ip}:{port}" if family == socket.AF_INET else f"[{ip}]:{port}"
    return addresses


@dataclass(frozen=True)
class Connection:
    """How a client reaches the service: the one place its channel settings are spelled.

    ``max_attempts``: tries of a call that gets UNAVAILABLE or RESOURCE_EXHAUSTED (gRPC's retry
    policy; 1: no retries). ``options``: extra gRPC channel options. Security (``security.py``):
    ``tls`` or any ``tls_*`` option turns TLS on (``tls_ca_file``: the CA to trust;
    ``tls_cert_file`` + ``tls_key_file``: a client certificate for mutual TLS;
    ``tls_server_name``: the name the server's certificate carries, when the target's differs);
    ``token`` or ``token_file``: a bearer token sent on every call.
    """

    max_attempts: int = 5
    options: Sequence[tuple[str, Any]] = ()
    tls: bool = False
    tls_ca_file: PathLike | None = None
    tls_cert_file: PathLike | None = None
    tls_key_file: PathLike | None = None
    tls_server_name: str | None = None
    token: str | None = None
    token_file: PathLike | None = None

    def security(self) -> list[str]:
        """The names of the TLS and token settings given (they cannot apply to a channel built elsewhere)."""
        return [f.name for f in fields(self) if f.name.startswith(("tls", "token")) and getattr(self, f.name)]

    def open(
        self, target: str | Sequence[str], *, aio: bool, own_connection: bool = False
    ) -> grpc.Channel | grpc.aio.Channel:
        """A blocking (``aio=False``) or asyncio channel to one target or a list of replicas
        (``channel_target``); plaintext, or TLS; sending the token on every call.
        ``own_connection``: see ``channel_options``."""
        merged = channel_options(
            max_attempts=self.max_attempts, extra=list(self.options), own_connection=own_connection
        )
        credentials = tls_credentials(
            tls=self.tls,
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            server_name=self.tls_server_name,
        )
        if self.tls_server_name is not None:
            merged.append(("grpc.ssl_target_name_override", self.tls_server_name))
        token = read_token(self.token, self.token_file)
        return make_channel(channel_target(target), aio=aio, options=merged, credentials=credentials, token=token)


def open_channel(target: str | Sequence[str], *, aio: bool, **connection: Any) -> grpc.Channel | grpc.aio.Channel:
    """The channel the clients use, for code that speaks to the stubs itself: ``connection`` holds
    the fields of ``Connection``."""
    return Connection(**connection).open(target, aio=aio)
