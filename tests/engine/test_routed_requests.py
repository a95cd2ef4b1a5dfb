"""Requests for routed experts: refused for a model without routers (naming the field and the
model), and batched only with requests that ask for them too (a launch keeps routing or not)."""

from __future__ import annotations

import dataclasses

import pytest
from logprob_service.domain import ModelInfo, ScoreJob, ScoreOptions, TokenSequence
from logprob_service.engine.batch_queue import BatchQueue, Request
from logprob_service.engine.validation import RequestLimits, validate_job
from logprob_service.errors import InvalidArgument

DENSE = ModelInfo("dense", "fake", "LlamaForCausalLM", 1000, None, "float32", "fake", 0, "fp")
MOE = dataclasses.replace(DENSE, name="moe", architecture="Qwen3MoeForCausalLM", num_experts=128)
LIMITS = RequestLimits(max_sequences_per_request=100, max_tokens_per_request=10_000)


def job(rng, model: str, *, routed: bool) -> ScoreJob:
    seq = TokenSequence(rng.integers(0, 1000, 3), rng.integers(0, 1000, 5))
    return ScoreJob("r", model, [seq], ScoreOptions(return_routed_experts=routed))


def test_a_model_with_routers_takes_the_flag_and_a_dense_one_refuses_it_by_name(rng):
    validate_job(job(rng, "moe", routed=True), MOE, LIMITS)
    validate_job(job(rng, "dense", routed=False), DENSE, LIMITS)
    with pytest.raises(
        InvalidArgument,
        match=r"^return_routed_experts: model 'dense' \(LlamaForCausalLM\) has no mixture-of-experts routers",
    ):
        validate_job(job(rng, "dense", routed=True), DENSE, LIMITS)


def test_requests_batch_only_with_requests_asking_the_same(rng):
    queue = BatchQueue(max_batch_tokens=1000, max_batch_sequences=10)
    requests = [Request(job(rng, "moe", routed=routed), lambda: False, print, print) for routed in (False, True, True)]
    for request in requests:
        queue.plan(request)
    assert requests[0].key != requests[1].key and requests[1].key == requests[2].key
    assert requests[1].key.options.return_routed_experts and not requests[0].key.options.return_routed_experts
    assert requests[0].cost == requests[1].cost  # admission: the ids cost no token-equivalents
