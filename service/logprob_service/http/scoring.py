"""What every scoring route shares: the caller's token sequences as one ``ScoreJob`` for the engine
facade, scored unless the caller hangs up first, with the results back per sequence.

A peer's prompt-log-prob call scores positions ``start..n-1`` of ids ``x_0..x_{n-1}``: the job's
sequence is ``prompt = x[:start]``, ``completion = x[start:]`` (``start >= 1``: the first token has
no context), with the call's top-k (``ScoreJob.top_k``) and, where it names some, the candidate ids
of each scored position (``TokenSequence.candidate_ids``). Sequences of one call with the same
prompt run it once (the engine's shared prompts), so a TRL call's ``prompt_lengths`` and SGLang's
``logprob_start_len`` cost what a gRPC group does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from logprob_service.domain import MAX_TOP_K, ScoreJob, ScoreOptions, ScoreResult, SequenceScores, TokenSequence
from logprob_service.engine import SEQUENCE_STEPS, Budget, RequestCounts, distinct_prompt_tokens, sequence_steps
from logprob_service.errors import InvalidArgument
from logprob_service.http.app import RouteRequest, until_disconnect
from logprob_service.http.errors import CallerGone, Naming


@dataclass(frozen=True)
class Item:
    """One sequence of the caller's request: all its ids, the first position to score, and the
    candidate ids of each position scored. ``field``: how the request names its ids, e.g.
    ``prompt[3]``; ``candidates_field``: its candidate ids, e.g. ``token_ids_logprob``."""

    ids: np.ndarray  # [n] int64
    start: int
    field: str
    candidates: np.ndarray | None = None  # [n - start, Kc] int64
    candidates_field: str = ""
    candidates_rows: int | None = None  # None: one list for every position; else the request's row 0's position

    @property
    def scored(self) -> bool:
        return self.start < len(self.ids)


INT64 = range(-(2**63), 2**63)


def _int64(values: Sequence[int] | Sequence[Sequence[int]], field: str) -> np.ndarray:
    """``values`` as int64; an id past int64's range is ``InvalidArgument`` naming its index (the
    engine checks the others against the model's vocabulary)."""
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        rows = values if values and not isinstance(values[0], int) else [values]
        where = next(
            f"[{i}][{j}]" if rows is values else f"[{j}]"
            for i, row in enumerate(rows)
            for j, v in enumerate(row)  # type: ignore[arg-type]
            if v not in INT64
        )
        raise InvalidArgument(f"{field}{where}: outside int64's range [-2^63, 2^63), past any vocabulary") from None


def ids_of(values: Sequence[int], field: str) -> np.ndarray:
    """A request's token ids as int64 (the engine checks them against the model's vocabulary)."""
    if not values:
        raise InvalidArgument(f"{field}: is empty; at least 1 token is required")
    return _int64(values, field)


def check_start(start: int, n: int, field: str, rule: str) -> None:
    if not 0 <= start <= n:
        raise InvalidArgument(f"{field}: {start} is outside [0, {n}] ({rule})")


def candidate_rows(values: Sequence[int] | Sequence[Sequence[int]], rows: int, field: str) -> np.ndarray:
    """A request's candidate ids as ``[rows, Kc]`` int64: one list for every row, or one per row
    (all of one length; the engine checks the ids and the width)."""
    if values and not isinstance(values[0], int):
        if len(values) != rows:
            raise InvalidArgument(f"{field}: {len(values)} rows of candidate ids for {rows} scored positions")
        widths = {len(row) for row in values}
        if len(widths) > 1:
            raise InvalidArgument(f"{field}: rows of {sorted(widths)} ids; every row needs the same number")
        return _int64(values, field).reshape(rows, -1)
    if not values:
        raise InvalidArgument(f"{field}: is empty; at least 1 candidate id is required")
    return np.broadcast_to(_int64(values, field), (rows, len(values)))


@dataclass(frozen=True)
class AnswerSize:
    """At most how many bytes a peer's answer takes (``max_answer_bytes``): ``request`` for what it
    writes once, ``sequence`` for each sequence, ``entry`` for each log-prob it writes (a scored
    position's own, its top-k's, its candidates') with its id and the text around them."""

    request: int
    sequence: int
    entry: int

    def of(self, sequences: int, entries: int) -> int:
        return self.request + self.sequence * sequences + self.entry * entries


def top_k_counted(k: int | None) -> int:
    """A request's top-k as its answer's estimate counts it: one out of range is refused by name
    when the job is checked."""
    return min(max(k or 0, 0), MAX_TOP_K)


def check_counts(
    call: RouteRequest, batch_field: str, prompts: Sequence[int], completions: Sequence[int], answer_bytes: int
) -> None:
    """Refuse a request whose counts pass a limit (``InvalidArgument`` naming ``batch_field``, the
    count and the limit) or the queue's room for its client (``Overloaded``) before any of its items
    is built. ``prompts``, ``completions``: the lengths of each sequence to score, as sent;
    ``answer_bytes``: the peer's ``AnswerSize`` of it."""
    counts = RequestCounts(len(completions), distinct_prompt_tokens(prompts, sum(completions)), answer_bytes)
    try:
        call.engine.check_counts(counts, client=call.client)
    except InvalidArgument as err:
        raise Naming([], batch_field).renamed(err) from None


@dataclass
class Scored:
    """A call's results: one ``SequenceScores`` per item (None: nothing of it to score)."""

    result: ScoreResult
    scores: list[SequenceScores | None]

    @property
    def model(self) -> str:
        return self.result.model


def _as_float32(value: float) -> float:
    """``value`` as gRPC's float field carries it, so both edges score at the same temperature."""
    with np.errstate(over="ignore"):  # too large: inf, which the engine refuses by name
        return float(np.float32(value))


def answer_steps(item: Item, top_k: int) -> int:
    """The slice steps (``engine.slices``) of writing ``item``'s answer with ``top_k`` entries a
    position: about 8 values of JSON a microsecond, 4 a position and entry."""
    return sequence_steps(4 * len(item.ids) * (1 + top_k))


async def score_items(
    call: RouteRequest,
    items: Sequence[Item],
    *,
    model: str,
    temperature: float,
    batch_field: str,
    temperature_field: str,
    top_k: int = 0,
    top_k_field: str = "top_k",
    answer_bytes: int = 0,
    return_ranks: bool = False,
) -> Scored:
    """Score ``items`` as one job of ``call``'s client (``answer_bytes``: its ``AnswerSize``;
    ``return_ranks``: each token's vocabulary rank too);
    ``InvalidArgument`` naming the request's fields. A caller that disconnects first cancels its
    job (its queued work is dropped): then ``CallerGone``."""
    call.model = model  # the request's model, for its accounting whatever the outcome
    scored = [item for item in items if item.scored]
    if not scored:
        raise InvalidArgument(f"{batch_field}: no position to score (every sequence is all prompt)")
    sequences, budget = [], Budget()
    for item in scored:
        sequences.append(TokenSequence(item.ids[: item.start], item.ids[item.start :], item.candidates))
        await budget.pause(SEQUENCE_STEPS)
    job = ScoreJob(
        request_id=call.request_id,
        model=model,
        sequences=sequences,
        options=ScoreOptions(temperature=_as_float32(temperature), top_k=top_k, return_ranks=return_ranks),
        deadline=call.deadline,
        client=call.client,
        answer_bytes=answer_bytes,
    )
    naming = Naming(
        [(item.field, item.start, item.candidates_field, item.candidates_rows) for item in scored],
        batch_field,
        temperature_field,
        top_k_field,
    )
    work = asyncio.ensure_future(call.engine.score(job))
    gone = asyncio.ensure_future(until_disconnect(call.request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise CallerGone()
    try:
        result = work.result()
    except InvalidArgument as err:
        raise naming.renamed(err) from None
    answers = iter(result.scores)
    return Scored(result, [next(answers) if item.scored else None for item in items])
