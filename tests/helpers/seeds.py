"""Seeds that are the same on every run (tests/conftest.py gives each test its own)."""

from __future__ import annotations

import hashlib
import os

SEED_ENV = "LOGPROB_TEST_SEED"


def stable_seed(text: str) -> int:
    """A seed from ``text`` that is the same on every run and machine (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def session_seed(name: str) -> int:
    """The seed of a session- or module-scoped fixture ``name`` (``LOGPROB_TEST_SEED`` moves it too)."""
    replay = os.environ.get(SEED_ENV)
    return stable_seed(f"{replay}:{name}") if replay else stable_seed(name)
