"""A request's cost over the HTTP edge, known before its work: a body of a million sequences is
refused before it is parsed while every other caller is answered as usual, and an answer larger
than max_answer_bytes is refused before any scoring, each peer's estimate of its answer never
below what it sends."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time

import httpx
import pytest

from tests.helpers.server import stop
from tests.http.conftest import VOCAB, serve_both
from tests.http.test_errors import refusal

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


@pytest.mark.serial  # health's answers are timed
async def test_a_million_sequence_body_is_refused_at_once_and_other_callers_wait_no_longer(served):
    """A 6 MB ``/generate`` body of a million ``[1,2]`` inputs: refused by its count (400 naming
    ``input_ids``, the count and the limit) before pydantic parses it, once its first bytes hold
    more JSON parts than any request within the limits could (the rest is not read), while ``/health`` keeps
    answering within a few milliseconds and the server's memory does not grow with the body's
    lists. (Before: parsed whole and built item by item, 12-15 s in which every caller waited.)"""
    body = b'{"input_ids":[' + b",".join([b"[1,2]"] * 1_000_000) + b'],"return_logprob":true}'
    assert 5_000_000 < len(body) < 7_000_000
    done = asyncio.Event()
    health_s: list[float] = []
    peak = baseline = resident_bytes()

    async def poll_health(http: httpx.AsyncClient) -> None:
        nonlocal peak
        while not done.is_set():
            begun = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            health_s.append(time.perf_counter() - begun)
            peak = max(peak, resident_bytes())

    async with (
        httpx.AsyncClient(base_url=served.base, timeout=60) as http,
        httpx.AsyncClient(base_url=served.base, timeout=60) as probe,
    ):
        assert (await probe.get("/health")).status_code == 200  # its connection is open before
        poller = asyncio.create_task(poll_health(probe))
        begun = time.perf_counter()
        response = await http.post("/generate", content=body, headers={"content-type": "application/json"})
        refused_s = time.perf_counter() - begun
        done.set()
        await poller
    refusal(response, 400, "input_ids", "JSON arrays, objects and strings", "max_sequences_per_request (16)")
    # Read only until its count passed the limit, answered whole (not reset while the rest came),
    # and the rest dropped unparsed as the connection closed.
    read = int(re.search(r"holds at least \d+ \(in its first (\d+) bytes", response.json()["error"]["message"])[1])
    assert read < len(body) // 8, read
    assert response.headers["connection"] == "close"
    assert refused_s < 2.0, refused_s
    assert health_s and max(health_s) < 0.5, max(health_s)
    assert peak - baseline < 64 * 2**20, (peak - baseline) / 2**20


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/generate",
            {
                "input_ids": [[1, 2]] * 17,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            "input_ids",
        ),
        ("/v1/completions", {"prompt": [[1, 2]] * 17, "max_tokens": 1, "prompt_logprobs": 0}, "prompt"),
        ("/get_sequence_logprobs/", {"sequences": [[1, 2]] * 17, "prompt_lengths": [1] * 17}, "sequences"),
    ],
)
async def test_too_many_sequences_are_refused_by_their_count_with_the_engines_message(served, path, body, param):
    """Counted before any item is built, and refused with the message the engine's check gives."""
    async with httpx.AsyncClient(base_url=served.base) as http:
        response = await http.post(path, json=body)
    refusal(response, 400, param, "17 sequences", "limit of 16 per request")


def _calls(rng, k: int) -> list[tuple[str, dict]]:
    """One call of each scoring route, with top-k ``k`` (and candidates where a route takes them)."""
    ids = [rng.integers(3, VOCAB, int(n)).tolist() for n in (40, 25, 33)]
    candidates = rng.integers(3, VOCAB, 5).tolist()
    return [
        ("/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": k}),
        (
            "/inference/v1/generate",
            {
                "token_ids": ids[0],
                "sampling_params": {"max_tokens": 1, "prompt_logprobs": k, "prompt_logprob_token_ids": candidates},
            },
        ),
        (
            "/generate",
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": k,
                "token_ids_logprob": candidates,
            },
        ),
        ("/get_sequence_logprobs/", {"sequences": ids, "prompt_lengths": [3, 0, 10], "top_logprobs": k}),
        (
            "/get_sequence_logprobs/",
            {"sequences": ids, "prompt_lengths": [3, 0, 10], "top_logprobs": k, "response_format": "binary"},
        ),
    ]


@pytest.mark.parametrize("k", [0, 20])
async def test_each_routes_answer_estimate_is_at_least_what_it_sends_and_refused_past_the_limit(served, rng, k):
    """With max_answer_bytes one byte under an answer's size, the same call is refused before any
    scoring, naming the limit: the route's estimate is never below its answer. With 6 times the
    answer's size it is answered: the estimate is not far above it."""
    engine = served.running.service.engine
    limits = engine.limits
    try:
        async with httpx.AsyncClient(base_url=served.base) as http:
            for path, body in _calls(rng, k):
                engine.limits = limits
                answered = await http.post(path, json=body)
                assert answered.status_code == 200, answered.text
                size = len(answered.content)
                engine.limits = dataclasses.replace(limits, max_answer_bytes=size - 1)
                refused = await http.post(path, json=body)
                assert refused.status_code == 400, (path, size, refused.text)
                assert "max_answer_bytes" in refused.json()["error"]["message"]
                engine.limits = dataclasses.replace(limits, max_answer_bytes=6 * size)
                assert (await http.post(path, json=body)).status_code == 200, (path, size)
    finally:
        engine.limits = limits


async def test_a_top_k_answer_past_max_answer_bytes_is_refused_before_scoring(rng):
    """The finding's call: top-k 256 on 4 x 4,096 tokens (a 129 MB ``/generate`` answer) is
    refused at once, naming the limit, with no micro-batch run."""
    both = await serve_both(max_answer_bytes=2**20, max_tokens_per_request=20_000, max_sequences_per_request=16)
    try:
        launched = []
        scheduler = both.running.service.device_side.scheduler
        body = {
            "input_ids": [rng.integers(3, VOCAB, 4096).tolist() for _ in range(4)],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "top_logprobs_num": 256,
        }
        original = scheduler.submit
        scheduler.submit = lambda job: launched.append(job) or original(job)
        async with httpx.AsyncClient(base_url=both.base, timeout=60) as http:
            response = await http.post("/generate", json=body)
        refusal(response, 400, "input_ids", "max_answer_bytes", "limit of 1048576 bytes")
        assert not launched
    finally:
        await stop(both.running)
