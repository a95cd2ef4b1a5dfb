"""``/get_sequence_logprobs/`` of ``trl vllm-serve`` (TRL 1.4-1.9, whose ``VLLMClient.get_sequence_logprobs``
and server-distillation trainers call it; TRL 1.16's client asks ``/v1/completions`` instead,
``vllm.completions``).

The request: full sequences, each with its prompt length; log-probs of the completion positions
``prompt_lengths[i]..n-1``. Sequences with the same prompt run it once. The answer is TRL's
server's (docs/http.md quotes both): ``response_format: "json"``, per position the entries sorted
by rank (the top ``top_logprobs`` and the token's own), the binary fields null (FastAPI writes
every field of TRL's ``SequenceLogprobsResponse``); ``"binary"``, base64 float32/int32 arrays
``[batch, max completion, top_logprobs]`` padded with -inf / 0, the token's own as ``actual_*``
``[batch, max completion, 1]``. A prompt length 0 answers its first position empty (-inf / 0),
as TRL's server does for the token without context.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np

from logprob_service.domain import SequenceScores
from logprob_service.engine import SEQUENCE_STEPS, Budget, sequence_steps
from logprob_service.errors import InvalidArgument
from logprob_service.http.app import RouteAnswer, RouteRequest
from logprob_service.http.bodies import Strict, parse, served_model
from logprob_service.http.scoring import (
    AnswerSize,
    Item,
    answer_steps,
    check_counts,
    check_start,
    ids_of,
    score_items,
    top_k_counted,
)


class SequenceLogprobsRequest(Strict):
    sequences: list[list[int]]
    prompt_lengths: list[int]
    top_logprobs: int = 100
    temperature: float = 1.0
    response_format: Literal["json", "binary"] = "json"


# The fields of TRL's SequenceLogprobsResponse, in its order.
RESPONSE_FIELDS = (
    "logprobs",
    "logprob_token_ids",
    "logprobs_b64",
    "token_ids_b64",
    "actual_logprobs_b64",
    "actual_token_ids_b64",
    "shape",
    "completion_lengths",
)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _by_rank(item: Item, scores: SequenceScores | None, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per completion position, TRL's server's JSON lists: the entries of vLLM's position dict
    sorted by rank, i.e. the top ``k``, then the token's own where it is not among them."""
    if scores is None:
        return [], []
    own, own_lps = item.ids[item.start :].tolist(), scores.logprobs.tolist()
    if not k:
        return [[lp] for lp in own_lps], [[t] for t in own]
    lps, ids = scores.top_logprobs.tolist(), scores.top_ids.tolist()
    for row_lps, row_ids, t, lp in zip(lps, ids, own, own_lps):
        if t not in row_ids:
            row_lps.append(lp)
            row_ids.append(t)
    return lps, ids


# The answer's bytes (``scoring.AnswerSize``). JSON: an entry is a log-prob and an id, 36 bytes
# at most with their commas. Binary: [batch, longest completion, top_logprobs + 1] slots of a
# float32 and an int32, in base64 (8 bytes in 11).
JSON_ANSWER = AnswerSize(request=256, sequence=8, entry=36)
BINARY_ANSWER = AnswerSize(request=512, sequence=8, entry=11)


def _answer_bytes(request: SequenceLogprobsRequest, completions: list[int]) -> int:
    entries = top_k_counted(request.top_logprobs) + 1  # a position's top k, and its own token
    if request.response_format == "json":
        return JSON_ANSWER.of(len(request.sequences), sum(completions) * entries)
    longest = max((len(s) - p for s, p in zip(request.sequences, request.prompt_lengths)), default=0)
    return BINARY_ANSWER.of(len(request.sequences), len(request.sequences) * longest * entries)


async def sequence_logprobs(call: RouteRequest) -> RouteAnswer:
    request = parse(call.body, SequenceLogprobsRequest, call.engine.limits, "sequences")
    if len(request.sequences) != len(request.prompt_lengths):
        raise InvalidArgument(
            f"prompt_lengths: {len(request.prompt_lengths)} lengths for {len(request.sequences)} sequences; "
            "give one per sequence"
        )
    if request.top_logprobs < 0:
        raise InvalidArgument(f"top_logprobs: {request.top_logprobs} must be >= 0")
    k = request.top_logprobs
    starts = [(min(max(p, 1), len(s)), len(s)) for s, p in zip(request.sequences, request.prompt_lengths)]
    prompts = [start for start, n in starts if start < n]
    completions = [n - start for start, n in starts if start < n]
    check_counts(call, "sequences", prompts, completions, _answer_bytes(request, completions))
    items, budget = [], Budget()  # thousands of sequences: the event loop handed back between slices of them
    for i, (sequence, prompt_length) in enumerate(zip(request.sequences, request.prompt_lengths)):
        await budget.pause(sequence_steps(len(sequence)))
        ids = ids_of(sequence, f"sequences[{i}]")
        check_start(prompt_length, len(ids), f"prompt_lengths[{i}]", f"the length of sequences[{i}]")
        items.append(Item(ids, max(prompt_length, 1), f"sequences[{i}]"))
    scored = await score_items(
        call,
        items,
        model=served_model(call.engine, None),
        temperature=request.temperature,
        batch_field="sequences",
        temperature_field="temperature",
        top_k=k,
        top_k_field="top_logprobs",
        answer_bytes=_answer_bytes(request, completions),
    )
    # A prompt length 0 adds the first position, which has no log-prob (vLLM's None).
    lengths = [len(item.ids) - p for item, p in zip(items, request.prompt_lengths)]
    if request.response_format == "json":
        logprobs, token_ids = [], []
        for item, p, scores in zip(items, request.prompt_lengths, scored.scores):
            empty = [[]] if p == 0 else []
            lps, ids = _by_rank(item, scores, k)
            logprobs.append(empty + lps)
            token_ids.append(empty + ids)
            await budget.pause(answer_steps(item, k))
        # TRL's server answers through FastAPI's response_model, which writes every field of it
        payload = dict.fromkeys(RESPONSE_FIELDS, None) | {"logprobs": logprobs, "logprob_token_ids": token_ids}
        return RouteAnswer(payload, scored.model, scored.result)
    longest = max(lengths, default=0)
    actual = np.full((len(items), longest, 1), -np.inf, dtype=np.float32)
    actual_ids = np.zeros((len(items), longest, 1), dtype=np.int32)
    top = np.full((len(items), longest, k), -np.inf, dtype=np.float32)
    top_ids = np.zeros((len(items), longest, k), dtype=np.int32)
    for i, (item, length, scores) in enumerate(zip(items, lengths, scored.scores)):
        if scores is not None:
            first = length - len(scores.logprobs)  # 1 where the first position (no log-prob) is answered
            actual[i, first:length, 0] = scores.logprobs
            actual_ids[i, first:length, 0] = item.ids[item.start :]
            if k:
                top[i, first:length] = scores.top_logprobs
                top_ids[i, first:length] = scores.top_ids
        await budget.pause(SEQUENCE_STEPS)
    payload = {
        "logprobs_b64": _b64(top),
        "token_ids_b64": _b64(top_ids),
        "actual_logprobs_b64": _b64(actual),
        "actual_token_ids_b64": _b64(actual_ids),
        "shape": [len(items), longest, k],
        "completion_lengths": lengths,
    }
    return RouteAnswer(payload, scored.model, scored.result)
