"""Admission control: the queue's token budget, each client's fair share, and retry hints.

Every request's tokens (``ScoreJob.cost``: each distinct prompt once, plus every completion) count
from admission until they are scored or dropped. The queue holds
at most ``max_queued_tokens``, and each client identity (``api.security.caller``) at most
``max_queued_tokens_per_client``, so one trainer cannot fill the queue and starve the others.
Past either limit a request is refused at once (``Overloaded``, RESOURCE_EXHAUSTED at the edge)
with a message naming the limit and a retry hint: the excess tokens over the throughput measured
so far. Synchronous and clock-free: the scheduler calls it.
"""

from __future__ import annotations

from collections import Counter

from logprob_service.domain import ScoreJob
from logprob_service.errors import Overloaded
from logprob_service.stats import NO_STATS, QueueChanged, StatsSink

MIN_RETRY_S, MAX_RETRY_S = 0.05, 30.0


class Admission:
    def __init__(
        self, *, max_queued_tokens: int, max_queued_tokens_per_client: int, stats: StatsSink = NO_STATS
    ) -> None:
        self.max_queued_tokens = max_queued_tokens
        self.max_queued_tokens_per_client = max_queued_tokens_per_client
        self.queued_tokens = 0  # admitted, not yet scored or dropped
        self.client_tokens: Counter[str] = Counter()  # the same, per client identity (none at 0)
        self.tokens_per_s = 0.0  # moving average of the measured throughput
        self._stats = stats

    def admit(self, job: ScoreJob) -> None:
        """Count ``job``'s tokens as queued, or raise ``Overloaded`` naming the limit it would pass."""
        tokens = job.cost
        if self.queued_tokens + tokens > self.max_queued_tokens:
            raise Overloaded(
                f"server queue holds {self.queued_tokens} tokens; this request's {tokens} would pass "
                f"max_queued_tokens={self.max_queued_tokens}",
                retry_after_s=self.retry_after_s(self.queued_tokens + tokens - self.max_queued_tokens),
            )
        held, cap = self.client_tokens[job.client], self.max_queued_tokens_per_client
        if held + tokens > cap:
            raise Overloaded(
                f"client {job.client!r} has {held} tokens queued; this request's {tokens} would pass "
                f"max_queued_tokens_per_client={cap}",
                retry_after_s=self.retry_after_s(held + tokens - cap),
            )
        self._count(job, tokens)

    def release(self, job: ScoreJob, tokens: int) -> None:
        """``tokens`` of ``job`` were scored or dropped."""
        self._count(job, -tokens)

    def _count(self, job: ScoreJob, tokens: int) -> None:
        self.queued_tokens += tokens
        self.client_tokens[job.client] += tokens
        if not self.client_tokens[job.client]:
            del self.client_tokens[job.client]
        self._stats.record(QueueChanged(job.model, tokens=tokens))

    def observe_throughput(self, tokens: int, elapsed_ns: int) -> None:
        rate = tokens / max(elapsed_ns, 1) * 1e9
        self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.8 * self.tokens_per_s + 0.2 * rate

    def retry_after_s(self, excess_tokens: int) -> float:
        if self.tokens_per_s <= 0:
            return 1.0
        return min(MAX_RETRY_S, max(MIN_RETRY_S, excess_tokens / self.tokens_per_s))
