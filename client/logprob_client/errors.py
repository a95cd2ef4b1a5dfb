"""Typed client exceptions, one per gRPC status the service answers with.

Each carries the server's message (which names the field, index and limit at fault) and the
status code. An ``InvalidRequest`` about one of the caller's sequences names it as the caller
did (``completion_ids[3][1]``), not as the request the client built named it
(``groups[2].completions[0].completion_ids[1]``); ``server_message`` keeps the server's words.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class PushOutcome:
    """What became of a push whose calls were cancelled or passed their deadline, as ListModels
    told right after: the server may have taken the push's commit before the calls ended, and
    then the push goes live all the same (ListModels answers once it has). ``version``: the
    version the push went (or would have gone) live as, None where the client cannot tell (a
    push of version 0, the live one + 1, made without the live version at hand);
    ``live_version`` and ``fingerprint``: the model's now (None: ListModels failed too, or the
    push was never sent, its ListModels before it having failed so);
    ``went_live``: whether the push's version is live (None: cannot be told: its version is
    unknown, a later one went live since, or ListModels failed)."""

    model: str
    version: int | None
    live_version: int | None
    fingerprint: str
    went_live: bool | None

    def __str__(self) -> str:
        if self.live_version is None:
            if self.went_live is False:
                return "the push was never sent: it did not go live"
            return "whether the push went live is unknown: ListModels failed too"
        pushed = f"version {self.version}" if self.version is not None else "version 0 (the live one + 1)"
        fate = {True: "went live", False: "did not go live (and will not)", None: "may or may not have gone live"}
        return (
            f"the push ({pushed}) {fate[self.went_live]}: model {self.model!r} serves version {self.live_version} "
            f"(fingerprint {self.fingerprint}) now"
        )


class LogprobError(Exception):
    """Base of every error this client raises for a failed call. ``push_outcome``: on a push
    cancelled or past its deadline, whether it went live all the same (``PushOutcome``)."""

    push_outcome: PushOutcome | None = None

    def __init__(
        self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN, *, server_message: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.server_message = message if server_message is None else server_message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidRequest(LogprobError):
    """INVALID_ARGUMENT: fix the request (the message says which field, index and limit)."""


class ModelNotFound(LogprobError):
    """NOT_FOUND: no model of that name is served."""


class Overloaded(LogprobError):
    """RESOURCE_EXHAUSTED: the server's queue is full; retried automatically, then raised."""


class Unavailable(LogprobError):
    """UNAVAILABLE: server unreachable (a scoring call gets no connection within the client's
    ``connect_timeout_s``: the message names the target and gRPC's last connection error), or
    starting or draining (this client's calls wait for a SERVING replica instead, within their
    deadline, as it watches health); retried automatically, then raised."""


class DeadlineExceeded(LogprobError):
    """DEADLINE_EXCEEDED: the call's timeout passed."""


class FailedPrecondition(LogprobError):
    """FAILED_PRECONDITION: the server's state does not allow the call (e.g. ``min_version`` did not
    go live in time, within the call's deadline too: the message names the awaited and the live
    version; or an update's version is not above the live one)."""


class UpdateAborted(LogprobError):
    """ABORTED: a weight update ended before its commit, or another update of the model was in
    progress; nothing of it was applied."""


class MixedVersionsError(LogprobError):
    """The parts of one split call were scored by different versions of the model's weights
    (an update went live meanwhile). Raised by the client; retry with the ``min_version`` it names."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.ABORTED)


class Unauthenticated(LogprobError):
    """UNAUTHENTICATED: missing or wrong credentials."""


class PermissionDenied(LogprobError):
    """PERMISSION_DENIED: the credentials lack the scope for this call."""


class Cancelled(LogprobError):
    """CANCELLED: the call was cancelled."""


class ServerError(LogprobError):
    """INTERNAL or any other status: a server-side problem (the server log has the request id)."""


_BY_CODE: dict[grpc.StatusCode, type[LogprobError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: UpdateAborted,
}
_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_for_status(code: grpc.StatusCode | int, message: str) -> LogprobError:
    """The typed exception for a status code (a grpc.StatusCode or its integer value)."""
    if isinstance(code, int):
        code = _CODE_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, ServerError)(message, code)


def error_from_rpc(err: grpc.RpcError) -> LogprobError:
    return error_for_status(err.code(), err.details() or "")
