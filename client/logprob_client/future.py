"""``ScoreFuture``: the pending result of ``LogprobClient.score_async``.

Its RPCs are already in flight (gRPC's own futures, driven by gRPC's threads), so the caller's
thread is free until it asks for the result: a trainer sends the reference scoring of batch k,
generates batch k+1, then collects batch k's log-probs.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from .errors import Cancelled, LogprobError

_UNSET = object()


class ScoreFuture:
    """One scoring call's RPCs (one per part of a split call) and how to assemble their answers."""

    def __init__(
        self,
        calls: Sequence[grpc.Future],
        finish: Callable[[list[Any]], Any],
        error: Callable[[int, grpc.StatusCode, str], LogprobError],
        connecting: concurrent.futures.Future[None] | None = None,
    ) -> None:
        self._calls = list(calls)
        self._finish = finish  # responses, in part order -> the caller's result
        self._error = error  # (part, status, message) of a failed RPC -> the error to raise
        self._connecting = connecting  # the wait for a connection, which cancels the calls if it fails
        self._value: Any = _UNSET

    def done(self) -> bool:
        """True when every RPC has finished (succeeded, failed or been cancelled)."""
        return all(call.done() for call in self._calls)

    def cancel(self) -> None:
        """Cancel the RPCs still in flight; ``result()`` then raises ``Cancelled``."""
        for call in self._calls:
            call.cancel()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for every RPC and return what ``score`` would have returned.

        Raises the call's typed error (the other parts are cancelled; ``Unavailable`` when no
        connection came within the client's ``connect_timeout_s``), or ``TimeoutError`` when
        ``timeout`` seconds pass first (the RPCs go on; ask again later).
        """
        if self._value is not _UNSET:
            return self._value
        deadline = None if timeout is None else time.monotonic() + timeout
        responses = []
        for part, call in enumerate(self._calls):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                responses.append(call.result(timeout=remaining))
            except grpc.FutureTimeoutError:
                raise TimeoutError(f"scores not ready within {timeout} s; the RPCs are still running") from None
            except grpc.FutureCancelledError:
                cancelled = Cancelled("the scoring call was cancelled", grpc.StatusCode.CANCELLED)
                raise self._unconnected() or cancelled from None
            except grpc.RpcError as err:
                self.cancel()
                if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED and (unconnected := self._unconnected(wait=True)):
                    raise unconnected from None  # a deadline no longer than the wait for a connection
                raise self._error(part, err.code(), err.details() or "") from None
        self._value = self._finish(responses)
        return self._value

    def _unconnected(self, wait: bool = False) -> BaseException | None:
        """Why the calls failed, when it is that no connection came (``channel.ConnectionWatch``);
        ``wait``: for the wait's end (it ends by the calls' deadline)."""
        if self._connecting is None or not (wait or self._connecting.done()):
            return None
        return self._connecting.exception()
