"""The engine, protocol-neutral and torch-free: what every edge calls is exported here.

Above the engine, every module imports the engine from this package only (`make lint`): the
facade (``LogprobEngine``, its ``Phase`` and ``EngineConfig``), the registry it serves from, the
request limits and counts an edge checks before any per-item work (and ``prompt_once``, whether
a request's prompt runs once for its sequences, which the count of its tokens follows), and the types of what an edge
hands a weight update (``WeightGroup``) or is told by one (``StreamIdle``). Only the builder,
which assembles the engine, reaches its modules.
"""

from logprob_service.engine.costs import prompt_once
from logprob_service.engine.engine import EngineConfig, LogprobEngine, Phase
from logprob_service.engine.interfaces import WeightGroup
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.slices import SEQUENCE_STEPS, Budget, sequence_steps
from logprob_service.engine.validation import (
    UNLIMITED,
    RequestCounts,
    RequestLimits,
    check_counts,
    distinct_prompt_tokens,
)
from logprob_service.engine.weights.session import StreamIdle

__all__ = [
    "SEQUENCE_STEPS",
    "UNLIMITED",
    "Budget",
    "EngineConfig",
    "LogprobEngine",
    "ModelRegistry",
    "Phase",
    "RequestCounts",
    "RequestLimits",
    "StreamIdle",
    "WeightGroup",
    "check_counts",
    "distinct_prompt_tokens",
    "prompt_once",
    "sequence_steps",
]
