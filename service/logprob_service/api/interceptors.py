"""Interceptors: one that turns exceptions into precise gRPC statuses and accounts for every RPC,
one that holds a refused call before its answer when its client keeps being refused
(``HeldRefusals``, over ``security.refusals``), and one that reads UpdateWeights pieces with their
bytes as views (``tensor_pieces``).

Domain errors (``errors.LogprobError``) carry their status and a message for the caller.
Anything else is a bug: answered INTERNAL (``accounting`` logs it once, with the traceback), and
the server keeps serving the other requests. An INTERNAL answer names its log line's request id:
the request's own, or one made for it (a request without an id field, a client stream). Each
unary RPC's outcome goes to ``accounting`` once, and so does a client-streaming RPC
(UpdateWeights) as a whole, with the push it is one of (``accounting.UpdateStream``: a push over
several calls counts once); a scoring
stream's requests are accounted for one by one by the stream handler, so here such a stream
counts only when it fails as a whole.

Only this service's RPCs are intercepted: health probes and reflection are not its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from logprob_service.api import accounting, handlers
from logprob_service.api.status import status_of
from logprob_service.api.tensor_pieces import read_update_request
from logprob_service.errors import LogprobError
from logprob_service.logs import shown_id
from logprob_service.security.caller import current_client
from logprob_service.security.refusals import RefusalThrottle


@dataclass
class _Answer:
    response: Any = None


def _internal(err: Exception, request_id: str) -> LogprobError:
    """What the caller is told of an INTERNAL failure: never the bug's own words (they may hold
    paths or values), and the request id its log line carries."""
    what = err.message if isinstance(err, LogprobError) else f"internal error ({type(err).__name__})"
    return LogprobError(f"{what}; request_id={shown_id(request_id)} is in the server log")


def cancellation_reason(context: grpc.aio.ServicerContext) -> str:
    """Why a call was cancelled, for its log line (a bare CancelledError says nothing): the
    caller's deadline, or the caller (or the server's stop)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return (
            "the caller's deadline passed before the answer (a call cut into parts waits for its "
            "share of the queue, max_queued_tokens_per_client, part by part)"
        )
    # The caller's cancel and the server's stop look alike here (the context says which only later).
    return (
        "the caller cancelled the call or closed its connection (a client cancels a split call's other parts "
        "when one of them fails), or the server stopped before answering"
    )


# How long a failed write waits for the cancellation it may be the sign of (the event that marks the
# context cancelled is delivered on the event loop, after the write's own failure).
CANCEL_NOTICE_S = 1.0


async def _cancelled(context: grpc.aio.ServicerContext, err: BaseException) -> bool:
    """Whether the call was cancelled by its client. A write to a call the client has just
    cancelled fails with gRPC's ExecuteBatchError before the context says it is cancelled; such a
    failure waits (at most CANCEL_NOTICE_S) for the context to say so, or for gRPC to cancel the
    handler. On a live call it stays what it is: a bug, INTERNAL."""
    if context.cancelled() or type(err).__name__ != "ExecuteBatchError":
        return context.cancelled()
    deadline = time.monotonic() + CANCEL_NOTICE_S
    try:
        while not context.cancelled() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:  # gRPC cancels the handler of a call its client cancelled
        return True
    return context.cancelled()


@contextlib.asynccontextmanager
async def _guarded(
    context: grpc.aio.ServicerContext,
    rpc: str,
    request: Any,
    *,
    answers_per_request: bool = False,
    update: accounting.UpdateStream | None = None,
) -> AsyncIterator[_Answer]:
    """Map what the handler raises to a status, and account for the RPC (``request``: None for a
    client stream; ``answers_per_request``: a scoring stream, whose requests are accounted for apart;
    ``update``: an UpdateWeights call's messages, which name the push it is one of).

    The outcome is accounted for before the answer leaves, so a caller that has its answer
    finds it counted."""
    start, answer = time.perf_counter_ns(), _Answer()

    def account(code: grpc.StatusCode, error: BaseException | None = None, request_id: str = "") -> None:
        elapsed_ns = time.perf_counter_ns() - start
        accounting.record(
            rpc,
            request,
            code,
            elapsed_ns=elapsed_ns,
            response=answer.response,
            error=error,
            update=update,
            request_id=request_id,
        )

    try:
        yield answer
    except grpc.aio.AbortError:
        raise
    except BaseException as err:
        # A call its client cancelled is CANCELLED however its handler's last step then fails (a
        # response written to the gone call raises ExecuteBatchError): no bug of the server's.
        code = grpc.StatusCode.CANCELLED if await _cancelled(context, err) else status_of(err)
        # An INTERNAL answer names the log line that holds the traceback: by the request's own id,
        # or (a request without one: a weight update, LoadWeights) one made for it here.
        request_id = ""
        if code is grpc.StatusCode.INTERNAL:
            request_id = getattr(request, "request_id", "") or uuid.uuid4().hex
        # The error is kept in no local of this frame, which its traceback holds: that cycle kept
        # every refused request in memory until the garbage collector ran (test_fuzz's no_leak).
        account(
            code,
            asyncio.CancelledError(cancellation_reason(context)) if isinstance(err, asyncio.CancelledError) else err,
            request_id,
        )
        if not isinstance(err, Exception) or code is grpc.StatusCode.CANCELLED:  # nobody to answer
            raise
        await handlers.fail(
            context,
            _internal(err, request_id) if code is grpc.StatusCode.INTERNAL else err,  # type: ignore[arg-type]
        )
    else:
        if context.cancelled():  # a stream whose client cancelled it may still end without an error
            account(grpc.StatusCode.CANCELLED, asyncio.CancelledError())
        elif not answers_per_request:
            account(grpc.StatusCode.OK)


class ExceptionToStatusInterceptor(handlers.ServiceInterceptor):
    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        inner = handlers.behaviour_of(handler)
        client_streaming = bool(handler.request_streaming)
        # A scoring stream accounts for each of its requests itself (servicer.py).
        per_request = client_streaming and bool(handler.response_streaming)

        async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
            logged = None if client_streaming else request
            update = None
            if rpc == "UpdateWeights":
                request = update = accounting.UpdateStream(request)
            async with _guarded(context, rpc, logged, answers_per_request=per_request, update=update) as answer:
                answer.response = await handlers.run(inner, request, context)
                return answer.response

        return handlers.rebuild(handler, behaviour)


# The size on the wire of the current call's request (a single request's; 0 for a stream's), which
# gRPC keeps until the call is answered.
_REQUEST_BYTES: ContextVar[int] = ContextVar("logprob_request_bytes", default=0)


def _sized(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        _REQUEST_BYTES.set(len(raw))
        return deserializer(raw)

    return deserialize


class HeldRefusals(handlers.ServiceInterceptor):
    """Outermost: once a call has been refused (``handlers.fail``), holds its answer as ``refusals``
    says for its client (``security.refusals``: a client past its burst of refusals gets them
    answered at its rate). The inner interceptors and the handler have returned by then, so nothing
    of theirs (the exception, its traceback's frames, what the handler built) is kept while the
    call waits; gRPC itself keeps the request until the answer, which ``refusals`` counts against its
    bytes. A call its client cancels, or whose deadline passes, is cancelled by gRPC meanwhile."""

    def __init__(self, refusals: RefusalThrottle) -> None:
        self.refusals = refusals

    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        inner = handlers.behaviour_of(handler)

        async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
            handlers.REFUSAL.set(None)
            response = await handlers.run(inner, request, context)
            if (code := handlers.REFUSAL.get()) is not None:
                del request
                await self.refusals.hold(current_client(), code, "grpc", nbytes=_REQUEST_BYTES.get())
            return response

        deserializer = handler.request_deserializer
        if handler.request_streaming or deserializer is None:
            return handlers.rebuild(handler, behaviour)
        return handlers.rebuild(handler, behaviour, _sized(deserializer))


class TensorPieceViews(handlers.ServiceInterceptor):
    """Reads UpdateWeights requests with ``tensor_pieces.read_update_request`` (tensor bytes as
    views of the received message). It must come after ``MalformedMessageInterceptor`` in the
    server's list, which then catches its errors."""

    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if rpc != "UpdateWeights":
            return handler
        return handlers.rebuild(handler, handlers.behaviour_of(handler), read_update_request)
