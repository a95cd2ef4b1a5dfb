"""Every answer of the HTTP edge, for each option its route takes, checked against the engine's own
models: vLLM 0.33.0's pydantic classes (``CompletionResponse``, ``GenerateTokensResponse``,
``ModelList``, ``ErrorResponse``), TRL 1.9.0's ``SequenceLogprobsResponse`` and SGLang 0.5.23's
``/generate`` JSON contract (``sglang/api/v1/api_types.py``), as JSON Schemas that
``scripts/engine_schemas.py`` wrote from the pinned releases (tests/http/schemas/; the engines are
not installed here). The requests docs/http.md documents must pass the engines' request models.

Beyond the models, the keys and their order: vLLM answers ``model.model_dump()`` (every field, in
the class's order), TRL's JSON answer goes through FastAPI's ``response_model`` (every field too),
and SGLang's ``meta_info`` is a dict its tokenizer manager fills key by key (``SGLANG_META``).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest

from tests.helpers.processes import ROOT
from tests.http.conftest import VOCAB

SCHEMAS = Path(__file__).parent / "schemas"


@cache
def schema(file: str, name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / file).read_text())["schemas"][name]


VLLM = "vllm-0.33.0.json"
TRL = "trl-1.9.0.json"
SGLANG = "sglang-0.5.23.json"


def random_sequences(rng: np.random.Generator, n: int, low: int, high: int) -> list[list[int]]:
    return [rng.integers(1, VOCAB, int(rng.integers(low, high))).tolist() for _ in range(n)]


def valid(answer: Any, file: str, name: str) -> None:
    jsonschema.Draft202012Validator(schema(file, name)).validate(answer)


def every_field_in_order(value: Any, node: dict[str, Any], root: dict[str, Any], where: str = "") -> None:
    """Each object of ``value`` whose schema lists its properties has all of them, in their order
    (a pydantic model dumped whole); ``dict[int, X]`` keys (vLLM's ``prompt_logprobs``) are ids."""
    while "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in node:
        for arm in node["anyOf"]:
            if jsonschema.Draft202012Validator({**arm, "$defs": root.get("$defs", {})}).is_valid(value):
                every_field_in_order(value, arm, root, where)
                return
        return
    if isinstance(value, dict) and "properties" in node:
        assert list(value) == list(node["properties"]), where or "the answer"
        for key, item in value.items():
            every_field_in_order(item, node["properties"][key], root, f"{where}.{key}")
    elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        for key, item in value.items():
            if node is not root and "Logprob" in json.dumps(node["additionalProperties"]):
                assert re.fullmatch(r"\d+", key), f"{where}: key {key!r} is no token id"
            every_field_in_order(item, node["additionalProperties"], root, f"{where}[{key}]")
    elif isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            every_field_in_order(item, node["items"], root, f"{where}[{i}]")


def as_vllm(answer: Any, name: str) -> None:
    valid(answer, VLLM, name)
    every_field_in_order(answer, schema(VLLM, name), schema(VLLM, name))


async def post(served, path: str, body: dict, status: int = 200) -> Any:
    async with httpx.AsyncClient(base_url=served.base) as session:
        response = await session.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


# ------------------------------------------------------------------------------------- vLLM


# Each test below starts one server and sends it each of its options in turn (a server a case
# would cost ten times the checks).


async def test_vllm_completions_answer_is_a_completion_response(served, rng):
    sequences = random_sequences(rng, 3, low=1, high=12)
    sequences[0] = sequences[0][:1]  # one token: prompt_logprobs [null]
    for options in (
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 3},
        {"prompt_logprobs": 3, "echo": True, "temperature": 0.7},
        {"prompt_logprobs": 0, "max_tokens": 0, "prompt": sequences[1]},
    ):
        body = {"model": "default", "prompt": sequences, "max_tokens": 1} | options
        as_vllm(await post(served, "/v1/completions", body), "CompletionResponse")


async def test_vllm_generate_answer_is_a_generate_tokens_response(served, rng):
    (tokens,) = random_sequences(rng, 1, low=6, high=12)
    for params in (
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 2},
        {"prompt_logprob_token_ids": [5, 7], "prompt_logprob_start": 2},
        {"prompt_logprob_token_ids": [[1, 2]] * (len(tokens) - 1), "prompt_logprobs": 1},
    ):
        body = {"model": "default", "token_ids": tokens, "sampling_params": {"max_tokens": 1} | params}
        as_vllm(await post(served, "/inference/v1/generate", body), "GenerateTokensResponse")


async def test_vllm_models_and_errors(served):
    async with httpx.AsyncClient(base_url=served.base) as session:
        as_vllm((await session.get("/v1/models")).json(), "ModelList")
        refused = await session.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 0, "n": 2})
    assert refused.status_code == 400
    as_vllm(refused.json(), "ErrorResponse")
    valid(refused.json()["error"], SGLANG, "ErrorBody")  # what SGLang's clients read of an error


# ------------------------------------------------------------------------------------- SGLang

# SGLang 0.5.23's meta_info of a finished /generate input, key by key as its tokenizer manager
# writes them on the default server (no --enable-metrics, no speculative decoding, one DP rank):
# ``tokenizer_manager.py`` ``_handle_batch_output`` (id .. num_retractions; the log-prob keys by
# ``add_logprob_to_meta_info``; reasoning_tokens, completion_tokens, cached_tokens;
# ``add_weight_versions_to_meta_info``'s weight_versions; cached_tokens_details, None without a
# cache hit; dp_rank; e2e_latency once finished) and ``_wait_one_response``
# (response_sent_to_client_ts).
SGLANG_META = {
    "head": ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"],
    "logprobs": ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"],
    "top": ["input_top_logprobs", "output_top_logprobs"],
    "token_ids": ["input_token_ids_logprobs", "output_token_ids_logprobs"],
    "tail": ["reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions", "cached_tokens_details",
             "dp_rank", "e2e_latency", "response_sent_to_client_ts"],
}  # fmt: skip


def as_sglang(answer: dict, top: bool, token_ids: bool) -> None:
    valid(answer, SGLANG, "GenerateResponse")
    assert list(answer) == ["text", "output_ids", "meta_info"]
    meta = answer["meta_info"]
    keys = SGLANG_META["head"] + SGLANG_META["logprobs"]
    keys += (SGLANG_META["top"] if top else []) + (SGLANG_META["token_ids"] if token_ids else [])
    assert list(meta) == keys + SGLANG_META["tail"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["num_retractions"] == meta["reasoning_tokens"] == meta["completion_tokens"] == 0
    assert meta["output_token_logprobs_length"] == 0 and meta["cached_tokens"] == 0
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 0}]
    assert meta["cached_tokens_details"] is None and meta["dp_rank"] == 0
    assert 0 < meta["e2e_latency"] < 60 and meta["response_sent_to_client_ts"] > 1.7e9


async def test_sglang_generate_answer_is_sglangs(served, rng):
    batch = random_sequences(rng, 2, low=5, high=12)
    for options in (
        {"logprob_start_len": 0},
        {"logprob_start_len": 3, "top_logprobs_num": 2},
        {"logprob_start_len": 0, "token_ids_logprob": [5, 7], "rid": "mine"},
        {"logprob_start_len": [0, 4], "top_logprobs_num": 2, "token_ids_logprob": [5], "input_ids": batch},
    ):
        body = {"input_ids": batch[0], "return_logprob": True, "sampling_params": {"max_new_tokens": 0}} | options
        answers = await post(served, "/generate", body)
        for answer in answers if isinstance(answers, list) else [answers]:
            as_sglang(answer, top="top_logprobs_num" in options, token_ids="token_ids_logprob" in options)
        if "rid" in options:
            assert answers["meta_info"]["id"] == "mine"
    error = await post(served, "/generate", {"input_ids": [1, 2], "return_logprob": False}, status=400)
    valid(error["error"], SGLANG, "ErrorBody")


# ------------------------------------------------------------------------------------- TRL


async def test_trl_answer_is_a_sequence_logprobs_response(served, rng):
    sequences = random_sequences(rng, 3, low=3, high=10)
    model = schema(TRL, "SequenceLogprobsResponse")
    for top_logprobs in (0, 3):
        for response_format in ("json", "binary"):
            body = {"sequences": sequences, "prompt_lengths": [0, 1, 2], "top_logprobs": top_logprobs,
                    "response_format": response_format}  # fmt: skip
            answer = await post(served, "/get_sequence_logprobs/", body)
            valid(answer, TRL, "SequenceLogprobsResponse")
            if response_format == "json":  # FastAPI's response_model writes every field
                every_field_in_order(answer, model, model)
            else:  # TRL's own payload, sent as it is (orjson)
                assert list(answer) == ["logprobs_b64", "token_ids_b64", "actual_logprobs_b64",
                                        "actual_token_ids_b64", "shape", "completion_lengths"]  # fmt: skip


# ------------------------------------------------------------------------------------- requests


def documented_requests() -> dict[str, dict]:
    """The first JSON block under each ``### `POST <route>``` heading of docs/http.md: its request."""
    text = (ROOT / "docs" / "http.md").read_text()
    found = {}
    for route, section in re.findall(r"### `POST (\S+)`.*?\n(.*?)(?=\n### |\n## )", text, flags=re.DOTALL):
        found[route] = json.loads(re.search(r"```json\n(.*?)```", section, flags=re.DOTALL).group(1))
    return found


REQUEST_MODELS = {
    "/v1/completions": (VLLM, "CompletionRequest"),
    "/inference/v1/generate": (VLLM, "GenerateRequest"),
    "/generate": (SGLANG, "GenerateRequest"),
    "/get_sequence_logprobs/": (TRL, "SequenceLogprobsRequest"),
}


@pytest.mark.parametrize("route", list(REQUEST_MODELS))
def test_documented_requests_pass_the_engines_request_models(route):
    file, name = REQUEST_MODELS[route]
    valid(documented_requests()[route], file, name)


def test_peers_requests_pass_the_engines_request_models():
    """The bodies the peers' own code sends (test_peers.py has them verbatim; prime-rl's is the
    one docs/http.md shows)."""
    trl_1_16 = {"model": "default", "prompt": [[1, 2, 3]], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    valid(trl_1_16, VLLM, "CompletionRequest")
    slime = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0,
             "sampling_params": {"temperature": 0.8, "max_new_tokens": 0, "skip_special_tokens": False}}  # fmt: skip
    valid(slime, SGLANG, "GenerateRequest")
