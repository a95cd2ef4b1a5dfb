"""The queue of scoring work and how micro-batches are formed from it: synchronous, no I/O.

Every admitted request is cut into *units* (``RequestSlice``: some of its sequences, always scored together): one
unit when it fits a micro-batch, else balanced parts (``partition.plan_micro_batches``,
Karmarkar-Karp), a part over the budget (a sequence longer than it) first. Each client
(``ScoreJob.client``) has a queue of its units per ``BatchKey``, in arrival order.

Clients share the device by deficit round-robin over their token-equivalents, with sparse clients
first, as Linux's fq_codel serves new flows (RFC 8290, section 4.1): they take turns in an order
where a client whose work arrives while it has none queued (one call at a time, a trainer waiting
for its answer) joins at the front, behind only other such clients still waiting for their first
turn, and any other client at the back. A turn gives its client a quantum of ``max_batch_tokens``
(its *deficit*, with what its last turn left), which it spends on its units until it has no more
work of the micro-batch's key or its deficit is spent (the last piece may overdraw it: the next
turn pays); the client then goes to the back. A backlogged client never comes first again until
its queue has emptied, so what comes ahead of it is at most one quantum per sparse arrival.

``take`` forms the next micro-batch: the first client in the order with eligible work names its
key (its oldest eligible unit's), and the turns fill the micro-batch, one client after another,
with work of that key under ``max_batch_tokens`` and ``max_batch_sequences``, each client's first
fit, in arrival order, among the first ``FIT_WINDOW`` units of its queue; a unit too big for the
room left gives the sequences that fit and keeps its place with the rest. So micro-batches fill
up to the budget from many clients' work, one client alone gets full micro-batches, and clients
that queued their whole shares delay another's small call by the micro-batches in flight and the
one it runs in, not by their backlogs or their number.
Forming one costs O(clients + units taken): nothing scans the queue.

Work is counted as it runs, in token-equivalents (``costs.run_costs``): real tokens (no padding:
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
(a request finishes on the weights it started with); units are taken only from among the first
``FIT_WINDOW`` of a client's queue, so a swap's wait looks only there. A request that is over
(answered, failed, its caller gone) leaves the queue through ``discard``, or when the queue meets
it; one past its deadline is failed by ``drop_dead``. The asyncio loop
(``scheduler``) owns the clock, the futures and the device; this class only decides, so tests
drive it directly.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from logprob_service.domain import ScoreJob, ScoreOptions, ScoreResult, SequenceScores, TokenSequence, prompt_groups
from logprob_service.engine.costs import output_cost, run_costs, shared_prompt_cost, tokens_run
from logprob_service.engine.partition import plan_micro_batches_steps
from logprob_service.engine.slices import SEQUENCE_STEPS, Budget, Steps, finish
from logprob_service.errors import DeadlineExceeded


@dataclass(frozen=True)
class BatchKey:
    """Work batches together only when both match; its ``options`` go to the device as they are."""

    model: str
    options: ScoreOptions


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
    queued_cost: int = 0  # token-equivalents (RequestSlice.cost) of its units in the queue; 0 once none are
    taken: int = 0  # its share of the planned cost in the units taken so far (RequestSlice.admitted)
    scores: list[SequenceScores | None] = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.scores = [None] * len(self.job.sequences)
        self.remaining = len(self.job.sequences)

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.job.model, self.job.options)

    @property
    def started(self) -> bool:
        return self.first_launch_ns is not None

    @property
    def cost(self) -> int:
        """Token-equivalents admission counts for it: what it costs as planned (``BatchQueue.plan``)."""
        return sum(self.costs)


@dataclass(eq=False)
class RequestSlice:
    """Some sequences of one request, always scored in the same micro-batch."""

    request: Request
    indices: list[int]
    cost: int  # token-equivalents as it runs (costs.run_costs): with share_prompts, a prompt its sequences share once

    @property
    def admitted(self) -> int:
        """Its sequences' share of what admission counted for the request (``Request.costs``)."""
        costs = self.request.costs
        return sum(costs[i] for i in self.indices)


@dataclass(eq=False)
class _Client:
    """One client's queued work and its turn in the round-robin."""

    name: str
    queues: dict[BatchKey, deque[RequestSlice]] = field(default_factory=dict)  # by key, each in arrival order
    cost: int = 0  # token-equivalents of its queued units (those of requests discarded not counted)
    deficit: int = 0  # what its turn may still take
    in_turn: bool = False  # its turn has begun (its quantum given) and is not over
    sparse: bool = False  # its work came while it had none queued, and its first turn has not begun


@dataclass
class _Batch:
    """A micro-batch being filled."""

    budget: int
    max_sequences: int
    units: list[RequestSlice] = field(default_factory=list)
    cost: int = 0
    sequences: int = 0

    @property
    def room(self) -> int:
        return self.budget - self.cost

    @property
    def room_sequences(self) -> int:
        return self.max_sequences - self.sequences

    @property
    def full(self) -> bool:
        return self.room <= 0 or self.room_sequences <= 0

    def add(self, unit: RequestSlice) -> None:
        self.units.append(unit)
        self.cost += unit.cost
        self.sequences += len(unit.indices)


# A client's work of a key goes into a micro-batch first fit among the first FIT_WINDOW units of its
# queue: a unit whose next sequence does not fit the room left does not keep smaller ones behind it
# out (the micro-batch fills as when the whole queue was searched), and the search stays short.
FIT_WINDOW = 16

# With several devices, a micro-batch is never cut below this fraction of the token budget to
# share a burst's tail between them (``BatchQueue.take``): smaller ones would cost more per token.
TAIL_FRACTION = 4


class BatchQueue:
    def __init__(self, *, max_batch_tokens: int, max_batch_sequences: int, share_prompts: bool = False) -> None:
        self.max_batch_tokens = max_batch_tokens  # also each turn's quantum
        self.max_batch_sequences = max_batch_sequences
        self.share_prompts = share_prompts
        self._clients: dict[str, _Client] = {}  # those with queued work, in turn order: the current or next first
        self._key_costs: Counter[BatchKey] = Counter()  # token-equivalents queued, by key (none at 0)
        self._requests = 0  # requests with units queued
        self._deadlines: list[tuple[float, int, Request]] = []  # a heap of queued requests' deadlines
        self._arrivals = itertools.count()  # breaks ties between equal deadlines
        self._dropped: list[tuple[Request, int]] = []  # discarded on meeting them, for drop_dead to report

    def tokens(self, sequences: list[TokenSequence]) -> int:
        """Real tokens a micro-batch of ``sequences`` runs (what the metrics count)."""
        return tokens_run(sequences) if self.share_prompts else sum(s.num_tokens for s in sequences)

    def costs(self, sequences: list[TokenSequence]) -> list[int]:
        """Each sequence's share of what a micro-batch of ``sequences`` costs (``costs.run_costs``)."""
        return run_costs(sequences, share_prompts=self.share_prompts)

    def cost(self, sequences: list[TokenSequence]) -> int:
        """Token-equivalents a micro-batch of ``sequences`` costs."""
        return sum(self.costs(sequences))

    def plan(self, request: Request) -> list[RequestSlice]:
        """``request``'s units (one, or balanced parts if it is larger than a micro-batch), not queued
        yet, and each sequence's share of their cost in ``request.costs``."""
        return finish(self.plan_steps(request))

    def plan_steps(self, request: Request) -> Steps[list[RequestSlice]]:
        """``plan`` as ``slices.Steps``: a request of thousands of sequences is planned in slices,
        between which the scheduler hands the event loop back. Reads only ``request``, so the
        queue may change between them."""
        seqs = request.job.sequences
        budget = Budget()
        if len(seqs) <= self.max_batch_sequences and self.cost(seqs) <= self.max_batch_tokens:
            parts = [list(range(len(seqs)))]
        else:
            items, costs = yield from self._items(seqs, budget)
            planned = yield from plan_micro_batches_steps(
                costs,
                max_tokens=self.max_batch_tokens,
                max_sequences=self.max_batch_sequences,
                sizes=[len(item) for item in items],
            )
            parts = [sorted(i for j in part for i in items[j]) for part in planned]
            yield
        request.costs = [0] * len(seqs)
        units = []
        for indices in parts:
            costs = self.costs([seqs[i] for i in indices])
            for i, cost in zip(indices, costs):
                # admission counts the extra outputs too; micro-batches are cut by the tokens they run
                request.costs[i] = cost + output_cost(seqs[i], request.job.options.top_k)
            units.append(RequestSlice(request, indices, sum(costs)))
            if budget.spent(SEQUENCE_STEPS * len(indices)):
                yield
        # A part over the budget runs as a micro-batch of its own, which it must start: first, it
        # holds up none of the request's other parts behind it.
        units.sort(key=lambda unit: unit.cost <= self.max_batch_tokens)
        return units

    def push(self, request: Request) -> None:
        """Queue ``request``'s units (``plan``)."""
        self.add(self.plan(request))

    def add(self, units: list[RequestSlice]) -> None:
        """Queue the units ``plan`` made of one request (once it is admitted)."""
        if not units:
            return
        request = units[0].request
        client = self._clients.get(request.job.client)
        if client is None:  # a sparse client: its turn comes next, after those of earlier sparse ones
            client = _Client(request.job.client, sparse=True)
            order = list(self._clients.values())
            place = next((i for i, other in enumerate(order) if not other.sparse), len(order))
            order.insert(place, client)
            self._clients = {other.name: other for other in order}
        queue = client.queues.setdefault(request.key, deque())
        for unit in units:
            queue.append(unit)
            self._count(client, unit, 1)
        if request.job.deadline is not None:
            heapq.heappush(self._deadlines, (request.job.deadline, next(self._arrivals), request))
            if len(self._deadlines) > 2 * self._requests + 64:  # drop entries of requests no longer queued
                self._deadlines = [entry for entry in self._deadlines if entry[2].queued_cost]
                heapq.heapify(self._deadlines)

    @property
    def units(self) -> list[RequestSlice]:
        """Every queued unit: client by client in turn order, each client's in arrival order by key."""
        return [
            unit
            for client in self._clients.values()
            for queue in client.queues.values()
            for unit in queue
            if unit.request.queued_cost
        ]

    def _count(self, client: _Client, unit: RequestSlice, sign: int) -> None:
        """``unit`` of ``client`` enters the queue (``sign`` 1) or leaves it (-1)."""
        cost, request = sign * unit.cost, unit.request
        queued = bool(request.queued_cost)
        request.queued_cost += cost
        self._requests += bool(request.queued_cost) - queued
        self._key_costs[request.key] += cost
        if not self._key_costs[request.key]:
            del self._key_costs[request.key]
        client.cost += cost
        if not client.cost:  # no work left: it leaves the round-robin, and what its turn had left lapses
            self._clients.pop(client.name, None)

    def _items(self, seqs: list[TokenSequence], budget: Budget) -> Steps[tuple[list[list[int]], list[int]]]:
        """What a large request is cut along, and what each costs: its sequences one by one, or with
        ``share_prompts`` its prompt groups, each cut into runs that fit a micro-batch (a sequence
        too long to fit: alone)."""
        if not self.share_prompts:
            return [[i] for i in range(len(seqs))], [seq.num_tokens for seq in seqs]
        items, costs = [], []
        for group in prompt_groups(seqs):
            item: list[int] = []
            cost = 0
            for i in group:
                more = shared_prompt_cost(seqs[i]) if item else seqs[i].num_tokens
                if item and (cost + more > self.max_batch_tokens or len(item) == self.max_batch_sequences):
                    items.append(item)
                    costs.append(cost)
                    item, cost, more = [], 0, seqs[i].num_tokens
                item.append(i)
                cost += more
                if budget.spent(SEQUENCE_STEPS):
                    yield
            items.append(item)
            costs.append(cost)
        return items, costs

    def discard(self, request: Request) -> int:
        """Take ``request``'s units out of the queue (it is over); returns its share of the planned
        cost in them, what admission counted for them (0 if none were queued). Its units are left
        where they are, skipped and dropped once they come to the front."""
        if not request.queued_cost:
            return 0
        client = self._clients[request.job.client]
        client.cost -= request.queued_cost
        self._key_costs[request.key] -= request.queued_cost
        if not self._key_costs[request.key]:
            del self._key_costs[request.key]
        request.queued_cost = 0
        self._requests -= 1
        if not client.cost:
            del self._clients[client.name]
        return request.cost - request.taken

    def drop_dead(self, now: float) -> list[tuple[Request, int]]:
        """Fail the requests whose deadline (``time.monotonic``) passed while queued, and discard
        their units and those of every request that is over (failed, answered, or its caller gone)
        at the front of its client's queue; returns each request discarded since the last call
        (here, or met by ``take``) with its share of the planned cost in the units discarded."""
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if not request.queued_cost:
                continue  # no longer queued
            if not request.done():
                request.fail(
                    DeadlineExceeded(
                        f"request {request.job.request_id}: deadline passed while queued; nothing was computed"
                    )
                )
            self._dropped.append((request, self.discard(request)))
        for client in list(self._clients.values()):
            for key in list(client.queues):
                self._clear_front(client, key)
        dropped, self._dropped = self._dropped, []
        return dropped

    @staticmethod
    def eligible(unit: RequestSlice, held: Collection[str]) -> bool:
        """Whether ``unit`` may be launched now: not when its model is held for a swap and its
        request has not started (a started one must finish on the weights it started with)."""
        return unit.request.job.model not in held or unit.request.started

    def _live(self, unit: RequestSlice) -> bool:
        """Whether ``unit`` is still to run; one of a request that is over is discarded with the
        request's other units (``discard``), for ``drop_dead`` to report."""
        request = unit.request
        if request.queued_cost and request.done():
            self._dropped.append((request, self.discard(request)))
        return bool(request.queued_cost)

    def _clear_front(self, client: _Client, key: BatchKey) -> deque[RequestSlice] | None:
        """``client``'s queue of ``key`` once the units at its front that will not run are
        dropped (None when nothing is left of it)."""
        queue = client.queues.get(key)
        while queue and not self._live(queue[0]):
            queue.popleft()
        if queue is not None and not queue:
            del client.queues[key]
            return None
        return queue

    def _window(self, client: _Client, key: BatchKey, held: Collection[str]) -> Iterator[tuple[int, RequestSlice]]:
        """The units among the first FIT_WINDOW still to run in ``client``'s queue of ``key`` that
        may run now, with their places in it (those that will not run are dropped on the way, so a
        started request always has a unit among them). Stop iterating once the queue changes."""
        queue = self._clear_front(client, key)
        place = live = 0
        while queue and place < len(queue) and live < FIT_WINDOW:
            unit = queue[place]
            if not self._live(unit):
                del queue[place]
                continue
            live += 1
            if self.eligible(unit, held):
                yield place, unit
            place += 1

    def _next(self, held: Collection[str]) -> tuple[_Client, BatchKey, int, RequestSlice] | None:
        """Where the next micro-batch starts: the first client in turn order with a unit that may
        run, the key of its oldest such unit, and that unit's place and the unit."""
        for client in list(self._clients.values()):
            firsts = [
                (key, *first) for key in list(client.queues) if (first := next(self._window(client, key, held), None))
            ]
            if firsts:
                return client, *min(firsts, key=lambda first: first[2].request.arrived_ns)
        return None

    def first_eligible(self, held: Collection[str] = ()) -> RequestSlice | None:
        """The unit the next micro-batch starts with (None: nothing may be launched now)."""
        found = self._next(held)
        return None if found is None else found[3]

    def holds_started_work(self, model: str, held: Collection[str]) -> bool:
        """Whether ``model`` has queued units that may still run although it is held: a swap of it must wait."""
        return any(
            key.model == model and next(self._window(client, key, held), None) is not None
            for client in list(self._clients.values())
            for key in list(client.queues)
        )

    def _key_cost(self, key: BatchKey, held: Collection[str]) -> int:
        """Token-equivalents of the eligible work of ``key`` (held: of the started requests' units
        that may be taken next)."""
        if key.model not in held:
            return self._key_costs[key]
        return sum(unit.cost for client in list(self._clients.values()) for _, unit in self._window(client, key, held))

    def fills_a_batch(self, first: RequestSlice, held: Collection[str] = ()) -> bool:
        """Whether the eligible work sharing ``first``'s key fills a micro-batch's budget."""
        return self._key_cost(first.request.key, held) >= self.max_batch_tokens

    def take(self, held: Collection[str] = (), spread: int = 1) -> list[RequestSlice]:
        """The next micro-batch (removed from the queue); needs an eligible unit. A unit larger than
        the budget (a sequence longer than it: ``plan_micro_batches`` puts each alone) goes alone,
        when it starts a micro-batch.

        ``spread``: how many devices share the queue. A micro-batch then takes at most 1/spread of
        the eligible work of its key (guided self-scheduling), and no less than 1/TAIL_FRACTION of
        the budget: a burst of work (a GRPO step sent at once) runs in full micro-batches until its
        last ones, which get smaller, so the devices finish it together. Greedy full batches leave
        one device up to a whole micro-batch behind the others: on 2 GPUs, a step that is 11
        micro-batches runs as 6 on one and 5 on the other, 1.83x one GPU at best."""
        found = self._next(held)
        assert found is not None, "take needs an eligible unit"
        first_client, key, place, first = found
        if first.cost > self.max_batch_tokens:
            self._replace(first_client, key, place, None)
            first.request.taken += first.admitted
            first_client.deficit = min(first_client.deficit, 0)  # it took more than a turn
            self._end_turn(first_client)
            return [first]
        budget = self.max_batch_tokens
        if spread > 1:
            share = -(-self._key_cost(key, held) // spread)
            budget = min(budget, max(share, self.max_batch_tokens // TAIL_FRACTION))
        batch = _Batch(budget, self.max_batch_sequences)
        # Turn after turn: a pass over every client, and another while the last one took work or
        # ended a turn (that client's next turn begins). A new turn's deficit is above 0: it takes
        # work, or stops at the micro-batch's room and goes on in the next one.
        progress = True
        while progress and not batch.full:
            progress = False
            for client in list(self._clients.values()):
                if batch.full:
                    break
                if next(self._window(client, key, held), None) is None:
                    continue
                if not client.in_turn:
                    client.deficit += self.max_batch_tokens
                    client.in_turn = True
                    client.sparse = False
                taken = len(batch.units)
                over = self._serve(client, key, batch, held)
                if over:
                    self._end_turn(client)
                progress = progress or over or len(batch.units) > taken
        if not batch.units:  # the first sequence alone is over the share: it goes at the full budget
            return self.take(held)
        return batch.units

    def _serve(self, client: _Client, key: BatchKey, batch: _Batch, held: Collection[str]) -> bool:
        """Put ``client``'s work of ``key`` in ``batch``, first fit among the first units of its
        queue, while its deficit lasts (the last piece may overdraw it: the next turn pays) and
        the room does; returns whether its turn is over (its deficit is spent, or its work of the
        key is)."""
        while client.deficit > 0 and not batch.full:
            window = self._window(client, key, held)
            first = next(window, None)
            if first is None:
                client.deficit = min(client.deficit, 0)  # nothing of the key left (or held): the rest lapses
                return True
            for place, unit in itertools.chain([first], window):  # left as soon as the queue changes
                taken, left = self._fit(unit, batch.room, batch.room_sequences)
                if taken is not None:
                    self._replace(client, key, place, left)
                    unit.request.taken += taken.admitted
                    client.deficit -= taken.cost
                    batch.add(taken)
                    break
            else:
                return False  # none of it fits the room left: its turn goes on in the next micro-batch
        return client.deficit <= 0

    def _replace(self, client: _Client, key: BatchKey, place: int, left: RequestSlice | None) -> None:
        """The unit at ``place`` in ``client``'s queue of ``key`` was taken: ``left`` (the sequences
        not taken) takes its place, or none does."""
        queue = client.queues[key]
        unit = queue[place]
        if left is None:
            del queue[place]
        else:
            queue[place] = left
            self._count(client, left, 1)  # first: the request stays counted as queued
        self._count(client, unit, -1)
        if not queue:
            del client.queues[key]

    def _end_turn(self, client: _Client) -> None:
        """``client``'s turn is over: it goes to the back of the order (if it has work left)."""
        client.in_turn = False
        client.sparse = False
        if self._clients.get(client.name) is client:
            self._clients[client.name] = self._clients.pop(client.name)

    def _fit(
        self, unit: RequestSlice, room: int, room_sequences: int
    ) -> tuple[RequestSlice | None, RequestSlice | None]:
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
        return RequestSlice(unit.request, taken, used), RequestSlice(
            unit.request, left, self.cost([sequences[j] for j in left])
        )


def owners_of(units: list[RequestSlice]) -> list[tuple[Request, int]]:
    """(request, sequence index) of each position in a micro-batch made of ``units``."""
    return [(unit.request, i) for unit in units for i in unit.indices]


def requests_of(owners: list[tuple[Request, Any]]) -> list[Request]:
    """The distinct requests among ``owners``, in order."""
    return list(dict.fromkeys(request for request, _ in owners))
