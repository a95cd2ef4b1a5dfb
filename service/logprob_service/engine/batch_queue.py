"""The queue of scoring work and how micro-batches are formed from it: synchronous, no I/O.

Every admitted request is cut into *units* (some of its sequences, always scored together): one
unit when it fits a micro-batch, else balanced parts (``partition.plan_micro_batches``,
Karmarkar-Karp). Units wait in arrival order. ``take`` forms the next micro-batch: first fit,
in arrival order, among units sharing the oldest eligible unit's ``BatchKey``, under
``max_batch_tokens`` and ``max_batch_sequences``; a unit too big for the room left gives the
sequences that fit and keeps its place with the rest, so micro-batches fill up to the budget.

Work is counted as it runs, in token-equivalents (``domain.run_costs``): real tokens (no padding:
the batch is packed) for an ordinary sequence. With ``share_prompts`` (the worker runs each
distinct prompt of a micro-batch once), a unit's sequences that share a prompt count it once, and
each further one its reads of the prompt's keys; a request larger than a micro-batch is cut along
its prompt groups, a group larger than a micro-batch into parts that each carry the prompt. (Two
units with the same prompt in one micro-batch count it twice: the budget errs on the safe side.)
What a request costs is planned before it is admitted (``plan``: its units, each part of a group
carrying the prompt), and each sequence's share of it (``Request.costs``) is what admission
counts in and out, however ``take`` later cuts the units.

Weight swaps hold a model's work: while a swap of model M waits (M in ``held``), M's units whose
request has not started are not eligible, while those of a request already partly launched are
(a request finishes on the weights it started with). The asyncio loop (``scheduler``) owns the
clock, the futures and the device; this class only decides, so tests drive it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from logprob_service.domain import (
    ScoreJob,
    ScoreResult,
    SequenceScores,
    TokenSequence,
    output_cost,
    prompt_groups,
    run_costs,
    shared_prompt_cost,
    tokens_run,
)
from logprob_service.engine.partition import plan_micro_batches
from logprob_service.errors import DeadlineExceeded


@dataclass(frozen=True)
class BatchKey:
    """Work batches together only when all of these match."""

    model: str
    temperature: float
    return_entropy: bool
    top_k: int = 0
    return_routed_experts: bool = False


@dataclass(eq=False)
class Request:
    """One admitted request: its job, its results as they come, and how to end it.

    ``done`` says whether it is over (answered, failed, or its caller gone); ``fail`` and
    ``complete`` end it (all three given by the loop that owns the caller's future)."""

    job: ScoreJob
    done: Callable[[], bool]
    fail: Callable[[BaseException], None]
    complete: Callable[[ScoreResult], None]
    arrived_ns: int = field(default_factory=time.perf_counter_ns)
    first_launch_ns: int | None = None
    compute_ns: int = 0
    model_version: int = 0
    costs: list[int] = field(default_factory=list)  # each sequence's share of the planned cost (BatchQueue.plan)
    scores: list[SequenceScores | None] = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.scores = [None] * len(self.job.sequences)
        self.remaining = len(self.job.sequences)

    @property
    def key(self) -> BatchKey:
        job = self.job
        return BatchKey(job.model, job.temperature, job.return_entropy, job.top_k, job.return_routed_experts)

    @property
    def started(self) -> bool:
        return self.first_launch_ns is not None

    @property
    def cost(self) -> int:
        """Token-equivalents admission counts for it: what it costs as planned (``BatchQueue.plan``)."""
        return sum(self.costs)


@dataclass(eq=False)
class Unit:
    """Some sequences of one request, always scored in the same micro-batch."""

    request: Request
    indices: list[int]
    cost: int  # token-equivalents as it runs (domain.run_costs): with share_prompts, a prompt its sequences share once

    @property
    def admitted(self) -> int:
        """Its sequences' share of what admission counted for the request (``Request.costs``)."""
        costs = self.request.costs
        return sum(costs[i] for i in self.indices)


# With several devices, a micro-batch is never cut below this fraction of the token budget to
# share a burst's tail between them (``BatchQueue.take``): smaller ones would cost more per token.
TAIL_FRACTION = 4


class BatchQueue:
    def __init__(self, *, max_batch_tokens: int, max_batch_sequences: int, share_prompts: bool = False) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences
        self.share_prompts = share_prompts
        self.units: list[Unit] = []  # waiting, in arrival order

    def tokens(self, sequences: list[TokenSequence]) -> int:
        """Real tokens a micro-batch of ``sequences`` runs (what the metrics count)."""
        return tokens_run(sequences) if self.share_prompts else sum(s.num_tokens for s in sequences)

    def costs(self, sequences: list[TokenSequence]) -> list[int]:
        """Each sequence's share of what a micro-batch of ``sequences`` costs (``domain.run_costs``)."""
        return run_costs(sequences, share_prompts=self.share_prompts)

    def cost(self, sequences: list[TokenSequence]) -> int:
        """Token-equivalents a micro-batch of ``sequences`` costs."""
        return sum(self.costs(sequences))

    def plan(self, request: Request) -> list[Unit]:
        """``request``'s units (one, or balanced parts if it is larger than a micro-batch), not queued
        yet, and each sequence's share of their cost in ``request.costs``."""
        seqs = request.job.sequences
        if self.cost(seqs) <= self.max_batch_tokens and len(seqs) <= self.max_batch_sequences:
            parts = [list(range(len(seqs)))]
        else:
            items = self._items(seqs)
            planned = plan_micro_batches(
                [self.cost([seqs[i] for i in item]) for item in items],
                max_tokens=self.max_batch_tokens,
                max_sequences=self.max_batch_sequences,
                sizes=[len(item) for item in items],
            )
            parts = [sorted(i for j in part for i in items[j]) for part in planned]
        request.costs = [0] * len(seqs)
        units = []
        for indices in parts:
            costs = self.costs([seqs[i] for i in indices])
            for i, cost in zip(indices, costs):
                # admission counts the extra outputs too; micro-batches are cut by the tokens they run
                request.costs[i] = cost + output_cost(seqs[i], request.job.top_k)
            units.append(Unit(request, indices, sum(costs)))
        return units

    def push(self, request: Request) -> None:
        """Queue ``request``'s units (``plan``)."""
        self.add(self.plan(request))

    def add(self, units: list[Unit]) -> None:
        """Queue units made by ``plan`` (once their request is admitted)."""
        self.units += units

    def _items(self, seqs: list[TokenSequence]) -> list[list[int]]:
        """What a large request is cut along: its sequences one by one, or with ``share_prompts`` its
        prompt groups, each cut into runs that fit a micro-batch (a sequence too long to fit: alone)."""
        if not self.share_prompts:
            return [[i] for i in range(len(seqs))]
        items = []
        for group in prompt_groups(seqs):
            item: list[int] = []
            cost = 0
            for i in group:
                more = shared_prompt_cost(seqs[i]) if item else seqs[i].num_tokens
                if item and (cost + more > self.max_batch_tokens or len(item) == self.max_batch_sequences):
                    items.append(item)
                    item, cost, more = [], 0, seqs[i].num_tokens
                item.append(i)
                cost += more
            items.append(item)
        return items

    def drop_dead(self, now: float) -> list[Unit]:
        """Fail the requests whose deadline (``time.monotonic``) passed while queued; drop and return
        the units of every request that is over (failed, answered, or its caller gone)."""
        alive, dropped = [], []
        for unit in self.units:
            request = unit.request
            deadline = request.job.deadline
            if not request.done() and deadline is not None and now >= deadline:
                request.fail(
                    DeadlineExceeded(
                        f"request {request.job.request_id}: deadline passed while queued; nothing was computed"
                    )
                )
            (dropped if request.done() else alive).append(unit)
        self.units = alive
        return dropped

    @staticmethod
    def eligible(unit: Unit, held: Collection[str]) -> bool:
        """Whether ``unit`` may be launched now: not when its model is held for a swap and its
        request has not started (a started one must finish on the weights it started with)."""
        return unit.request.job.model not in held or unit.request.started

    def first_eligible(self, held: Collection[str] = ()) -> Unit | None:
        return next((unit for unit in self.units if self.eligible(unit, held)), None)

    def holds_started_work(self, model: str, held: Collection[str]) -> bool:
        """Whether ``model`` has queued units that may still run although it is held: a swap of it must wait."""
        return any(unit.request.job.model == model and self.eligible(unit, held) for unit in self.units)

    def _key_cost(self, first: Unit, held: Collection[str]) -> int:
        """Token-equivalents of the eligible work that may share a micro-batch with ``first`` (its key)."""
        key = first.request.key
        return sum(u.cost for u in self.units if u.request.key == key and self.eligible(u, held))

    def fills_a_batch(self, first: Unit, held: Collection[str] = ()) -> bool:
        """Whether the eligible work sharing ``first``'s key fills a micro-batch's budget."""
        return self._key_cost(first, held) >= self.max_batch_tokens

    def take(self, held: Collection[str] = (), spread: int = 1) -> list[Unit]:
        """The next micro-batch (removed from the queue); needs an eligible unit. A unit larger than
        the budget (a sequence longer than it: ``plan_micro_batches`` puts each alone) goes alone.

        ``spread``: how many devices share the queue. A micro-batch then takes at most 1/spread of
        the eligible work of its key (guided self-scheduling), and no less than 1/TAIL_FRACTION of
        the budget: a burst of work (a GRPO step sent at once) runs in full micro-batches until its
        last ones, which get smaller, so the devices finish it together. Greedy full batches leave
        one device up to a whole micro-batch behind the others: on 2 GPUs, a step that is 11
        micro-batches runs as 6 on one and 5 on the other, 1.83x one GPU at best."""
        first = self.first_eligible(held)
        assert first is not None, "take needs an eligible unit"
        if first.cost > self.max_batch_tokens:
            self.units.remove(first)
            return [first]
        budget = self.max_batch_tokens
        if spread > 1:
            share = -(-self._key_cost(first, held) // spread)
            budget = min(budget, max(share, self.max_batch_tokens // TAIL_FRACTION))
        chosen: list[Unit] = []
        rest: list[Unit] = []
        cost = sequences = 0
        for unit in self.units:
            left: Unit | None = unit
            if unit.request.key == first.request.key and self.eligible(unit, held):
                taken, left = self._fit(unit, budget - cost, self.max_batch_sequences - sequences)
                if taken is not None:
                    chosen.append(taken)
                    cost += taken.cost
                    sequences += len(taken.indices)
            if left is not None:
                rest.append(left)
        self.units = rest
        if not chosen:  # the first sequence alone is over the share: it goes at the full budget
            return self.take(held)
        return chosen

    def _fit(self, unit: Unit, room: int, room_sequences: int) -> tuple[Unit | None, Unit | None]:
        """Split ``unit`` into the sequences that fit the room (in order) and the rest."""
        if unit.cost <= room and len(unit.indices) <= room_sequences:
            return unit, None
        sequences = unit.request.job.sequences
        taken: list[int] = []
        used = 0
        prompts: set[bytes] = set()  # of the taken sequences: with share_prompts, run once
        for i in unit.indices:
            seq = sequences[i]
            shared = self.share_prompts and seq.prompt_key in prompts
            cost = shared_prompt_cost(seq) if shared else seq.num_tokens
            if len(taken) == room_sequences or used + cost > room:
                break
            taken.append(i)
            used += cost
            prompts.add(seq.prompt_key)
        if not taken:
            return None, unit
        left = unit.indices[len(taken) :]
        return Unit(unit.request, taken, used), Unit(unit.request, left, self.cost([sequences[j] for j in left]))


def owners_of(units: list[Unit]) -> list[tuple[Request, int]]:
    """(request, sequence index) of each position in a micro-batch made of ``units``."""
    return [(unit.request, i) for unit in units for i in unit.indices]


def requests_of(owners: list[tuple[Request, Any]]) -> list[Request]:
    """The distinct requests among ``owners``, in order."""
    return list(dict.fromkeys(request for request, _ in owners))
