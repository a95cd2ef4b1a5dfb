"""Each peer's own client code, or its request and parsing code copied verbatim, against the HTTP
edge; every log-prob equal, bit for bit, to what gRPC answers for the same sequences.

One server serves both edges (conftest.py). A peer's call and the gRPC call hold the same
sequences in the same order, so the engine scores the same micro-batches (on the CPU scores are
equal run to run for the same batch; batch invariance is a CUDA guarantee).
"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from logprob_client import AsyncLogprobClient
from trl.generation import vllm_client

from tests.http.conftest import VOCAB


def random_sequences(rng: np.random.Generator, n: int, low: int = 3, high: int = 40) -> list[list[int]]:
    return [rng.integers(1, VOCAB, int(rng.integers(low, high))).tolist() for _ in range(n)]


async def grpc_scores(served, prompts, completions, **keywords) -> list[np.ndarray]:
    async with AsyncLogprobClient(served.target) as client:
        return await client.score(prompts, completions, **keywords)


async def grpc_teacher_scores(served, prompts, completions, *, top_k=0, candidates=None, temperature=1.0):
    """What gRPC answers for these sequences with ``top_k`` and ``candidates`` (one [C, Kc] list
    per sequence), one ``SequenceScores``-like record per sequence."""
    keywords = {"top_k": top_k, "temperature": temperature}
    if candidates is not None:
        keywords["candidate_ids"] = [np.asarray(c, dtype=np.int64) for c in candidates]
    async with AsyncLogprobClient(served.target) as client:
        answer = await client.score(prompts, completions, **keywords)
    fields = ("logprobs", "top_ids", "top_logprobs", "candidate_logprobs")
    columns = [getattr(answer, name) or [None] * len(prompts) for name in fields]
    return [SimpleNamespace(**dict(zip(fields, values))) for values in zip(*columns)]


async def prompt_logprobs_by_grpc(served, sequences, **keywords) -> list[np.ndarray]:
    """A prompt-log-prob call's meaning: each sequence's first token as the prompt, the rest scored."""
    return await grpc_scores(served, [s[:1] for s in sequences], [s[1:] for s in sequences], **keywords)


def bitwise(got: list[float], expected: np.ndarray) -> None:
    """JSON's numbers are float32 values written exactly: equal as float64, so as float32 bits."""
    assert np.asarray(got, dtype=np.float64).tolist() == expected.astype(np.float64).tolist()


async def test_trl_1_16_vllm_client_get_sequence_logprobs(served, rng, monkeypatch):
    """TRL 1.16's own ``VLLMClient``: its health check and model lookup at construction, then
    ``get_sequence_logprobs`` (a /v1/completions call with ``prompt_logprobs``), sliced by TRL."""
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)  # vLLM itself is not needed
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=served.base)
    assert client.model == "default"
    sequences = random_sequences(rng, 5)
    prompt_lengths = [int(rng.integers(1, len(s))) for s in sequences]
    result = await asyncio.to_thread(
        client.get_sequence_logprobs, sequences, prompt_lengths, top_logprobs=0, temperature=0.7
    )
    expected = await prompt_logprobs_by_grpc(served, sequences, temperature=0.7)
    for seq, p, actual, ids, want in zip(
        sequences, prompt_lengths, result["actual_logprobs"], result["actual_token_ids"], expected
    ):
        assert ids == [[t] for t in seq[p:]]
        bitwise([v[0] for v in actual], want[p - 1 :])
    assert result["logprobs"] == [[[] for _ in seq[p:]] for seq, p in zip(sequences, prompt_lengths)]


async def test_openai_completions_with_token_id_prompts(served, rng):
    """The ``openai`` package's ``completions.create``: token-id prompts, ``prompt_logprobs`` in
    ``extra_body`` (how vLLM documents it), the answer parsed by the package's own models."""
    sequences = random_sequences(rng, 3)
    async with openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0) as client:
        completion = await client.completions.create(
            model="default", prompt=sequences, max_tokens=1, temperature=1.0, extra_body={"prompt_logprobs": 0}
        )
        models = await client.models.list()
    assert [m.id for m in models.data] == ["default"]
    expected = await prompt_logprobs_by_grpc(served, sequences)
    assert completion.object == "text_completion" and completion.model == "default"
    for seq, choice, want in zip(sequences, completion.choices, expected):
        entries = choice.model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(seq)
        assert [next(iter(e)) for e in entries[1:]] == [str(t) for t in seq[1:]]
        bitwise([next(iter(e.values()))["logprob"] for e in entries[1:]], want)
    assert completion.usage.prompt_tokens == sum(map(len, sequences)) and completion.usage.completion_tokens == 0


async def test_slime_on_policy_distillation_request(served, rng):
    """slime's ``reward_func`` payload and ``post_process_rewards`` parsing, verbatim
    (slime/rollout/on_policy_distillation.py), one sample per call as slime sends them."""
    rollout_temperature = 0.8
    for tokens in random_sequences(rng, 3, low=4):
        response_length = int(rng.integers(1, len(tokens)))
        payload = {
            # "text": sample.prompt + sample.response,
            "input_ids": tokens,
            "sampling_params": {
                "temperature": rollout_temperature,
                "max_new_tokens": 0,
                "skip_special_tokens": False,
            },
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        async with httpx.AsyncClient() as session:
            resp = await session.post(f"{served.base}/generate", json=payload)
            resp.raise_for_status()
            reward = resp.json()
        teacher_log_probs = [item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]]
        teacher_log_probs = teacher_log_probs[-response_length:]
        (expected,) = await prompt_logprobs_by_grpc(served, [tokens], temperature=rollout_temperature)
        bitwise(teacher_log_probs, expected[-response_length:])
        assert reward["meta_info"]["input_token_logprobs"][0] == [None, tokens[0], None]


async def test_sglang_batch_and_logprob_start_len(served, rng):
    """A batch of inputs answers a list; ``logprob_start_len`` s > 0 answers positions s.., the
    first null (SGLang's, test_shapes.py), with inputs sharing their first s + 1 tokens sharing
    that prompt."""
    prefix = rng.integers(1, VOCAB, 6).tolist()
    batch = [prefix + rng.integers(1, VOCAB, int(rng.integers(2, 9))).tolist() for _ in range(3)]
    body = {
        "input_ids": batch,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 6,
    }
    async with httpx.AsyncClient(base_url=served.base) as session:
        answers = (await session.post("/generate", json=body)).json()
    expected = await grpc_scores(served, [s[:7] for s in batch], [s[7:] for s in batch])
    for seq, answer, want in zip(batch, answers, expected):
        entries = answer["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == seq[6:] and entries[0][0] is None
        bitwise([e[0] for e in entries[1:]], want)


def prime_rl_prefill_body(token_ids: list[int]) -> dict:
    """The body prime-rl's ``prefill_logprobs`` posts to ``/inference/v1/generate``, verbatim."""
    return {
        "model": "default",
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1},
    }


async def test_prime_rl_prefill_logprobs_request(served, rng):
    """prime-rl's ``prefill_logprobs`` (src/prime_rl/utils/client.py): its body as it sends it
    (``prompt_logprobs: 1``: the token's own and the top 1), and its flattening of the answer
    (the first entry of each position's dict: the token's own), verbatim."""
    token_ids = random_sequences(rng, 1, low=5)[0]
    base = served.base
    body = prime_rl_prefill_body(token_ids)
    async with httpx.AsyncClient() as http:
        http_response = await http.post(f"{base}/inference/v1/generate", json=body)
    response = http_response.json()
    flat: list[float] = []
    for entry in response["prompt_logprobs"] or []:
        if not entry:
            flat.append(0.0)
            continue
        first = next(iter(entry.values()))
        lp = first.logprob if hasattr(first, "logprob") else first.get("logprob")
        flat.append(float(lp) if lp is not None else 0.0)
    (expected,) = await grpc_teacher_scores(served, [token_ids[:1]], [token_ids[1:]], top_k=1)
    assert flat[0] == 0.0 and len(flat) == len(token_ids)
    bitwise(flat[1:], expected.logprobs)
    for entry, top, own in zip(response["prompt_logprobs"][1:], expected.top_ids[:, 0].tolist(), token_ids[1:]):
        assert next(iter(entry)) == str(own) and entry[str(top)]["rank"] == 1
        assert len(entry) == (1 if top == own else 2)
    assert response["output_mode"] == "tokens" and response["choices"][0]["token_ids"] == []


def decode_binary_logprobs(response: dict) -> dict[str, list]:
    """TRL 1.9's ``VLLMClient._decode_binary_logprobs`` (trl/generation/vllm_client.py), verbatim."""
    shape = response["shape"]  # [batch, max_comp_len, top_k]
    comp_lengths = response["completion_lengths"]

    logprobs_arr = np.frombuffer(base64.b64decode(response["logprobs_b64"]), dtype=np.float32).reshape(shape)
    token_ids_arr = np.frombuffer(base64.b64decode(response["token_ids_b64"]), dtype=np.int32).reshape(shape)

    all_logprobs = []
    all_token_ids = []
    for i, comp_len in enumerate(comp_lengths):
        all_logprobs.append(logprobs_arr[i, :comp_len, :].tolist())
        all_token_ids.append(token_ids_arr[i, :comp_len, :].tolist())

    result = {"logprobs": all_logprobs, "logprob_token_ids": all_token_ids}

    if "actual_logprobs_b64" in response:
        actual_shape = [shape[0], shape[1], 1]
        actual_lp = np.frombuffer(base64.b64decode(response["actual_logprobs_b64"]), dtype=np.float32).reshape(
            actual_shape
        )
        actual_ids = np.frombuffer(base64.b64decode(response["actual_token_ids_b64"]), dtype=np.int32).reshape(
            actual_shape
        )
        all_actual_lps = []
        all_actual_ids = []
        for i, comp_len in enumerate(comp_lengths):
            all_actual_lps.append(actual_lp[i, :comp_len, :].tolist())
            all_actual_ids.append(actual_ids[i, :comp_len, :].tolist())
        result["actual_logprobs"] = all_actual_lps
        result["actual_token_ids"] = all_actual_ids

    return result


@pytest.mark.parametrize("response_format", ["binary", "json"])
async def test_trl_get_sequence_logprobs_route(served, rng, response_format):
    """TRL 1.4-1.9's ``/get_sequence_logprobs/``: the request its ``VLLMClient`` posts, and its
    decoding; GRPO-like groups (completions of one prompt) share the prompt as a gRPC group does."""
    prompts = random_sequences(rng, 2, low=2, high=12)
    completions = [random_sequences(rng, 3, low=1, high=20) for _ in prompts]
    sequences = [p + c for p, group in zip(prompts, completions) for c in group]
    prompt_lengths = [len(p) for p, group in zip(prompts, completions) for _ in group]
    request = {
        "sequences": sequences,
        "prompt_lengths": prompt_lengths,
        "top_logprobs": 0,
        "temperature": 1.0,
        "response_format": response_format,
    }
    async with httpx.AsyncClient(base_url=served.base) as session:
        response = await session.post("/get_sequence_logprobs/", json=request)
    assert response.status_code == 200, response.text
    flat = [c for group in completions for c in group]
    expected = await grpc_scores(served, [s[:p] for s, p in zip(sequences, prompt_lengths)], flat)
    if response_format == "binary":
        decoded = decode_binary_logprobs(response.json())
        actual, ids = decoded["actual_logprobs"], decoded["actual_token_ids"]
    else:
        actual, ids = response.json()["logprobs"], response.json()["logprob_token_ids"]
    for seq, p, lps, tokens, want in zip(sequences, prompt_lengths, actual, ids, expected):
        assert tokens == [[t] for t in seq[p:]]
        bitwise([v[0] for v in lps], want)


async def test_trl_prompt_length_zero_answers_the_first_position_empty(served, rng):
    (seq,) = random_sequences(rng, 1, low=4)
    async with httpx.AsyncClient(base_url=served.base) as session:
        body = {"sequences": [seq], "prompt_lengths": [0], "top_logprobs": 0}
        as_json = (await session.post("/get_sequence_logprobs/", json=body)).json()
        binary = decode_binary_logprobs(
            (await session.post("/get_sequence_logprobs/", json=body | {"response_format": "binary"})).json()
        )
    (expected,) = await prompt_logprobs_by_grpc(served, [seq])
    assert as_json["logprobs"][0][0] == [] and as_json["logprob_token_ids"][0][0] == []
    bitwise([v[0] for v in as_json["logprobs"][0][1:]], expected)
    assert binary["actual_logprobs"][0][0] == [-np.inf] and binary["actual_token_ids"][0][0] == [0]
    bitwise([v[0] for v in binary["actual_logprobs"][0][1:]], expected)


async def test_trl_1_16_top_logprobs_are_the_engines_top_k(served, rng, monkeypatch):
    """TRL 1.16's ``get_sequence_logprobs`` with ``top_logprobs`` 3: its rank-sorted, padded
    top-k lists (forward KL) and the token's own (reverse KL), as gRPC answers them."""
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=served.base)
    sequences = random_sequences(rng, 3)
    prompt_lengths = [int(rng.integers(1, len(s))) for s in sequences]
    result = await asyncio.to_thread(client.get_sequence_logprobs, sequences, prompt_lengths, top_logprobs=3)
    expected = await grpc_teacher_scores(served, [s[:1] for s in sequences], [s[1:] for s in sequences], top_k=3)
    for p, lps, ids, actual, want in zip(
        prompt_lengths, result["logprobs"], result["logprob_token_ids"], result["actual_logprobs"], expected
    ):
        assert ids == want.top_ids[p - 1 :].tolist()
        bitwise([v for row in lps for v in row], want.top_logprobs[p - 1 :].ravel())
        bitwise([v[0] for v in actual], want.logprobs[p - 1 :])


async def test_sglang_top_logprobs_num_and_token_ids_logprob(served, rng):
    (tokens,) = random_sequences(rng, 1, low=5)
    wanted = [5, 7, 11]
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": wanted,
    }
    async with httpx.AsyncClient(base_url=served.base) as session:
        meta = (await session.post("/generate", json=body)).json()["meta_info"]
    rows = len(tokens) - 1
    (want,) = await grpc_teacher_scores(served, [tokens[:1]], [tokens[1:]], top_k=2, candidates=[[wanted] * rows])
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert meta["output_top_logprobs"] == [] and meta["output_token_ids_logprobs"] == []
    assert [[e[1] for e in row] for row in meta["input_top_logprobs"][1:]] == want.top_ids.tolist()
    bitwise([e[0] for row in meta["input_top_logprobs"][1:] for e in row], want.top_logprobs.ravel())
    assert [[e[1] for e in row] for row in meta["input_token_ids_logprobs"][1:]] == [wanted] * rows
    bitwise([e[0] for row in meta["input_token_ids_logprobs"][1:] for e in row], want.candidate_logprobs.ravel())


@pytest.mark.parametrize("per_row", [False, True])
async def test_vllm_prompt_logprob_token_ids_answer_the_npy_matrix(served, rng, per_row):
    """vLLM's training path: candidate ids from ``prompt_logprob_start``; ``[rows, K]`` float32
    ``.npy`` whose row i scores token ``start + i + 1`` (docs "training/prompt_token_id_logprobs")."""
    import io

    (tokens,) = random_sequences(rng, 1, low=8)
    start = 3
    rows = len(tokens) - 1 - start
    candidates = rng.integers(0, VOCAB, (rows, 4)).tolist() if per_row else [9, 99, 999, 3]
    body = {
        "token_ids": tokens,
        "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": candidates, "prompt_logprob_start": start},
    }
    async with httpx.AsyncClient(base_url=served.base) as session:
        response = (await session.post("/inference/v1/generate", json=body)).json()
    scores = np.load(io.BytesIO(base64.b64decode(response["prompt_token_id_logprobs"])))
    assert scores.dtype == np.float32 and scores.shape == (rows, 4) and response["prompt_logprobs"] is None
    per_position = candidates if per_row else [candidates] * rows
    (want,) = await grpc_teacher_scores(served, [tokens[: start + 1]], [tokens[start + 1 :]], candidates=[per_position])
    assert scores.tobytes() == want.candidate_logprobs.astype(np.float32).tobytes()


async def test_trl_get_sequence_logprobs_route_top_logprobs_binary(served, rng):
    sequences = random_sequences(rng, 3, low=4)
    request = {"sequences": sequences, "prompt_lengths": [2, 2, 3], "top_logprobs": 3, "response_format": "binary"}
    async with httpx.AsyncClient(base_url=served.base) as session:
        decoded = decode_binary_logprobs((await session.post("/get_sequence_logprobs/", json=request)).json())
    expected = await grpc_teacher_scores(
        served, [s[:p] for s, p in zip(sequences, [2, 2, 3])], [s[p:] for s, p in zip(sequences, [2, 2, 3])], top_k=3
    )
    for lps, ids, actual, want in zip(
        decoded["logprobs"], decoded["logprob_token_ids"], decoded["actual_logprobs"], expected
    ):
        assert ids == want.top_ids.tolist()
        bitwise([v for row in lps for v in row], want.top_logprobs.ravel())
        bitwise([v[0] for v in actual], want.logprobs)
