"""Answers shaped as the engines' own, where they differ from a plain reading of the fields: SGLang's
null at position ``logprob_start_len``, vLLM's ranks, the routes with and without their trailing
slash. The expected shapes are written from the engines' code (cited at each test); the values
are gRPC's, bit for bit.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.http.test_peers import bitwise, grpc_scores, grpc_teacher_scores, random_sequences


async def test_sglang_start_position_is_null_whatever_logprob_start_len(served, rng):
    """SGLang 0.5.23 ``scheduler_components/logprob_result_processor.py``,
    ``_process_input_token_logprobs``: ``[None] + input_token_logprobs[:-1]`` against ids
    ``origin_input_ids[logprob_start_len:]``, and a ``[None]`` first row of the top-k and
    token-ids lists (``_process_input_top_logprobs``); ``tokenizer_manager.py``,
    ``detokenize_logprob_tokens``: ``(logprob, token_id, None)`` tuples. So position s answers
    ``[null, x_s, null]`` and the tokens scored are s + 1 .. n - 1."""
    (tokens,) = random_sequences(rng, 1, low=9, high=20)
    s = 4
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": s,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5, 7],
    }
    async with httpx.AsyncClient(base_url=served.base) as session:
        meta = (await session.post("/generate", json=body)).json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(tokens) - s and entries[0] == [None, tokens[s], None]
    assert [e[1] for e in entries] == tokens[s:] and all(e[2] is None for e in entries)
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_ids_logprobs"]) == len(entries)
    rows = len(tokens) - s - 1
    (want,) = await grpc_teacher_scores(
        served, [tokens[: s + 1]], [tokens[s + 1 :]], top_k=2, candidates=[[[5, 7]] * rows]
    )
    bitwise([e[0] for e in entries[1:]], want.logprobs)
    assert [[e[1] for e in row] for row in meta["input_top_logprobs"][1:]] == want.top_ids.tolist()
    bitwise([e[0] for row in meta["input_top_logprobs"][1:] for e in row], want.top_logprobs.ravel())
    bitwise([e[0] for row in meta["input_token_ids_logprobs"][1:] for e in row], want.candidate_logprobs.ravel())


async def test_sglang_last_position_as_start_answers_one_null(served, rng):
    """logprob_start_len n - 1 of one input among others: that input's one entry, null (SGLang
    has nothing to score there either)."""
    batch = random_sequences(rng, 2, low=5, high=9)
    body = {"input_ids": batch, "return_logprob": True, "logprob_start_len": [len(batch[0]) - 1, 1],
            "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    async with httpx.AsyncClient(base_url=served.base) as session:
        answers = (await session.post("/generate", json=body)).json()
    assert answers[0]["meta_info"]["input_token_logprobs"] == [[None, batch[0][-1], None]]
    (want,) = await grpc_scores(served, [batch[1][:2]], [batch[1][2:]])
    bitwise([e[0] for e in answers[1]["meta_info"]["input_token_logprobs"][1:]], want)


@pytest.mark.parametrize("k", [0, 3])
async def test_vllm_ranks_are_vocabulary_ranks(served, rng, k):
    """vLLM 0.33 ``vllm/logprobs.py``, ``append_logprobs_for_next_position``: the token's own entry
    first with its rank from ``v1/sample/sampler.py`` ``gather_logprobs`` (``(logprobs >=
    token_logprob).sum(-1)``), then the top k with ranks 1..k (the own token's overwritten by its
    top-k place when it is one of them). Checked against gRPC's top 256: a token ranked within
    it has the rank its log-prob has there; one past it, a rank past 256."""
    sequences = random_sequences(rng, 2, low=20, high=40)
    async with httpx.AsyncClient(base_url=served.base) as session:
        body = {"model": "default", "prompt": sequences, "max_tokens": 1, "prompt_logprobs": k}
        choices = (await session.post("/v1/completions", json=body)).json()["choices"]
    wide = await grpc_teacher_scores(served, [s[:1] for s in sequences], [s[1:] for s in sequences], top_k=256)
    checked = past = 0
    for seq, choice, want in zip(sequences, choices, wide):
        for position, (token, entry) in enumerate(zip(seq[1:], choice["prompt_logprobs"][1:])):
            assert (next(iter(entry)) == str(token) and len(entry) in (k, k + 1)) or (k == 0 and len(entry) == 1)
            own = entry[str(token)]
            top = want.top_ids[position].tolist()
            if token in top[:k]:
                assert own["rank"] == top.index(token) + 1
            elif token in top:
                lps = want.top_logprobs[position]
                assert own["rank"] == int((lps >= np.float32(own["logprob"])).sum()) and own["rank"] > k
                checked += 1
            else:
                assert own["rank"] > 256
                past += 1
            assert [e["rank"] for e in list(entry.values())[1:]] == [r for r in range(1, k + 1) if top[r - 1] != token]
    assert checked and past  # both kinds were met


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/get_sequence_logprobs", {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "top_logprobs": 0}),
        ("POST", "/v1/completions/", {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0}),
        (
            "POST",
            "/generate/",
            {
                "input_ids": [1, 2, 3],
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            },
        ),
        ("GET", "/v1/models/", None),
        ("GET", "/health/", None),
    ],
)
async def test_routes_answer_with_and_without_their_trailing_slash(served, method, path, body):
    """vLLM's and TRL's FastAPI servers answer either spelling; Starlette's default is a 307 with
    an empty body."""
    other = path[:-1] if path.endswith("/") else path + "/"
    async with httpx.AsyncClient(base_url=served.base) as session:
        answers = [await session.request(method, p, json=body) for p in (path, other)]
    assert [a.status_code for a in answers] == [200, 200]
    if method == "POST":
        first, second = (a.json() for a in answers)
        for volatile in ("id", "created"):
            first.pop(volatile, None), second.pop(volatile, None)
        if "meta_info" in first:
            for key in ("id", "e2e_latency", "response_sent_to_client_ts"):
                first["meta_info"].pop(key), second["meta_info"].pop(key)
        assert first == second
