"""Rebuilding gRPC method handlers of any of the four kinds, for the server's interceptors.

An interceptor that must run code around a call (``security.auth``, ``malformed``,
``interceptors``) replaces the handler's behaviour with a coroutine that does its part and then
``run``s the original behaviour. A
coroutine is a valid behaviour of every kind in ``grpc.aio``: one that streams responses writes
them with ``context.write``, which ``run`` does for an async-generator behaviour.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import grpc

from logprob_service.api import accounting
from logprob_service.api.health import SERVICE_NAME
from logprob_service.api.status import status_of, trailing_metadata
from logprob_service.errors import ErrorCode, LogprobError

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Any]

# The code of the error the current call was answered with (``fail``), for the hold of refused
# calls (``interceptors.HeldRefusals``, which sets it to None as each call begins).
REFUSAL: ContextVar[ErrorCode | None] = ContextVar("logprob_refusal", default=None)

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor of this service's RPCs: ``wrap`` gets the handler of each one, and health
    checks and reflection pass untouched."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        service, _, rpc = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or service != SERVICE_NAME:
            return handler
        return self.wrap(handler, rpc, handler_call_details)

    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The handler that runs instead of ``handler`` for a call of ``rpc``."""
        raise NotImplementedError


def behaviour_of(handler: grpc.RpcMethodHandler) -> Behaviour:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def rebuild(
    handler: grpc.RpcMethodHandler, behaviour: Behaviour, request_deserializer: Callable[[bytes], Any] | None = None
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind and serializers that runs ``behaviour``."""
    factory = _FACTORIES[bool(handler.request_streaming), bool(handler.response_streaming)]
    return factory(
        behaviour,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def run(behaviour: Behaviour, request: Any, context: grpc.aio.ServicerContext) -> Any:
    """Run a handler's original behaviour to its end: its response, or its streamed responses
    written to ``context``."""
    result = behaviour(request, context)
    if inspect.isasyncgen(result):
        async for response in result:
            await context.write(response)
        return None
    return await result if inspect.isawaitable(result) else result


async def fail(context: grpc.aio.ServicerContext, error: LogprobError) -> None:
    """End the call with ``error``'s status.

    A retryable status is raised with ``context.abort``, the one way grpc.aio answers with
    trailers only, which gRPC's client retry policy needs (a call that received response headers
    is never retried). Any other status is set on the context and takes effect when the behaviour
    returns (its response, if any, is dropped): grpc.aio keeps an abort's exception on the call's
    state, in a reference cycle with the handler's frames, so an aborted request stays in memory
    until the cyclic garbage collector runs, which under a stream of large bad requests grew the
    server by 150 MiB (tests/integration/limits/test_fuzz.py)."""
    REFUSAL.set(error.code)
    if error.retryable:
        await context.abort(status_of(error), error.message, trailing_metadata=trailing_metadata(error))
    context.set_code(status_of(error))
    context.set_details(error.message)
    if trailing := trailing_metadata(error):
        context.set_trailing_metadata(trailing)


async def reject(context: grpc.aio.ServicerContext, rpc: str, error: LogprobError) -> None:
    """Answer a call its handler never sees with ``error``'s status, accounted for like any other;
    the caller then returns without running the handler."""
    accounting.record(rpc, None, status_of(error), elapsed_ns=0, error=error)
    await fail(context, error)


async def read_to_end(requests: AsyncIterator[object]) -> None:
    """Read (and drop) what a client stream still sends, before the call is answered with an error.

    A grpc.aio client (grpcio 1.84 and older) whose write fails because the server already ended
    the call reports INTERNAL "Internal error from Core" instead of the server's status
    (grpc/grpc#36066); a client that has finished sending gets the status as sent. So a refused
    weight update is answered once the client's stream has ended (or broken off): it costs
    receiving the rest of the upload, only on the error path."""
    with contextlib.suppress(Exception):  # a broken stream has nothing more to read
        async for _ in requests:
            pass
