"""vLLM's calls: ``/v1/completions`` with token-id prompts and ``prompt_logprobs`` (TRL 1.16's
``VLLMClient.get_sequence_logprobs``, the ``openai`` package), ``/inference/v1/generate`` with
``prompt_logprobs`` (prime-rl's ``prefill_logprobs``) or ``prompt_logprob_token_ids`` (vLLM's
teacher-scoring path), and ``/v1/models`` and ``/health`` as vLLM answers them.

Answers carry vLLM's shapes (docs/http.md quotes them): ``prompt_logprobs`` is one entry per
prompt token, ``None`` for the first (no context), else ``{"<id>": {"logprob", "rank",
"decoded_token"}}`` with the token's own entry first. This server has no tokenizer: a token's
``decoded_token`` is ``"token_id:<id>"``, what vLLM answers with ``--return-tokens-as-token-ids``
(which TRL's ``vllm-serve`` sets). ``rank`` is where the engine does not count the tokens above it
a lower bound: ``k + 1`` for a token outside the top ``k``.
"""

from __future__ import annotations

import time
import uuid

from logprob_service.domain import SequenceScores
from logprob_service.engine.engine import Phase
from logprob_service.errors import InvalidArgument, Unavailable
from logprob_service.http import encoding
from logprob_service.http.app import Answer, Call
from logprob_service.http.bodies import (
    Strict,
    generates_none,
    no_streaming,
    parse,
    served_model,
    text_refused,
)
from logprob_service.http.scoring import Item, Scored, check_start, ids_of, refuse_top_k, score_items

OWNER = "logprob-service"


def prompt_logprobs(item: Item, scores: SequenceScores | None, k: int) -> bytes:
    """vLLM's ``prompt_logprobs`` of one prompt, as JSON: null for each position not scored, then
    each scored token's own entry."""
    entries = [b"null"] * item.start
    if scores is not None:
        rank = b"%d" % (k + 1)
        entries += [
            b'{"%b":{"logprob":%b,"rank":%b,"decoded_token":"token_id:%b"}}' % (t, lp, rank, t)
            for t, lp in zip(
                encoding.numbers(item.ids[item.start :].tolist()), encoding.numbers(scores.logprobs.tolist())
            )
        ]
    return encoding.array(entries)


def check_prompt_logprobs(k: int | None, field: str) -> int:
    if k is None:
        raise InvalidArgument(
            f"{field}: absent; this server answers prompt log-probs only: send 0 (the tokens' own) or k (the top k too)"
        )
    if k < -1:
        raise InvalidArgument(f"{field}: {k} must be >= -1 (-1: the whole vocabulary)")
    refuse_top_k(k, field)
    return k


def usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


# --------------------------------------------------------------------------- /v1/completions


class CompletionRequest(Strict):
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    temperature: float | None = None
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    n: int = 1
    stream: bool | None = False


async def completions(call: Call) -> Answer:
    request = parse(call.body, CompletionRequest)
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        raise text_refused("prompt")
    no_streaming(request.stream)
    generates_none(request, "max_tokens", "max_tokens", (0, 1))
    if request.logprobs is not None:
        raise InvalidArgument("logprobs: asks for generated tokens' log-probs; this server generates none")
    if request.n != 1:
        raise InvalidArgument(f"n: {request.n}; this server answers one choice per prompt (send 1)")
    k = check_prompt_logprobs(request.prompt_logprobs, "prompt_logprobs")
    if not prompt:
        raise InvalidArgument("prompt: is empty; at least 1 token is required")
    single = isinstance(prompt[0], int)
    batch = [prompt] if single else prompt
    names = ["prompt"] if single else [f"prompt[{i}]" for i in range(len(batch))]
    items = [Item(ids_of(ids, name), 1, name) for ids, name in zip(batch, names)]
    scored = await _score(call, items, request.model, request.temperature, "prompt", "temperature")
    choices = [
        b'{"index":%d,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":%b}'
        % (i, prompt_logprobs(item, scores, k))
        for i, (item, scores) in enumerate(zip(items, scored.scores))
    ]
    payload = {
        "choices": None,
        "id": f"cmpl-{call.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": scored.model,
        "usage": usage(sum(len(item.ids) for item in items)),
    }
    return Answer(encoding.with_raw(payload, "choices", encoding.array(choices)), scored.model, scored.result)


async def _score(
    call: Call, items: list[Item], model: str | None, temperature: float | None, batch: str, temperature_field: str
) -> Scored:
    return await score_items(
        call,
        items,
        model=served_model(call.engine, model),
        temperature=temperature or 0.0,  # absent or 0 (vLLM's greedy, whose log-probs are unscaled): 1.0
        batch_field=batch,
        temperature_field=temperature_field,
    )


# --------------------------------------------------------------------------- /inference/v1/generate


class SamplingParams(Strict):
    max_tokens: int | None = 16
    temperature: float | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[int] | list[list[int]] | None = None
    prompt_logprob_start: int | None = None
    logprobs: int | None = None
    n: int = 1


class GenerateRequest(Strict):
    model: str | None = None
    request_id: str | None = None
    token_ids: list[int]
    sampling_params: SamplingParams = SamplingParams()
    stream: bool | None = False


async def generate(call: Call) -> Answer:
    request = parse(call.body, GenerateRequest)
    params = request.sampling_params
    no_streaming(request.stream)
    generates_none(params, "max_tokens", "sampling_params.max_tokens", (0, 1))
    if params.logprobs is not None:
        raise InvalidArgument(
            "sampling_params.logprobs: log-probs of generated tokens; this server generates none "
            "(use prompt_logprobs or prompt_logprob_token_ids)"
        )
    if params.n != 1:
        raise InvalidArgument(f"sampling_params.n: {params.n}; this server answers one choice (send 1)")
    if params.prompt_logprobs is None and params.prompt_logprob_token_ids is None:
        raise InvalidArgument(
            "sampling_params: neither prompt_logprobs nor prompt_logprob_token_ids; this server answers prompt "
            "log-probs only"
        )
    ids = ids_of(request.token_ids, "token_ids")
    k = params.prompt_logprobs
    if k is not None:
        k = check_prompt_logprobs(k, "sampling_params.prompt_logprobs")
    if params.prompt_logprob_token_ids is not None:
        refuse_top_k(len(params.prompt_logprob_token_ids), "sampling_params.prompt_logprob_token_ids")
    start = params.prompt_logprob_start or 0
    check_start(start, len(ids) - 1, "sampling_params.prompt_logprob_start", "the first prompt row scored")
    item = Item(ids, 1 if k is not None else start + 1, "token_ids")
    scored = await _score(call, [item], request.model, params.temperature, "token_ids", "sampling_params.temperature")
    payload = {
        "prompt_logprobs": None,
        "request_id": request.request_id or call.request_id or str(uuid.uuid4()),
        "model": scored.model,
        "created": int(time.time()),
        "usage": usage(len(ids)),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [],
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": None,
            }
        ],
    }
    if k is not None:
        return Answer(
            encoding.with_raw(payload, "prompt_logprobs", prompt_logprobs(item, scored.scores[0], k)),
            scored.model,
            scored.result,
        )
    return Answer(payload, scored.model, scored.result)


# --------------------------------------------------------------------------- /v1/models, /health


async def models(call: Call) -> Answer:
    """vLLM's model list (TRL's ``VLLMClient`` takes ``data[0]["id"]``), once the weight updates
    committed before have settled (the engine's ``list_models``)."""
    created = int(time.time())
    data = [
        {
            "id": info.name,
            "object": "model",
            "created": created,
            "owned_by": OWNER,
            "root": info.source,
            "parent": info.base_model or None,
            "max_model_len": info.max_positions,
            "permission": [],
        }
        for info in await call.engine.list_models()
    ]
    return Answer({"object": "list", "data": data})


async def health(call: Call) -> Answer:
    """200 with an empty body while the engine serves (vLLM's and SGLang's answer); 503 while it
    loads, warms up or drains (readiness probes and TRL's ``check_server`` wait on it)."""
    if call.engine.phase is not Phase.SERVING:
        raise Unavailable(f"server is {call.engine.phase.value}")
    return Answer(None)
