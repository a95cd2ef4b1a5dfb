"""A weight receiver: a process of the server's own that takes UpdateWeights calls on a port of its
own and hands their messages to the serving process through shared memory (``api.receivers``).

Why a process: gRPC Python copies every received message three times before a handler sees it
(``ReceiveMessageOperation.un_c``), holding the receiving process's one interpreter lock. In the
process that also parses, checks and stages the pieces, that bounds a dense push to what one
interpreter can copy: 1.6-2.5 GB/s on the H100 hosts, where two processes receiving carried
3.1-3.9 GB/s (benchmarks/RESULTS.md). A receiver does gRPC's copies in its own interpreter and
one more, of the whole message into a slot of memory it shares with the serving process, then
sends the slot's number over a pipe. The serving process reads the message in place (tensor
bytes stay views, as on its own port), through the same interceptors and handler as a call on
its own port, credentials included, and sends the answer back; the slot is free again once
nothing there refers to it.

Nothing of torch or the engine is imported here (an import contract): a receiver starts in about
a second and holds little memory.

The pipe carries pickled tuples:

- receiver to server: ``("ready", port)``, or ``("refused", message)`` when it cannot listen on
  its port; per call ``("open", call, metadata, peer, seconds_left)``,
  then ``("message", call, slot, nbytes)`` for each message that fits a slot, ``("inline", call,
  raw)`` for one that does not, and ``("end", call)`` or ``("broken", call)`` (the client's stream
  broke off, or the client cancelled);
- server to receiver: ``("read", call)``: the call's handler asks for its first message;
  ``("free", slot)``; ``("answer", call, response, code, details, trailing, aborted)``: the call's
  status as the handler left it (``aborted``: ended by ``context.abort``, the trailers-only
  answer that clients may retry).

A receiver reads nothing of a call's stream before the serving process asks for it (``read``):
a call refused from its metadata alone (no credentials, or the wrong ones) is answered before
any of its messages is received, as on the server's own port, however much its client sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import sys
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import grpc

from logprob_service import host_malloc
from logprob_service.api import tls
from logprob_service.api.server_options import listen, server_options
from logprob_service.logs import configure_logging
from logprob_service.settings.errors import StartupError
from logprob_service.settings.model import Settings

SERVICE = "logprob.v1.LogprobService"
# A slot holds one message of this project's client (4 MiB of a tensor's bytes and their framing);
# a larger message goes over the pipe instead, which costs two more copies.
RECEIVER_SLOT_BYTES = (4 << 20) + (64 << 10)
# Slots per receiver: messages in flight between it and the serving process. The serving process
# holds at most 8 pieces of an update unwritten (engine.weights.update.WRITES_IN_FLIGHT); a few
# more keep a receiver copying while the serving process parses.
SLOTS = 12


class SharedMemory:
    """``slots`` slots of ``slot_bytes`` in a memfd: created by the serving process, mapped by a
    receiver from the descriptor it inherits."""

    def __init__(self, slots: int, slot_bytes: int, fd: int | None = None) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        if fd is None:
            fd = os.memfd_create("logprob-weight-receiver", os.MFD_CLOEXEC)
            os.ftruncate(fd, slots * slot_bytes)
        self.fd = fd
        self.buffer = mmap.mmap(fd, slots * slot_bytes)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still refers to it: the mapping goes with the process
            self.buffer.close()
        os.close(self.fd)


class _Receiver:
    def __init__(self, conn: Connection, memory: SharedMemory) -> None:
        self.conn, self.memory = conn, memory
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(memory.slots):
            self.free.put_nowait(slot)
        self.answers: dict[int, asyncio.Future[tuple[Any, ...]]] = {}
        self.reading: dict[int, asyncio.Event] = {}  # set once the serving process asks for a call's messages
        self.calls = itertools.count()
        self.orphaned = asyncio.Event()  # the serving process is gone

    def send(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the serving process is gone: on_readable stops the server
            self.conn.send(message)

    def on_readable(self) -> None:
        try:
            while self.conn.poll():
                kind, *rest = self.conn.recv()
                if kind == "free":
                    self.free.put_nowait(rest[0])
                elif kind == "read":
                    if (reading := self.reading.get(rest[0])) is not None:
                        reading.set()
                elif (answer := self.answers.get(rest[0])) is not None and not answer.done():
                    answer.set_result(tuple(rest[1:]))
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.orphaned.set()

    async def update_weights(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        call = next(self.calls)
        answer = self.answers[call] = asyncio.get_running_loop().create_future()
        reading = self.reading[call] = asyncio.Event()
        metadata = tuple((key, value) for key, value in context.invocation_metadata() or ())  # plain, to pickle
        self.send(("open", call, metadata, context.peer(), context.time_remaining()))
        forward = asyncio.create_task(self._forward(call, requests, answer, reading))
        try:
            response, code, details, trailing, aborted = await answer
            if reading.is_set():
                # What the client still sends is read and dropped before the status goes. Answered
                # with the reading task cancelled mid-stream, a client still sending got INTERNAL
                # ("Internal error from Core") instead of the status in about one run of six of
                # tests/integration/weights/test_weight_receivers.py (cf. grpc/grpc#36066, and
                # handlers.read_to_end on the server's port).
                await forward
            else:
                # Answered without a message asked for (refused from its metadata): nothing of the
                # stream is read, as on the server's own port.
                forward.cancel()
        except asyncio.CancelledError:  # the client cancelled, or its connection broke
            forward.cancel()
            self.send(("broken", call))
            raise
        finally:
            del self.answers[call], self.reading[call]
        if code == grpc.StatusCode.OK:
            return response
        if aborted:
            await context.abort(code, details, trailing_metadata=trailing)
        context.set_code(code)
        context.set_details(details)
        if trailing:
            context.set_trailing_metadata(trailing)
        return b""

    async def _forward(
        self, call: int, requests: AsyncIterator[bytes], answer: asyncio.Future[Any], reading: asyncio.Event
    ) -> None:
        """Once the serving process asks for the call's messages (``reading``), hand each to it
        until it has answered, then drop the rest."""
        memory = self.memory
        await reading.wait()
        try:
            async for raw in requests:
                if answer.done():
                    continue
                if len(raw) > memory.slot_bytes:
                    self.send(("inline", call, raw))
                    continue
                slot = await self.free.get()
                start = slot * memory.slot_bytes
                memory.buffer[start : start + len(raw)] = raw
                self.send(("message", call, slot, len(raw)))
        except Exception:  # the client's stream broke off
            if not answer.done():
                self.send(("broken", call))
            return
        if not answer.done():
            self.send(("end", call))


async def _serve(conn: Connection, memory: SharedMemory, settings: Settings, port: int) -> None:
    receiver = _Receiver(conn, memory)
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), receiver.on_readable)
    server = grpc.aio.server(options=server_options(settings))
    method = grpc.stream_unary_rpc_method_handler(receiver.update_weights)  # raw bytes both ways
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"UpdateWeights": method}),))
    bound = listen(server, settings.host, port, tls.server_credentials(settings), "--weight-receiver-port")
    await server.start()
    conn.send(("ready", bound))
    await receiver.orphaned.wait()
    await server.stop(None)


def main(conn_fd: int, memory_fd: int) -> None:
    """A receiver's process (``python -m logprob_service.api.receiver_process CONN_FD MEMORY_FD``,
    started by ``api.receivers``): reads its settings, port and slots from the pipe, then serves
    UpdateWeights until the serving process closes the pipe."""
    conn = Connection(conn_fd)
    settings, port, slots, slot_bytes = conn.recv()
    configure_logging(settings.log_level, settings.log_format)
    host_malloc.apply(settings.keep_freed_host_memory)  # gRPC's copies of each message land in warm pages
    try:
        asyncio.run(_serve(conn, SharedMemory(slots, slot_bytes, memory_fd), settings, port))
    except StartupError as err:  # its port is taken: the serving process says so, naming the flag
        with contextlib.suppress(OSError):
            conn.send(("refused", str(err)))
        sys.exit(2)
    except Exception as err:
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(err).__name__}: {err}"))
        raise


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
