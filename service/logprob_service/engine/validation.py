"""Check a ScoreJob against its model and the server's limits, and a request's counts before
any of it is built.

Every rejection raises ``InvalidArgument`` whose message names the field, the index, the bad
value and the limit as the request named them, e.g. ``sequences[3].completion_ids[7]: token id
50321 is outside [0, 32000) of model 'default'`` or ``groups[1].completions[5].completion_ids[0]: ...``.

A request's cost is known from its wire form: its sequences, its tokens and the bytes of its
answer (``RequestCounts``). Each edge counts them from what it received, before it builds an
object per sequence or converts any ids, and refuses with ``check_counts``; ``validate_job``
checks the built job with the same function, so a limit has one message whichever check meets it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from logprob_service.domain import MAX_TOP_K, ModelInfo, ScoreJob, TokenSequence, validate_version
from logprob_service.engine.costs import tokens_run
from logprob_service.errors import InvalidArgument

# The smallest temperature (as a float32, the wire's type). Logits divided by a much smaller one
# overflow float32 to inf and the log-probs come out NaN (found by tests/integration/limits/test_fuzz.py);
# no sampler runs anywhere near it.
MIN_TEMPERATURE = float(np.float32(1e-6))


UNLIMITED = 2**62


@dataclass(frozen=True)
class RequestLimits:
    max_sequences_per_request: int
    max_tokens_per_request: int
    max_answer_bytes: int = UNLIMITED
    answer_limit: str = "max_answer_bytes"  # the setting max_answer_bytes comes from, for its message
    # The queue's limits (admission.py), which a request's cost must fit; told to clients (ListModels).
    max_queued_tokens: int = UNLIMITED
    max_queued_tokens_per_client: int = UNLIMITED


@dataclass(frozen=True)
class RequestCounts:
    """What a request asks for, counted before its work.

    ``tokens``: each distinct prompt once, plus every completion. An edge counting the wire tells
    prompts apart by their lengths only (``distinct_prompt_tokens``), a count that never exceeds
    the job's, so what it refuses the job would be refused for too. ``answer_bytes``: the edge's
    estimate of its answer, encoded as it sends it (``ScoreJob.answer_bytes``)."""

    sequences: int
    tokens: int = 0
    answer_bytes: int = 0


def distinct_prompt_tokens(prompt_lengths: Iterable[int], completion_tokens: int) -> int:
    """The tokens of a request's prompts and completions, each prompt counted once where it
    could be one that another repeats (an equal length): at most what the job counts."""
    return sum(set(prompt_lengths)) + completion_tokens


def check_counts(counts: RequestCounts, limits: RequestLimits) -> None:
    """``InvalidArgument`` naming the limit and the count when ``counts`` pass one of ``limits``."""
    if counts.sequences > limits.max_sequences_per_request:
        raise InvalidArgument(
            f"sequences: {counts.sequences} sequences (a group's completions each count) exceed the limit of "
            f"{limits.max_sequences_per_request} per request"
        )
    if counts.tokens > limits.max_tokens_per_request:
        raise InvalidArgument(
            f"sequences: {counts.tokens} tokens (each distinct prompt once, plus every completion) exceed the limit "
            f"of {limits.max_tokens_per_request} per request"
        )
    if counts.answer_bytes > limits.max_answer_bytes:
        raise InvalidArgument(
            f"sequences: the answer would take about {counts.answer_bytes} bytes (every completion token's "
            f"log-prob, entropy, top-k and candidates), more than the limit of {limits.max_answer_bytes} bytes "
            f"({limits.answer_limit}); send fewer completion tokens, a smaller top-k or fewer candidates a call"
        )


def validate_temperature(temperature: float) -> float:
    """0 means unset (1.0); anything else must be finite and at least ``MIN_TEMPERATURE``."""
    if temperature == 0.0:
        return 1.0
    if not math.isfinite(temperature) or temperature < MIN_TEMPERATURE:
        raise InvalidArgument(
            f"temperature: {temperature} must be a finite number >= {MIN_TEMPERATURE:.0e} (or 0 for the default 1.0)"
        )
    return temperature


def _names(job: ScoreJob) -> list[tuple[str, str | None]]:
    """For each of ``job.sequences``, how the request named it and its prompt's field, the latter
    None where an earlier sequence of the same group already had the prompt checked."""
    plain = len(job.sequences) - sum(job.group_sizes)
    names: list[tuple[str, str | None]] = [(f"sequences[{i}]", f"sequences[{i}].prompt_ids") for i in range(plain)]
    for g, size in enumerate(job.group_sizes):
        names += [(f"groups[{g}].completions[{c}]", None if c else f"groups[{g}].prompt_ids") for c in range(size)]
    return names


def _check_ids(field: str, ids: np.ndarray, info: ModelInfo) -> None:
    if len(ids) == 0:
        raise InvalidArgument(f"{field}: is empty; at least 1 token is required")
    bad = np.flatnonzero((ids < 0) | (ids >= info.vocab_size))
    if bad.size:
        j = int(bad[0])
        raise InvalidArgument(
            f"{field}[{j}]: token id {int(ids[j])} is outside [0, {info.vocab_size}) of model {info.name!r}"
        )


def _check_candidates(name: str, seq: TokenSequence, info: ModelInfo) -> None:
    """``seq.candidate_ids``: [C, Kc] ids of the model's vocabulary, 1 <= Kc <= ``MAX_TOP_K``."""
    candidates = seq.candidate_ids
    if candidates is None:
        return
    field = f"{name}.candidate_ids"
    rows = len(seq.completion_ids)
    if candidates.ndim != 2 or candidates.shape[0] != rows:
        got = f"{candidates.shape[0]} rows of {candidates.shape[1]}" if candidates.ndim == 2 else f"{candidates.size}"
        raise InvalidArgument(
            f"{field}: {got} ids; the completion has {rows} tokens, and each needs one row of equal length"
        )
    if not 1 <= candidates.shape[1] <= min(MAX_TOP_K, info.vocab_size):
        raise InvalidArgument(
            f"{field}: {candidates.shape[1]} candidates per position; 1 to {min(MAX_TOP_K, info.vocab_size)} allowed"
        )
    bad = np.argwhere((candidates < 0) | (candidates >= info.vocab_size))
    if bad.size:
        t, j = (int(x) for x in bad[0])
        raise InvalidArgument(
            f"{field}[{t}][{j}]: token id {int(candidates[t, j])} (completion position {t}) is outside "
            f"[0, {info.vocab_size}) of model {info.name!r}"
        )


def validate_job(job: ScoreJob, info: ModelInfo, limits: RequestLimits) -> ScoreJob:
    """``job`` checked against its model ``info`` and ``limits``, with its temperature resolved
    (0: the default 1.0); ``InvalidArgument`` naming the field, index and limit otherwise."""
    options = job.options
    temperature = validate_temperature(options.temperature)
    validate_version("min_version", job.min_version)
    if not 0 <= options.top_k <= min(MAX_TOP_K, info.vocab_size):
        raise InvalidArgument(f"top_k: {options.top_k} must lie in [0, {min(MAX_TOP_K, info.vocab_size)}] (0: none)")
    if options.return_routed_experts and not info.num_experts:
        raise InvalidArgument(
            f"return_routed_experts: model {info.name!r} ({info.architecture}) has no mixture-of-experts "
            "routers whose choices could be returned"
        )
    for g, size in enumerate(job.group_sizes):
        if size == 0:
            raise InvalidArgument(f"groups[{g}].completions: the group has none; at least 1 completion is required")
    if not job.sequences:
        raise InvalidArgument("sequences: the request has no sequences and no groups; at least 1 sequence is required")
    check_counts(RequestCounts(len(job.sequences), tokens_run(job.sequences), job.answer_bytes), limits)
    if not _all_valid(job.sequences, info):
        _refuse_first_invalid(job, info)
    if temperature == options.temperature:
        return job
    return dataclasses.replace(job, options=dataclasses.replace(options, temperature=temperature))


def _all_valid(sequences: list[TokenSequence], info: ModelInfo) -> bool:
    """Whether every sequence's ids, candidates and length are valid, checked over all of them at
    once (a request of thousands of sequences in a few numpy passes, not a few per sequence)."""
    arrays, cap = [], min(MAX_TOP_K, info.vocab_size)
    for seq in sequences:
        prompt, completion, candidates = seq.prompt_ids, seq.completion_ids, seq.candidate_ids
        if not len(prompt) or not len(completion):
            return False
        if info.max_positions is not None and len(prompt) + len(completion) > info.max_positions:
            return False
        arrays += (prompt, completion)
        if candidates is not None:
            if candidates.ndim != 2 or candidates.shape[0] != len(completion) or not 1 <= candidates.shape[1] <= cap:
                return False
            arrays.append(candidates.ravel())
    ids = np.concatenate(arrays)
    return not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < info.vocab_size)


def _refuse_first_invalid(job: ScoreJob, info: ModelInfo) -> None:
    """``InvalidArgument`` naming the first invalid sequence of ``job`` as the request named it."""
    for seq, (name, prompt_field) in zip(job.sequences, _names(job), strict=True):
        if prompt_field is not None:
            _check_ids(prompt_field, seq.prompt_ids, info)
        _check_ids(f"{name}.completion_ids", seq.completion_ids, info)
        _check_candidates(name, seq, info)
        if info.max_positions is not None and seq.num_tokens > info.max_positions:
            raise InvalidArgument(
                f"{name}: {len(seq.prompt_ids)} prompt + {len(seq.completion_ids)} completion = "
                f"{seq.num_tokens} tokens exceed the {info.max_positions} positions of model {info.name!r}"
            )
