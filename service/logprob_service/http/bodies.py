"""Parsing request bodies, and the checks every peer's route shares: a request asks for prompt
log-probs only (nothing generated), of a served model.

Bodies are parsed by pydantic in strict mode (a token id is a JSON integer, never ``2.0`` or
``"2"``); unknown fields are ignored, as the peers' servers ignore sampling fields that do not
apply. The first complaint becomes an ``InvalidArgument`` naming the field and its index.

Before it is parsed, a body's JSON arrays, objects and strings are counted (``bytes.count``, in
C: milliseconds for the largest body) and it is refused if it holds more than a request within
the limits could: pydantic makes a Python object of each, and a 6 MB body of a million ``[1,2]``
took 12 s to parse and turn into sequences, on the event loop every caller shares.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from logprob_service.engine import LogprobEngine, RequestLimits
from logprob_service.errors import InvalidArgument
from logprob_service.http.errors import invalid_body

Body = TypeVar("Body", bound=BaseModel)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# JSON arrays, objects and strings a body may hold for each sequence the limit allows (its ids,
# its candidate ids, a SGLang input's sampling_params with its keys and its rid: about 15), and
# for the request around them; ``parse`` adds the rows a request may send for each position.
PARTS_PER_SEQUENCE = 32
PARTS_PER_REQUEST = 256


def parse(body: bytes, model: type[Body], limits: RequestLimits, field: str, rows: int = 0) -> Body:
    """``body`` as ``model``; refused unparsed (``InvalidArgument`` naming ``field``, the count and
    the limit) when it holds more JSON arrays, objects and strings than a request within
    ``limits`` and ``rows`` further lists could. Strings' brackets count too: no peer sends any."""
    most = PARTS_PER_SEQUENCE * limits.max_sequences_per_request + rows + PARTS_PER_REQUEST
    parts = body.count(b"[") + body.count(b"{") + body.count(b'"') // 2
    if parts > most:
        raise InvalidArgument(
            f"{field}: the body holds {parts} JSON arrays, objects and strings, more than the {most} a request "
            f"within max_sequences_per_request ({limits.max_sequences_per_request}) may; refused unparsed"
        )
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise invalid_body(err) from None


def served_model(engine: LogprobEngine, name: str | None) -> str:
    """The model a request names; without one, the first served (as vLLM takes its one model).
    A name not served is the engine's NOT_FOUND when it scores."""
    return name or engine.models()[0].name


def generates_none(body: BaseModel, name: str, field: str, allowed: tuple[int, ...]) -> None:
    """``body.<name>`` (named ``field`` in errors; the peer's default when absent) must ask for no
    more generated tokens than ``allowed``: this server scores what it is sent and generates nothing."""
    value = getattr(body, name)
    if value in allowed:
        return
    shown = f"{value}" if name in body.model_fields_set else f"absent (the peer's default: {value})"
    raise InvalidArgument(
        f"{field}: {shown}; this server scores prompts but does not generate: "
        f"send {' or '.join(map(str, allowed))} with the log-prob fields"
    )


def text_refused(field: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: text needs a tokenizer; this server takes token ids (lists of ints)")


def no_streaming(stream: bool | None) -> None:
    if stream:
        raise InvalidArgument("stream: true; this server answers log-probs in one response (send false)")


def nonnegative(value: int, field: str) -> int:
    if value < 0:
        raise InvalidArgument(f"{field}: {value} must be >= 0")
    return value
