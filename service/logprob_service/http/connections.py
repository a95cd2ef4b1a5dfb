"""What the HTTP edge's connections may hold: file descriptors, and time to send a request's head.

- **A cap on open connections** (``http_max_connections``; 0 derives it from the process's
  open-file limit): a connection past it is answered 503 and closed as soon as it is accepted, so
  however many a caller opens, the descriptors gRPC, LoadWeights' files and the weight receivers
  need stay free.
- **A deadline for each request's head** (``http_header_timeout_s``), from the connection's
  opening or from the end of the answer before: a connection that sends nothing, one byte, a
  partial head, or a body nobody reads (a route that answers without reading it) is closed when
  it passes. Once a head is in, the request is the application's: its body has a deadline of its
  own (``http_body_timeout_s``, ``app.read_body``), and idle keep-alive connections are closed by
  uvicorn (``timeout_keep_alive``).
- **A lingering close for a body answered before it was read**: a request refused by its first
  bytes (a body of more JSON parts than any request within the limits, ``bodies``) is answered
  with ``connection: close`` while its client still sends. Closing the socket then would reset
  the connection (unread data) and its client could lose the answer; reading the rest through
  the HTTP parser would cost the loop the whole body each time it is sent. So the answer goes
  out, the connection's sending side is shut, and the rest is read and dropped unparsed until
  the client closes, for at most ``http_header_timeout_s``.
- **Accept errors logged once in a while**: out of descriptors anyway, asyncio's accept loop
  reports each retry (a second apart) with its traceback; ``quiet_accept_errors`` makes that one
  line every ``ACCEPT_ERROR_LOG_S``, counting the others.

uvicorn has no header-read deadline and counts only requests against ``limit_concurrency``
(a connection that never sends one holds its descriptor for good), hence these, as a subclass of
whichever HTTP protocol uvicorn picked (h11 or httptools), made by ``guarded``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Descriptors left to the rest of the server before HTTP connections get any: gRPC's listening
# socket and connections, checkpoint files LoadWeights reads, weight receivers' sockets and shared
# memory, logs, and the libraries' own.
RESERVED_FDS = 512
# The derived cap, however high the open-file limit: each connection costs memory too.
MAX_DERIVED_CONNECTIONS = 4096
ACCEPT_ERROR_LOG_S = 10.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft open-file limit (RLIMIT_NOFILE) to its hard limit; returns (the
    limit before, the limit now). Left as it was where the hard limit is unlimited or refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, hard
    return soft, soft


def connection_cap(configured: int) -> int:
    """The most HTTP connections open at once: ``configured`` (``http_max_connections``), or with 0
    half of the open-file limit left after ``RESERVED_FDS``, at least 16 and at most
    ``MAX_DERIVED_CONNECTIONS``."""
    if configured:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DERIVED_CONNECTIONS
    return max(16, min(MAX_DERIVED_CONNECTIONS, (soft - RESERVED_FDS) // 2))


def _busy_answer(cap: int) -> bytes:
    body = (
        b'{"error":{"message":"server has %d HTTP connections open, its limit (http_max_connections); '
        b'retry later","type":"UNAVAILABLE","param":null,"code":503}}' % cap
    )
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    return head + body


class LingeringClose:
    """``transport`` as a uvicorn protocol holds it, but closed lingering (the module's docstring)
    while ``protocol``'s request body is not all in: its sending side shut, what comes in dropped
    (``Guarded.data_received``), closed once the client closes or after ``linger_s``."""

    def __init__(self, transport: asyncio.Transport, protocol: Any, linger_s: float) -> None:
        self._transport, self._protocol, self._linger_s = transport, protocol, linger_s
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        cycle = self._protocol.cycle
        if self.lingering or self._transport.is_closing() or cycle is None or not cycle.more_body:
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()
        self._transport.resume_reading()
        self._protocol.loop.call_later(self._linger_s, self._transport.close)


@dataclass
class ConnectionLimits:
    """The edge's connection cap and head deadline, and what was refused or cut."""

    max_connections: int
    header_timeout_s: float
    refused: int = 0  # connections answered 503 at accept
    timed_out: int = 0  # connections closed for a head that did not come in time
    _last_refusal_log: float = field(default=-float("inf"), repr=False)

    def __post_init__(self) -> None:
        self.busy = _busy_answer(self.max_connections)

    def note_refused(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_refusal_log >= ACCEPT_ERROR_LOG_S:
            self._last_refusal_log = now
            log.warning(
                "HTTP connections at their limit of %d (http_max_connections): further ones answered 503 (%d so far)",
                self.max_connections,
                self.refused,
            )


def guarded(base: type[asyncio.Protocol], limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol) with ``limits``' connection cap and head deadline."""

    class Guarded(base):  # type: ignore[valid-type, misc]
        _refused = False
        _head_due: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.server_state.connections) >= limits.max_connections:
                self._refused = True
                transport.write(limits.busy)
                transport.close()
                limits.note_refused()
                return
            super().connection_made(LingeringClose(transport, self, limits.header_timeout_s))
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            if self._head_due is not None:
                self._head_due.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused and not self.transport.lingering:
                super().data_received(data)

        def eof_received(self) -> bool | None:
            if self._refused or self.transport.lingering:
                return None  # the client closed: so does the transport
            return super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def _await_head(self) -> None:
            if self._head_due is not None:
                self._head_due.cancel()
            self._head_due = self.loop.call_later(limits.header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_due = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request in progress: the next answer's end sets the next deadline
            limits.timed_out += 1
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """``loop``'s exception handler, but accept errors for lack of descriptors or memory logged in
    one line every ``ACCEPT_ERROR_LOG_S`` (with how many came since), not each with a traceback."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_accept_errors", False):
        return
    state = {"last": -float("inf"), "since": 0}

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in _OUT_OF_RESOURCES and "accept" in context.get("message", ""):
            state["since"] += 1
            now = time.monotonic()
            if now - state["last"] >= ACCEPT_ERROR_LOG_S:
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                log.warning(
                    "cannot accept connections: %s (open-file limit %d; %d times in the last %.0f s); retrying",
                    error.strerror,
                    soft,
                    state["since"],
                    ACCEPT_ERROR_LOG_S,
                )
                state["last"], state["since"] = now, 0
            return
        (previous or _default)(loop, context)

    handle.quiets_accept_errors = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handle)


def _default(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    loop.default_exception_handler(context)
