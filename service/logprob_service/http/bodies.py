"""Parsing request bodies, and the checks every peer's route shares: a request asks for prompt
log-probs only (nothing generated), of a served model.

Bodies are parsed by pydantic in strict mode (a token id is a JSON integer, never ``2.0`` or
``"2"``); unknown fields are ignored, as the peers' servers ignore sampling fields that do not
apply. The first complaint becomes an ``InvalidArgument`` naming the field and its index.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from logprob_service.engine.engine import LogprobEngine
from logprob_service.errors import InvalidArgument
from logprob_service.http.errors import invalid_body

Body = TypeVar("Body", bound=BaseModel)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def parse(body: bytes, model: type[Body]) -> Body:
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
