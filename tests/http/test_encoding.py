"""The JSON writers of the per-token answers give, byte for byte, what the answers were before they
were rewritten for speed: each number written by pydantic-core (the shortest text that reads back
as the same float, ``-Infinity`` / ``NaN``), a bytes object per entry, joined."""

from __future__ import annotations

import numpy as np
import pydantic_core
import pytest
from logprob_service.domain import SequenceScores
from logprob_service.http import encoding, sglang, vllm
from logprob_service.http.scoring import Item

# log-probs a writer must keep as they are: non-finite, signed zero, the float32 extremes
SPECIAL = np.array(
    [-np.inf, np.inf, np.nan, -0.0, 0.0, 1e-45, -1e-45, 1.2e-38, -3.4028235e38, 3.4028235e38, -1e-7, -100.0],
    dtype=np.float32,
)


def numbers(values: np.ndarray) -> list[bytes]:
    return pydantic_core.to_json(values.ravel().tolist())[1:-1].split(b",")


def triples_before(logprobs: np.ndarray, ids: np.ndarray) -> bytes:
    """SGLang's triples as the edge wrote them before ``encoding.triples``."""
    lps, names = numbers(logprobs), numbers(ids)
    entries = [b"[%b,%b,null]" % (lp, t) for lp, t in zip(lps, names)]
    if ids.ndim == 1:
        return b"[" + b",".join(entries) + b"]"
    width = ids.shape[1]
    rows = [b"[" + b",".join(entries[p : p + width]) + b"]" for p in range(0, len(entries), width)]
    return b"[" + b",".join(rows) + b"]"


def prompt_logprobs_before(item: Item, scores: SequenceScores | None, k: int) -> bytes:
    """vLLM's ``prompt_logprobs`` written an entry at a time (as the edge wrote them before
    ``encoding.interleave``), with vLLM's ranks: a top-k entry's place, else the vocabulary rank."""
    entry = b'"%b":{"logprob":%b,"rank":%d,"decoded_token":"token_id:%b"}'
    entries = [b"null"] * item.start
    if scores is None:
        return b"[" + b",".join(entries) + b"]"
    own = item.ids[item.start :]
    ids, lps = numbers(own), numbers(scores.logprobs)
    if not k:
        entries += [b"{" + entry % (t, lp, r, t) + b"}" for t, lp, r in zip(ids, lps, scores.ranks.tolist())]
        return b"[" + b",".join(entries) + b"]"
    among = scores.top_ids == own[:, None]
    ranks = np.where(among.any(axis=1), among.argmax(axis=1) + 1, scores.ranks).tolist()
    top_ids, top_lps = numbers(scores.top_ids), numbers(scores.top_logprobs)
    for p in range(len(own)):
        row = [entry % (ids[p], lps[p], ranks[p], ids[p])]
        row += [
            entry % (top_ids[j], top_lps[j], j - p * k + 1, top_ids[j])
            for j in range(p * k, (p + 1) * k)
            if j - p * k + 1 != ranks[p]
        ]
        entries.append(b"{" + b",".join(row) + b"}")
    return b"[" + b",".join(entries) + b"]"


def random_logprobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 log-probs of ``shape``, a fifth of them from SPECIAL and some of magnitudes far from 1."""
    values = -rng.exponential(2.0, shape) * 10.0 ** rng.integers(-30, 30, shape)
    values = values.astype(np.float32)
    chosen = rng.random(shape) < 0.2
    values[chosen] = rng.choice(SPECIAL, int(chosen.sum()))
    return values


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("shape", [(1,), (2,), (777,), (1, 1), (1, 20), (5, 1), (300, 20)])
def test_triples_equal_the_writing_before(rng, shape, dtype):
    ids = rng.integers(0, 151_936, shape).astype(dtype)
    ids.flat[0] = 0
    logprobs = random_logprobs(rng, shape)
    written = encoding.triples(logprobs, ids)
    assert written == triples_before(logprobs, ids)
    assert pydantic_core.from_json(written, allow_inf_nan=True)  # and it is JSON


def test_triples_of_every_special_value(rng):
    ids = rng.integers(0, 151_936, SPECIAL.shape)
    assert encoding.triples(SPECIAL, ids) == triples_before(SPECIAL, ids)
    grid = np.tile(SPECIAL, (3, 1))
    assert encoding.triples(grid, np.tile(ids, (3, 1))) == triples_before(grid, np.tile(ids, (3, 1)))


def test_triples_of_nothing():
    assert encoding.triples(np.zeros(0, np.float32), np.zeros(0, np.int64)) == b"[]"
    assert encoding.triples(np.zeros((2, 0), np.float32), np.zeros((2, 0), np.int64)) == b"[[],[]]"
    assert encoding.triples(np.zeros((0, 5), np.float32), np.zeros((0, 5), np.int64)) == b"[]"


def test_prepend():
    assert encoding.prepend(b"null", b"[[1,2,null]]") == b"[null,[1,2,null]]"
    assert encoding.prepend(b"[null,7,null]", b"[]") == b"[[null,7,null]]"


def finite_logprobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 log-probs of ``shape`` from random bit patterns, every finite one possible (tiny,
    subnormal, huge, -0.0), none -inf or NaN: what the compiled writer takes."""
    bits = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(bits), bits, np.float32(-1.5))


@pytest.mark.parametrize("values", ["special", "finite", "one -inf"])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
@pytest.mark.parametrize("length,start", [(2, 1), (3, 2), (700, 1), (700, 350), (2500, 1)])
def test_prompt_logprobs_equal_the_writing_before(rng, length, start, k, values):
    """Byte for byte, on ids near the vocabulary's end and log-probs of every kind: with the
    non-finite among them (written by pydantic-core), without (by orjson), and one -inf among
    2,500 (a block of each); answers past one block of entries."""
    vocab = 151_936
    low = vocab - 64 if values == "finite" else 0
    ids = rng.integers(low, vocab, length)
    rows = length - start
    # distinct ids, none the token's own (shifted past it)
    top_ids = np.stack([rng.choice(vocab - 1 - low, k, replace=False) + low for _ in range(rows)]).reshape(rows, k)
    top_ids = (top_ids + (top_ids >= ids[start:, None])).astype(np.int32)
    if k:  # the token itself among the top k at a third of the positions, at every rank
        hits = np.flatnonzero(rng.random(rows) < 1 / 3)
        hits = hits[hits != 0]  # row 0 has it at rank k, below: once, as a top-k's ids are distinct
        top_ids[hits, rng.integers(0, k, len(hits))] = ids[start:][hits]
        top_ids[0, k - 1] = ids[start]  # and at rank k
    write = random_logprobs if values == "special" else finite_logprobs
    logprobs, top_logprobs = write(rng, (rows,)), write(rng, (rows, k))
    if values == "one -inf":
        logprobs[rng.integers(rows)] = -np.inf
    scores = SequenceScores(
        logprobs=logprobs,
        top_ids=top_ids if k else None,
        top_logprobs=top_logprobs if k else None,
        ranks=rng.integers(k + 1, vocab + 1, rows).astype(np.int32),
    )
    item = Item(ids, start, "prompt")
    written = b"".join(vllm.prompt_logprobs(item, scores, k))
    assert written == prompt_logprobs_before(item, scores, k)
    assert pydantic_core.from_json(written, allow_inf_nan=True)[start:][0] is not None


@pytest.mark.parametrize("start", [0, 1, 3])
def test_prompt_logprobs_of_nothing_scored(start):
    item = Item(np.arange(max(start, 1)), start, "prompt")
    assert (
        b"".join(vllm.prompt_logprobs(item, None, 0))
        == prompt_logprobs_before(item, None, 0)
        == pydantic_core.to_json([None] * start)
    )


@pytest.mark.parametrize("rows", [1, 5000])
def test_interleave(rows):
    """A constant, a number and a text a row; a column given twice; rows past one ``block`` of the
    join come out in order."""
    values = np.arange(rows)
    texts = np.array([b"<%d>" % i for i in range(rows)], dtype=object)
    chunks = encoding.interleave(values, b"-", values[::-1].copy(), texts, values, head=b"[", tail=b"]", block=7)
    assert len(chunks) == 2 + -(-rows // 7)
    expected = b"".join(b"%d-%d<%d>%d" % (i, rows - 1 - i, i, i) for i in range(rows))
    assert b"".join(chunks) == b"[" + expected + b"]"


def test_with_raw():
    value = {"a": None, "b": None, "c": '"a":null', "d": [1.5, None]}
    written = encoding.with_raw(value, a=b"[1,-Infinity]", b=[b"{", b"}"])
    assert written == b'{"a":[1,-Infinity],"b":{},"c":"\\"a\\":null","d":[1.5,null]}'


def sglang_answer_as_objects(item: Item, start: int, scores: SequenceScores | None, k: int) -> bytes:
    """SGLang's answer to one input built as Python objects, all written by pydantic-core."""

    def triples(lps: np.ndarray, ids: np.ndarray) -> list:
        return [[lp, t, None] for lp, t in zip(lps.tolist(), ids.tolist())]

    head = [None]  # position start's, whatever it is (SGLang's [None] + values[:-1])
    tokens = [[None, int(item.ids[start]), None]]
    meta = {"id": "rid", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(item.ids),
            "weight_version": "7", "num_retractions": 0}  # fmt: skip
    meta["input_token_logprobs"] = tokens + (triples(scores.logprobs, item.ids[item.start :]) if scores else [])
    meta |= {"output_token_logprobs": [], "output_token_logprobs_length": 0}
    if k:
        rows = [triples(*row) for row in zip(scores.top_logprobs, scores.top_ids)] if scores else []
        meta |= {"input_top_logprobs": head + rows if scores else [None], "output_top_logprobs": []}
    if item.candidates is not None:
        rows = [triples(*row) for row in zip(scores.candidate_logprobs, item.candidates)] if scores else []
        meta |= {"input_token_ids_logprobs": head + rows if scores else [None], "output_token_ids_logprobs": []}
    meta |= {
        "reasoning_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_versions": [{"version": "7", "start": 0, "end": 0}],
        "cached_tokens_details": None,
        "dp_rank": 0,
        "e2e_latency": 0.25,
        "response_sent_to_client_ts": 1795664900.5,
    }
    return pydantic_core.to_json({"text": "", "output_ids": [], "meta_info": meta})


@pytest.mark.parametrize("k,candidates", [(0, False), (3, False), (0, True), (20, True)])
@pytest.mark.parametrize("length,start", [(1, 0), (2, 0), (2, 1), (300, 0), (300, 17), (300, 299)])
def test_sglang_answer_equals_it_built_as_objects(rng, length, start, k, candidates):
    ids = rng.integers(0, 151_936, length)
    item = Item(ids, start + 1, "input_ids")
    rows = length - item.start
    if candidates:
        item = Item(ids, item.start, "input_ids", candidates=rng.integers(0, 151_936, (rows, 4)))
    scores = None
    if rows > 0:  # logprob_start_len at the last position: nothing scored
        scores = SequenceScores(
            logprobs=random_logprobs(rng, (rows,)),
            top_ids=rng.integers(0, 151_936, (rows, k)).astype(np.int32),
            top_logprobs=random_logprobs(rng, (rows, k)),
            candidate_logprobs=random_logprobs(rng, (rows, 4)),
        )
    written = sglang.input_answer(item, start, "rid", scores, k, version=7, latency=0.25, sent=1795664900.5)
    assert written == sglang_answer_as_objects(item, start, scores, k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numbers_are_written_as_pydantic_core_writes_them(rng, dtype):
    """Floats of every bit pattern (finite ones by orjson, a list holding a non-finite one by
    pydantic-core), and integers of every size an id or a rank has."""
    width = np.dtype(dtype).itemsize * 8
    bits = rng.integers(0, 2**width, 20_000, dtype=np.uint64).astype(f"u{width // 8}").view(dtype)
    finite = bits[np.isfinite(bits)]
    assert not np.isfinite(bits).all()
    for values in (finite, bits, SPECIAL.astype(dtype), finite[:1], np.zeros(0, dtype)):
        assert encoding.numbers(values) == (numbers(values) if len(values) else [])
    for values in (rng.integers(0, 2**31, 1000), np.array([0, 151_935, 2**31 - 1, -(2**31), 2**62]), np.arange(3)):
        assert encoding.numbers(values) == numbers(values)
        assert encoding.numbers(values.astype(np.int32)) == numbers(values.astype(np.int32))
