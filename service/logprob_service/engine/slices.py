"""Long passes over a request's sequences in slices, so that the event loop every caller shares is
handed back between them.

A request of thousands of sequences is converted, checked, planned and answered on the event
loop, where every other caller's calls, health checks and answers wait meanwhile. Each such pass
counts what it does in *steps* (one step: about a microsecond of Python on the 2-core CPU machine,
e.g. a few attribute reads of one sequence, or 32 of its ids converted) and hands the loop back once
a slice of ``SLICE_STEPS`` is spent: an async pass awaits ``Budget.pause``, and a synchronous
computation (``BatchQueue.plan``) is written as ``Steps``, a generator that yields where a slice
ends, which ``run`` drives on the loop and ``finish`` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

# A slice: about 2 ms of the loop on the 2-core CPU machine, a tenth of a 256-token micro-batch there.
SLICE_STEPS = 2048
# One sequence's conversion, check or answer costs about this many steps beside its ids.
SEQUENCE_STEPS = 8
IDS_PER_STEP = 32

Steps = Generator[None, None, T]


class Budget:
    """The steps spent in the current slice."""

    def __init__(self, slice_steps: int = SLICE_STEPS) -> None:
        self.slice_steps = slice_steps
        self._spent = 0

    def spent(self, steps: int) -> bool:
        """Count ``steps``; whether the slice is over (its count then starts again)."""
        self._spent += steps
        if self._spent < self.slice_steps:
            return False
        self._spent = 0
        return True

    async def pause(self, steps: int) -> None:
        """Count ``steps``, and hand the event loop back once the slice is over."""
        if self.spent(steps):
            await asyncio.sleep(0)


def sequence_steps(tokens: int) -> int:
    """The steps of one sequence of ``tokens`` ids converted, checked or answered."""
    return SEQUENCE_STEPS + tokens // IDS_PER_STEP


def finish(steps: Steps[T]) -> T:
    """``steps``' result, computed at once (a caller that shares no event loop, a test)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def run(steps: Steps[T]) -> T:
    """``steps``' result, handing the event loop back (``asyncio.sleep(0)``) where each slice ends."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)
