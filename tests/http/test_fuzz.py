"""Fuzzing each HTTP scoring route's JSON with hypothesis: no body gets a 5xx.

Bodies are a valid body of each route with up to three of its fields, any field of the route's
own request model (its JSON schema, nested objects' fields too), drawn from its type (now and
then any other JSON value) or removed; integers from the edges of int32 and int64 and of
the vocabulary as well as small ones; lists short. So most get past the parser and into the
route's own checks and the engine's. Ids of 2^63 and more were a 500 (OverflowError) on every route,
list-valued per-input fields on a single ``/generate`` input too. The server runs on the test's
event loop; hypothesis drives it from a worker thread with a blocking client. The examples are
derandomized and bounded, so the file runs in seconds.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from logprob_service.http import sglang, trl, vllm
from pydantic import BaseModel

from tests.http.conftest import VOCAB

FUZZ = settings(
    max_examples=80,
    deadline=None,  # a busy CI core makes single examples slow; the example count bounds the time
    database=None,
    derandomize=True,  # the same examples every run: a failure is a bug to replay, never chance
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
EDGES = [0, 1, 2, -1, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]
INTS = st.one_of(st.integers(0, 40), st.sampled_from(EDGES))
FLOATS = st.one_of(st.sampled_from([0.0, 1.0, 0.5, -1.0, 1e-40, 1e39]), st.floats(allow_nan=False))
ANY_JSON = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
# Each route's request model and a body it scores.
ROUTES: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "/v1/completions": (
        vllm.CompletionRequest,
        {"model": "default", "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0},
    ),
    "/inference/v1/generate": (
        vllm.GenerateRequest,
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}},
    ),
    "/generate": (
        sglang.GenerateRequest,
        {
            "input_ids": [1, 2, 3],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    ),
    "/get_sequence_logprobs/": (
        trl.SequenceLogprobsRequest,
        {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "top_logprobs": 0},
    ),
}


# Bodies that were a 500, sent as explicit cases besides the drawn ones.
FOUND = {
    "/v1/completions": [{"prompt": [1, 2**63]}, {"prompt": [[1, 2], [3, -(2**64)]]}],
    "/inference/v1/generate": [{"token_ids": [2**63, 1]}, {"sampling_params": {"prompt_logprob_token_ids": [2**64]}}],
    "/generate": [
        {"input_ids": [1, 2**63]},
        {"token_ids_logprob": [2**63]},
        {"sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 0}]},
        {"top_logprobs_num": [1, 2]},
        {"logprob_start_len": [0, 1]},
    ],
    "/get_sequence_logprobs/": [{"sequences": [[1, 2**63, 3]]}],
}


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy:
    """Values of ``schema`` (a pydantic model's JSON schema, ``defs`` its definitions), and now and
    then any JSON value instead."""
    return st.one_of(_typed(schema, defs), _typed(schema, defs), _typed(schema, defs), ANY_JSON)


def _typed(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: _typed(defs[name], defs))
    if "anyOf" in schema:
        return st.one_of([_typed(option, defs) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        fields = {name: from_schema(field, defs) for name, field in schema.get("properties", {}).items()}
        return st.fixed_dictionaries({}, optional=fields)
    if kind == "array":
        return st.lists(_typed(schema.get("items", {}), defs), max_size=6)
    return {
        "integer": INTS,
        "number": FLOATS,
        "string": st.text(max_size=8),
        "boolean": st.booleans(),
        "null": st.none(),
    }.get(kind, ANY_JSON)


def _object(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """The object schema ``schema`` is, or is one option of (None: none)."""
    if "$ref" in schema:
        return _object(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if schema.get("type") == "object":
        return schema
    return next(filter(None, (_object(option, defs) for option in schema.get("anyOf", ()))), None)


def _fields(schema: dict[str, Any], defs: dict[str, Any], at: tuple[str, ...] = ()) -> list[tuple[tuple, dict]]:
    """Every field of an object schema, nested objects' fields too: (its path, its schema)."""
    found = []
    for name, field in (_object(schema, defs) or {}).get("properties", {}).items():
        found.append(((*at, name), field))
        if _object(field, defs) is not None:
            found += _fields(field, defs, (*at, name))
    return found


@st.composite
def bodies(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """The route's valid body with up to 3 of its fields (nested ones too) drawn or removed."""
    model, valid = ROUTES[path]
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    fields = _fields(schema, defs)
    body = copy.deepcopy(valid)
    for _ in range(draw(st.integers(0, 3))):
        keys, field = draw(st.sampled_from(fields))
        parent = body
        for key in keys[:-1]:
            parent = parent.setdefault(key, {})
        if not isinstance(parent, dict):
            continue  # an earlier change made the object something else
        if draw(st.integers(0, 5)) == 0:
            parent.pop(keys[-1], None)
        else:
            parent[keys[-1]] = draw(from_schema(field, defs))
    return body


@pytest.mark.parametrize("path", list(ROUTES))
async def test_no_body_gets_a_5xx(served, path):
    def check(http: httpx.Client, body: dict[str, Any]) -> None:
        answer = http.post(path, json=body)
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        assert answer.status_code < 500, (body, answer.status_code, answer.text[:500])
        if answer.status_code != 200:
            assert answer.json()["error"]["message"], answer.text

    _, valid = ROUTES[path]
    for changes in FOUND[path]:
        body = copy.deepcopy(valid)
        for name, value in changes.items():  # a nested field's change keeps the object's other fields
            merge = isinstance(body.get(name), dict) and isinstance(value, dict)
            body[name] = {**body[name], **value} if merge else value
        check = example(body=body)(check)
    check = FUZZ(given(body=bodies(path))(check))

    def run() -> None:
        with httpx.Client(base_url=served.base, timeout=60) as http:
            check(http)

    statuses: dict[int, int] = {}
    await asyncio.to_thread(run)
    assert statuses.get(200, 0) >= 5, statuses  # the fuzzing reaches scoring, not only the parser
    assert served.running.service.device_side.scheduler.admission.queued_tokens == 0, "fuzzed requests left work queued"
    async with httpx.AsyncClient(base_url=served.base) as http:
        body = {"model": "default", "max_tokens": 1, "prompt_logprobs": 0, "prompt": [1, 2, 3]}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
