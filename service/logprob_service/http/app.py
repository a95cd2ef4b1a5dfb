"""The HTTP edge's ASGI application (Starlette): every route through one wrapper that does what the
gRPC edge's interceptors do, and the peers' routes (``vllm``, ``sglang``, ``trl``) beside it.

The wrapper, for every request:

1. checks the bearer token (``security.bearer_tokens.check_bearer``, as gRPC does; every route but
   the health checks needs scope ``score``) and sets the client identity (the token's name, else
   the caller's IP address) that the fair share counts;
2. reads the body, refusing one over ``http_max_body_bytes`` (413) by its Content-Length, or as
   it arrives, before any of it is parsed;
3. runs the route, which parses the body, calls the engine facade and encodes the answer;
4. maps what the route raises to a status and a JSON error body (``errors``): a
   ``LogprobError`` is the caller's to act on; anything else is a bug, answered 500 with the
   request id its log line (with the traceback) carries, and the server serves on;
5. accounts for the request once: ``logprob_requests_total{protocol="http"}`` and one log line on
   the ``logprob_service.requests`` logger, as the gRPC edge's ``accounting`` does.

Unknown paths get 404 and a wrong method 405, with the same JSON error body.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pydantic_core
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from logprob_service.domain import ScoreResult
from logprob_service.engine.engine import LogprobEngine
from logprob_service.errors import ErrorCode, InvalidArgument, LogprobError
from logprob_service.http.errors import BodyTooLarge, MethodNotAllowed, NoSuchRoute, error_body, http_status
from logprob_service.observability import metrics
from logprob_service.security.bearer_tokens import Scope, TokenTable, check_bearer
from logprob_service.security.caller import current_client, set_client

log = logging.getLogger("logprob_service.requests")

JSON = "application/json"


@dataclass
class Call:
    """One request as a route sees it: its body, read whole, and what the wrapper knows of it."""

    engine: LogprobEngine
    body: bytes
    request_id: str
    deadline: float | None  # time.monotonic() from the X-Request-Timeout header (seconds), if sent
    request: Request
    model: str = ""  # the model the request scores with, once the route knows it

    @property
    def client(self) -> str:
        return current_client()


@dataclass
class Answer:
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


Handler = Callable[[Call], Awaitable[Answer]]


def json_error(err: LogprobError, request_id: str = "") -> Response:
    headers = {"x-request-id": request_id} if request_id else {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after_s)))
    if err.code is ErrorCode.UNAUTHENTICATED:
        headers["www-authenticate"] = "Bearer"
    content = pydantic_core.to_json(error_body(err))
    return Response(content, status_code=http_status(err), media_type=JSON, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"body: {int(declared)} bytes exceed the limit of {limit} bytes (http_max_body_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body: more than the limit of {limit} bytes (http_max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _deadline(request: Request) -> float | None:
    text = request.headers.get("x-request-timeout")
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InvalidArgument(f"X-Request-Timeout: {text!r} is not a number of seconds > 0")
    return time.monotonic() + seconds


class Edge:
    """The routes over ``engine``, with ``tokens``' authentication (None: off)."""

    def __init__(self, engine: LogprobEngine, tokens: TokenTable | None, max_body_bytes: int) -> None:
        self.engine = engine
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes

    def route(
        self, path: str, handler: Handler, *, methods: tuple[str, ...] = ("POST",), scope: Scope | None = "score"
    ) -> Route:
        """A Starlette route of ``handler`` at ``path``; ``scope``: what a token needs (None: open,
        and not accounted for: the health checks, which gRPC does not count either)."""

        async def endpoint(request: Request) -> Response:
            start = time.perf_counter_ns()
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            answer: Answer | None = None
            call: Call | None = None
            error: BaseException | None = None
            try:
                set_client(request.client.host if request.client is not None else "")
                if self.tokens is not None and scope is not None:
                    principal = check_bearer(self.tokens, request.headers.get("authorization"), path, scope, "header")
                    set_client(principal.name)
                deadline = _deadline(request)
                body = await read_body(request, self.max_body_bytes) if request.method == "POST" else b""
                call = Call(self.engine, body, request_id, deadline, request)
                answer = await handler(call)
                return answer.response(request_id)
            except LogprobError as err:
                error = err
                return json_error(err, request_id)
            except Exception as err:  # a bug: the caller gets its log line's request id, never its words
                error = err
                what = f"internal error ({type(err).__name__}); request_id={request_id} is in the server log"
                return json_error(LogprobError(what), request_id)
            except BaseException as err:  # the caller hung up (its job was cancelled): no answer goes
                error = err
                raise
            finally:
                if scope is not None:
                    model = answer.model if answer is not None else call.model if call is not None else ""
                    _account(path, request_id, model, answer, error, time.perf_counter_ns() - start)

        return Route(path, endpoint, methods=list(methods))

    def app(self, routes: list[Route]) -> Starlette:
        async def not_found(request: Request, exc: HTTPException) -> Response:
            path = request.url.path
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
    return "INTERNAL" if isinstance(error, Exception) else "CANCELLED"


def _account(
    path: str, request_id: str, model: str, answer: Answer | None, error: BaseException | None, elapsed_ns: int
) -> None:
    code = _code(error)
    metrics.observe_request(model, path, code, "http")
    level = logging.DEBUG if error is None else logging.ERROR if code == "INTERNAL" else logging.WARNING
    if not log.isEnabledFor(level):
        return
    fields: dict[str, object] = {"rpc": path, "protocol": "http", "status": code, "request_id": request_id}
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
    if error is not None:
        fields["error"] = error.message if isinstance(error, LogprobError) else f"{type(error).__name__}: {error}"
    log.log(
        level,
        "answered" if error is None else "failed",
        extra={"fields": fields},
        exc_info=error if code == "INTERNAL" else None,
    )
