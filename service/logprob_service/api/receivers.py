"""The serving process's side of the weight receivers (``api.receiver_process``, the
``weight_receivers`` setting): starts them, runs each UpdateWeights call they forward through this
server's own interceptors and handler, and gives their shared-memory slots back.

A forwarded call is run as a call on this server's own port would be: the same interceptors
(credentials from the call's metadata, malformed messages, exceptions to statuses and accounting,
tensor bytes as views), on a context that records the status they set, which goes back to the
receiver to answer with. The receiver reads the call's stream only once the handler asks for its
first message, so a call refused from its metadata costs the receipt of none of its messages.

A message in a slot is read in place: the slot is given back once no view of it is left (a dense
piece's bytes are written to where they are staged first). Serving on a GPU, the slots are
page-locked in place (``worker.pinned.page_lock``), so a dense piece goes from its slot to the
device with no copy in host memory.

A receiver that dies ends its calls as broken streams (their updates are abandoned; the live
version keeps serving) and is no longer announced; the server goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from logprob_service.api import handlers
from logprob_service.api.receiver_process import RECEIVER_SLOT_BYTES, SLOTS, SharedMemory
from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
_END = object()  # a call's queue: its stream ended


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, Any], ...]) -> None:
        self.method, self.invocation_metadata = method, invocation_metadata


class ForwardedContext:
    """What this server's interceptors and UpdateWeights handler use of a ``grpc.aio.ServicerContext``,
    for a call a receiver forwarded; keeps the status they set."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...], peer: str, seconds_left: float | None) -> None:
        self._metadata, self._peer = metadata, peer
        self._deadline = None if seconds_left is None else time.monotonic() + seconds_left
        self.code, self.details, self.trailing, self.aborted = grpc.StatusCode.OK, "", (), False

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancelled(self) -> bool:
        """Never as such: a forwarded call its client breaks off has its task cancelled instead."""
        return False

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailing: Sequence[tuple[str, Any]]) -> None:
        self.trailing = tuple(trailing)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[Any] = ()) -> None:
        self.code, self.details, self.trailing, self.aborted = code, details, tuple(trailing_metadata), True
        raise grpc.aio.AbortError()


@dataclass
class _Receiver:
    index: int
    process: subprocess.Popen[bytes]
    conn: Connection
    memory: SharedMemory
    port: int = 0
    alive: bool = True
    calls: dict[int, tuple[asyncio.Queue[Any], asyncio.Task[None]]] = field(default_factory=dict)
    unlock: Callable[[], None] | None = None  # undoes the page-locking of its slots
    lent: set[int] = field(default_factory=set)  # slots a view of which is still alive

    def send(self, message: tuple[Any, ...]) -> None:
        if self.alive:
            with contextlib.suppress(OSError):  # it died: its reader notices
                self.conn.send(message)


async def _messages(
    queue: asyncio.Queue[Any], deserialize: Callable[[Any], Any], ask: Callable[[], None]
) -> AsyncIterator[Any]:
    """The call's messages, as the receiver hands them over; ``ask`` tells it to start reading the
    client's stream, at the first message the handler asks for (a call refused before, from its
    metadata, is answered with none of its messages received)."""
    ask()
    while (raw := await queue.get()) is not _END:
        message = deserialize(raw)
        # A slot's view: not held while the handler works on the message or waits for the next,
        # nor after the call (an update stops reading at its commit; this generator may outlive
        # the call). What the message keeps of the slot (a piece's views) goes with the message.
        del raw
        yield message


# Page-locks a receiver's slots in place for the devices the server stages on; returns what undoes
# it, or None where they stay as they are (``worker.pinned.page_lock``).
PageLock = Callable[[mmap.mmap], Callable[[], None] | None]


class WeightReceivers:
    """Receivers started by ``start``; ``ports`` are those alive; ``forwarded`` counts the calls
    they forwarded."""

    def __init__(
        self,
        handler_for: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        page_lock: PageLock | None = None,
    ) -> None:
        self._handler_for = handler_for
        self._page_lock = page_lock
        self._receivers: list[_Receiver] = []
        self._loop = asyncio.get_running_loop()
        self.forwarded = 0

    @property
    def ports(self) -> list[int]:
        return [r.port for r in self._receivers if r.alive]

    @classmethod
    async def start(
        cls,
        settings: Settings,
        handler_for: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        page_lock: PageLock | None = None,
    ) -> WeightReceivers:
        """Start ``settings.weight_receivers`` receivers, on consecutive ports from
        ``settings.weight_receiver_port`` (0: free ports), their slots page-locked by ``page_lock``;
        raises StartupError if one cannot listen on its port, OSError if one cannot start otherwise."""
        self = cls(handler_for, page_lock)
        try:
            for i in range(settings.weight_receivers):
                port = settings.weight_receiver_port + i if settings.weight_receiver_port else 0
                self._receivers.append(await self._spawn(i, settings, port))
        except BaseException:
            await self.close()
            raise
        log.info("weight receivers listening on ports %s", ", ".join(map(str, self.ports)))
        return self

    async def _spawn(self, index: int, settings: Settings, port: int) -> _Receiver:
        memory = SharedMemory(SLOTS, RECEIVER_SLOT_BYTES)
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])  # where logprob_service is imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        process = subprocess.Popen(
            [sys.executable, "-m", "logprob_service.api.receiver_process", str(theirs.fileno()), str(memory.fd)],
            pass_fds=(theirs.fileno(), memory.fd),
            env=env,
        )
        theirs.close()
        receiver = _Receiver(index, process, Connection(ours.detach()), memory)
        if self._page_lock is not None:
            receiver.unlock = await self._loop.run_in_executor(None, self._page_lock, memory.buffer)
        receiver.conn.send((settings, port, memory.slots, memory.slot_bytes))
        ready = await self._loop.run_in_executor(None, receiver.conn.poll, START_TIMEOUT_S)
        try:
            kind, detail = receiver.conn.recv() if ready else ("failed", f"not ready in {START_TIMEOUT_S:.0f} s")
        except EOFError:
            kind, detail = "failed", f"exited with code {process.wait()}"
        if kind != "ready":
            receiver.alive = False
            self._stop(receiver)
            if kind == "refused":  # its port cannot be listened on: the message names the address and flag
                raise StartupError(detail)
            raise OSError(f"weight receiver {index} (port {port or 'any'}) did not start: {detail}")
        receiver.port = detail
        self._loop.add_reader(receiver.conn.fileno(), self._on_readable, receiver)
        return receiver

    def _on_readable(self, receiver: _Receiver) -> None:
        try:
            while receiver.conn.poll():
                self._dispatch(receiver, *receiver.conn.recv())
        except (EOFError, OSError):
            self._lost(receiver)

    def _dispatch(self, receiver: _Receiver, kind: str, call: int, *rest: Any) -> None:
        if kind == "open":
            self.forwarded += 1
            queue: asyncio.Queue[Any] = asyncio.Queue()
            task = self._loop.create_task(self._serve(receiver, call, queue, *rest))
            receiver.calls[call] = queue, task
            return
        if kind == "message":
            slot, nbytes = rest
            raw: Any = self._view(receiver, slot, nbytes)
        else:
            raw = rest[0] if kind == "inline" else _END
        entry = receiver.calls.get(call)
        if entry is None:
            return  # the call was answered already: what still comes is dropped (a slot's view with it)
        if kind == "broken":
            entry[1].cancel()
        else:
            entry[0].put_nowait(raw)

    def _view(self, receiver: _Receiver, slot: int, nbytes: int) -> memoryview:
        """A message in ``slot``: its slot is given back once no view of it is left."""
        array = np.frombuffer(receiver.memory.buffer, np.uint8, nbytes, slot * receiver.memory.slot_bytes)
        receiver.lent.add(slot)
        weakref.finalize(array, self._give_back, receiver, slot)
        return memoryview(array)

    def _give_back(self, receiver: _Receiver, slot: int) -> None:  # on any thread: the last view went there
        receiver.lent.discard(slot)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the receivers are gone too
            self._loop.call_soon_threadsafe(receiver.send, ("free", slot))

    async def _serve(
        self,
        receiver: _Receiver,
        call: int,
        queue: asyncio.Queue[Any],
        metadata: tuple[tuple[str, Any], ...],
        peer: str,
        seconds_left: float | None,
    ) -> None:
        context = ForwardedContext(metadata, peer, seconds_left)
        handler = self._handler_for(_CallDetails("/logprob.v1.LogprobService/UpdateWeights", metadata))
        response = None
        try:
            ask = functools.partial(receiver.send, ("read", call))
            async with contextlib.aclosing(_messages(queue, handler.request_deserializer, ask)) as requests:
                response = await handlers.run(handlers.behaviour_of(handler), requests, context)
        except grpc.aio.AbortError:
            pass  # the context holds the status
        finally:
            del receiver.calls[call]
            while not queue.empty():  # messages not read: their slots go back
                queue.get_nowait()
        ok = context.code == grpc.StatusCode.OK and response is not None
        raw = handler.response_serializer(response) if ok else b""
        receiver.send(("answer", call, raw, context.code, context.details, context.trailing, context.aborted))

    def _lost(self, receiver: _Receiver) -> None:
        if not receiver.alive:
            return
        receiver.alive = False
        self._loop.remove_reader(receiver.conn.fileno())
        log.error(
            "weight receiver %d (port %d) is gone (exit code %s); its %d calls end as broken streams",
            receiver.index,
            receiver.port,
            receiver.process.poll(),
            len(receiver.calls),
        )
        for _, task in receiver.calls.values():
            task.cancel()

    def _stop(self, receiver: _Receiver) -> None:
        receiver.conn.close()  # the receiver stops at the end of its pipe
        try:
            receiver.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            receiver.process.kill()
            receiver.process.wait()
        if receiver.unlock is not None and not receiver.lent:
            # Page-locked memory is unlocked before it goes. A slot still lent may still be read
            # by a copy: then the memory stays, locked, with this process.
            receiver.unlock()
        receiver.memory.close()

    async def close(self) -> None:
        """Stop every receiver (their calls end as broken streams)."""
        for receiver in self._receivers:
            if receiver.alive:
                receiver.alive = False
                self._loop.remove_reader(receiver.conn.fileno())
            for _, task in receiver.calls.values():
                task.cancel()
            await self._loop.run_in_executor(None, self._stop, receiver)
        self._receivers.clear()
