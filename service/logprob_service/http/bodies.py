"""Parsing request bodies, and the checks every peer's route shares: a request asks for prompt
log-probs only (nothing generated), of a served model.

Bodies are parsed by pydantic in strict mode (a token id is a JSON integer, never ``2.0`` or
``"2"``); unknown fields are ignored, as the peers' servers ignore sampling fields that do not
apply. The first complaint becomes an ``InvalidArgument`` naming the field and its index.

Before it is parsed, a body's JSON arrays, objects and strings are counted (``PartCount``: each
chunk once as it comes in, vectorized) and it is refused if it holds more than a request
within the limits could: pydantic makes a Python object of each, and a 6 MB body of a million
``[1,2]`` took 12 s to parse and turn into sequences, on the event loop every caller shares. The
edge stops reading a body once its count passes what any route allows (``most_parts`` with the
rows ``positions`` gives), so a body of a million sequences costs the loop its first tenth, once,
not a copy and counts of all of it for each time it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from logprob_service.engine import LogprobEngine, RequestLimits
from logprob_service.errors import InvalidArgument
from logprob_service.http.errors import invalid_body

Parsed = TypeVar("Parsed", bound=BaseModel)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# JSON arrays, objects and strings a body may hold for each sequence the limit allows (its ids,
# its candidate ids, a SGLang input's sampling_params with its keys and its rid: about 15), and
# for the request around them; ``parse`` adds the rows a request may send for each position.
PARTS_PER_SEQUENCE = 32
PARTS_PER_REQUEST = 256
_OPEN_ARRAY, _OPEN_OBJECT, _QUOTE = b'[{"'


class PartCount:
    """A body's JSON arrays, objects and strings, counted chunk by chunk as it is read."""

    def __init__(self) -> None:
        self.brackets = self.quotes = 0

    def add(self, chunk: bytes) -> None:
        # numpy's comparisons are vectorized: 3-4x faster than bytes.count's loop.
        codes = np.frombuffer(chunk, np.uint8)
        self.brackets += int(np.count_nonzero(codes == _OPEN_ARRAY)) + int(np.count_nonzero(codes == _OPEN_OBJECT))
        self.quotes += int(np.count_nonzero(codes == _QUOTE))

    @property
    def parts(self) -> int:
        return self.brackets + self.quotes // 2


@dataclass(frozen=True)
class Body:
    """A request body as the edge read it: its bytes and their count of JSON parts (``PartCount``);
    ``whole`` False when the edge stopped reading once the count passed what any route allows
    (``data`` is then empty: it is refused unparsed)."""

    data: bytes
    parts: int
    whole: bool = True
    read_bytes: int = 0  # of a body not read whole: how many bytes were counted


def most_parts(limits: RequestLimits, rows: int = 0) -> int:
    """The most JSON arrays, objects and strings a body within ``limits`` holds, with ``rows``
    further lists (one for each position a route may take a row of ids for)."""
    return PARTS_PER_SEQUENCE * limits.max_sequences_per_request + rows + PARTS_PER_REQUEST


def positions(engine: LogprobEngine) -> int:
    """The most positions one sequence may have: the served models' longest, else the token limit
    (``/inference/v1/generate`` may send a row of candidate ids for each)."""
    longest = [info.max_positions for info in engine.models() if info.max_positions is not None]
    return max(longest) if longest else engine.limits.max_tokens_per_request


def parse(body: Body, model: type[Parsed], limits: RequestLimits, field: str, rows: int = 0) -> Parsed:
    """``body`` as ``model``; refused unparsed (``InvalidArgument`` naming ``field``, the count and
    the limit) when it holds more JSON arrays, objects and strings than a request within
    ``limits`` and ``rows`` further lists could. Strings' brackets count too: no peer sends any."""
    most = most_parts(limits, rows)
    if body.parts > most:
        held = (
            f"{body.parts}"
            if body.whole
            else f"at least {body.parts} (in its first {body.read_bytes} bytes, where the edge stopped reading)"
        )
        raise InvalidArgument(
            f"{field}: the body holds {held} JSON arrays, objects and strings, more than the {most} a request "
            f"within max_sequences_per_request ({limits.max_sequences_per_request}) may; refused unparsed"
        )
    try:
        return model.model_validate_json(body.data or b"{}")
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
