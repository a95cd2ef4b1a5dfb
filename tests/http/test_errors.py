"""Bad input through the HTTP edge: a 4xx with a JSON body naming the field (and the limit), never a
500; huge bodies refused by size before parsing; unknown routes; tokens missing, wrong or short of
scope; and requests in flight beside bad ones answered as if alone."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from tests.helpers.server import stop
from tests.http.conftest import VOCAB, serve_both
from tests.http.test_peers import bitwise, prompt_logprobs_by_grpc, random_sequences

COMPLETION = {"model": "default", "max_tokens": 1, "prompt_logprobs": 0}


def refusal(response: httpx.Response, status: int, param: str | None, *fragments: str) -> str:
    """The error's message, once checked: the status, the JSON body's shape, the field and what it says."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "fragments"),
    [
        ("/v1/completions", b"{not json", "body", ["not JSON"]),
        ("/v1/completions", b"[1, 2]", "body", ["should be an object"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2.5]}, "prompt[1]", ["valid integer", "2.5"]),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3, "4"]]}, "prompt[1][1]", ["valid integer"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, True]}, "prompt[1]", ["valid integer"]),
        ("/v1/completions", {**COMPLETION, "prompt": "hello"}, "prompt", ["tokenizer"]),
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt", ["empty"]),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], []]}, "prompt[1]", ["empty"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, VOCAB]}, "prompt[1]", [f"token id {VOCAB}", f"[0, {VOCAB})"]),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3, -1]]}, "prompt[1][1]", ["token id -1"]),
        # Ids past int64 were an OverflowError, a 500, on every route.
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2**63]}, "prompt[1]", ["outside int64's range"]),
        ("/v1/completions", {**COMPLETION, "prompt": [[1], [2, -(2**64)]]}, "prompt[1][1]", ["int64"]),
        (
            "/generate",
            {
                "input_ids": [[1, 3], [2, 2**70]],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 0},
                "logprob_start_len": 0,
            },
            "input_ids[1][1]",
            ["int64"],
        ),
        (
            "/generate",
            {
                "input_ids": [1, 2],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 0},
                "logprob_start_len": 0,
                "token_ids_logprob": [2**63],
            },
            "token_ids_logprob[0]",
            ["int64"],
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [2**64, 1], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}},
            "token_ids[0]",
            ["int64"],
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": [[5], [2**63]]}},
            "sampling_params.prompt_logprob_token_ids[1][0]",
            ["int64"],
        ),
        ("/get_sequence_logprobs/", {"sequences": [[1, 2**63]], "prompt_lengths": [1]}, "sequences[0][1]", ["int64"]),
        # List-valued per-input fields on a single input were a 500: one value, or a list of one.
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "max_tokens": 5}, "max_tokens", ["does not generate"]),
        ("/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 0}, "max_tokens", ["absent", "default: 16"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "prompt_logprobs": None}, "prompt_logprobs", ["absent"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "prompt_logprobs": 300}, "prompt_logprobs", ["[0, 256]"]),
        (
            "/v1/completions",
            {**COMPLETION, "prompt": [1, 2], "prompt_logprobs": -1},
            "prompt_logprobs",
            ["at most 256"],
        ),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "temperature": -1.0}, "temperature", [">= 1e-06"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "stream": True}, "stream", ["one response"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2], "model": 7}, "model", ["valid string"]),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2]] * 17}, "prompt", ["17 sequences", "limit of 16"]),
        ("/v1/completions", {**COMPLETION, "prompt": [1] * 4001}, "prompt", ["4001 tokens", "limit of 4000"]),
        ("/generate", {"input_ids": [1, 2], "return_logprob": True}, "sampling_params.max_new_tokens", ["128"]),
        (
            "/generate",
            {"input_ids": [1, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 8}},
            "sampling_params.max_new_tokens",
            ["does not generate"],
        ),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "text", ["tokenizer"]),
        *(
            (
                "/generate",
                {
                    "input_ids": [1, 2],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 0},
                    "logprob_start_len": 0,
                    field: value,
                },
                field,
                ["2 values for 1 inputs"],
            )
            for field, value in (
                ("sampling_params", [{"max_new_tokens": 0}, {"max_new_tokens": 0}]),
                ("top_logprobs_num", [1, 2]),
                ("rid", ["a", "b"]),
                ("logprob_start_len", [0, 1]),
            )
        ),
        (
            "/generate",
            {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": [True]},
            "return_logprob",
            ["1 values for 2 inputs"],
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True},
            "logprob_start_len",
            ["-1 is outside [0, 1]"],
        ),
        (
            "/generate",
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 1000,
            },
            "top_logprobs_num",
            ["1000 must lie in [0, 256]"],
        ),
        (
            "/generate",
            {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
                "token_ids_logprob": [5, VOCAB],
            },
            "token_ids_logprob[1]",
            [f"token id {VOCAB} (completion position 0)", f"[0, {VOCAB})"],
        ),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}, "sampling_params", []),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": [5, VOCAB + 1]}},
            "sampling_params.prompt_logprob_token_ids[1]",
            [f"token id {VOCAB + 1}"],
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": [[5], [6], [7]]}},
            "sampling_params.prompt_logprob_token_ids",
            ["3 rows of candidate ids for 2 scored positions"],
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": [[5], [6, 8]]}},
            "sampling_params.prompt_logprob_token_ids",
            ["rows of [1, 2] ids"],
        ),
        (
            "/get_sequence_logprobs/",
            {"sequences": [[1, 2, 3]], "prompt_lengths": [4], "top_logprobs": 0},
            "prompt_lengths[0]",
            ["4 is outside [0, 3]"],
        ),
        (
            "/get_sequence_logprobs/",
            {"sequences": [[1, 2, 3]], "prompt_lengths": [1, 1], "top_logprobs": 0},
            "prompt_lengths",
            ["2 lengths for 1 sequences"],
        ),
        (
            "/get_sequence_logprobs/",
            {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "top_logprobs": 257},
            "top_logprobs",
            ["257 must lie in [0, 256]"],
        ),
        (
            "/get_sequence_logprobs/",
            {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "top_logprobs": 0, "response_format": "npy"},
            "response_format",
            ["'json' or 'binary'"],
        ),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_field(served, path, body, param, fragments):
    async with httpx.AsyncClient(base_url=served.base) as http:
        sent = await (http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body))
    refusal(sent, 400, param, *fragments)


async def test_unknown_routes_and_methods_get_json_errors(served):
    async with httpx.AsyncClient(base_url=served.base) as http:
        refusal(await http.get("/v1/chat/completions"), 404, None, "no such route")
        refusal(await http.post("/update_weights", json={}), 404, None, "no such route")
        refusal(await http.get("/v1/completions"), 405, None, "method GET")


async def test_unknown_routes_and_methods_need_a_valid_token_first(authed):
    """With tokens configured a caller without a valid one learns nothing of the routes: 401 for
    every path and method; with one (of any scope), 404 and 405."""
    both, values = authed
    async with httpx.AsyncClient(base_url=both.base) as http:
        refusal(await http.get("/v1/chat/completions"), 401, None, "no credentials")
        refusal(await http.get("/v1/completions"), 401, None, "no credentials")
        wrong = {"authorization": "Bearer " + "x" * 40}
        refusal(await http.post("/update_weights", json={}, headers=wrong), 401, None, "not valid")
        for token in values.values():
            valid = {"authorization": f"Bearer {token}"}
            refusal(await http.get("/v1/chat/completions", headers=valid), 404, None, "no such route")
            refusal(await http.get("/v1/completions", headers=valid), 405, None, "method GET")


async def test_a_huge_body_is_refused_by_its_size_before_it_is_parsed(served, monkeypatch):
    """By its Content-Length at once, and a chunked body (no length) once it passes the limit;
    neither reaches the JSON parser."""
    limit = served.running.service.settings.http_max_body_bytes
    parsed = []
    import logprob_service.http.bodies as bodies

    original = bodies.parse
    monkeypatch.setattr(bodies, "parse", lambda *a: parsed.append(1) or original(*a))
    async with httpx.AsyncClient(base_url=served.base) as http:
        declared = await http.post("/v1/completions", content=b" " * (limit + 1))
        refusal(declared, 413, "body", f"{limit + 1} bytes exceed the limit of {limit} bytes")

        async def chunks():
            for _ in range(limit // 2**20 + 2):
                yield b" " * 2**20

        streamed = await http.post("/generate", content=chunks())
        refusal(streamed, 413, "body", f"limit of {limit} bytes")
        after = await http.get("/health")
    assert after.status_code == 200 and parsed == []


async def test_bad_requests_in_flight_leave_the_others_answered_as_alone(served, rng):
    """Good calls sent together with bad ones (all at once, over several connections) get the
    answers they get alone; no bad one is a 5xx."""
    sequences = random_sequences(rng, 6)
    alone = await prompt_logprobs_by_grpc(served, sequences)
    bad = [
        {**COMPLETION, "prompt": [1, VOCAB + 5]},
        {**COMPLETION, "prompt": "text"},
        {**COMPLETION, "prompt": [[1, 2]] * 40},
        {**COMPLETION, "prompt": [1, 2], "temperature": float("1e39")},
    ]
    async with httpx.AsyncClient(base_url=served.base) as http:
        calls = [http.post("/v1/completions", json={**COMPLETION, "prompt": [s]}) for s in sequences]
        calls += [http.post("/v1/completions", json=b) for b in bad] + [http.post("/generate", content=b"\xff")]
        answers = await asyncio.gather(*calls)
    for answer, want in zip(answers, alone):
        assert answer.status_code == 200, answer.text
        entries = answer.json()["choices"][0]["prompt_logprobs"][1:]
        bitwise([next(iter(e.values()))["logprob"] for e in entries], want)
    assert [a.status_code for a in answers[len(sequences) :]] == [400] * (len(bad) + 1)


async def test_a_bug_is_a_500_naming_the_log_line_and_the_server_serves_on(served, monkeypatch, caplog):
    from logprob_service.http import vllm

    def broken(*args):
        raise RuntimeError("secret /path/in/the/server")

    monkeypatch.setattr(vllm, "prompt_logprobs", broken)
    async with httpx.AsyncClient(base_url=served.base) as http:
        with caplog.at_level(logging.ERROR, logger="logprob_service.requests"):
            failed = await http.post(
                "/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3]}, headers={"x-request-id": "r-1"}
            )
        monkeypatch.undo()
        after = await http.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3]})
    message = refusal(failed, 500, None, "internal error (RuntimeError)", "request_id=r-1")
    assert "secret" not in message and after.status_code == 200
    assert any(r.exc_info and getattr(r, "fields", {}).get("request_id") == "r-1" for r in caplog.records)


def requests_counted(rpc: str, code: str) -> float:
    labels = {"model": "default", "rpc": rpc, "code": code, "protocol": "http"}
    return REGISTRY.get_sample_value("logprob_requests_total", labels) or 0.0


async def test_requests_are_counted_with_the_http_protocol(served):
    before = requests_counted("/v1/completions", "OK"), requests_counted("/v1/completions", "INVALID_ARGUMENT")
    async with httpx.AsyncClient(base_url=served.base) as http:
        assert (await http.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3]})).status_code == 200
        assert (await http.post("/v1/completions", json={**COMPLETION, "prompt": [1, VOCAB]})).status_code == 400
        await http.get("/health")
    assert requests_counted("/v1/completions", "OK") - before[0] == 1
    assert requests_counted("/v1/completions", "INVALID_ARGUMENT") - before[1] == 1
    assert (
        REGISTRY.get_sample_value(
            "logprob_requests_total", {"model": "", "rpc": "/health", "code": "OK", "protocol": "http"}
        )
        is None
    )


async def test_health_and_scoring_are_503_until_warm_and_while_draining():
    both = await serve_both(warm=False)
    body = {**COMPLETION, "prompt": [1, 2, 3]}
    try:
        async with httpx.AsyncClient(base_url=both.base) as http:
            cold = await http.get("/health")
            refusal(cold, 503, None, "server is starting")
            assert cold.headers["retry-after"] == "2"
            refusal(await http.post("/v1/completions", json=body), 503, None, "starting")
            await both.running.service.warm_up()
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/health_generate")).status_code == 200
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            await both.running.service.engine.draining()
            refusal(await http.get("/health"), 503, None, "draining")
            refusal(await http.post("/v1/completions", json=body), 503, None, "draining")
    finally:
        await stop(both.running)


async def test_a_bad_timeout_header_is_named(served):
    async with httpx.AsyncClient(base_url=served.base) as http:
        sent = await http.post(
            "/v1/completions", json={**COMPLETION, "prompt": [1, 2]}, headers={"x-request-timeout": "soon"}
        )
    refusal(sent, 400, "X-Request-Timeout", "'soon'")


async def test_tokens_missing_wrong_or_short_of_scope_are_401_or_403(authed, rng):
    both, values = authed
    body = {**COMPLETION, "prompt": [1, 2, 3]}
    async with httpx.AsyncClient(base_url=both.base) as http:
        missing = await http.post("/v1/completions", json=body)
        refusal(missing, 401, None, "no credentials", "header 'authorization: Bearer <token>'")
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer " + "x" * 40})
        refusal(wrong, 401, None, "not valid")
        basic = await http.get("/v1/models", headers={"authorization": f"Basic {values['trainer']}"})
        refusal(basic, 401, None, "'Bearer <token>'")
        admin = await http.post("/generate", json={}, headers={"authorization": f"Bearer {values['ops']}"})
        refusal(admin, 403, None, "token 'ops' has scopes [admin]; /generate needs scope 'score'")
        assert (await http.get("/health")).status_code == 200  # probes need no token
        for answer in (missing, wrong, basic, admin):
            assert values["trainer"] not in answer.text and values["ops"] not in answer.text
    sequences = random_sequences(rng, 2)
    async with openai.AsyncOpenAI(base_url=f"{both.base}/v1", api_key=values["trainer"], max_retries=0) as client:
        completion = await client.completions.create(
            model="default", prompt=sequences, max_tokens=1, extra_body={"prompt_logprobs": 0}
        )
    async with openai.AsyncOpenAI(base_url=f"{both.base}/v1", api_key="not-a-token", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError, match="not valid"):
            await client.models.list()
    from logprob_client import AsyncLogprobClient

    async with AsyncLogprobClient(both.target, token=values["trainer"]) as grpc_client:
        expected = await grpc_client.score([s[:1] for s in sequences], [s[1:] for s in sequences])
    for choice, want in zip(completion.choices, expected):
        bitwise([next(iter(e.values()))["logprob"] for e in choice.model_extra["prompt_logprobs"][1:]], want)


async def test_a_caller_that_hangs_up_takes_its_queued_work_with_it(served, rng, caplog):
    """A request whose caller disconnects while it waits in the queue is cancelled: it never
    reaches the model, it is counted CANCELLED and logged in one INFO line (no ERROR, no
    traceback: it was uvicorn's 40-line "Exception in ASGI application"), and the request ahead of
    it is answered."""
    caplog.set_level(logging.INFO)
    from tests.helpers.calls import Gate

    gate = Gate(served.running)
    ahead, behind = random_sequences(rng, 2)
    cancelled_before = requests_counted("/v1/completions", "CANCELLED")
    try:
        async with httpx.AsyncClient(base_url=served.base) as first, httpx.AsyncClient(base_url=served.base) as second:
            held = asyncio.create_task(first.post("/v1/completions", json={**COMPLETION, "prompt": ahead}))
            await gate.wait_entered()
            hung_up = asyncio.create_task(second.post("/v1/completions", json={**COMPLETION, "prompt": behind}))
            await asyncio.sleep(0.5)  # queued behind the held micro-batch
            hung_up.cancel()
            deadline = asyncio.get_running_loop().time() + 10
            while requests_counted("/v1/completions", "CANCELLED") == cancelled_before:
                assert asyncio.get_running_loop().time() < deadline, "the hung-up request was never cancelled"
                await asyncio.sleep(0.05)
            gate.restore()
            answered = await held
    finally:
        gate.restore()
    assert answered.status_code == 200
    assert gate.calls == [1]  # the held request's one sequence; the other never reached the model
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    (line,) = [r for r in caplog.records if getattr(r, "fields", {}).get("status") == "CANCELLED"]
    assert line.levelno == logging.INFO and line.fields["error"] == "the caller hung up"


async def test_x_request_timeout_is_the_deadline_and_passing_it_is_504(served, rng):
    """The deadline holds for the whole call, its wait in the queue included: a call stuck behind a
    held micro-batch is answered 504 at its deadline, as gRPC's deadline does, not once it runs."""
    from tests.helpers.calls import Gate

    gate = Gate(served.running)
    ahead, behind = random_sequences(rng, 2)
    try:
        async with httpx.AsyncClient(base_url=served.base) as http:
            held = asyncio.create_task(http.post("/v1/completions", json={**COMPLETION, "prompt": ahead}))
            await gate.wait_entered()
            sent = time.monotonic()
            expired = await asyncio.wait_for(
                http.post(
                    "/v1/completions", json={**COMPLETION, "prompt": behind}, headers={"x-request-timeout": "0.3"}
                ),
                timeout=5.0,  # the micro-batch ahead is held all along
            )
            waited = time.monotonic() - sent
            gate.restore()
            answered = await held
    finally:
        gate.restore()
    assert answered.status_code == 200
    refusal(expired, 504, None, "X-Request-Timeout: 0.3 s passed")
    assert 0.3 <= waited < 2.0, waited


def test_every_error_code_has_an_http_status():
    """A new ErrorCode without a status would raise KeyError while its error answer is built."""
    from logprob_service.errors import ErrorCode
    from logprob_service.http.errors import HTTP_STATUS

    assert set(HTTP_STATUS) == set(ErrorCode)
    assert all(400 <= status < 600 for status in HTTP_STATUS.values())


async def test_a_long_request_id_is_cut_in_the_log_line(served, caplog):
    """A 60 KB X-Request-Id was logged whole; the answer still echoes it."""
    from logprob_service.logs import SHOWN_ID_CHARS

    long_id = "r" * 60_000
    caplog.set_level(logging.WARNING, logger="logprob_service.requests")
    async with httpx.AsyncClient(base_url=served.base) as http:
        sent = await http.post("/v1/completions", json={**COMPLETION, "prompt": []}, headers={"x-request-id": long_id})
    assert sent.status_code == 400 and sent.headers["x-request-id"] == long_id
    (line,) = [r for r in caplog.records if r.name == "logprob_service.requests"]
    assert line.fields["request_id"] == "r" * SHOWN_ID_CHARS + "...(60000 characters)"
