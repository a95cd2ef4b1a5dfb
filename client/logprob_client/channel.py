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
- **Connecting.** A scoring call waits for a SERVING replica (``wait_for_ready``) within its
  deadline, but first for a connection at most ``connect_timeout_s`` (``ConnectionWatch``): a
  target nothing listens on, or that does not resolve, fails in that time as ``Unavailable``
  naming the target and gRPC's last connection error, not as a bare DEADLINE_EXCEEDED at the end
  of the deadline. A server that was reached (connected, even if still loading or draining) keeps
  the call's whole deadline. A target gRPC cannot parse is a ``ValueError`` when the client is built.
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

import asyncio
import concurrent.futures
import ipaddress
import json
import math
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import grpc

from .errors import Unavailable
from .security import PathLike, make_channel, read_token, tls_credentials

MiB = 1024**2
SERVICE = "logprob.v1.LogprobService"
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
INITIAL_BACKOFF_S, MAX_BACKOFF_S, BACKOFF_MULTIPLIER = 0.1, 5.0, 2
# Client pings every 30 s; the server accepts one every 10 s or more (server.py).
KEEPALIVE_TIME_MS = 30_000
# How long a scoring call waits for a connection to the server before it fails (Unavailable).
CONNECT_TIMEOUT_S = 5.0
# gRPC's resolvers (a target with another scheme, or none, is a dns name: "host:port").
_SCHEMES = frozenset({"dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p"})
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


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
    ``dns:///host:port``, ``ipv4:a:p,b:p``, ...), once checked: one gRPC cannot parse
    (``"not a target"``) is a ``ValueError``. A list of several ``host:port`` becomes one
    ``ipv4:`` (or ``ipv6:``) address-list target, gRPC's own syntax for a fixed set of backends:
    gRPC Python has no resolver for a list of names, so host names are resolved here, once, one
    address each (the IPv4 one when every replica has one). A name whose addresses change is
    better given alone as ``dns:///name:port``, which gRPC re-resolves.
    """
    if isinstance(target, str):
        scheme, has_scheme, rest = target.partition(":")
        if not (has_scheme and scheme in _SCHEMES):
            _check_host_port(target, target)
        elif scheme == "dns":  # dns:[//authority/]host[:port]
            _check_host_port(target, rest.rpartition("/")[2])
        return target
    replicas = list(target)
    if not replicas:
        raise ValueError("target: the list of replicas is empty")
    if len(replicas) == 1:
        return channel_target(replicas[0])
    resolved = [_resolve(i, replica) for i, replica in enumerate(replicas)]
    for scheme, family in (("ipv4", socket.AF_INET), ("ipv6", socket.AF_INET6)):
        if all(family in addresses for addresses in resolved):
            return f"{scheme}:" + ",".join(addresses[family] for addresses in resolved)
    raise ValueError(f"target: the replicas {replicas} share no address family (all IPv4 or all IPv6)")


def _check_host_port(target: str, address: str) -> None:
    """Raise ``ValueError`` unless ``address`` is ``host[:port]`` as gRPC's dns resolver reads it:
    a host name, an IPv4 address or a bracketed IPv6 one (bare without a port)."""
    if address.startswith("["):
        host, bracket, port = address[1:].partition("]")
        valid = bool(bracket) and (not port or port.startswith(":")) and _is_ip(host, 6)
        port = port[1:]
    elif address.count(":") > 1:
        valid, port = _is_ip(address, 6), ""
    else:
        host, colon, port = address.partition(":")
        valid = (_is_ip(host, 4) or _HOST_NAME.fullmatch(host) is not None) and not (colon and not port)
    if not (valid and (not port or (port.isdigit() and int(port) < 65536))):
        raise ValueError(
            f"target {target!r} is not host:port, [ipv6]:port or a gRPC target (dns:///host:port, "
            "ipv4:address:port, unix:path)"
        )


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


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


# The probe: a call any server answers once connected (UNIMPLEMENTED without a health service),
# open without a token, that does not wait for a connection: it fails with gRPC's last
# connection error (refused, not resolved, TLS handshake) while there is none.
_PROBE = "/grpc.health.v1.Health/Check"
_PROBE_EVERY_S = 0.25  # while not connected: gRPC reconnects on its own backoff meanwhile
# gRPC's words for a replica that is connected but whose health service says NOT_SERVING (loading,
# draining): reached, so the call waits for it within its deadline.
_UNHEALTHY = "backend unhealthy"
# Statuses of a call that no server need have answered.
_NOT_ANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# How long a blocking client takes the server as reached after it last answered.
REACHED_FRESH_S = 1.0


def _reached(error: grpc.RpcError | None) -> bool:
    """Whether a probe that ended with ``error`` (None: answered) reached a server."""
    if error is None or error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    return _UNHEALTHY in (error.details() or "")


class _Watch:
    """What the blocking and asyncio ``ConnectionWatch`` share: the probe and the failure."""

    def __init__(self, channel: Any, target: str, connect_timeout_s: float) -> None:
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self.target, self.connect_timeout_s = target, connect_timeout_s
        self._channel = channel
        self._probe = channel.unary_unary(_PROBE, request_serializer=lambda _: b"", response_deserializer=bytes)

    def _bound(self, timeout: float) -> tuple[float, float]:
        """How long to wait for a connection within a call's ``timeout``, and until when."""
        limit = min(self.connect_timeout_s, timeout)
        return limit, time.monotonic() + limit

    @staticmethod
    def _failure(error: grpc.RpcError | None, last: str) -> str | None:
        """None when a probe that ended with ``error`` reached the server; else the connection
        error to report (gRPC's last one: a probe that timed out while connecting tells none)."""
        if _reached(error):
            return None
        assert error is not None
        if error.code() is grpc.StatusCode.UNAVAILABLE:
            return error.details() or "UNAVAILABLE"
        return last or "still connecting, no answer yet"

    def _unreachable(self, limit: float, last: str) -> Unavailable:
        bound = "connect_timeout_s" if limit == self.connect_timeout_s else "the call's timeout"
        return Unavailable(
            f"cannot connect to {self.target} within {limit:g} s ({bound}): {last}",
            grpc.StatusCode.UNAVAILABLE,
        )


class ConnectionWatch(_Watch):
    """Waits, before a scoring call, for a blocking channel to be connected, at most
    ``connect_timeout_s`` (or the call's timeout, if shorter), else raises ``Unavailable`` naming
    the target and gRPC's last connection error. It probes the server, and a connected server that
    is not SERVING counts as reached: the call then waits for it within its deadline.

    A blocking channel's state cannot be read (only followed, with ``subscribe``, whose polling
    thread raises when the channel is closed under it), so the server counts as reached for
    ``REACHED_FRESH_S`` after a probe or a call got an answer from it (``answered``): a client
    scoring steadily probes nothing."""

    def __init__(self, channel: grpc.Channel, target: str, connect_timeout_s: float) -> None:
        super().__init__(channel, target, connect_timeout_s)
        self._reached_at = -math.inf

    def _fresh(self) -> bool:
        return time.monotonic() - self._reached_at < REACHED_FRESH_S

    def answered(self, call: grpc.Future) -> None:
        """A done callback of the client's calls: one the server answered shows it reached."""
        if not call.cancelled() and call.code() not in _NOT_ANSWERED:
            self._reached_at = time.monotonic()

    def wait(self, timeout: float) -> None:
        if self._fresh():
            return
        limit, deadline = self._bound(timeout)
        last = ""
        while (last := self._failure(self._try(deadline), last)) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unreachable(limit, last)
            time.sleep(min(remaining, _PROBE_EVERY_S))
        self._reached_at = time.monotonic()

    def watch(self, timeout: float, cancel: Callable[[], None]) -> concurrent.futures.Future[None] | None:
        """``wait`` without blocking, for calls sent meanwhile (``score_async`` returns at once; each
        call is to have ``answered`` as a done callback): None when the server was reached just now;
        else a future of the wait, on a thread of its own, which calls ``cancel`` (the calls') when
        it fails (its exception says why)."""
        if self._fresh():
            return None
        connecting: concurrent.futures.Future[None] = concurrent.futures.Future()

        def wait() -> None:
            try:
                self.wait(timeout)
            except Exception as err:  # Unavailable; or the client was closed meanwhile
                connecting.set_exception(err)  # before the calls end, so that their caller finds it
                if isinstance(err, Unavailable):
                    cancel()
            else:
                connecting.set_result(None)

        threading.Thread(target=wait, name="logprob-connect", daemon=True).start()
        return connecting

    def _try(self, deadline: float) -> grpc.RpcError | None:
        try:
            self._probe(b"", timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.RpcError as err:
            return err
        return None


class AioConnectionWatch(_Watch):
    """``ConnectionWatch`` for an asyncio channel (whose state is read with ``get_state``)."""

    async def wait(self, timeout: float) -> None:
        state = self._channel.get_state(try_to_connect=True)
        if state is grpc.ChannelConnectivity.READY:
            return
        limit, deadline = self._bound(timeout)
        last = ""
        while (last := self._failure(await self._try(deadline), last)) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unreachable(limit, last)
            state = self._channel.get_state()
            try:  # until the state changes (READY, say), or a while
                await asyncio.wait_for(self._channel.wait_for_state_change(state), min(remaining, _PROBE_EVERY_S))
            except TimeoutError:
                pass

    async def _try(self, deadline: float) -> grpc.RpcError | None:
        try:
            await self._probe(b"", timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.RpcError as err:
            return err
        return None
