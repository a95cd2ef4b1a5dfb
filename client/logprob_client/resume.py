"""One ``score_many`` call over as many streams as it takes.

gRPC's retry policy cannot retry a stream once responses have flowed, so a server restart in
the middle of a ``ScoreTokensStream`` would lose every answer still owed. Instead, when a stream
breaks with a retryable status (UNAVAILABLE: the server went away; RESOURCE_EXHAUSTED), the
requests it left unanswered, and those it answered with a retryable error, are sent again on a
new stream after gRPC's backoff (or the server's retry hint, when longer), up to ``max_attempts``
streams, within the call's deadline.
Scoring is a pure function of the request and the weights, so sending a request twice does no
harm; answers are kept by ``request_id``, one per request, so none is counted twice.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from logprob_proto import logprob_pb2 as pb

from .channel import RETRYABLE_CODES, backoff_s
from .errors import error_from_rpc

_RETRYABLE_VALUES = frozenset(code.value[0] for code in RETRYABLE_CODES)


class StreamResume:
    def __init__(self, requests: list[pb.ScoreRequest], timeout: float, max_attempts: int) -> None:
        self.deadline = time.monotonic() + timeout
        self.max_attempts = max_attempts
        self.pending = requests  # to send on the next stream
        self.responses: dict[str, pb.ScoreResponse] = {}
        self.streams = 0

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def next_stream(self) -> dict[str, Any]:
        """The arguments of the next ``ScoreTokensStream`` call: the requests still unanswered."""
        self.streams += 1
        return {"request_iterator": iter(self.pending), "timeout": self.remaining_s(), "wait_for_ready": True}

    def take(self, response: pb.ScoreResponse) -> None:
        self.responses[response.request_id] = response

    def retry_after_s(self, error: grpc.RpcError | None) -> float | None:
        """After a stream ended (with ``error`` when it broke): how long to wait before the next
        stream, or None when there is none to send. Raises the stream's error when it ended the
        call for good (not retryable, no attempts or time left)."""
        self.pending = [r for r in self.pending if self._unsettled(self.responses.get(r.request_id))]
        if not self.pending:
            return None
        delay = max(backoff_s(self.streams), _pushback_s(error))
        retryable = error is None or error.code() in RETRYABLE_CODES or _status_lost(error)
        if retryable and self.streams < self.max_attempts and delay < self.remaining_s():
            return delay
        if error is not None:
            raise error_from_rpc(error)
        return None  # only retryable answers are left: they stand, and the caller reports them

    @staticmethod
    def _unsettled(response: pb.ScoreResponse | None) -> bool:
        return response is None or (response.HasField("error") and response.error.code in _RETRYABLE_VALUES)


def _pushback_s(error: grpc.RpcError | None) -> float:
    """The server's retry hint on a broken stream (``grpc-retry-pushback-ms``), as gRPC's retry
    policy honours it for unary calls; 0 without one."""
    metadata = dict(error.trailing_metadata() or ()) if error is not None else {}
    hint = metadata.get("grpc-retry-pushback-ms")
    return int(hint) / 1000 if hint is not None and str(hint).isdigit() else 0.0


def _status_lost(error: grpc.RpcError) -> bool:
    """grpc.aio reports INTERNAL "Internal error from Core" in place of the server's status when a
    request write fails because the server already ended the stream (grpc/grpc#36066): the stream
    broke, why is lost. Sending the unanswered requests again is safe (scoring is idempotent),
    and the next stream reports the server's status if it still refuses them."""
    return error.code() == grpc.StatusCode.INTERNAL and error.details() == "Internal error from Core"
