"""A push process: a process of the client's own that makes a weight push's UpdateWeights calls,
its messages handed over through shared memory (``push_processes``, the client's
``push_processes`` option).

Why a process: gRPC Python copies each message it sends (into a slice of its own) and runs each
stream's sending loop in Python, under the sending process's one interpreter lock. A push of four
streams from one process spends 1.3-1.7 cores' worth and moves 2.1-2.9 GB/s on H100 hosts, the
server with time to spare (benchmarks/RESULTS.md). Here the client copies each message
into a slot of memory it shares with this process and sends the slot's number over a pipe; this
process copies the message out (gRPC needs ``bytes``), gives the slot back, and sends it.

The pipe carries pickled tuples:

- client to push process: ``(channel.Connection, slot_bytes, size)`` first; then per call
  ``("open", call, target, seconds_left)``, ``("message", call, slot, nbytes)`` for each message
  in a slot, ``("inline", call, raw)`` for one too large for a slot, ``("end", call)`` and
  ``("cancel", call)``;
- push process to client: ``("ready",)``; ``("free", slot)``; ``("answer", call, response, code,
  details)``: the call's serialized UpdateWeightsResponse (None unless ``code`` is "OK"), the name
  of its status code and its details.

It imports no torch: it starts in well under a second and holds little memory.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import grpc

from .channel import Connection

UPDATE_WEIGHTS = "/logprob.v1.LogprobService/UpdateWeights"
_END = ("end",)


class _Call:
    """One UpdateWeights call: its messages still to send, and whether it has ended."""

    def __init__(self) -> None:
        self.messages: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.ended = False
        self.future: Any = None


class _PushProcess:
    def __init__(self, pipe: Pipe, memory: mmap.mmap, slot_bytes: int, connection: Connection) -> None:
        self.pipe, self.memory, self.slot_bytes, self.connection = pipe, memory, slot_bytes, connection
        self.calls: dict[int, _Call] = {}
        self.lock = threading.Lock()  # the pipe and the calls, from this thread and gRPC's
        self.idle: dict[str, list[grpc.Channel]] = {}  # by target: channels no call is using

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock, contextlib.suppress(OSError):  # the client is gone: run() ends
            self.pipe.send(message)

    def run(self) -> None:
        """Takes the client's messages until it closes the pipe."""
        while True:
            try:
                kind, call_id, *rest = self.pipe.recv()
            except (EOFError, OSError):
                return
            if kind == "open":
                self._open(call_id, *rest)
                continue
            with self.lock:
                call = self.calls.get(call_id)
                if kind == "cancel" or call is None or call.ended:
                    ended = True
                else:
                    call.messages.put((kind, *rest))
                    ended = False
            if kind == "cancel" and call is not None and call.future is not None:
                call.future.cancel()
            elif ended and kind == "message":  # the call ended before this message: the slot is free
                self.send(("free", rest[0]))

    def _open(self, call_id: int, target: str, seconds_left: float | None) -> None:
        call = _Call()
        with self.lock:
            self.calls[call_id] = call
        channels = self.idle.setdefault(target, [])
        channel = channels.pop() if channels else self.connection.open(target, aio=False, own_connection=True)
        push = channel.stream_unary(UPDATE_WEIGHTS, request_serializer=None, response_deserializer=None)
        call.future = push.future(self._messages(call), timeout=seconds_left)
        call.future.add_done_callback(lambda future: self._answer(call_id, call, future, target, channel))

    def _messages(self, call: _Call) -> Iterator[bytes]:
        """The call's messages, read on gRPC's thread: each copied out of its slot, which is given
        back at once."""
        while (message := call.messages.get()) != _END:
            kind, *rest = message
            if kind == "inline":
                yield rest[0]
                continue
            slot, nbytes = rest
            start = slot * self.slot_bytes
            raw = self.memory[start : start + nbytes]
            self.send(("free", slot))
            yield raw

    def _answer(self, call_id: int, call: _Call, future: Any, target: str, channel: grpc.Channel) -> None:
        with self.lock:
            call.ended = True
            del self.calls[call_id]
        # Messages it will not send: their slots are free; its reading thread may be waiting.
        while True:
            try:
                kind, *rest = call.messages.get_nowait()
            except queue.Empty:
                break
            if kind == "message":
                self.send(("free", rest[0]))
        call.messages.put(_END)
        if future.cancelled():
            self.send(("answer", call_id, None, grpc.StatusCode.CANCELLED.name, "cancelled by the client"))
        elif (err := future.exception()) is not None:
            self.send(("answer", call_id, None, err.code().name, err.details() or ""))
        else:
            self.send(("answer", call_id, future.result(), grpc.StatusCode.OK.name, ""))
        self.idle.setdefault(target, []).append(channel)


def main(pipe_fd: int, memory_fd: int) -> None:
    """A push process (``python -m logprob_client.push_process PIPE_FD MEMORY_FD``, started by
    ``push_processes``): reads its channel settings and slots from the pipe, then makes the calls
    it is given until the client closes the pipe."""
    pipe = Pipe(pipe_fd)
    connection, slot_bytes, size = pipe.recv()
    process = _PushProcess(pipe, mmap.mmap(memory_fd, size), slot_bytes, connection)
    pipe.send(("ready",))
    process.run()
    for call in list(process.calls.values()):  # the client is gone: so are its calls
        call.messages.put(_END)
        call.future.cancel()
    for channels in process.idle.values():
        for channel in channels:
            channel.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
