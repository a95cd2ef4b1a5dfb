"""One interceptor that turns exceptions into precise gRPC statuses, and counts every RPC.

Domain errors (``errors.LogprobError``) carry their status and a message for the caller.
Anything else is a bug: logged with the request id and answered INTERNAL, and the server keeps
serving the other requests. Each RPC's final status and duration go to ``metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from . import metrics
from .errors import LogprobError

log = logging.getLogger(__name__)


def _status_of(err: BaseException) -> grpc.StatusCode:
    if isinstance(err, LogprobError):
        return err.status
    if isinstance(err, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, method: str, request_id: str, err: Exception) -> None:
    if isinstance(err, LogprobError):
        log.warning("%s request_id=%s -> %s: %s", method, request_id, err.status.name, err.message)
        await context.abort(err.status, err.message, trailing_metadata=err.trailing_metadata())
    log.exception("%s request_id=%s failed with an internal error", method, request_id, exc_info=err)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__}); request_id={request_id} is in the server log"
    )


@contextlib.asynccontextmanager
async def _guarded(context: grpc.aio.ServicerContext, method: str, request_id: str) -> AsyncIterator[None]:
    """Map what the handler raises to a status, and record the RPC's status and duration."""
    start, code = time.perf_counter(), grpc.StatusCode.OK
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except BaseException as err:
        code = _status_of(err)
        if not isinstance(err, Exception):  # cancellation and exits pass through untouched
            raise
        await _abort(context, method, request_id, err)
    finally:
        metrics.observe_rpc(method.rsplit("/", 1)[-1], code, time.perf_counter() - start)


class ExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async with _guarded(context, method, getattr(request, "request_id", "")):
                    return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with _guarded(context, method, ""):
                    async for response in inner_stream(request_iterator, context):
                        yield response

            return grpc.stream_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
