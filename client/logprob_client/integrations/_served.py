"""What the verl and OpenRLHF integrations share: checking a served model against the trainer's
settings at start-up, and scoring a trainer's rows with GRPO groups sent as shared-prompt groups.

numpy only: the frameworks' tensors are cut into token-id arrays by their own modules.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..client import LogprobClient
from ..errors import LogprobError, Unavailable
from ..wire import ModelInfo


class ServiceConfigError(ValueError):
    """A setting of the trainer's that the service contradicts; the message names the setting."""


class UntestedVersionWarning(UserWarning):
    """The installed trainer framework is not the release its integration was tested with."""


def warn_untested_version(distribution: str, tested: str, installed: str | None = None) -> str | None:
    """Warn, once, when ``distribution``'s installed version (``installed``, else what its
    package metadata says) is not ``tested``: the integration reaches into the framework's
    internals, which move between releases. Returns the installed version (None: not found)."""
    if installed is None:
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
    if installed != tested:
        warnings.warn(
            f"logprob_client's {distribution} integration was tested with {distribution} {tested}; "
            f"{distribution} {installed} is installed: its internals may have moved (install {distribution}=={tested}, "
            "or check the integration's tests against this release)",
            UntestedVersionWarning,
            stacklevel=2,
        )
    return installed


def targets(address: str | Sequence[str], setting: str) -> str | list[str]:
    """The client's target from a trainer setting: one gRPC target, or replicas given as a list or
    as one comma-separated string of ``host:port`` (calls are spread over them)."""
    if isinstance(address, str):
        replicas = [part.strip() for part in address.split(",") if part.strip()]
    else:
        replicas = [str(part).strip() for part in address]
    if not replicas:
        raise ServiceConfigError(f"{setting} is empty: set it to the service's host:port (or several, comma-separated)")
    return replicas[0] if len(replicas) == 1 else replicas


@dataclass(frozen=True)
class Expected:
    """What the trainer expects of the served model, each with the setting that says so."""

    model: str
    model_setting: str
    address_setting: str
    vocab_size: int | None = None  # the trainer's tokenizer/model vocabulary
    vocab_setting: str = ""
    dtype: str | None = None  # the dtype the trainer would have run the model in
    dtype_setting: str = ""


def check_served_model(client: LogprobClient, expected: Expected, timeout: float = 30.0) -> ModelInfo:
    """The served model's description, once checked against ``expected``; a mismatch (or no
    service at the address) raises ``ServiceConfigError`` naming the setting, before any training."""
    try:
        served = {m.name: m for m in client.list_models(timeout=timeout)}
    except Unavailable as err:
        raise ServiceConfigError(
            f"no logprob-service answers at {expected.address_setting} ({err.message}); check the address"
        ) from None
    except LogprobError as err:
        raise ServiceConfigError(f"the service at {expected.address_setting} refused ListModels: {err}") from None
    info = served.get(expected.model)
    if info is None:
        raise ServiceConfigError(
            f"{expected.model_setting}={expected.model!r}: the service serves no such model; "
            f"it serves {', '.join(sorted(served)) or 'none'}"
        )
    if expected.vocab_size is not None and info.vocab_size != expected.vocab_size:
        raise ServiceConfigError(
            f"{expected.model_setting}={expected.model!r} has a vocabulary of {info.vocab_size} tokens but "
            f"{expected.vocab_setting} has {expected.vocab_size}: the served model must share the trainer's tokenizer"
        )
    if expected.dtype is not None and normalize_dtype(info.dtype) != normalize_dtype(expected.dtype):
        raise ServiceConfigError(
            f"{expected.model_setting}={expected.model!r} is served in {info.dtype} but {expected.dtype_setting} "
            f"is {expected.dtype}: serve it in that dtype (logprob-service serve --dtype) or change the setting"
        )
    return info


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def normalize_dtype(name: str) -> str:
    name = str(name).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def score_rows(
    client: LogprobClient,
    model: str,
    prompts: Sequence[np.ndarray],
    completions: Sequence[np.ndarray],
    *,
    temperature: float,
    return_entropy: bool,
    min_version: int = 0,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Log-probs (and entropies) of each row's completion, in row order.

    Rows whose prompts are equal are sent next to each other, so the client sends each such run as
    one shared-prompt group (the prompt sent and run once): a trainer's rows of a GRPO group need
    not be adjacent (verl balances its batch by length before scoring). Every row's result is
    put back in its own place.
    """
    first: dict[bytes, int] = {}
    keys = [first.setdefault(np.ascontiguousarray(p, dtype=np.int64).tobytes(), i) for i, p in enumerate(prompts)]
    order = sorted(range(len(prompts)), key=lambda i: (keys[i], i))  # groups in order of first appearance
    if not order:
        return [], ([] if return_entropy else None)
    result: Any = client.score(
        [prompts[i] for i in order],
        [completions[i] for i in order],
        model=model,
        temperature=temperature,
        return_entropy=return_entropy,
        min_version=min_version,
    )
    logps, entropies = result if return_entropy else (result, None)
    out_logps: list[Any] = [None] * len(order)
    out_entropies: list[Any] | None = [None] * len(order) if return_entropy else None
    for position, row in enumerate(order):
        out_logps[row] = logps[position]
        if out_entropies is not None:
            out_entropies[row] = entropies[position]
    return out_logps, out_entropies
