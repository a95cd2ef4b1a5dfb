"""A loopback relay in front of a trainer's TCP store, so that a wait on the store can be ended.

torch's TCPStore client waits for the store's answers in blocking reads that its timeout does not
bound (the constructor's ``ping``, for one: a peer that accepts the connection and never answers
holds it for good), and it offers no way to end them. Connected through a ``StoreRelay`` instead,
the client's socket is one end of a loopback connection the relay owns: ``close`` shuts every
connection down, and each such read returns at once with an error. The relay passes bytes on
unchanged, each connection made to it on a connection of its own to the store, on daemon threads
that end with their connections.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

CHUNK_BYTES = 1 << 16


def _daemon(target: Callable[..., None], *args: object) -> None:
    threading.Thread(target=target, args=args, name="logprob-store-relay", daemon=True).start()


class StoreRelay:
    """Listens on a port of 127.0.0.1 (``port``) and relays each connection to ``address:port``."""

    def __init__(self, address: str, port: int, *, connect_timeout_s: float) -> None:
        """Raises ``OSError`` if ``address`` does not resolve."""
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        self._target = (address, port)
        self._connect_timeout_s = connect_timeout_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = {self._listener}
        self._closed = False
        self.connected = False  # whether a connection to the store was ever made
        self.error: OSError | None = None  # why the last connection to the store could not be made
        _daemon(self._accept)

    def close(self) -> None:
        """End every connection and stop listening (from any thread): reads and writes on the
        relayed connections fail at once."""
        with self._lock:
            self._closed = True
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it; its thread closes it

    def _track(self, *sockets: socket.socket) -> bool:
        """Whether the relay is open; if it is, ``sockets`` are closed with it."""
        with self._lock:
            if not self._closed:
                self._open.update(sockets)
            return not self._closed

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(sockets)
        for sock in sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                self._forget(self._listener)
                return
            _daemon(self._relay, client)

    def _relay(self, client: socket.socket) -> None:
        try:
            store = socket.create_connection(self._target, timeout=self._connect_timeout_s)
        except OSError as err:
            self.error = err
            client.close()  # the client sees the connection end, and retries until its own timeout
            return
        store.settimeout(None)
        self.connected = True
        if not self._track(client, store):
            self._forget(client, store)
            return
        _daemon(self._pipe, store, client)
        self._pipe(client, store)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Bytes from ``source`` to ``sink`` until either ends; then both directions end."""
        with contextlib.suppress(OSError):
            while data := source.recv(CHUNK_BYTES):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._forget(source)  # the other direction's thread closes ``sink``, which it reads
