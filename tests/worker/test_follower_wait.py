"""A tensor-parallel follower's wait for its launches (``worker.tensor_parallel._wait``): a
micro-batch that fails as rank 0 reports it (``Launched.fetch``'s LogprobError, e.g. an unfinished
fused top-k, which every rank sees) does not end the follower; anything else does."""

from __future__ import annotations

import pytest
import torch
from logprob_service.errors import LogprobError
from logprob_service.models.scorer import Launched
from logprob_service.worker.tensor_parallel import _wait


def launched(incomplete: bool) -> Launched:
    return Launched(
        logprobs=torch.zeros(3),
        entropies=None,
        completion_lengths=[3],
        ready=None,
        top_ids=torch.zeros((3, 4), dtype=torch.int32),
        top_logprobs=torch.zeros((3, 4)),
        top_k_incomplete=torch.tensor(incomplete),
    )


def test_a_failed_micro_batch_leaves_the_follower_running():
    with pytest.raises(LogprobError, match="top-4 did not finish some rows of this micro-batch of 1 sequences"):
        launched(True).fetch()
    _wait(launched(True))  # no raise
    _wait(launched(False))


def test_other_errors_end_it():
    broken = launched(False)
    broken.completion_lengths = None  # type: ignore[assignment]
    with pytest.raises(TypeError):
        _wait(broken)
