"""Admission control (``engine.admission``), synchronously: the queue's budget, the fair share, hints."""

from __future__ import annotations

import numpy as np
import pytest
from logprob_service.domain import ScoreJob, TokenSequence
from logprob_service.engine.admission import MAX_RETRY_S, MIN_RETRY_S, Admission
from logprob_service.errors import Overloaded
from logprob_service.stats import QueueChanged


def job(client: str, tokens: int, model: str = "m") -> ScoreJob:
    seq = TokenSequence(np.arange(1, tokens, dtype=np.int64), np.array([7], dtype=np.int64))
    return ScoreJob(request_id=f"{client}-{tokens}", model=model, sequences=[seq], client=client)


def test_the_queue_budget_and_each_clients_share_refuse_with_the_limit_named():
    records: list = []
    admission = Admission(
        max_queued_tokens=1000,
        max_queued_tokens_per_client=600,
        stats=type("S", (), {"record": staticmethod(records.append)}),
    )
    admission.admit(job("a", 500))
    with pytest.raises(Overloaded, match=r"client 'a' has 500 tokens queued; .* max_queued_tokens_per_client=600"):
        admission.admit(job("a", 200))
    admission.admit(job("b", 450))  # another client is still admitted
    with pytest.raises(Overloaded, match=r"server queue holds 950 tokens; .* max_queued_tokens=1000"):
        admission.admit(job("c", 60))
    assert admission.queued_tokens == 950 and dict(admission.client_tokens) == {"a": 500, "b": 450}
    admission.release(job("a", 500), 500)
    assert admission.queued_tokens == 450 and dict(admission.client_tokens) == {"b": 450}  # none kept at 0
    assert records == [QueueChanged("m", tokens=500), QueueChanged("m", tokens=450), QueueChanged("m", tokens=-500)]


def test_the_retry_hint_is_the_excess_over_the_measured_throughput_within_bounds():
    admission = Admission(max_queued_tokens=100, max_queued_tokens_per_client=100)
    assert admission.retry_after_s(50) == 1.0  # nothing measured yet
    admission.observe_throughput(tokens=1000, elapsed_ns=1_000_000_000)  # 1000 tokens/s
    assert admission.retry_after_s(500) == pytest.approx(0.5)
    assert admission.retry_after_s(1) == MIN_RETRY_S and admission.retry_after_s(10**9) == MAX_RETRY_S
    admission.admit(job("a", 100))
    with pytest.raises(Overloaded) as refused:
        admission.admit(job("b", 50))
    assert refused.value.retry_after_s == pytest.approx(0.05) and "retry after 50 ms" in refused.value.message
