"""Refused calls held per client: a client whose calls keep being refused gets its further
refusals answered no faster than a set rate, so a closed loop of refused calls (each resent as
soon as it is answered) runs at that rate instead of the server's speed, however cheap a refusal.

Both edges use one ``RefusalThrottle`` (``api.interceptors.HeldRefusals``, ``http.app``), keyed by
the client identity the fair share uses (``security.caller``: the token's name, else the caller's
address), so a client's refusals count together whichever edge they come over.

Which refusals count (``HELD_CODES``): those a client can cure only by changing its call, and that
a well-behaved client therefore does not repeat: INVALID_ARGUMENT (bad input, a limit passed; HTTP
400, 405, 413), NOT_FOUND (an unknown model), UNAUTHENTICATED and PERMISSION_DENIED (no or a wrong
token, a missing scope: the client is then its address, so guessing tokens is held too). Not the
retryable ones (RESOURCE_EXHAUSTED, UNAVAILABLE): they carry a retry hint that clients' retry
policies honour, and they often say the server is busy rather than that the client is at fault;
the client library retries only those, so its retries never meet a hold. Nor a deadline, a
cancel, a weight update's state or a bug.

The rate is a token bucket per client (``RefusalBuckets``, kept as a theoretical arrival time:
GCRA): ``burst`` refusals are answered at once, then one every ``1 / per_s`` seconds; a refusal
past the bucket waits for its turn before it is answered. A client refused once in a while (one
bad request in a training run) is never held. A wait is at most ``burst / per_s`` (what the burst
takes to refill), however many of a client's calls are held at once. A client's entry goes once
its bucket is full again, so the state holds only clients refused within the last few seconds.

A held call waits on the event loop (no CPU) and ends as soon as its caller goes (the edge's
cancellation), its deadline passes, or the server drains (``release``: every held call answered
at once, and no further one held). Held calls are bounded: at most ``MAX_HELD_CALLS`` at once, and
the request bytes they keep (``nbytes``: a gRPC call keeps its message until it is answered; an
HTTP call's body is let go before its hold) at most ``max_held_bytes``; a refusal past either is
answered at once, as without the throttle.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from logprob_service.errors import ErrorCode
from logprob_service.settings.model import Settings
from logprob_service.stats import NO_STATS, RefusalHeld, StatsSink

log = logging.getLogger(__name__)

HELD_CODES = frozenset(
    {ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED}
)
# Calls held at once over all clients: each is a coroutine asleep on the event loop and, over
# gRPC, its call (HTTP: its connection, within http_max_connections).
MAX_HELD_CALLS = 1024
# Clients remembered at once: each entry is a few hundred bytes; past this the least recently
# refused is forgotten (its next refusals start a fresh burst).
MAX_CLIENTS = 65536
# Sums of intervals in floating point: a wait this short is none (the burst's last refusal).
_ROUNDING_S = 1e-9


@dataclass
class _Client:
    due: float  # when its bucket is full again (GCRA's theoretical arrival time)
    throttled: bool = False  # its start has been logged


class RefusalBuckets:
    """A token bucket of refusals per client, on the clock the caller passes (``now``, seconds)."""

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst = burst
        self.per_s = per_s
        self._clients: collections.OrderedDict[str, _Client] = collections.OrderedDict()

    @property
    def max_wait_s(self) -> float:
        return self.burst / self.per_s

    def charge(self, client: str, now: float) -> float:
        """Count one refusal of ``client`` at ``now``: how long it waits before its answer (0: at once)."""
        self._forget(now)
        entry = self._clients.pop(client, None) or _Client(now)
        self._clients[client] = entry  # the most recently refused last
        interval, window = 1 / self.per_s, self.max_wait_s
        entry.due = max(entry.due, now) + interval
        wait = entry.due - now - window
        if wait > window:  # a wait is at most what the burst takes to refill; so is the debt beyond it
            entry.due, wait = now + 2 * window, window
        if wait <= _ROUNDING_S:
            return 0.0
        if not entry.throttled:
            entry.throttled = True
            log.info(
                "refusals held",
                extra={
                    "fields": {
                        "client": client,
                        "why": f"more than {self.burst} refused calls at once (refusal_burst); its further refused "
                        f"calls are answered at most {self.per_s:g} a second (refusals_per_s) until it stops",
                    }
                },
            )
        return wait

    def __len__(self) -> int:
        return len(self._clients)

    def _forget(self, now: float) -> None:
        """Drop the clients whose bucket is full again. The least recently refused come first, and
        a client's ``due`` is at most ``2 * max_wait_s`` past its last refusal, so every entry older
        than that is reached from the front."""
        while self._clients:
            entry = next(iter(self._clients.values()))
            if entry.due > now and len(self._clients) < MAX_CLIENTS:
                return
            self._clients.popitem(last=False)


class RefusalThrottle:
    """Holds refused calls past their client's bucket (``per_s`` 0: never). ``max_held_bytes``: the
    request bytes held calls may keep together; ``stats`` gets a ``RefusalHeld`` for each held call."""

    def __init__(
        self,
        burst: int,
        per_s: float,
        *,
        max_held_bytes: int,
        max_held_calls: int = MAX_HELD_CALLS,
        stats: StatsSink = NO_STATS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.buckets = RefusalBuckets(burst, per_s) if per_s > 0 else None
        self.max_held_bytes = max_held_bytes
        self.max_held_calls = max_held_calls
        self.held_calls = self.held_bytes = 0
        self._stats = stats
        self._clock = clock
        self._wakers: set[asyncio.Future[None]] = set()
        self._draining = False
        self._full = False  # the caps were reached (logged) and held calls have not all ended since

    @classmethod
    def of(cls, settings: Settings, stats: StatsSink = NO_STATS) -> RefusalThrottle:
        """The settings' throttle: ``refusal_burst``, ``refusals_per_s``; held gRPC messages at most
        ``max_message_bytes`` together (one of the largest is always held)."""
        return cls(
            settings.refusal_burst, settings.refusals_per_s, max_held_bytes=settings.max_message_bytes, stats=stats
        )

    async def hold(
        self,
        client: str,
        code: ErrorCode,
        edge: str,
        *,
        nbytes: int = 0,
        deadline: float | None = None,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Wait before a refusal of ``client`` with ``code`` over ``edge`` ("grpc", "http") is
        answered, if its bucket says so. ``nbytes``: what the call keeps while held; ``deadline``
        (on the throttle's clock): the wait ends by then; ``gone``: a coroutine that returns when
        the caller has gone, which then ends the wait (the edge's cancellation does too)."""
        if self.buckets is None or code not in HELD_CODES or self._draining:
            return
        wait = self.buckets.charge(client, self._clock())
        if deadline is not None:
            wait = min(wait, deadline - self._clock())
        if wait <= 0 or not self._room(nbytes):
            return
        self.held_calls += 1
        self.held_bytes += nbytes
        self._stats.record(RefusalHeld(edge))
        loop = asyncio.get_running_loop()
        waker: asyncio.Future[None] = loop.create_future()
        self._wakers.add(waker)
        timer = loop.call_later(wait, _wake, waker)
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        if watch is not None:
            watch.add_done_callback(lambda done: _wake(waker, done))
        try:
            await waker
        finally:
            timer.cancel()
            if watch is not None:
                watch.cancel()
            self._wakers.discard(waker)
            self.held_calls -= 1
            self.held_bytes -= nbytes
            if self.held_calls == 0:
                self._full = False

    def release(self) -> None:
        """The server drains: every held call is answered now, and no refusal is held from here on."""
        self._draining = True
        for waker in list(self._wakers):
            _wake(waker)

    def _room(self, nbytes: int) -> bool:
        if self.held_calls < self.max_held_calls and self.held_bytes + nbytes <= self.max_held_bytes:
            return True
        if not self._full:
            self._full = True
            log.warning(
                "refusals answered at once: %d refused calls held (at most %d), keeping %d request bytes (at most "
                "%d); until they end, further refusals are not held",
                self.held_calls,
                self.max_held_calls,
                self.held_bytes,
                self.max_held_bytes,
            )
        return False


def _wake(waker: asyncio.Future[None], watch: asyncio.Future[object] | None = None) -> None:
    """End a hold; ``watch``: the caller's watch that ended it (its failure, if any, read: the caller
    is gone either way)."""
    if watch is not None and not watch.cancelled():
        watch.exception()
    if not waker.done():
        waker.set_result(None)
