"""The HTTP edge's ASGI application (Starlette): every route through one wrapper that does what the
gRPC edge's interceptors do, and the peers' routes (``vllm``, ``sglang``, ``trl``) beside it.

The wrapper, for every request:

1. checks the bearer token (``security.bearer_tokens.check_bearer``, as gRPC does; every route but
   the health checks needs scope ``score``) and sets the client identity (the token's name, else
   the caller's IP address, which X-Forwarded-For replaces only from ``http_trusted_proxies``)
   that the fair share counts;
2. holds the call to its ``X-Request-Timeout`` from here to its answer, queue wait included (504
   past it, as gRPC's deadline does);
3. reads the body (``BodyLimits``), refusing one over ``http_max_body_bytes`` (413) by its
   Content-Length, or as it arrives, before any of it is parsed; one not all sent within
   ``http_body_timeout_s`` (408); and one that would take the bytes held of every connection's
   body past ``http_max_buffered_body_bytes`` (503, retryable);
4. runs the route, which parses the body, calls the engine facade and encodes the answer;
5. maps what the route raises to a status and a JSON error body (``errors``): a
   ``LogprobError`` is the caller's to act on; anything else is a bug, answered 500 with the
   request id its log line (with the traceback) carries, and the server serves on;
6. accounts for the request once: ``logprob_requests_total{protocol="http"}`` and one log line on
   the ``logprob_service.requests`` logger, as the gRPC edge's ``accounting`` does (a caller that
   hung up: CANCELLED, one INFO line);
7. holds a refusal before it is answered when its client keeps being refused
   (``security.refusals``: past its burst, at its rate), once the body, the route's objects and
   the error are let go; the hold ends by the call's X-Request-Timeout and, when its body was read
   to its end, as soon as the caller hangs up.

Unknown paths get 404 and a wrong method 405, with the same JSON error body; with tokens
configured, only once the caller's token is valid, so that the route table is not shown to
callers without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import pydantic_core
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from logprob_service.domain import ScoreResult
from logprob_service.engine import LogprobEngine
from logprob_service.errors import DeadlineExceeded, ErrorCode, InvalidArgument, LogprobError, PermissionDenied
from logprob_service.http.bodies import Body, PartCount, most_parts, positions
from logprob_service.http.errors import (
    BodiesBuffered,
    BodyTooLarge,
    BodyTooSlow,
    CallerGone,
    MethodNotAllowed,
    NoSuchRoute,
    error_body,
    http_status,
)
from logprob_service.logs import shown_id
from logprob_service.observability import metrics
from logprob_service.security.bearer_tokens import Scope, TokenTable, check_bearer
from logprob_service.security.caller import current_client, set_client
from logprob_service.security.refusals import RefusalThrottle
from logprob_service.settings.model import Settings

log = logging.getLogger("logprob_service.requests")

JSON = "application/json"
# What a caller over http_max_buffered_body_bytes is told to wait before it retries.
BUFFERED_RETRY_S = 1.0


@dataclass
class RouteRequest:
    """One request as a route sees it: its body, read whole, and what the wrapper knows of it."""

    engine: LogprobEngine
    body: Body
    request_id: str
    deadline: float | None  # time.monotonic() from the X-Request-Timeout header (seconds), if sent
    request: Request
    model: str = ""  # the model the request scores with, once the route knows it

    @property
    def client(self) -> str:
        return current_client()


@dataclass
class RouteAnswer:
    """A route's answer: its JSON (a value, or bytes already written: ``encoding``), and for the
    log line the model and result it scored with."""

    payload: object
    model: str = ""
    result: ScoreResult | None = None

    def response(self, request_id: str) -> Response:
        headers = {"x-request-id": request_id}
        if self.payload is None:  # an empty 200, as vLLM's and SGLang's /health answer
            return Response(headers=headers)
        content = self.payload if isinstance(self.payload, bytes) else pydantic_core.to_json(self.payload)
        return Response(content, media_type=JSON, headers=headers)


Handler = Callable[[RouteRequest], Awaitable[RouteAnswer]]


def json_error(err: LogprobError, request_id: str = "") -> Response:
    headers = {"x-request-id": request_id} if request_id else {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after_s)))
    if err.code is ErrorCode.UNAUTHENTICATED:
        headers["www-authenticate"] = "Bearer"
    if isinstance(err, BodyTooSlow):  # the rest of a body this slow is not waited for: the connection goes
        headers["connection"] = "close"
    content = pydantic_core.to_json(error_body(err))
    return Response(content, status_code=http_status(err), media_type=JSON, headers=headers)


@dataclass
class BodyLimits:
    """What the edge reads of request bodies: each one's bytes and time, and the bytes held of all
    of them at once (``held``: of bodies being read and of requests still in progress)."""

    max_body_bytes: int
    body_timeout_s: float
    max_buffered_bytes: int
    held: int = 0

    @classmethod
    def of(cls, settings: Settings) -> BodyLimits:
        return cls(settings.http_max_body_bytes, settings.http_body_timeout_s, settings.http_max_buffered_body_bytes)

    @contextlib.asynccontextmanager
    async def read(self, request: Request, most_parts: int) -> AsyncIterator[Body]:
        """The whole body, counted (``bodies.PartCount``) and held against ``max_buffered_bytes``
        until the block ends; ``BodyTooLarge`` as soon as it is known to pass ``max_body_bytes``,
        ``BodyTooSlow`` past ``body_timeout_s``, ``BodiesBuffered`` when the bytes held would pass
        ``max_buffered_bytes``, ``CallerGone`` when the caller hangs up first. Once its count of
        JSON parts passes ``most_parts`` the rest is not read: the body comes without its bytes
        (``whole`` False), for the route to refuse by its count (uvicorn drops the unread rest)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"body: {int(declared)} bytes exceed the limit of {limit} bytes (http_max_body_bytes)")
        chunks: list[bytes] = []
        count = PartCount()
        size = 0
        try:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    async for chunk in request.stream():
                        if size + len(chunk) > limit:
                            raise BodyTooLarge(f"body: more than the limit of {limit} bytes (http_max_body_bytes)")
                        self._take(len(chunk))
                        size += len(chunk)
                        chunks.append(chunk)
                        count.add(chunk)
                        if count.parts > most_parts:
                            break
            except TimeoutError:
                raise BodyTooSlow(
                    f"body: not all sent within {self.body_timeout_s:g} s (http_body_timeout_s); {size} bytes came"
                ) from None
            except ClientDisconnect:
                raise CallerGone() from None
            if count.parts > most_parts:
                chunks.clear()
                yield Body(b"", count.parts, whole=False, read_bytes=size)
            else:
                yield Body(b"".join(chunks), count.parts, read_bytes=size)
        finally:
            self.held -= size

    def _take(self, size: int) -> None:
        if self.held + size > self.max_buffered_bytes:
            raise BodiesBuffered(
                f"body: the server holds {self.held} bytes of request bodies; this one would pass "
                f"http_max_buffered_body_bytes={self.max_buffered_bytes}",
                BUFFERED_RETRY_S,
            )
        self.held += size


def _timeout(request: Request) -> float | None:
    """The call's X-Request-Timeout in seconds, if sent."""
    text = request.headers.get("x-request-timeout")
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InvalidArgument(f"X-Request-Timeout: {text!r} is not a number of seconds > 0")
    return seconds


class _Refusal(NamedTuple):
    """What the hold of a refused call needs (``RefusalThrottle.hold``)."""

    code: ErrorCode
    deadline: float | None = None  # the call's X-Request-Timeout, on time.monotonic()'s clock
    gone: Callable[[], Awaitable[None]] | None = None  # returns once the caller has hung up


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Once the body is read, only a disconnect comes on the ASGI ``receive`` channel."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Edge:
    """The routes over ``engine``, with ``tokens``' authentication (None: off), and ``refusals``'
    hold of refused calls (None: answered at once)."""

    def __init__(
        self,
        engine: LogprobEngine,
        tokens: TokenTable | None,
        bodies: BodyLimits,
        refusals: RefusalThrottle | None = None,
    ) -> None:
        self.engine = engine
        self.tokens = tokens
        self.bodies = bodies
        self.refusals = refusals

    def route(
        self, path: str, handler: Handler, *, methods: tuple[str, ...] = ("POST",), scope: Scope | None = "score"
    ) -> Route:
        """A Starlette route of ``handler`` at ``path``; ``scope``: what a token needs (None: open,
        and not accounted for: the health checks, which gRPC does not count either)."""

        async def endpoint(request: Request) -> Response:
            response, refusal = await answered(request)
            if refusal is not None and self.refusals is not None:
                await self.refusals.hold(
                    current_client(), refusal.code, "http", deadline=refusal.deadline, gone=refusal.gone
                )
            return response

        async def answered(request: Request) -> tuple[Response, _Refusal | None]:
            """The call's answer, accounted for, and, when it is a refusal, what its hold needs
            (this frame, and with it the body, the route's objects and the error, is gone by then)."""
            start = time.perf_counter_ns()
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            answer: RouteAnswer | None = None
            call: RouteRequest | None = None
            error: BaseException | None = None
            deadline: float | None = None
            try:
                set_client(request.client.host if request.client is not None else "")
                if self.tokens is not None and scope is not None:
                    principal = check_bearer(self.tokens, request.headers.get("authorization"), path, scope, "header")
                    set_client(principal.name)
                seconds = _timeout(request)
                deadline = None if seconds is None else time.monotonic() + seconds
                try:
                    async with asyncio.timeout(seconds), self._body(request) as body:
                        call = RouteRequest(self.engine, body, request_id, deadline, request)
                        answer = await handler(call)
                except TimeoutError:
                    if deadline is None or time.monotonic() < deadline:
                        raise
                    raise DeadlineExceeded(
                        f"X-Request-Timeout: {seconds:g} s passed before the request was answered"
                    ) from None
                return answer.response(request_id), None
            except LogprobError as err:
                error = err
                response = json_error(err, request_id)
                if call is not None and not call.body.whole:  # the unread rest is not taken in: the connection goes
                    response.headers["connection"] = "close"
                # Only a caller whose body was read to its end is watched for hanging up while held:
                # watching reads what comes, which would otherwise be the rest of a body not wanted.
                read = call is not None and call.body.whole
                return response, _Refusal(
                    err.code, deadline, functools.partial(until_disconnect, request.receive) if read else None
                )
            except CallerGone as err:  # nobody to answer: the response goes nowhere
                error = err
                return Response(status_code=499), None
            except Exception as err:  # a bug: the caller gets its log line's request id, never its words
                error = err
                what = f"internal error ({type(err).__name__}); request_id={shown_id(request_id)} is in the server log"
                return json_error(LogprobError(what), request_id), None
            except BaseException as err:  # the server cancelled the call (it stops): no answer goes
                error = err
                raise
            finally:
                if scope is not None:
                    model = answer.model if answer is not None else call.model if call is not None else ""
                    _account(path, request_id, model, answer, error, time.perf_counter_ns() - start)

        return Route(path, endpoint, methods=list(methods))

    def _body(self, request: Request) -> contextlib.AbstractAsyncContextManager[Body]:
        if request.method != "POST":
            return contextlib.nullcontext(Body(b"", 0))
        # What any route allows: the one taking a row of ids for each position allows the most.
        return self.bodies.read(request, most_parts(self.engine.limits, positions(self.engine)))

    def app(self, routes: list[Route]) -> Starlette:
        async def not_found(request: Request, exc: HTTPException) -> Response:
            path = request.url.path
            if self.tokens is not None:  # only a caller with a valid token learns which routes are here
                try:
                    check_bearer(self.tokens, request.headers.get("authorization"), path, "score", "header")
                except PermissionDenied:
                    pass  # a valid token, of any scope
                except LogprobError as err:
                    return json_error(err)
            if exc.status_code == 405:
                return json_error(MethodNotAllowed(f"{path}: method {request.method} is not allowed here"))
            return json_error(NoSuchRoute(f"{path}: no such route here (docs/http.md lists them)"))

        return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def _code(error: BaseException | None) -> str:
    """The status's name, as gRPC's accounting names it."""
    if error is None:
        return "OK"
    if isinstance(error, LogprobError):
        return error.code.name
    return "INTERNAL" if isinstance(error, Exception) and not isinstance(error, CallerGone) else "CANCELLED"


def _level(code: str) -> int:
    """As gRPC's accounting: DEBUG when answered, INFO when the caller hung up, ERROR for a bug,
    else WARNING."""
    levels = {"OK": logging.DEBUG, "CANCELLED": logging.INFO, "INTERNAL": logging.ERROR}
    return levels.get(code, logging.WARNING)


def _account(
    path: str, request_id: str, model: str, answer: RouteAnswer | None, error: BaseException | None, elapsed_ns: int
) -> None:
    code = _code(error)
    metrics.observe_request(model, path, code, "http")
    level = _level(code)
    if not log.isEnabledFor(level):
        return
    fields: dict[str, object] = {"rpc": path, "protocol": "http", "status": code, "request_id": shown_id(request_id)}
    if model:
        fields["model"] = model
    if client := current_client():
        fields["client"] = client
    result = answer.result if answer is not None else None
    if result is not None:
        fields |= {
            "model": result.model,
            "sequences": len(result.scores),
            "tokens": result.tokens,
            "queue_ms": round(result.timings.queue_ns / 1e6, 3),
            "compute_ms": round(result.timings.compute_ns / 1e6, 3),
            "total_ms": round(result.timings.total_ns / 1e6, 3),
        }
    else:
        fields["total_ms"] = round(elapsed_ns / 1e6, 3)
    if isinstance(error, LogprobError):
        fields["error"] = error.message
    elif code == "CANCELLED":
        fields["error"] = "the caller hung up" if isinstance(error, CallerGone) else "the server stopped the call"
    elif error is not None:
        fields["error"] = f"{type(error).__name__}: {error}"
    log.log(
        level,
        "answered" if error is None else "failed",
        extra={"fields": fields},
        exc_info=error if code == "INTERNAL" else None,
    )
