"""Pacing a client's scoring RPCs to its share of the server's queue.

The server admits at most ``max_queued_tokens_per_client`` tokens of one client (its token's name;
without authentication, its IP address) that are not yet scored, and refuses more with
RESOURCE_EXHAUSTED and a retry hint. A call cut into parts (``split.py``) larger than that share,
sent at once, would have most of its parts refused and retried, again and again, until its
deadline passed. So a client (``Share``, one for all its calls) sends a part only while the tokens
of its parts in flight stay within ``PACED_SHARE`` of the share the server tells (ListModels'
``ModelLimits``, the smaller of ``max_queued_tokens_per_client`` and ``max_queued_tokens``), and
sends the parts kept back, in the order they were asked for, as earlier ones are answered. A part
that alone passes that budget goes when nothing else of the client is in flight: the server
admits a request up to the whole share when the client has nothing else queued (one that costs
more than the share it refuses as invalid, naming the limit).

Half the share, not all of it: the client counts a part's tokens as ``split`` does (each prompt
once a part), the server counts them as they run (a shared prompt once in each micro-batch of its
completions and their reads of it, and top-k and candidate outputs: up to about twice as many),
and other processes of one identity (a trainer's ranks on one host, without tokens) draw on the
same share.

The budget is asked for once, when a part of the client first has to wait (a lone call's first
part never waits). A server that tells none (0: one before these fields; or ListModels failed)
leaves the parts unpaced, all sent at once, as before.

When a call's deadline passes, ``PacedCall.deadline_error`` says how much of it was answered, how
much was sent, and what held the rest back: the share, named with its value.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from .errors import DeadlineExceeded

# What part of the share the client's parts in flight may hold (see the module's docstring).
PACED_SHARE = 0.5


@dataclass(eq=False)
class Waiter:
    """A part kept back: its tokens, and what sends it (called once, when there is room)."""

    cost: int
    go: Callable[[], None]


class Share:
    """One client's tokens in flight, within its share of the server's queue.

    Thread-safe; ``go`` callbacks run outside its lock, on the thread that made room (a blocking
    client's: gRPC's callback threads; an asyncio client's: its event loop). ``learn``: asks the
    server for its limits and calls ``told`` with the answer (called once, the first time a part
    has to wait)."""

    def __init__(self, learn: Callable[[], None]) -> None:
        self._learn = learn
        self._lock = threading.Lock()
        self._waiting: deque[Waiter] = deque()
        self._asked = False
        self.in_flight = 0  # tokens of the parts sent and not yet answered
        self.share: int | None = None  # the server's share for this client; None: not told yet; 0: none
        self.limit_name = "max_queued_tokens_per_client"  # the limit the share is (or the whole queue's)

    @property
    def budget(self) -> int | None:
        """Tokens the client's parts in flight may hold (0: no pacing; None: not known yet)."""
        if self.share is None:
            return None
        return max(1, int(self.share * PACED_SHARE)) if self.share else 0

    def ask(self, cost: int, go: Callable[[], None]) -> Waiter | None:
        """Send a part of ``cost`` tokens: ``go()`` now, when there is room (None returned), or
        later (the ``Waiter`` returned, for ``withdraw``)."""
        waiter = Waiter(cost, go)
        with self._lock:
            self._waiting.append(waiter)
            ready = self._ready()
            learn = self.share is None and bool(self._waiting) and not self._asked
            self._asked |= learn
        for each in ready:
            each.go()
        if learn:
            self._learn()
        return None if waiter in ready else waiter

    def release(self, cost: int) -> None:
        """A part of ``cost`` tokens was answered (or failed, or was cancelled)."""
        with self._lock:
            self.in_flight -= cost
            ready = self._ready()
        for each in ready:
            each.go()

    def withdraw(self, waiter: Waiter) -> bool:
        """Take back a part still kept back; False when it was already let go (its ``go`` ran or
        is running, and the sender answers for its tokens)."""
        with self._lock:
            if waiter not in self._waiting:
                return False
            self._waiting.remove(waiter)
            ready = self._ready()
        for each in ready:
            each.go()
        return True

    def told(self, max_queued_tokens: int, max_queued_tokens_per_client: int) -> None:
        """The server's queue limits (0: not told, so no pacing)."""
        limits = {"max_queued_tokens_per_client": max_queued_tokens_per_client, "max_queued_tokens": max_queued_tokens}
        told = {name: value for name, value in limits.items() if value > 0}
        with self._lock:
            self.limit_name = min(told, key=told.__getitem__) if told else self.limit_name
            self.share = told.get(self.limit_name, 0)
            ready = self._ready()
        for each in ready:
            each.go()

    def _ready(self) -> list[Waiter]:
        """The waiters at the head of the line that fit now, their tokens counted in flight (under the lock)."""
        ready = []
        budget = self.budget
        while self._waiting:
            cost = self._waiting[0].cost
            if not (self.in_flight == 0 or budget == 0 or (budget is not None and self.in_flight + cost <= budget)):
                break
            self.in_flight += cost
            ready.append(self._waiting.popleft())
        return ready

    def described(self) -> str:
        """What paced the client's parts, for an error."""
        if not self.share:
            return (
                "the server told no share of its queue (ListModels' max_queued_tokens_per_client), so the parts "
                "were sent at once, unpaced"
            )
        return (
            f"parts were paced to this client's share of the server's queue, {self.limit_name}={self.share} tokens "
            f"(ListModels): at most {self.budget} tokens of its parts in flight at once, the next part sent as "
            "earlier ones were answered"
        )


@dataclass
class PacedCall:
    """One scoring call's parts as they are paced: their tokens (as the client counts them) and
    sequences, its deadline, and which were sent and answered."""

    costs: Sequence[int]
    sequences: Sequence[int]
    timeout: float
    deadline: float = field(init=False)
    sent: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def deadline_error(self, target: str, share: Share, server_message: str = "") -> DeadlineExceeded:
        """The call's error when its deadline passed: how much of it was answered and sent, what
        paced it, and the server's words (when a part's RPC ended so)."""
        parts = len(self.costs)
        answered = sorted(self.answered)
        sent = len(self.sent) - len(answered)
        done = (
            f"{len(answered)} of {parts} parts answered ({sum(self.sequences[i] for i in answered)} of "
            f"{sum(self.sequences)} sequences, {sum(self.costs[i] for i in answered)} of {sum(self.costs)} tokens), "
            f"{sent} sent and not yet answered, {parts - len(self.sent)} not sent"
        )
        said = f" (the server: {server_message})" if server_message and server_message != "Deadline Exceeded" else ""
        advice = (
            f"; give the call a longer timeout, send less in one call, or raise the server's {share.limit_name}"
            if share.share
            else ""
        )
        message = (
            f"{target}: the call's deadline ({self.timeout:g} s) passed with {done}{said}; {share.described()}{advice}"
        )
        return DeadlineExceeded(message, grpc.StatusCode.DEADLINE_EXCEEDED, server_message=server_message)
