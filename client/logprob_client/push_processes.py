"""The client's push processes (the ``push_processes`` option): a weight push's UpdateWeights calls
made from processes of the client's own (``push_process``), so that gRPC Python's per-message
work runs in several interpreters, not under the trainer's one lock.

The trainer's process still reads the tensors (a GPU tensor is copied to host memory when its
turn comes) and frames each message (``weights.Message``); a thread per call copies each message
into a free slot of the memory it shares with that call's push process (numpy's copy, which lets
the interpreter lock go) and sends the slot's number over a pipe. A message larger than a slot
goes over the pipe itself. Calls are dealt to the processes in turn; slots come back as the
processes copy messages out.

The processes start at the first push that uses them (1.9-2.6 s on H100 hosts), live until the client
closes, and one that dies is started again at the next push; its calls fail as UNAVAILABLE.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import mmap
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from logprob_proto.framing import Message, join

from .channel import Connection
from .errors import LogprobError, error_for_status

# A slot holds one message: a piece of ``chunk_bytes`` and its framing (names, shapes, offsets).
FRAMING_BYTES = 64 << 10
# Slots per process: messages copied in and not yet out. The process copies each out at once;
# two per call it carries keep the copying in this process ahead of gRPC's sending there.
SLOTS = 8
START_TIMEOUT_S = 60.0
# glibc's thresholds for the processes' 4 MiB copies (warm pages, not a fresh mmap each), as the
# server and its receivers set them for theirs ("Page faults" in benchmarks/RESULTS.md), unless
# the trainer's environment sets its own. Their effect here was not measured on its own.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


@dataclass
class _Process:
    index: int
    process: subprocess.Popen[bytes]
    socket: socket.socket  # the pipe's socket: shut down to wake its reader and end the process
    pipe: Pipe
    slots: np.ndarray  # the shared memory, as bytes (a view of its mapping, which it keeps open)
    slot_bytes: int
    free: queue.SimpleQueue[int | None] = field(default_factory=queue.SimpleQueue)  # None: it died
    answers: dict[int, concurrent.futures.Future[tuple[Any, str, str]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the pipe, from the calls' threads
    alive: bool = True
    ended: str = ""  # how it ended, once it has

    def expect(self, call: int) -> concurrent.futures.Future[tuple[Any, str, str]]:
        """The future answer of a call about to be opened (failed at once if the process is gone)."""
        answer: concurrent.futures.Future[tuple[Any, str, str]] = concurrent.futures.Future()
        self.answers[call] = answer
        if not self.alive:  # its reader may have failed the calls it knew of before this one came
            self.fail_calls()
        return answer

    def fail_calls(self) -> None:
        """Every call it had not answered fails as UNAVAILABLE (once it has died)."""
        for call in list(self.answers):
            answer = self.answers.pop(call, None)  # one thread gets each
            if answer is not None:
                answer.set_result((None, grpc.StatusCode.UNAVAILABLE.name, self.ended))

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock, contextlib.suppress(OSError):  # it died: its reader fails its calls
            self.pipe.send(message)

    def close_pipe(self) -> None:
        with self.lock:  # not while a call's thread writes to it (it writes under this lock)
            self.pipe.close()
            self.socket.close()

    def slot(self) -> int | None:
        """A free slot, waiting for one; None once the process has died."""
        slot = self.free.get()
        if slot is None:
            self.free.put(None)  # for the other calls' threads
        return slot


class _Push:
    """One push's calls, each fed by a thread of its own."""

    def __init__(self) -> None:
        self.calls: list[tuple[_Process, int, concurrent.futures.Future[tuple[Any, str, str]]]] = []
        self.stopped = threading.Event()
        self.error: BaseException | None = None  # a stream's own exception (reading a tensor failed)

    def cancel(self) -> None:
        self.stopped.set()
        for process, call, _ in self.calls:
            process.send(("cancel", call))

    def wait(self) -> bytes:
        """The first call's serialized answer once all have answered; the first failure raised
        (the others cancelled)."""
        answers = [answer for _, _, answer in self.calls]
        try:
            for answer in concurrent.futures.as_completed(answers):
                _, code, details = answer.result()
                if code != grpc.StatusCode.OK.name:
                    if self.error is not None:
                        raise self.error
                    raise error_for_status(grpc.StatusCode[code], details)
        except BaseException:
            self.cancel()
            raise
        return answers[0].result()[0]

    def feed(self, process: _Process, call: int, stream: Iterator[Message]) -> None:
        """Hands the call's messages to its process, each in a slot (a thread per call)."""
        try:
            for message in stream:
                if self.stopped.is_set():
                    return
                sizes = [memoryview(part).nbytes for part in message]
                if sum(sizes) > process.slot_bytes:
                    process.send(("inline", call, join(message)))
                    continue
                if (slot := process.slot()) is None:
                    return  # its reader fails the call
                start = position = slot * process.slot_bytes
                for part, size in zip(message, sizes):
                    process.slots[position : position + size] = np.frombuffer(part, np.uint8)
                    position += size
                process.send(("message", call, slot, position - start))
            process.send(("end", call))
        except BaseException as err:
            self.error = err
            self.cancel()


class PushProcesses:
    """``count`` push processes making UpdateWeights calls with ``connection``'s settings (TLS,
    token, options), each with ``SLOTS`` slots of ``slot_bytes``."""

    def __init__(self, connection: Connection, count: int, slot_bytes: int) -> None:
        if count < 1:
            raise ValueError(f"push_processes must be >= 1 to push from processes, got {count}")
        self.connection, self.count, self.slot_bytes = connection, count, slot_bytes
        self._processes: list[_Process | None] = [None] * count
        self._calls = itertools.count()
        self._lock = threading.Lock()

    def push(self, targets: Sequence[str], streams: Sequence[Iterator[Message]], timeout: float | None) -> bytes:
        """The calls of one push, stream ``i`` to ``targets[i]``, made together: the first's
        serialized UpdateWeightsResponse once every call has answered; the first failure raised
        as a ``LogprobError`` (or a stream's own exception), the other calls cancelled."""
        return self.start(targets, streams, timeout).wait()

    def start(self, targets: Sequence[str], streams: Sequence[Iterator[Message]], timeout: float | None) -> _Push:
        """``push``'s calls, started: ``wait()`` for their answer, or ``cancel()`` them."""
        push = _Push()
        try:
            for i, (target, stream) in enumerate(zip(targets, streams, strict=True)):
                process = self._process(i % self.count)
                call = next(self._calls)
                push.calls.append((process, call, process.expect(call)))
                process.send(("open", call, target, timeout))
                threading.Thread(target=push.feed, args=(process, call, stream), daemon=True).start()
        except BaseException:
            push.cancel()
            raise
        return push

    def _process(self, index: int) -> _Process:
        with self._lock:
            process = self._processes[index]
            if process is None or not process.alive:
                if process is not None:
                    self._stop(process)
                process = self._processes[index] = self._spawn(index)
            return process

    def _spawn(self, index: int) -> _Process:
        size = SLOTS * self.slot_bytes
        memory_fd = os.memfd_create("logprob-push", os.MFD_CLOEXEC)
        os.ftruncate(memory_fd, size)
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[1])  # where logprob_client is imported from
        env = {**MALLOC_ENV, **os.environ}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "logprob_client.push_process", str(theirs.fileno()), str(memory_fd)],
                pass_fds=(theirs.fileno(), memory_fd),
                env=env,
            )
        finally:
            theirs.close()
        slots = np.frombuffer(mmap.mmap(memory_fd, size), np.uint8)
        os.close(memory_fd)
        pipe = Pipe(os.dup(ours.fileno()))
        process = _Process(index, popen, ours, pipe, slots, self.slot_bytes)
        try:
            pipe.send((self.connection, self.slot_bytes, size))
            if not pipe.poll(START_TIMEOUT_S):
                raise TimeoutError(f"push process {index} did not start within {START_TIMEOUT_S:.0f} s")
            pipe.recv()  # ("ready",)
        except (EOFError, OSError, TimeoutError) as err:
            self._stop(process)
            process.close_pipe()  # no reader yet
            code = popen.poll()
            raise LogprobError(f"push process {index} failed to start (exit code {code}): {err}") from None
        for slot in range(SLOTS):
            process.free.put(slot)
        threading.Thread(target=self._read, args=(process,), daemon=True, name=f"logprob-push-{index}").start()
        return process

    @staticmethod
    def _read(process: _Process) -> None:
        """The process's answers and free slots, until it exits; then its calls fail."""
        try:
            while True:
                kind, *rest = process.pipe.recv()
                if kind == "free":
                    process.free.put(rest[0])
                elif (answer := process.answers.pop(rest[0], None)) is not None:
                    answer.set_result(tuple(rest[1:]))
        except (EOFError, OSError):
            pass
        process.close_pipe()  # here, not in ``_stop``: closed while recv waits on it, it raised TypeError
        code = process.process.wait()
        process.ended = f"push process {process.index} (pid {process.process.pid}) exited with code {code}"
        process.alive = False  # after ``ended``, before the calls fail: see ``expect``
        process.free.put(None)
        process.fail_calls()

    @staticmethod
    def _stop(process: _Process) -> None:
        # It exits when its pipe ends. Closing the pipe would not end it while this side's reader
        # waits in recv (the socket stays open until that returns): shutting the socket down ends
        # the pipe and wakes the reader, which closes it.
        with contextlib.suppress(OSError):
            process.socket.shutdown(socket.SHUT_RDWR)
        try:
            process.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.process.kill()
            process.process.wait()
        # Its shared memory is unmapped with ``slots``, when the _Process is dropped.

    def close(self) -> None:
        """Stops the processes (calls in flight fail)."""
        with self._lock:
            for process in filter(None, self._processes):
                self._stop(process)
            self._processes = [None] * self.count
