"""Waiting for something to happen, instead of sleeping and hoping it did.

A test that needs an order of events (a call has reached the server, a drain has begun) waits
for the event itself, with a timeout far above what it takes on a loaded 2-core machine; the
timeout only bounds how long a broken run hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

TIMEOUT_S = 60.0


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Return once ``condition()`` holds (checked every 10 ms on the event loop); fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    """``eventually`` for threads without an event loop."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)
