"""Admission control (``engine.admission``), synchronously and clock-free (the throughput and the
time are given): the queue's budget, the fair share, what a shared-prompt group counts for,
deadlines, and retry hints."""

from __future__ import annotations

import numpy as np
import pytest
from logprob_service.domain import ScoreJob, TokenSequence
from logprob_service.engine.admission import (
    DEADLINE_SLACK,
    DEFAULT_RETRY_S,
    MAX_RETRY_S,
    MIN_RETRY_S,
    Admission,
)
from logprob_service.engine.batch_queue import BatchQueue, Request
from logprob_service.engine.costs import tokens_run
from logprob_service.errors import InvalidArgument, Overloaded
from logprob_service.stats import QueueChanged

NOW = 1000.0  # time.monotonic() of every admission below


def job(client: str, tokens: int, model: str = "m", deadline: float | None = None) -> ScoreJob:
    seq = TokenSequence(np.arange(1, tokens, dtype=np.int64), np.array([7], dtype=np.int64))
    return ScoreJob(request_id=f"{client}-{tokens}", model=model, sequences=[seq], client=client, deadline=deadline)


# The queue's round-robin (BatchQueue): a client's turn takes up to TURN_TOKENS (max_batch_tokens),
# and the devices hold up to IN_FLIGHT_TOKENS in flight (two micro-batches).
TURN_TOKENS, IN_FLIGHT_TOKENS = 200, 400


def admission_of(max_queued_tokens: int, max_queued_tokens_per_client: int, **settings) -> Admission:
    return Admission(
        max_queued_tokens=max_queued_tokens,
        max_queued_tokens_per_client=max_queued_tokens_per_client,
        turn_tokens=TURN_TOKENS,
        in_flight_tokens=IN_FLIGHT_TOKENS,
        **settings,
    )


def admit(admission: Admission, j: ScoreJob, now: float = NOW) -> None:
    admission.admit(j, tokens_run(j.sequences), now)  # one ordinary sequence costs its tokens


def measured(admission: Admission, tokens_per_s: float, batches: int = 3, cost: int = 1000) -> Admission:
    """``admission`` after ``batches`` micro-batches of ``cost`` ran at ``tokens_per_s``."""
    for _ in range(batches):
        admission.observe(cost, round(cost / tokens_per_s * 1e9))
    return admission


def test_the_queue_budget_and_each_clients_share_refuse_with_the_limit_named():
    records: list = []
    admission = admission_of(
        1000,
        600,
        stats=type("S", (), {"record": staticmethod(records.append)}),
    )
    admit(admission, job("a", 500))
    with pytest.raises(Overloaded, match=r"client 'a' has 500 tokens queued; .* max_queued_tokens_per_client=600"):
        admit(admission, job("a", 200))
    admit(admission, job("b", 450))  # another client is still admitted
    with pytest.raises(Overloaded, match=r"server queue holds 950 tokens; .* max_queued_tokens=1000"):
        admit(admission, job("c", 60))
    assert admission.queued_tokens == 950 and dict(admission.client_tokens) == {"a": 500, "b": 450}
    admission.release(job("a", 500), 500)
    assert admission.queued_tokens == 450 and dict(admission.client_tokens) == {"b": 450}  # none kept at 0
    assert records == [QueueChanged("m", tokens=500), QueueChanged("m", tokens=450), QueueChanged("m", tokens=-500)]


def test_the_retry_hint_is_the_excess_over_the_measured_throughput_within_bounds():
    admission = admission_of(100, 100)
    assert admission.retry_after_s(50) == DEFAULT_RETRY_S  # nothing measured yet
    measured(admission, tokens_per_s=1000)
    assert admission.retry_after_s(500) == pytest.approx(0.5)
    assert admission.retry_after_s(1) == MIN_RETRY_S and admission.retry_after_s(10**9) == MAX_RETRY_S
    admit(admission, job("a", 100))
    with pytest.raises(Overloaded) as refused:
        admit(admission, job("b", 50))
    assert refused.value.retry_after_s == pytest.approx(0.05) and "retry after 50 ms" in refused.value.message


def test_small_micro_batches_such_as_the_warm_up_do_not_set_the_throughput():
    # The warm-up's 16 tokens took 10 ms (1,600 tokens/s, mostly a micro-batch's fixed cost): a
    # fresh server's first refusal of 4,000 excess tokens was told to come back in 2.5 s, and a
    # request of 4,000 tokens with a second to go was refused for its deadline.
    admission = admission_of(10**6, 10**6, min_measured_cost=128)
    for _ in range(5):
        admission.observe(16, 10_000_000)
    assert admission.throughput is None
    assert admission.retry_after_s(4000) == DEFAULT_RETRY_S
    admit(admission, job("a", 4000, deadline=NOW + 1))  # no credible estimate: no deadline refusal
    # Micro-batches of at least min_measured_cost count; the median of the last few, so one slow
    # first micro-batch (a kernel compiled) does not set it.
    admission.observe(128, 1_000_000_000)
    admission.observe(512, 50_000_000)
    assert admission.throughput is None  # two are not enough
    admission.observe(1024, 100_000_000)
    assert admission.throughput == pytest.approx(10_240)
    assert admission.retry_after_s(4000) == pytest.approx(4000 / 10_240)


def test_the_throughput_counts_every_device():
    one = measured(admission_of(10, 10), tokens_per_s=500)
    two = measured(admission_of(10, 10, devices=2), tokens_per_s=500)
    assert (one.throughput, two.throughput) == (pytest.approx(500), pytest.approx(1000))


def test_a_request_that_would_miss_its_deadline_is_refused_with_the_wait_and_the_queue_named():
    admission = measured(admission_of(10**6, 10**6), tokens_per_s=1000)
    admit(admission, job("a", 3000))  # 3 s of work queued by client a
    # a's next call runs after a's own queued work: 3,100 tokens at 1,000 tokens/s, 3.1 s, past a
    # deadline 1 s away.
    with pytest.raises(Overloaded) as refused:
        admit(admission, job("a", 100, deadline=NOW + 1))
    message = refused.value.message
    assert "request a-100: its deadline is 1.00 s away" in message
    assert "3100 tokens would run before it finishes (its 100, 3000 its client queued before it" in message
    assert "measured 1000 tokens/s take about 3.10 s" in message
    # Once the queue has drained so far that it would finish with the slack to spare.
    assert refused.value.retry_after_s == pytest.approx((3100 - 1000 * 1 / DEADLINE_SLACK) / 1000)
    assert admission.queued_tokens == 3000  # nothing counted
    # One that finishes in time, or later than its deadline by less than the slack, is admitted;
    # as is one without a deadline, and one whose deadline passed already (dropped as expired).
    admit(admission, job("a", 100, deadline=NOW + 10))  # 3.1 s of 10
    admit(admission, job("a", 100, deadline=NOW + 3.2 / DEADLINE_SLACK + 0.01))  # 3.2 s of 2.57
    admit(admission, job("a", 100))
    admit(admission, job("a", 100, deadline=NOW - 1))
    assert admission.queued_tokens == 3400


def test_another_clients_backlog_counts_only_as_far_as_it_runs_before_the_call():
    """The queue takes clients in turn (deficit round-robin), so of another client's backlog only
    what is in flight and one turn more than the call's own client gets runs before the call.
    Counted whole, as when the queue ran in arrival order, client a's share refused client b's
    small call for its deadline (the server's 2M tokens: "about 349.92 s")."""
    admission = measured(admission_of(10**6, 10**6), tokens_per_s=1000)
    admit(admission, job("a", 3000))
    # b's 100, and of a's 3,000 what is in flight (400) and b's 100 and a turn (200) more: 0.8 s.
    admit(admission, job("b", 100, deadline=NOW + 1))
    # b's next 600 after its 100: 700, and of a's 400 + 700 + 200: 2.0 s, past 1 s by more than the slack.
    with pytest.raises(
        Overloaded,
        match=r"request b-600: its deadline is 1.00 s away, but 2000 tokens would run before it finishes "
        r"\(its 600, 100 its client queued before it, 1300 of the 3000 other clients have queued\)",
    ):
        admit(admission, job("b", 600, deadline=NOW + 1))
    assert dict(admission.client_tokens) == {"a": 3000, "b": 100}


def test_a_shared_prompt_group_counts_its_prompt_in_each_micro_batch_and_its_reads_of_it(rng):
    # The case scaled down: a 512-token prompt with 512 one-token completions was admitted
    # as 1,024 tokens, as much as two plain sequences of 512, yet runs as two micro-batches (256
    # sequences each) that each run the prompt, and each completion reads the prompt's 512 keys.
    prompt = rng.integers(0, 100, 512)
    group = ScoreJob("group", "m", [TokenSequence(prompt, rng.integers(0, 100, 1)) for _ in range(512)], client="g")
    plain = ScoreJob(
        "plain", "m", [TokenSequence(rng.integers(0, 100, 511), rng.integers(0, 100, 1)) for _ in "ab"], client="g"
    )
    assert (
        tokens_run(group.sequences) == tokens_run(plain.sequences) == 1024
    )  # the request's tokens (max_tokens_per_request)
    queue = BatchQueue(max_batch_tokens=65536, max_batch_sequences=256, share_prompts=True)
    costs = {}
    for j in (group, plain):
        request = Request(j, done=lambda: False, fail=lambda error: None, complete=lambda result: None)
        units = queue.plan(request)
        costs[j.request_id] = (len(units), request.cost)
    # Each part: its prompt and first completion (513), then 255 completions of 1 token that each
    # read 512 keys (a token's worth: KEYS_PER_TOKEN, rounded up).
    assert costs == {"group": (2, 2 * (513 + 255 * 2)), "plain": (1, 1024)}
    # The same client, with two plain requests queued: a third is admitted, the group is not.
    admission = admission_of(10**6, 3100)
    admission.admit(plain, 1024, NOW)
    admission.admit(plain, 1024, NOW)
    with pytest.raises(
        Overloaded,
        match=r"has 2048 tokens queued; this request's 2046 \(as it runs; 1024 tokens with each distinct prompt once\) "
        r"would pass max_queued_tokens_per_client=3100",
    ):
        admission.admit(group, costs["group"][1], NOW)
    admission.admit(plain, 1024, NOW)


def test_a_request_that_could_never_be_admitted_is_invalid_naming_the_limit():
    admission = admission_of(5000, 2000)
    group = ScoreJob("g", "m", [TokenSequence(np.arange(1, 600), np.array([7]))] * 3, group_sizes=(3,))
    with pytest.raises(
        InvalidArgument, match=r"groups: the request costs 2001 token-equivalents .* max_queued_tokens_per_client=2000"
    ):
        admission.admit(group, 2001, NOW)  # the queue is empty: no amount of waiting admits it
    admission = admission_of(1500, 2000)
    with pytest.raises(InvalidArgument, match=r"sequences: the request costs 1501 .* max_queued_tokens=1500"):
        admission.admit(job("a", 10), 1501, NOW)
