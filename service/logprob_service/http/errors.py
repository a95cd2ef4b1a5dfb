"""The one table from the server's error codes to HTTP statuses, the JSON error body, and the
engine's field names rewritten as the caller's request named them.

Every error body is ``{"error": {"message", "type", "param", "code"}}``: the shape vLLM's
OpenAI-compatible server answers (the ``openai`` package reads ``error.message``), ``type`` the
error code's name (as gRPC's status names it), ``param`` the request field at fault (or null),
``code`` the HTTP status.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from logprob_service.errors import ErrorCode, InvalidArgument, LogprobError, Overloaded

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.FAILED_PRECONDITION: 409,
    ErrorCode.ABORTED: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.INTERNAL: 500,
}


class BodyTooLarge(InvalidArgument):
    """A request body over ``http_max_body_bytes``, refused before any of it is parsed."""

    status = 413


class BodyTooSlow(LogprobError):
    """A request body not all sent within ``http_body_timeout_s``."""

    code = ErrorCode.DEADLINE_EXCEEDED
    status = 408


class BodiesBuffered(Overloaded):
    """A body that would take the bytes the edge holds of all bodies past ``http_max_buffered_body_bytes``."""

    status = 503


class CallerGone(Exception):
    """The caller hung up before its answer (its work, if any, was dropped): nothing goes back."""


class NoSuchRoute(LogprobError):
    code = ErrorCode.NOT_FOUND


class MethodNotAllowed(LogprobError):
    code = ErrorCode.INVALID_ARGUMENT
    status = 405


def http_status(err: LogprobError) -> int:
    """``err``'s status: its code's, unless its class says a more precise one (405, 408, 413, 503)."""
    return getattr(err, "status", None) or HTTP_STATUS[err.code]


def _param(message: str) -> str | None:
    """The field an InvalidArgument's message names first (every message starts "field: ...")."""
    field, sep, _ = message.partition(": ")
    return field if sep and " " not in field else None


def error_body(err: LogprobError) -> dict[str, Any]:
    param = _param(err.message) if isinstance(err, InvalidArgument) else None
    return {"error": {"message": err.message, "type": err.code.name, "param": param, "code": http_status(err)}}


# Union members in pydantic's error locations ("list[int]", "int"): how the model was tried, not
# where the caller's value is.
_TYPE_TAGS = {"int", "float", "bool", "str", "dict", "list", "none", "function-after", "function-before"}


def _location(loc: Sequence[int | str]) -> str:
    where = ""
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS:
            continue
        else:
            where += f".{part}" if where else part
    return where or "body"


def invalid_body(err: ValidationError) -> InvalidArgument:
    """The first of pydantic's complaints about a request body, as an InvalidArgument naming the
    field (with its index) and what was wrong."""
    # Of a union's members (a prompt is ids, or lists of ids), the complaint that got deepest into
    # the value names the field best: "prompt[1][1]", not "prompt[0] should be an integer".
    errors = err.errors(include_url=False)
    first = max(errors, key=lambda e: len(e["loc"]))
    where = _location(first["loc"])
    if first["type"] == "json_invalid":
        return InvalidArgument(f"body: not JSON ({first['msg'].removeprefix('Invalid JSON: ')})")
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return InvalidArgument(f"{where}: {first['msg'][0].lower()}{first['msg'][1:]} (got {shown})")


@dataclass(frozen=True)
class Naming:
    """How the caller's request named what the engine checks, to rewrite the engine's messages:
    the engine's ``sequences[i]`` is ``items[i] = (field, offset, candidates, rows)`` (its
    prompt's token ``j`` is ``field[j]``, its completion's ``field[offset + j]``, its candidate ids
    the list ``candidates`` shared by every position when ``rows`` is None, else that list's row
    ``t - rows`` for position ``t``), ``sequences`` the whole ``batch``, ``top_k`` the request's
    top-k field."""

    items: Sequence[tuple[str, int, str, int | None]]
    batch: str
    temperature: str = "temperature"
    top_k: str = "top_k"

    _SEQUENCE = re.compile(r"^sequences\[(\d+)\](?:\.(prompt_ids|completion_ids|candidate_ids)(?:\[(\d+)\])?)?")

    def rename(self, message: str) -> str:
        for engine_field, field in (("temperature", self.temperature), ("top_k", self.top_k)):
            if message.startswith(f"{engine_field}:"):
                return field + message.removeprefix(engine_field)
        match = self._SEQUENCE.match(message)
        if match is None:
            return self.batch + message.removeprefix("sequences") if message.startswith("sequences:") else message
        field, offset, candidates, rows = self.items[int(match[1])]
        if match[2] == "candidate_ids":
            if rows is not None and match[3] is not None:  # rows before the request's own copy its first
                candidates += f"[{max(int(match[3]) - rows, 0)}]"
            return candidates + message[match.end() :]
        if match[3] is not None:
            field += f"[{int(match[3]) + (offset if match[2] == 'completion_ids' else 0)}]"
        return field + message[match.end() :]

    def renamed(self, err: InvalidArgument) -> InvalidArgument:
        return InvalidArgument(self.rename(err.message))
