"""One interceptor that turns exceptions into precise gRPC statuses, and accounts for every RPC.

Domain errors (``errors.LogprobError``) carry their status and a message for the caller.
Anything else is a bug: answered INTERNAL (``accounting`` logs it with the request id and the
traceback), and the server keeps serving the other requests. Each unary RPC's outcome goes to
``accounting`` once, and so does a client-streaming RPC (UpdateWeights) as a whole; a scoring
stream's requests are accounted for one by one by the stream handler, so here such a stream
counts only when it fails as a whole.

Only this service's RPCs are intercepted: health probes and reflection are not its requests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from . import accounting, handlers
from .errors import LogprobError, status_of
from .state import SERVICE_NAME


@dataclass
class _Answer:
    response: Any = None


async def _fail(context: grpc.aio.ServicerContext, request_id: str, err: Exception) -> None:
    if not isinstance(err, LogprobError):
        err = LogprobError(f"internal error ({type(err).__name__}); request_id={request_id} is in the server log")
    await handlers.fail(context, err)


@contextlib.asynccontextmanager
async def _guarded(
    context: grpc.aio.ServicerContext, rpc: str, request: Any, *, answers_per_request: bool = False
) -> AsyncIterator[_Answer]:
    """Map what the handler raises to a status, and account for the RPC (``request``: None for a
    client stream; ``answers_per_request``: a scoring stream, whose requests are accounted for apart).

    The outcome is accounted for before the answer leaves, so a caller that has its answer
    finds it counted."""
    start, answer = time.perf_counter_ns(), _Answer()

    def account(code: grpc.StatusCode, error: BaseException | None = None) -> None:
        elapsed_ns = time.perf_counter_ns() - start
        accounting.record(rpc, request, code, elapsed_ns=elapsed_ns, response=answer.response, error=error)

    try:
        yield answer
    except grpc.aio.AbortError:
        raise
    except BaseException as err:
        account(status_of(err), err)
        if not isinstance(err, Exception):  # cancellation and exits pass through untouched
            raise
        await _fail(context, getattr(request, "request_id", ""), err)  # the status says it all
    else:
        if not answers_per_request:
            account(grpc.StatusCode.OK)


class ExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service, _, rpc = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or service != SERVICE_NAME:
            return handler
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async with _guarded(context, rpc, request) as answer:
                    answer.response = await inner_unary(request, context)
                    return answer.response

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            inner_client_stream = handler.stream_unary

            async def client_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                async with _guarded(context, rpc, None) as answer:
                    answer.response = await inner_client_stream(request_iterator, context)
                    return answer.response

            return grpc.stream_unary_rpc_method_handler(
                client_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with _guarded(context, rpc, None, answers_per_request=True):
                    async for response in inner_stream(request_iterator, context):
                        yield response

            return grpc.stream_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
