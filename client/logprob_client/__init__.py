"""Client of logprob-service: score token log-probabilities on a remote GPU.

No torch or transformers import here: torch is imported only when tensors are passed.
"""

from .client import AsyncLogprobClient, LogprobClient, ModelInfo, ModelLimits, ScoreInput
from .errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    LogprobError,
    ModelNotFound,
    Overloaded,
    PermissionDenied,
    ServerError,
    Unauthenticated,
    Unavailable,
)
from .future import ScoreFuture
from .split import RpcLimits

__all__ = [
    "AsyncLogprobClient",
    "Cancelled",
    "DeadlineExceeded",
    "InvalidRequest",
    "LogprobClient",
    "LogprobError",
    "ModelInfo",
    "ModelLimits",
    "ModelNotFound",
    "Overloaded",
    "PermissionDenied",
    "RpcLimits",
    "ScoreFuture",
    "ScoreInput",
    "ServerError",
    "Unauthenticated",
    "Unavailable",
]
