"""SGLang's ``/generate`` for log-probs only (slime's on-policy distillation calls it with
``input_ids``, ``return_logprob``, ``logprob_start_len: 0`` and ``max_new_tokens: 0``), and the
``/get_model_info`` and ``/health_generate`` that slime's scripts poll.

The answer is SGLang's (docs/http.md quotes it): per input, ``{"text": "", "output_ids": [],
"meta_info": {..., "input_token_logprobs": [[logprob, token_id, null], ...]}}``: one entry for each
input position from ``logprob_start_len`` = s on, the first ``[null, x_s, null]`` whatever s is
(SGLang drops the last position's log-prob and puts ``None`` first, ``[None] + values[:-1]``, so
the tokens scored are s + 1 ..), and a ``null`` first row of ``input_top_logprobs`` and
``input_token_ids_logprobs`` likewise; a batch (``input_ids`` a list of lists) gets a list of them.
``meta_info`` has SGLang 0.5.23's keys in its order, with the values of a prefill-only request on
one data-parallel rank: nothing generated, retracted or cached, the model's version as
``weight_version`` (``/get_model_info``'s too), the time from the body's parsing to the scores as
``e2e_latency``.
``/generate`` names no model: it scores with the first one served.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import TypeVar

import numpy as np

from logprob_service.domain import SequenceScores
from logprob_service.engine import Budget, sequence_steps
from logprob_service.errors import InvalidArgument
from logprob_service.http import encoding
from logprob_service.http.app import RouteAnswer, RouteRequest
from logprob_service.http.bodies import Strict, generates_none, no_streaming, parse, served_model, text_refused
from logprob_service.http.scoring import (
    AnswerSize,
    Item,
    answer_steps,
    candidate_rows,
    check_counts,
    check_start,
    ids_of,
    score_items,
    top_k_counted,
)

T = TypeVar("T")


class SamplingParams(Strict):
    max_new_tokens: int | None = 128
    temperature: float | None = None


class GenerateRequest(Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = False


def _each(value: T | list[T] | None, i: int, batch: int, field: str) -> T | None:
    """A per-input field: one value for all inputs, or one per input (a single input's: a list of one)."""
    if not isinstance(value, list):
        return value
    if len(value) != batch:
        raise InvalidArgument(f"{field}: {len(value)} values for {batch} inputs; give one, or one per input")
    return value[i]


# The answer's bytes (``scoring.AnswerSize``): each log-prob a ``[<lp>,<id>,null],`` triple of at
# most 43 bytes (a log-prob of 24 characters, an int32 id), an input's meta_info 700 and its rid.
ANSWER = AnswerSize(request=64, sequence=700, entry=43)


def _counted(request: GenerateRequest, batch: list[list[int]], single: bool) -> tuple[list[int], list[int], int]:
    """The prompts and completions of the inputs to score, as sent, and the answer's bytes (a value
    that is not what its field takes counts as absent: the checks after name it)."""
    prompts, completions, entries = [], [], 0
    wanted = request.token_ids_logprob
    shared = single or (bool(wanted) and isinstance(wanted[0], int))
    for i, ids in enumerate(batch):
        start = _each(request.logprob_start_len, i, len(batch), "logprob_start_len")
        first = min(max(start if isinstance(start, int) else 0, 0) + 1, len(ids))
        k = _each(request.top_logprobs_num, i, len(batch), "top_logprobs_num")
        mine = wanted if shared else _each(wanted, i, len(batch), "token_ids_logprob")
        width = len(mine) if isinstance(mine, list) else 0
        entries += (len(ids) - first) * (1 + top_k_counted(k if isinstance(k, int) else 0) + width)
        if first < len(ids):
            prompts.append(first)
            completions.append(len(ids) - first)
    rids = request.rid if isinstance(request.rid, list) else [request.rid or ""]
    return prompts, completions, ANSWER.of(len(batch), entries) + sum(map(len, rids))


async def generate(call: RouteRequest) -> RouteAnswer:
    begun = time.perf_counter()
    request = parse(call.body, GenerateRequest, call.engine.limits, "input_ids")
    if request.text is not None:
        raise text_refused("text")
    if request.input_ids is None:
        raise InvalidArgument("input_ids: absent; this server scores token ids")
    no_streaming(request.stream)
    single = bool(request.input_ids) and isinstance(request.input_ids[0], int)
    batch: list[list[int]] = [request.input_ids] if single else request.input_ids  # type: ignore[list-item]
    if not batch:
        raise InvalidArgument("input_ids: is empty; at least 1 input is required")
    prompts, completions, answer_bytes = _counted(request, batch, single)
    check_counts(call, "input_ids", prompts, completions, answer_bytes)
    items, starts, rids, temperatures, tops = [], [], [], set(), set()
    budget = Budget()  # thousands of inputs: the event loop handed back between slices of them
    for i in range(len(batch)):
        await budget.pause(sequence_steps(len(batch[i])))
        where = "" if single else f"[{i}]"
        field = f"input_ids{where}"
        ids = ids_of(batch[i], field)
        params = _each(request.sampling_params, i, len(batch), "sampling_params") or SamplingParams()
        generates_none(params, "max_new_tokens", f"sampling_params{where}.max_new_tokens", (0,))
        temperatures.add(params.temperature or 0.0)
        if not _each(request.return_logprob, i, len(batch), "return_logprob"):
            raise InvalidArgument(f"return_logprob{where}: not true; this server answers log-probs only (send true)")
        start = _each(request.logprob_start_len, i, len(batch), "logprob_start_len")
        start = -1 if start is None else start
        check_start(start, len(ids) - 1, f"logprob_start_len{where}", "the first input position answered")
        tops.add(_each(request.top_logprobs_num, i, len(batch), "top_logprobs_num") or 0)
        item = Item(ids, start + 1, field)  # SGLang answers position start's log-prob null
        wanted = request.token_ids_logprob
        if wanted is not None:
            shared = single or (bool(wanted) and isinstance(wanted[0], int))
            name = "token_ids_logprob" if shared else f"token_ids_logprob[{i}]"
            mine = wanted if shared else _each(wanted, i, len(batch), "token_ids_logprob")
            candidates = candidate_rows(mine, len(ids) - item.start, name)  # type: ignore[arg-type]
            item = dataclasses.replace(item, candidates=candidates, candidates_field=name)
        items.append(item)
        starts.append(start)
        rids.append(_each(request.rid, i, len(batch), "rid") or uuid.uuid4().hex)
    if len(temperatures) > 1:
        raise InvalidArgument("sampling_params: inputs of one request must share a temperature; send them apart")
    if len(tops) > 1:
        raise InvalidArgument("top_logprobs_num: inputs of one request must share it; send them apart")
    k = tops.pop()
    scored = await score_items(
        call,
        items,
        model=served_model(call.engine, None),
        temperature=temperatures.pop(),  # 0 or absent: 1.0 (greedy's log-probs are unscaled)
        batch_field="input_ids",
        temperature_field="sampling_params.temperature",
        top_k=k,
        top_k_field="top_logprobs_num",
        answer_bytes=answer_bytes,
    )
    latency, sent, version = time.perf_counter() - begun, time.time(), scored.result.model_version
    answers = []
    for item, start, rid, scores in zip(items, starts, rids, scored.scores):
        answers.append(input_answer(item, start, rid, scores, k, version=version, latency=latency, sent=sent))
        await budget.pause(answer_steps(item, k))
    return RouteAnswer(answers[0] if single else encoding.array(answers), scored.model, scored.result)


def input_answer(
    item: Item,
    start: int,
    rid: str,
    scores: SequenceScores | None,
    k: int,
    *,
    version: int,
    latency: float,
    sent: float,
) -> bytes:
    """SGLang's answer to one input, as JSON (``start``: its ``logprob_start_len``; ``k``: its
    ``top_logprobs_num``; ``version``: the model's; ``latency``: seconds from its body's parsing
    to its scores, SGLang's ``e2e_latency``; ``sent``: the answer's wall-clock time, SGLang's
    ``response_sent_to_client_ts``): position ``start``'s entries null, then the scored positions'."""
    first = b"[null,%d,null]" % item.ids[start]
    raw = {}
    if scores is None:  # only position start, which SGLang answers null
        raw["input_token_logprobs"] = b"[" + first + b"]"
        raw |= {"input_top_logprobs": b"[null]"} if k else {}
        raw |= {"input_token_ids_logprobs": b"[null]"} if item.candidates is not None else {}
    else:
        raw["input_token_logprobs"] = encoding.prepend(first, encoding.triples(scores.logprobs, item.ids[item.start :]))
        if k:
            raw["input_top_logprobs"] = _positions(scores.top_ids, scores.top_logprobs)
        if item.candidates is not None:
            raw["input_token_ids_logprobs"] = _positions(item.candidates, scores.candidate_logprobs)
    # SGLang's keys in its order (its tokenizer manager fills meta_info key by key: docs/http.md)
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(item.ids),
        "weight_version": str(version),
        "num_retractions": 0,
        "input_token_logprobs": None,
        "output_token_logprobs": [],
        "output_token_logprobs_length": 0,
        **({"input_top_logprobs": None, "output_top_logprobs": []} if k else {}),
        **({"input_token_ids_logprobs": None, "output_token_ids_logprobs": []} if item.candidates is not None else {}),
        "reasoning_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_versions": [{"version": str(version), "start": 0, "end": 0}],
        "cached_tokens_details": None,
        "dp_rank": 0,
        "e2e_latency": latency,
        "response_sent_to_client_ts": sent,
    }
    return b'{"text":"","output_ids":[],"meta_info":%b}' % encoding.with_raw(meta, **raw)


def _positions(ids: np.ndarray, logprobs: np.ndarray) -> bytes:
    """SGLang's per-position lists of ``[logprob, token_id, null]`` (``input_top_logprobs``,
    ``input_token_ids_logprobs``), after the null row of position ``logprob_start_len``."""
    return encoding.prepend(b"null", encoding.triples(logprobs, ids))


async def model_info(call: RouteRequest) -> RouteAnswer:
    """SGLang's ``/get_model_info`` of the model ``/generate`` scores with."""
    info = next(m for m in await call.engine.list_models() if m.name == served_model(call.engine, None))
    return RouteAnswer(
        {
            "model_path": info.source,
            "tokenizer_path": info.source,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(info.version),
            "model_type": info.architecture,
            "architectures": [info.architecture],
        }
    )
