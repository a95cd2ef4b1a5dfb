"""Check a ScoreJob against its model and the server's limits.

Every rejection raises ``InvalidArgument`` whose message names the field, the index, the bad
value and the limit, e.g. ``sequences[3].completion_ids[7]: token id 50321 is outside
[0, 32000) of model 'default'``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from logprob_service.domain import ModelInfo, ScoreJob
from logprob_service.errors import InvalidArgument

# The smallest temperature (as a float32, the wire's type). Logits divided by a much smaller one
# overflow float32 to inf and the log-probs come out NaN (found by tests/integration/test_fuzz.py);
# no sampler runs anywhere near it.
MIN_TEMPERATURE = float(np.float32(1e-6))


@dataclass(frozen=True)
class RequestLimits:
    max_sequences_per_request: int
    max_tokens_per_request: int


def validate_temperature(temperature: float) -> float:
    """0 means unset (1.0); anything else must be finite and at least ``MIN_TEMPERATURE``."""
    if temperature == 0.0:
        return 1.0
    if not math.isfinite(temperature) or temperature < MIN_TEMPERATURE:
        raise InvalidArgument(
            f"temperature: {temperature} must be a finite number >= {MIN_TEMPERATURE:.0e} (or 0 for the default 1.0)"
        )
    return temperature


def validate_version(field: str, version: int) -> int:
    if version < 0:
        raise InvalidArgument(f"{field}: {version} must be >= 0 (0: unset)")
    return version


def validate_job(job: ScoreJob, info: ModelInfo, limits: RequestLimits) -> None:
    if not job.sequences:
        raise InvalidArgument("sequences: the request has no sequences; at least 1 is required")
    if len(job.sequences) > limits.max_sequences_per_request:
        raise InvalidArgument(
            f"sequences: {len(job.sequences)} sequences exceed the limit of "
            f"{limits.max_sequences_per_request} per request"
        )
    if job.num_tokens > limits.max_tokens_per_request:
        raise InvalidArgument(
            f"sequences: {job.num_tokens} tokens (prompt + completion, all sequences) exceed the limit "
            f"of {limits.max_tokens_per_request} per request"
        )
    for i, seq in enumerate(job.sequences):
        for field, ids in (("prompt_ids", seq.prompt_ids), ("completion_ids", seq.completion_ids)):
            if len(ids) == 0:
                raise InvalidArgument(f"sequences[{i}].{field}: is empty; at least 1 token is required")
            bad = np.flatnonzero((ids < 0) | (ids >= info.vocab_size))
            if bad.size:
                j = int(bad[0])
                raise InvalidArgument(
                    f"sequences[{i}].{field}[{j}]: token id {int(ids[j])} is outside "
                    f"[0, {info.vocab_size}) of model {info.name!r}"
                )
        if info.max_positions is not None and seq.num_tokens > info.max_positions:
            raise InvalidArgument(
                f"sequences[{i}]: {len(seq.prompt_ids)} prompt + {len(seq.completion_ids)} completion = "
                f"{seq.num_tokens} tokens exceed the {info.max_positions} positions of model {info.name!r}"
            )
