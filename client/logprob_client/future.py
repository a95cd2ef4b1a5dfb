"""``ScoreFuture``: the pending result of ``LogprobClient.score_async``.

Its RPCs are sent as the client's share of the server's queue has room (``pacing.py``: at once,
unless the client has more in flight than its share allows) and driven by gRPC's threads, so
the caller's thread is free until it asks for the result: a trainer sends the reference scoring
of batch k, generates batch k+1, then collects batch k's log-probs.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from .errors import Cancelled, LogprobError
from .pacing import PacedCall, Share, Waiter

_UNSET = object()
_EXPIRED = None  # a part's sending, when the call's deadline passed before there was room to send it


class ScoreFuture:
    """One scoring call's RPCs (one per part of a split call), sent as its client's share has room,
    and how to assemble their answers."""

    def __init__(
        self,
        paced: PacedCall,
        share: Share,
        send: Callable[[int, float], grpc.Future],
        finish: Callable[[list[Any]], Any],
        error: Callable[[int, grpc.StatusCode, str], LogprobError],
        deadline_error: Callable[[PacedCall, str], LogprobError],
    ) -> None:
        self._paced = paced
        self._share = share
        self._send = send  # (part, timeout) -> its RPC, sent
        self._finish = finish  # responses, in part order -> the caller's result
        self._error = error  # (part, status, message) of a failed RPC -> the error to raise
        self._deadline_error = deadline_error  # (the call, the server's message) -> the error when its deadline passed
        self._connecting: concurrent.futures.Future[None] | None = None
        # Each part's RPC once sent (_EXPIRED: never sent, the deadline passed first).
        self._parts: list[concurrent.futures.Future[grpc.Future | None]] = [
            concurrent.futures.Future() for _ in paced.costs
        ]
        self._waiters: dict[int, Waiter] = {}
        self._lock = threading.Lock()
        self._cancelled = False
        self._value: Any = _UNSET

    def start(self, connecting: concurrent.futures.Future[None] | None) -> None:
        """Send the parts, as the share has room; ``connecting``: the wait for a connection, which
        cancels the call if it fails (``channel.ConnectionWatch.watch``)."""
        self._connecting = connecting
        for part, cost in enumerate(self._paced.costs):
            waiter = self._share.ask(cost, lambda part=part: self._go(part))
            if waiter is not None:
                self._waiters[part] = waiter

    def _go(self, part: int) -> None:
        """Send ``part``: the share has counted its tokens in flight."""
        with self._lock:  # (sends nothing once cancelled)
            remaining = self._paced.remaining_s()
            cancelled = self._cancelled
            call = None if cancelled or remaining <= 0 else self._send(part, remaining)
        if call is None:  # the share's lock and other calls' are not taken under this one's
            self._share.release(self._paced.costs[part])
            if cancelled:
                self._parts[part].cancel()
            else:
                self._parts[part].set_result(_EXPIRED)
            return
        self._paced.sent.add(part)
        self._parts[part].set_result(call)
        call.add_done_callback(lambda call: self._ended(part, call))

    def _ended(self, part: int, call: grpc.Future) -> None:
        if not call.cancelled() and call.exception() is None:
            self._paced.answered.add(part)
        self._share.release(self._paced.costs[part])

    def done(self) -> bool:
        """True when every RPC has finished (succeeded, failed or been cancelled)."""
        return all(
            sent.done() and (sent.cancelled() or (call := sent.result()) is _EXPIRED or call.done())
            for sent in self._parts
        )

    def cancel(self) -> None:
        """Cancel the RPCs still in flight and those not yet sent; ``result()`` then raises ``Cancelled``."""
        with self._lock:
            self._cancelled = True
        for part, waiter in list(self._waiters.items()):
            if self._share.withdraw(waiter):
                self._parts[part].cancel()
        for sent in self._parts:
            if sent.done() and not sent.cancelled() and (call := sent.result()) is not _EXPIRED:
                call.cancel()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for every RPC and return what ``score`` would have returned.

        Raises the call's typed error (the other parts are cancelled; ``Unavailable`` when no
        connection came within the client's ``connect_timeout_s``; ``DeadlineExceeded`` saying how
        much was answered and what paced the rest), or ``TimeoutError`` when ``timeout`` seconds
        pass first (the RPCs go on; ask again later).
        """
        if self._value is not _UNSET:
            return self._value
        deadline = None if timeout is None else time.monotonic() + timeout
        responses = []
        for part, sent in enumerate(self._parts):
            try:
                call = sent.result(timeout=self._until(deadline))
                if call is _EXPIRED:
                    raise self._failed(self._deadline_error(self._paced, "")) from None
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                responses.append(call.result(timeout=left))
            except (TimeoutError, grpc.FutureTimeoutError):
                if self._paced.remaining_s() <= 0 and not sent.done():  # kept back past the call's deadline
                    raise self._failed(self._deadline_error(self._paced, "")) from None
                raise TimeoutError(f"scores not ready within {timeout} s; the RPCs are still running") from None
            except (grpc.FutureCancelledError, concurrent.futures.CancelledError):
                cancelled = Cancelled("the scoring call was cancelled", grpc.StatusCode.CANCELLED)
                raise self._failed(self._unconnected() or cancelled) from None
            except grpc.RpcError as err:
                self.cancel()
                if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    if unconnected := self._unconnected(wait=True):
                        raise unconnected from None  # a deadline no longer than the wait for a connection
                    raise self._deadline_error(self._paced, err.details() or "") from None
                raise self._error(part, err.code(), err.details() or "") from None
        self._value = self._finish(responses)
        return self._value

    def _until(self, deadline: float | None) -> float | None:
        """How long to wait for a part to be sent: until ``result``'s ``deadline``, or the call's
        own (a part kept back that long will not be sent)."""
        remaining = max(0.0, self._paced.remaining_s())
        return remaining if deadline is None else max(0.0, min(remaining, deadline - time.monotonic()))

    def _failed(self, error: BaseException) -> BaseException:
        """``error``, once the call's other parts are cancelled."""
        self.cancel()
        return error

    def _unconnected(self, wait: bool = False) -> BaseException | None:
        """Why the calls failed, when it is that no connection came (``channel.ConnectionWatch``);
        ``wait``: for the wait's end (it ends by the calls' deadline)."""
        if self._connecting is None or not (wait or self._connecting.done()):
            return None
        return self._connecting.exception()
