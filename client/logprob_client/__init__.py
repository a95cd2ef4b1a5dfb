"""Client of logprob-service: score token log-probabilities on a remote GPU.

No torch or transformers import here: torch is imported only when tensors are passed.
"""

from .aio import AsyncLogprobClient
from .client import LogprobClient
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    LogprobError,
    MixedVersionsError,
    ModelNotFound,
    Overloaded,
    PermissionDenied,
    ServerError,
    Unauthenticated,
    Unavailable,
    UpdateAborted,
)
from .future import ScoreFuture
from .split import RpcLimits
from .streams import UpdateResult
from .wire import ModelInfo, ModelLimits, ScoreInput, TeacherScores

__all__ = [
    "AsyncLogprobClient",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidRequest",
    "LogprobClient",
    "LogprobError",
    "MixedVersionsError",
    "ModelInfo",
    "ModelLimits",
    "ModelNotFound",
    "Overloaded",
    "PermissionDenied",
    "RpcLimits",
    "ScoreFuture",
    "ScoreInput",
    "ServerError",
    "TeacherScores",
    "Unauthenticated",
    "Unavailable",
    "UpdateAborted",
    "UpdateResult",
]
