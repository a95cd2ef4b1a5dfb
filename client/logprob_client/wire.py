"""The client's side of the wire: scoring requests from the caller's sequences, the caller's
layout from the responses, and the server's model descriptions."""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from logprob_proto import logprob_pb2 as pb

from .errors import InvalidRequest, LogprobError, MixedVersionsError, ServerError, error_for_status
from .inputs import Prepared, assemble


@dataclass(frozen=True)
class ModelLimits:
    """What the server takes of a model's requests. ``max_queued_tokens`` and
    ``max_queued_tokens_per_client``: the whole queue's and one client's share of it (tokens admitted
    and not yet scored), server-wide; a call cut into parts is paced to the share (``pacing.py``).
    0: the server does not tell (one before these fields)."""

    max_sequence_tokens: int
    max_sequences_per_request: int
    max_tokens_per_request: int
    max_queued_tokens: int = 0
    max_queued_tokens_per_client: int = 0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    max_positions: int
    dtype: str
    version: int
    fingerprint: str
    limits: ModelLimits
    source: str
    device: str
    base_model: str = ""  # a LoRA model's base, whose weights it shares
    attention: str = ""  # which attention backend serves which kind of row
    determinism: str = ""  # what the server's --deterministic guarantees for this model
    num_experts: int = 0  # experts per MoE layer, whose choices return_routed_experts returns; 0: none
    weight_format: str = ""  # the dtype, or the checkpoint's quantization and its compute mode


@dataclass(frozen=True)
class ScoreInput:
    """One batch for ``score_many``: the same arguments ``score`` takes."""

    prompt_ids: Any
    completion_ids: Any
    prompt_mask: Any = None
    completion_mask: Any = None
    candidate_ids: Any = None


def model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        name=m.name,
        architecture=m.architecture,
        vocab_size=m.vocab_size,
        max_positions=m.max_positions,
        dtype=m.dtype,
        version=m.version,
        fingerprint=m.fingerprint,
        limits=ModelLimits(
            max_sequence_tokens=m.limits.max_sequence_tokens,
            max_sequences_per_request=m.limits.max_sequences_per_request,
            max_tokens_per_request=m.limits.max_tokens_per_request,
            max_queued_tokens=m.limits.max_queued_tokens,
            max_queued_tokens_per_client=m.limits.max_queued_tokens_per_client,
        ),
        source=m.source,
        device=m.device,
        base_model=m.base_model,
        attention=m.attention,
        determinism=m.determinism,
        num_experts=m.num_experts,
        weight_format=m.weight_format,
    )


@dataclass(frozen=True)
class Options:
    """Per-call scoring options, as every part of a call sends them."""

    model: str
    temperature: float
    return_entropy: bool
    min_version: int
    top_k: int = 0
    return_routed_experts: bool = False


def repeats_prompt(sequences: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[bool]:
    """Whether each sequence has the same prompt as the one before it (TRL's layout of GRPO groups)."""
    return [i > 0 and np.array_equal(prompt, sequences[i - 1][0]) for i, (prompt, _) in enumerate(sequences)]


def _i32(ids: np.ndarray) -> bytes:
    return ids.astype("<i4").tobytes()


def _candidates(ids: np.ndarray | None) -> dict[str, Any]:
    """A Sequence's or Completion's candidate fields for [C, Kc] ids (none for None)."""
    return {} if ids is None else {"candidate_ids_i32": _i32(ids), "num_candidates": ids.shape[1]}


def score_request(
    sequences: Sequence[tuple[np.ndarray, np.ndarray]],
    options: Options,
    *,
    repeats: Sequence[bool] | None = None,
    legacy: bool = False,
    candidates: Sequence[np.ndarray | None] | None = None,
) -> pb.ScoreRequest:
    """A request carrying ``sequences``, ids as int32 bytes and asking for float32 bytes back. With
    ``repeats`` (``repeats_prompt`` of them), as ``SequenceGroup``s: each run of consecutive
    sequences with one prompt one group (a lone sequence, a group of one), so a prompt crosses the
    wire once; the answers come back in the sequences' order. Without, each sequence whole.
    ``legacy``: a v1 request (every sequence whole, repeated fields). ``candidates``: each
    sequence's [C, Kc] candidate ids, or None."""
    request = pb.ScoreRequest(
        request_id=str(uuid.uuid4()),
        model=options.model,
        temperature=options.temperature,
        return_entropy=options.return_entropy,
        min_version=options.min_version,
        scores_f32=not legacy,
        top_k=options.top_k,
        return_routed_experts=options.return_routed_experts,
    )
    extra = [_candidates(ids) for ids in candidates] if candidates is not None else [{}] * len(sequences)
    if legacy:
        request.sequences.extend(pb.Sequence(prompt_ids=p.tolist(), completion_ids=c.tolist()) for p, c in sequences)
    elif repeats is None:
        request.sequences.extend(
            pb.Sequence(prompt_ids_i32=_i32(p), completion_ids_i32=_i32(c), **more)
            for (p, c), more in zip(sequences, extra, strict=True)
        )
    else:
        for (prompt, completion), repeat, more in zip(sequences, repeats, extra, strict=True):
            if not (request.groups and repeat):  # a part's first sequence starts a group
                request.groups.add(prompt_ids_i32=_i32(prompt))
            request.groups[-1].completions.add(completion_ids_i32=_i32(completion), **more)
    return request


def _values(scores: pb.SequenceScores, field: str) -> np.ndarray:
    """One list of scores: from its float32 bytes, or (from a server that answers v1) the repeated field."""
    raw = getattr(scores, f"{field}_f32")
    return np.frombuffer(raw, dtype="<f4") if raw else np.asarray(getattr(scores, field), dtype=np.float32)


@dataclass(frozen=True)
class TeacherScores:
    """A call's answer when it asked for ``top_k`` or ``return_routed_experts``, or sent
    ``candidate_ids``: each field in the caller's layout (lists: one array per sequence; 2-D inputs:
    (B, C), (B, C, K) and (B, C, layers, top_k) arrays or tensors, 0 where ``completion_mask`` is 0)."""

    logprobs: Any  # [C] float32 per sequence
    entropies: Any = None  # [C] float32 per sequence, with return_entropy
    top_ids: Any = None  # [C, K] int32: the K most likely ids at each position, descending, ties by id
    top_logprobs: Any = None  # [C, K] float32: their log-probs
    candidate_logprobs: Any = None  # [C, Kc] float32: log-probs of candidate_ids (None where none were sent)
    # [C, MoE layers, top_k] int64: the experts each MoE layer routed the row predicting token t to
    routed_experts: Any = None


def _rows_of(scores: pb.SequenceScores, field: str, dtype: str, columns: int) -> np.ndarray:
    """A packed [C * columns] field as [C, columns]."""
    return np.frombuffer(getattr(scores, field), dtype=dtype).reshape(-1, columns)


def _routed_experts(scores: pb.SequenceScores, completion: int) -> np.ndarray:
    """A sequence's ``RoutedExperts`` as [C, layers, top_k] (int16 or int32 ids on the wire, told
    apart by their length)."""
    if not scores.HasField("routed_experts"):
        raise ServerError(
            "the server answered no routed_experts: it predates return_routed_experts",
            grpc.StatusCode.UNIMPLEMENTED,
        )
    routed = scores.routed_experts
    shape = (completion, routed.layers, routed.top_k)
    size = len(routed.ids) // max(1, int(np.prod(shape)))
    return np.frombuffer(routed.ids, dtype=f"<i{size}").reshape(shape).astype(np.int64)


def result(
    prepared: Prepared,
    responses: Sequence[pb.ScoreResponse],
    return_entropy: bool,
    top_k: int = 0,
    return_routed_experts: bool = False,
) -> Any:
    """The caller's layout from the responses of a call's parts, in part order: log-probs (and
    entropies, as a pair); with ``top_k``, candidates or ``return_routed_experts``, a ``TeacherScores``."""
    versions = sorted({response.model_version for response in responses})
    if len(versions) > 1:
        # The model's weights were updated while the call's parts were being scored.
        raise MixedVersionsError(
            f"the parts of this call were scored by versions {versions} of model {responses[0].model!r}; "
            f"retry with min_version={versions[-1]}"
        )
    scores = [s for response in responses for s in response.scores]
    per_sequence = [_values(s, "logprobs") for s in scores]
    logprobs = assemble(prepared, per_sequence)
    entropies = assemble(prepared, [_values(s, "entropies") for s in scores]) if return_entropy else None
    if not top_k and prepared.candidates is None and not return_routed_experts:
        return logprobs if entropies is None else (logprobs, entropies)
    answer = TeacherScores(logprobs, entropies)
    if top_k:
        ids = [_rows_of(s, "top_ids_i32", "<i4", top_k) for s in scores]
        lps = [_rows_of(s, "top_logprobs_f32", "<f4", top_k) for s in scores]
        answer = dataclasses.replace(
            answer, top_ids=assemble(prepared, ids, top_k, np.int32), top_logprobs=assemble(prepared, lps, top_k)
        )
    if prepared.candidates is not None:
        widths = [0 if ids is None else ids.shape[1] for ids in prepared.candidates]
        cands = [_rows_of(s, "candidate_logprobs_f32", "<f4", w) if w else None for s, w in zip(scores, widths)]
        answer = dataclasses.replace(answer, candidate_logprobs=assemble(prepared, cands, max(widths)))
    if return_routed_experts:
        routed = [_routed_experts(s, len(lp)) for s, lp in zip(scores, per_sequence, strict=True)]
        trailing = routed[0].shape[1:] if routed else ()
        answer = dataclasses.replace(answer, routed_experts=assemble(prepared, routed, trailing, np.int64))
    return answer


# How the server names a sequence of a request, at the start of its message ("...: token id 5000
# is outside [0, 4096)"): api/wire.py and engine/validation.py.
_WIRE_NAME = re.compile(
    r"(?:sequences\[(?P<sequence>\d+)\]|groups\[(?P<group>\d+)\](?:\.completions\[(?P<completion>\d+)\])?)"
    r"(?:\.(?P<field>prompt_ids|completion_ids|candidate_ids)(?:\[(?P<position>\d+)\])?(?P<column>\[\d+\])?)?(?=:)"
)


def _sequences(request: pb.ScoreRequest) -> int:
    return len(request.sequences) + sum(len(group.completions) for group in request.groups)


def caller_error(
    prepared: Prepared, requests: Sequence[pb.ScoreRequest], part: int, code: grpc.StatusCode | int, message: str
) -> LogprobError:
    """The typed error of the server's answer to ``requests[part]`` (the RPCs of one call, built
    from ``prepared``). An INVALID_ARGUMENT naming a sequence of that request
    (``groups[2].completions[0].completion_ids[1]: ...``) names it as the caller did instead
    (``completion_ids[3][1]: ...``): prompts shared in groups, the call cut into several RPCs and
    dense rows left out (nothing to score) number the request's sequences otherwise. The
    server's message stays in ``server_message``."""
    error = error_for_status(code, message)
    match = _WIRE_NAME.match(message)
    if not isinstance(error, InvalidRequest) or match is None or part >= len(requests):
        return error
    request = requests[part]
    if match["sequence"] is not None:
        index = int(match["sequence"])
    else:
        group = int(match["group"])
        if group >= len(request.groups):
            return error
        earlier = sum(len(g.completions) for g in request.groups[:group])
        index = len(request.sequences) + earlier + int(match["completion"] or 0)  # a group's prompt: its first
    index += sum(_sequences(r) for r in requests[:part])
    if index >= len(prepared.sequences):
        return error
    position = None if match["position"] is None else int(match["position"])
    name = prepared.name(index, match["field"], position) + (match["column"] or "")
    rpc = f" of RPC {part + 1} of {len(requests)}" if len(requests) > 1 else ""
    return type(error)(f"{name}{message[match.end() :]} (sent as {match[0]}{rpc})", error.code, server_message=message)


def collect(
    calls: list[tuple[Prepared, list[pb.ScoreRequest]]],
    responses: dict[str, pb.ScoreResponse],
    return_entropy: bool,
    return_exceptions: bool,
    top_k: int = 0,
    return_routed_experts: bool = False,
) -> list[Any]:
    results: list[Any] = []
    for prepared, requests in calls:
        errors = (_stream_error(prepared, requests, part, responses) for part in range(len(requests)))
        error = next(filter(None, errors), None)
        if error is None:
            answers = [responses[r.request_id] for r in requests]
            results.append(result(prepared, answers, return_entropy, top_k, return_routed_experts))
        elif return_exceptions:
            results.append(error)
        else:
            raise error
    return results


def _stream_error(
    prepared: Prepared, requests: Sequence[pb.ScoreRequest], part: int, responses: dict[str, pb.ScoreResponse]
) -> LogprobError | None:
    """The error the stream answered for ``requests[part]``, if any."""
    response = responses.get(requests[part].request_id)
    if response is None:
        return error_for_status(grpc.StatusCode.UNKNOWN, f"no response for {requests[part].request_id}")
    if response.HasField("error"):
        return caller_error(prepared, requests, part, response.error.code, response.error.message)
    return None
