"""vLLM's calls: ``/v1/completions`` with token-id prompts and ``prompt_logprobs`` (TRL 1.16's
``VLLMClient.get_sequence_logprobs``, the ``openai`` package), ``/inference/v1/generate`` with
``prompt_logprobs`` (prime-rl's ``prefill_logprobs``) or ``prompt_logprob_token_ids`` (vLLM's
teacher-scoring path), and ``/v1/models`` and ``/health`` as vLLM answers them.

Answers carry vLLM's shapes (docs/http.md quotes them): ``prompt_logprobs`` is one entry per
prompt token, ``None`` for the first (no context), else ``{"<id>": {"logprob", "rank",
"decoded_token"}}`` with the token's own entry first. This server has no tokenizer: a token's
``decoded_token`` is ``"token_id:<id>"``, what vLLM answers to ``return_tokens_as_token_ids``.
``rank`` is vLLM's: a top-k entry's place, a token outside the top k its vocabulary rank.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import time
import uuid

import numpy as np

from logprob_service.domain import MAX_TOP_K, SequenceScores
from logprob_service.engine import Budget, Phase, sequence_steps
from logprob_service.errors import InvalidArgument, Unavailable
from logprob_service.http import encoding
from logprob_service.http.app import RouteAnswer, RouteRequest
from logprob_service.http.bodies import (
    Strict,
    generates_none,
    no_streaming,
    parse,
    positions,
    served_model,
    text_refused,
)
from logprob_service.http.scoring import (
    AnswerSize,
    Item,
    Scored,
    answer_steps,
    candidate_rows,
    check_counts,
    check_start,
    ids_of,
    score_items,
    top_k_counted,
)

OWNER = "logprob-service"


def prompt_logprobs(item: Item, scores: SequenceScores | None, k: int) -> list[bytes]:
    """vLLM's ``prompt_logprobs`` of one prompt, as JSON in chunks to join: null for each position
    not scored, then for each scored token its own entry and the top ``k``'s (the own entry once,
    first, as vLLM's dict has it):
    ``{"<id>":{"logprob":<lp>,"rank":<rank>,"decoded_token":"token_id:<id>"},...}``.

    Ranks as vLLM's (``vllm/logprobs.py``, ``append_logprobs_for_next_position``): the top k's
    1..k by place, the token's own its place there when it is one of them (the dict's later
    entry), else its vocabulary rank (``SequenceScores.ranks``; over a split vocabulary, which
    does not count them, k + 1, a lower bound).

    Written by ``encoding.interleave``: the entries' ids, log-probs and ranks as columns between
    constant texts, a block of entries at a time, not as a formatted bytes object per entry."""
    nulls = b"null," * item.start
    if scores is None:
        return [b"[" + nulls[:-1] + b"]"]
    own = item.ids[item.start :]
    vocab_rank = scores.ranks if scores.ranks is not None else np.full(len(own), k + 1)
    if not k:  # one entry a position
        ids, lps, ranks, ends = own, scores.logprobs, vocab_rank, _ENDS[1]
    else:
        assert scores.top_ids is not None and scores.top_logprobs is not None
        among = scores.top_ids == own[:, None]
        rank = np.where(among.any(axis=1), among.argmax(axis=1) + 1, vocab_rank)
        # [n, 1 + k] entries: the own token's, then the top k's, of which the own token's (if
        # there) is left out, row by row
        table_ranks = np.column_stack([rank, np.broadcast_to(np.arange(1, k + 1), (len(own), k))])
        kept = np.ones(table_ranks.shape, dtype=bool)
        kept[:, 1:] = ~among
        ids = np.column_stack([own, scores.top_ids])[kept]
        lps = np.column_stack([scores.logprobs, scores.top_logprobs])[kept]
        ranks = table_ranks[kept]
        # what follows each entry: the next entry of its position, or (after its last) the next position
        last = np.zeros(len(ids), dtype=np.intp)
        last[np.cumsum(kept.sum(axis=1)) - 1] = 1
        ends = _ENDS[last]
    chunks = encoding.interleave(
        ids,
        b'":{"logprob":',
        lps,
        b',"rank":',
        ranks,
        b',"decoded_token":"token_id:',
        ids,
        ends,
        head=b"[" + nulls + b'{"',
        tail=b"]",
    )
    chunks[-2] = chunks[-2][: -len(_NEXT)]  # the last position has none after it
    return chunks


# What follows an entry: another of its position, or (after a position's last) the next position,
# whose opening ``_NEXT`` the last position's does not have.
_NEXT = b',{"'
_ENDS = np.array([b'"},"', b'"}}' + _NEXT], dtype=object)


# The answer's bytes (``scoring.AnswerSize``): a prompt_logprobs entry is at most 99 bytes
# (``"<id>":{"logprob":<lp>,"rank":<rank>,"decoded_token":"token_id:<id>"},``: 52 of text, two
# int32 ids, a log-prob of 24 characters, a rank of 10), a choice's fields and a position's null
# 200; /inference/v1/generate's candidate log-probs are a float32 matrix in base64 (4 bytes in 6).
ANSWER = AnswerSize(request=512, sequence=200, entry=106)
CANDIDATE_BYTES = 6


def check_prompt_logprobs(k: int | None, field: str) -> int:
    if k is None:
        raise InvalidArgument(
            f"{field}: absent; this server answers prompt log-probs only: send 0 (the tokens' own) or k (the top k too)"
        )
    if k == -1:
        raise InvalidArgument(f"{field}: -1 asks for the whole vocabulary; at most {MAX_TOP_K} are answered")
    if k < 0:
        raise InvalidArgument(f"{field}: {k} must be >= 0")
    return k


def usage(tokens: int) -> dict:
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


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


async def completions(call: RouteRequest) -> RouteAnswer:
    request = parse(call.body, CompletionRequest, call.engine.limits, "prompt")
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
    completions = [len(ids) - 1 for ids in batch if len(ids) > 1]
    answer_bytes = ANSWER.of(len(batch), sum(completions) * (top_k_counted(k) + 1))
    check_counts(call, "prompt", [1] * len(completions), completions, answer_bytes)
    names = ["prompt"] if single else [f"prompt[{i}]" for i in range(len(batch))]
    items, budget = [], Budget()  # thousands of prompts: the event loop handed back between slices of them
    for ids, name in zip(batch, names):
        items.append(Item(ids_of(ids, name), 1, name))
        await budget.pause(sequence_steps(len(ids)))
    scored = await _score(
        call, items, request.model, request.temperature, "prompt", "temperature", k, "prompt_logprobs", answer_bytes
    )
    # vLLM's CompletionResponseChoice and CompletionResponse, every field in the model's order
    # (vLLM answers ``model_dump()``)
    choices: list[bytes] = [b"["]
    for i, (item, scores) in enumerate(zip(items, scored.scores)):
        head = b'{"index":%d,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,'
        tail = b',"prompt_token_ids":null,"routed_experts":null,"weight_versions":null}'
        choices += [b"," if i else b"", head % i, b'"prompt_logprobs":', *prompt_logprobs(item, scores, k), tail]
        await budget.pause(answer_steps(item, k))
    choices.append(b"]")
    payload = {
        "id": f"cmpl-{call.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": scored.model,
        "choices": None,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(sum(len(item.ids) for item in items)),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    return RouteAnswer(encoding.with_raw(payload, choices=choices), scored.model, scored.result)


async def _score(
    call: RouteRequest,
    items: list[Item],
    model: str | None,
    temperature: float | None,
    batch: str,
    temperature_field: str,
    top_k: int,
    top_k_field: str,
    answer_bytes: int,
    return_ranks: bool = True,
) -> Scored:
    return await score_items(
        call,
        items,
        model=served_model(call.engine, model),
        temperature=temperature or 0.0,  # absent or 0 (vLLM's greedy, whose log-probs are unscaled): 1.0
        batch_field=batch,
        temperature_field=temperature_field,
        top_k=top_k,
        top_k_field=top_k_field,
        answer_bytes=answer_bytes,
        return_ranks=return_ranks,
    )


# --------------------------------------------------------------------------- /inference/v1/generate


def npy_base64(array: np.ndarray) -> str:
    """A base64 ``.npy`` file, as vLLM answers ``prompt_token_id_logprobs``."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


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


async def generate(call: RouteRequest) -> RouteAnswer:
    request = parse(call.body, GenerateRequest, call.engine.limits, "token_ids", rows=positions(call.engine))
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
    k = params.prompt_logprobs
    if k is not None:
        k = check_prompt_logprobs(k, "sampling_params.prompt_logprobs")
    start = params.prompt_logprob_start or 0
    n = len(request.token_ids)
    first = 1 if k is not None else min(max(start, 0), n) + 1  # the item's start, below
    wanted = params.prompt_logprob_token_ids
    width = 0 if not wanted else len(wanted[0]) if isinstance(wanted[0], list) else len(wanted)
    completions = [n - first] if first < n else []
    entries = (n - 1) * (top_k_counted(k) + 1) if k is not None else 0
    answer_bytes = ANSWER.of(1, entries) + CANDIDATE_BYTES * max(n - 1, 0) * width
    check_counts(call, "token_ids", [first] * len(completions), completions, answer_bytes)
    ids = ids_of(request.token_ids, "token_ids")
    check_start(start, len(ids) - 1, "sampling_params.prompt_logprob_start", "the first prompt row scored")
    # With prompt_logprobs every position is scored, the matrix's rows (from start) among them.
    first_row = start if k is not None else 0
    item = Item(ids, 1 if k is not None else start + 1, "token_ids")
    if wanted is not None:
        field = "sampling_params.prompt_logprob_token_ids"
        rows = candidate_rows(wanted, len(ids) - 1 - start, field)
        per_row = not isinstance(wanted[0], int)
        padded = np.concatenate([np.repeat(rows[:1], first_row, axis=0), rows]) if first_row and len(rows) else rows
        rows_at = first_row if per_row else None
        item = dataclasses.replace(item, candidates=padded, candidates_field=field, candidates_rows=rows_at)
    scored = await _score(
        call, [item], request.model, params.temperature, "token_ids", "sampling_params.temperature",
        k or 0, "sampling_params.prompt_logprobs", answer_bytes, return_ranks=k is not None,
    )  # fmt: skip
    scores = scored.scores[0]
    matrix = None
    if wanted is not None and scores is not None and scores.candidate_logprobs is not None:
        matrix = npy_base64(scores.candidate_logprobs[first_row:].astype(np.float32))
    payload = {  # vLLM's GenerateTokensResponse, every field in the model's order
        "request_id": request.request_id or call.request_id or str(uuid.uuid4()),
        "model": scored.model,
        "created": int(time.time()),
        "usage": usage(len(ids)),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": matrix,
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
                "stop_reason": None,
                "token_ids": [],
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": None,
            }
        ],
    }
    if k is not None:
        answered = encoding.with_raw(payload, prompt_logprobs=prompt_logprobs(item, scores, k))
        return RouteAnswer(answered, scored.model, scored.result)
    return RouteAnswer(payload, scored.model, scored.result)


# --------------------------------------------------------------------------- /v1/models, /health


async def models(call: RouteRequest) -> RouteAnswer:
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
    return RouteAnswer({"object": "list", "data": data})


async def health(call: RouteRequest) -> RouteAnswer:
    """200 with an empty body while the engine serves (vLLM's and SGLang's answer); 503 while it
    loads, warms up or drains (readiness probes and TRL's ``check_server`` wait on it)."""
    if call.engine.phase is not Phase.SERVING:
        raise Unavailable(f"server is {call.engine.phase.value}")
    return RouteAnswer(None)
