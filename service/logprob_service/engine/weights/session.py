"""An update coming over several streams: the streams that join it, and the one outcome they are
all answered with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from logprob_service.domain import UpdateHeader, UpdateOutcome
from logprob_service.engine.weights.update import Update
from logprob_service.errors import Aborted, InvalidArgument, LogprobError

# How long the streams of one update have to arrive, counted from the first.
STREAMS_JOIN_S = 30.0


class StreamIdle(Aborted):
    """No message of an update stream came within the server's ``update_idle_timeout_s``: the
    update is aborted and the model's update slot freed. The client holds the stream open without
    sending, so the stream is answered at once, not read to its end first."""


class Session:
    """An update coming over several streams (``UpdateHeader.streams``): the update they all feed,
    how many have come and committed, and the outcome every stream is answered with."""

    def __init__(self, update: Update, header: UpdateHeader, start_ns: int) -> None:
        self.update, self.header, self.start_ns = update, header, start_ns
        self.joined, self.committed = 1, 0
        self.outcome: asyncio.Future[UpdateOutcome] = asyncio.get_running_loop().create_future()
        self._timer = asyncio.get_running_loop().call_later(STREAMS_JOIN_S, self._check_joined)
        self.on_end: Callable[[], None] = lambda: None  # releases the model's update slot
        self.commit: asyncio.Future[UpdateOutcome] | None = None  # the swap, once every stream committed

    def join(self, header: UpdateHeader) -> None:
        """Another stream of the update. One too many is refused alone; one whose header differs
        from the first's fails the update (its streams disagree on what it is)."""
        if self.joined == self.header.streams:
            raise InvalidArgument(
                f"header.streams: update {header.update_id!r} already has its {self.header.streams} streams"
            )
        if header != self.header:
            self.fail(
                InvalidArgument(
                    f"header: a stream of update {header.update_id!r} says {header}, its first stream said "
                    f"{self.header}; nothing applied"
                )
            )
            self.check()
        self.joined += 1

    def _check_joined(self) -> None:
        if self.joined < self.header.streams:
            self.fail(
                Aborted(
                    f"header.streams: only {self.joined} of the {self.header.streams} streams of update "
                    f"{self.header.update_id!r} came within {STREAMS_JOIN_S:g} s; nothing applied"
                )
            )

    def check(self) -> None:
        """Raises the update's failure, if a stream failed it."""
        if self.outcome.done() and self.outcome.exception() is not None:
            raise self.outcome.exception()  # type: ignore[misc]

    def settle(self, commit: asyncio.Future[UpdateOutcome]) -> None:
        """The commit is done: its outcome, or its failure, is every stream's answer."""
        if commit.cancelled():
            self.fail(Aborted(f"update {self.header.update_id!r}: its commit was cancelled (the server stopping)"))
        elif (error := commit.exception()) is not None:
            self.fail(error)
        elif not self.outcome.done():
            self.outcome.set_result(commit.result())
            self.end()

    def fail(self, error: BaseException) -> None:
        """The update fails for every stream: ``error`` becomes each stream's answer."""
        if not isinstance(error, LogprobError):
            error = Aborted(
                f"a stream of update {self.header.update_id!r} broke off ({type(error).__name__}); nothing applied"
            )
        elif isinstance(error, StreamIdle):
            error = Aborted(error.message)  # the other streams may still be sending: read to their ends
        if not self.outcome.done():
            self.outcome.set_exception(error)
            self.outcome.exception()  # retrieved: streams that already returned never read it
            self.end()

    def end(self) -> None:
        self._timer.cancel()
        self.on_end()
