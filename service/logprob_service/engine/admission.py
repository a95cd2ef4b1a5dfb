"""Admission control: the queue's budget, each client's fair share, deadlines, and retry hints.

Every request counts what it costs as it will run (``BatchQueue.plan``, in token-equivalents:
``costs.run_costs``; an ordinary sequence its tokens, a shared prompt once in each micro-batch
that holds some of its completions, plus each further completion's reads of it) from admission
until it is scored or dropped. The queue holds at most ``max_queued_tokens`` of them, and each
client identity (``security.caller``) at most ``max_queued_tokens_per_client``, so one trainer
cannot fill the queue and starve the others. Past either limit a request is refused at once
(``Overloaded``, RESOURCE_EXHAUSTED at the edge) with a message naming the limit and a retry hint:
the excess over the measured throughput. A request that could never be admitted (costs more than
either limit, which only a group cut into many micro-batches can) is refused as invalid.

A request with a deadline that the work that would run before it finishes (and its own) would
pass, at the measured throughput, by more than ``DEADLINE_SLACK``, is refused at once the same way,
rather than admitted to time out in the queue. The queue shares the device between clients by
deficit round-robin (``BatchQueue``), so what runs before it is its own client's queued work and,
of each other client's, at most as much and one turn (``turn_tokens``) more, plus what the
devices hold in flight: a client's backlog delays another client's call by a turn, not by itself.
The throughput counts only micro-batches large enough that their fixed cost does not rule their
time (not the warm-up's few tokens); until a few such have been measured, nothing is refused for
its deadline and hints are ``DEFAULT_RETRY_S``.
Synchronous and clock-free: the scheduler calls it, with the time.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable

from logprob_service.domain import ScoreJob
from logprob_service.engine.costs import OUTPUTS_PER_TOKEN, tokens_run
from logprob_service.errors import InvalidArgument, Overloaded
from logprob_service.stats import NO_STATS, QueueChanged, StatsSink

MIN_RETRY_S, MAX_RETRY_S = 0.05, 30.0
DEFAULT_RETRY_S = 1.0  # the hint while no throughput has been measured
# A request is refused for its deadline only when the estimated time to finish it passes the time
# left by a quarter: an estimate that errs (a slow micro-batch measured, work ahead that is
# dropped) must not refuse work that would have finished.
DEADLINE_SLACK = 1.25
# The throughput: the median of the last MEASURED_BATCHES measured micro-batches' rates, once
# there are MIN_MEASURED_BATCHES (one slow first batch, compiling a kernel, does not set it).
MEASURED_BATCHES, MIN_MEASURED_BATCHES = 8, 3


class Admission:
    def __init__(
        self,
        *,
        max_queued_tokens: int,
        max_queued_tokens_per_client: int,
        turn_tokens: int,
        in_flight_tokens: int,
        min_measured_cost: int = 1,
        devices: int = 1,
        stats: StatsSink = NO_STATS,
    ) -> None:
        """``turn_tokens``: what one client's turn of the queue's round-robin may take (its quantum);
        ``in_flight_tokens``: the most the devices hold in flight at once; ``min_measured_cost``: the
        least a micro-batch must cost for its time to count towards the throughput; ``devices``: how
        many devices run micro-batches side by side."""
        self.max_queued_tokens = max_queued_tokens
        self.max_queued_tokens_per_client = max_queued_tokens_per_client
        self.turn_tokens = turn_tokens
        self.in_flight_tokens = in_flight_tokens
        self.min_measured_cost = min_measured_cost
        self.devices = devices
        self.queued_tokens = 0  # token-equivalents admitted, not yet scored or dropped
        self.client_tokens: Counter[str] = Counter()  # the same, per client identity (none at 0)
        self._rates: deque[float] = deque(maxlen=MEASURED_BATCHES)  # token-equivalents/s of one device
        self._stats = stats

    def admit(self, job: ScoreJob, cost: int, now: float) -> None:
        """Count ``cost`` (``job``'s token-equivalents as planned) as queued; or raise ``InvalidArgument``
        if no wait could make room for it, or ``Overloaded`` naming the limit it would pass, or the
        deadline (``time.monotonic``, as ``now``) it would."""
        cap = min(self.max_queued_tokens, self.max_queued_tokens_per_client)
        if cost > cap:
            field = "groups" if job.group_sizes else "sequences"
            limit = "max_queued_tokens" if cap == self.max_queued_tokens else "max_queued_tokens_per_client"
            raise InvalidArgument(
                f"{field}: the request costs {cost} token-equivalents as it runs (a shared prompt again in "
                f"each micro-batch that holds some of its completions, plus their reads of it, and one per "
                f"{OUTPUTS_PER_TOKEN} top-k or candidate outputs of a position), more than "
                f"{limit}={cap} can ever admit; send fewer completions of a prompt (or a smaller top_k) per request"
            )
        self.check_room(job.client, cost, lambda: _counted(job, cost))
        self._check_deadline(job, cost, now)
        self._count(job, cost)

    def check_room(self, client: str, cost: int, counted: Callable[[], str]) -> None:
        """``Overloaded`` naming the limit, with its retry hint, when ``cost`` more token-equivalents
        of ``client``'s would pass ``max_queued_tokens`` or its fair share as the queue holds now;
        ``counted``: the request's cost as its message names it. ``admit`` checks a planned job
        with it, and an edge a request's counts before it builds the job (``LogprobEngine.check_counts``:
        its tokens, at most what it costs as it runs, so what that refuses ``admit`` would)."""
        if self.queued_tokens + cost > self.max_queued_tokens:
            raise Overloaded(
                f"server queue holds {self.queued_tokens} tokens; this request's {counted()} would pass "
                f"max_queued_tokens={self.max_queued_tokens}",
                retry_after_s=self.retry_after_s(self.queued_tokens + cost - self.max_queued_tokens),
            )
        held, share = self.client_tokens[client], self.max_queued_tokens_per_client
        if held + cost > share:
            raise Overloaded(
                f"client {client!r} has {held} tokens queued; this request's {counted()} would pass "
                f"max_queued_tokens_per_client={share}",
                retry_after_s=self.retry_after_s(held + cost - share),
            )

    def _check_deadline(self, job: ScoreJob, cost: int, now: float) -> None:
        throughput = self.throughput
        if job.deadline is None or throughput is None or job.deadline <= now:
            return  # (one already past is dropped as expired, DEADLINE_EXCEEDED, before any compute)
        left_s = job.deadline - now
        held = self.client_tokens[job.client]  # its client's own, queued before it
        own = held + cost
        # While its client gets `own`, each other client gets at most as much and a turn more
        # (deficit round-robin), after what is in flight; never more than it has queued.
        others = self.queued_tokens - held
        turns = sum(
            min(tokens, own + self.turn_tokens) for client, tokens in self.client_tokens.items() if client != job.client
        )
        ahead = min(others, turns + self.in_flight_tokens)
        work = own + ahead
        finish_s = work / throughput
        if finish_s <= DEADLINE_SLACK * left_s:
            return
        raise Overloaded(
            f"request {job.request_id}: its deadline is {left_s:.2f} s away, but {work} tokens would run before "
            f"it finishes (its {_counted(job, cost)}, {held} its client queued before it, {ahead} of the {others} "
            f"other clients have queued), which at the measured {throughput:.0f} tokens/s take about {finish_s:.2f} s",
            retry_after_s=self.retry_after_s(work - throughput * left_s / DEADLINE_SLACK),
        )

    def release(self, job: ScoreJob, cost: int) -> None:
        """``cost`` of ``job`` was scored or dropped."""
        self._count(job, -cost)

    def _count(self, job: ScoreJob, cost: int) -> None:
        self.queued_tokens += cost
        self.client_tokens[job.client] += cost
        if not self.client_tokens[job.client]:
            del self.client_tokens[job.client]
        self._stats.record(QueueChanged(job.model, tokens=cost))

    def observe(self, cost: int, busy_ns: int) -> None:
        """A micro-batch of ``cost`` token-equivalents held its device for ``busy_ns``. One that
        costs less than ``min_measured_cost`` is left out: its time is mostly the fixed cost of a
        micro-batch (the warm-up's 16 tokens measured 1/10 of the CPU's throughput)."""
        if cost >= self.min_measured_cost and busy_ns > 0:
            self._rates.append(cost / busy_ns * 1e9)

    @property
    def throughput(self) -> float | None:
        """Token-equivalents per second, every device together; None until enough is measured."""
        if len(self._rates) < MIN_MEASURED_BATCHES:
            return None
        return statistics.median(self._rates) * self.devices

    def retry_after_s(self, excess_tokens: float) -> float:
        throughput = self.throughput
        if throughput is None:
            return DEFAULT_RETRY_S
        return min(MAX_RETRY_S, max(MIN_RETRY_S, excess_tokens / throughput))


def _counted(job: ScoreJob, cost: int) -> str:
    """``cost``, and where it is not the request's tokens, why."""
    tokens = tokens_run(job.sequences)
    if cost == tokens:
        return str(cost)
    return f"{cost} (as it runs; {tokens} tokens with each distinct prompt once)"
