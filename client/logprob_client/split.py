"""Cutting one scoring call into several RPCs that are in flight together.

A call's sequences are cut, in order, into contiguous parts that each stay within a sequence
limit and a token limit (prompt + completion tokens). The parts are sent at once (within the
client's share of the server's queue: ``pacing.py``) and their scores put back together in
order, so that the server starts on the first part while later ones are still on the wire, no
message grows past the server's per-request limits, and parts can be served by different
replicas behind one target.

Consecutive sequences with the same prompt (GRPO's completions of one prompt, laid out as TRL
does) are counted the way the server runs them (``--share-prompts``): the prompt once per part,
so a group stays in one RPC, and so in one micro-batch, where the server runs its prompt once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# One RPC's default share: half the server's default micro-batch (--max-batch-tokens 65536,
# --max-batch-sequences 256), so the server starts on the first part while the next is on the
# wire and packs two parts into one micro-batch, well inside its default per-request limits
# (4096 sequences, 1M tokens).
DEFAULT_MAX_SEQUENCES_PER_RPC = 256
DEFAULT_MAX_TOKENS_PER_RPC = 32768


@dataclass(frozen=True)
class RpcLimits:
    """The most sequences, and prompt + completion tokens, that one ScoreTokens RPC carries."""

    max_sequences: int = DEFAULT_MAX_SEQUENCES_PER_RPC
    max_tokens: int = DEFAULT_MAX_TOKENS_PER_RPC

    def __post_init__(self) -> None:
        if self.max_sequences < 1 or self.max_tokens < 1:
            raise ValueError(f"RPC limits must be >= 1, got {self}")


def split(lengths: Sequence[int], limits: RpcLimits, shared: Sequence[int] | None = None) -> list[slice]:
    """Contiguous parts of ``range(len(lengths))``, in order, each within ``limits``.

    ``lengths[i]`` is sequence i's prompt + completion tokens; ``shared[i]`` (default 0) its
    prompt's length when sequence i - 1 has the same prompt, which a part that holds both runs
    once. A part grows until the next sequence would break a limit; a sequence longer than
    ``limits.max_tokens`` is a part of its own (the server then decides whether it can score it).
    There is always at least one part, so an empty call still reaches the server and gets its answer.
    """
    shared = shared or [0] * len(lengths)
    parts: list[slice] = []
    start, tokens = 0, 0
    for i, length in enumerate(lengths):
        cost = _cost(lengths, shared, i, start)
        if i > start and (i - start >= limits.max_sequences or tokens + cost > limits.max_tokens):
            parts.append(slice(start, i))
            start, tokens, cost = i, 0, length
        tokens += cost
    parts.append(slice(start, len(lengths)))
    return parts


def part_tokens(lengths: Sequence[int], part: slice, shared: Sequence[int] | None = None) -> int:
    """The tokens of ``part`` (one of ``split``'s), counted as ``split`` counts them."""
    shared = shared or [0] * len(lengths)
    return sum(_cost(lengths, shared, i, part.start) for i in range(part.start, part.stop))


def _cost(lengths: Sequence[int], shared: Sequence[int], i: int, start: int) -> int:
    """Sequence i's tokens in a part that starts at ``start``: its prompt counted unless the
    sequence before it in the part has it."""
    return lengths[i] - shared[i] if i > start else lengths[i]
