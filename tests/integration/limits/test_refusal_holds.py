"""Refused calls held per client (``security.refusals``), on a live server with both edges (CPU,
builtin tiny-llama, a token a client): a client resending refused calls as soon as they are
answered (a closed loop) gets them at ``refusals_per_s`` after its burst, on either edge, while
another client scores and has its own few refusals answered at once; a held call ends with its
caller, its deadline, or the server's drain.

Each loop runs LOOP_S; without the hold a loop gets hundreds of refusals in that time."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc
import httpx
import pytest_asyncio
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.metrics import moved, snapshot
from tests.helpers.server import settings, start, stop

VOCAB = 4096  # builtin:tiny-llama's
BURST, PER_S, LOOP_S = 5, 10.0, 1.5
CLIENTS = ("looper", "other")
HELD = "logprob_refusals_held_total"


class Served:
    def __init__(self, running, http_port: int, tokens: dict[str, str]) -> None:
        self.running, self.tokens = running, tokens
        self.base = f"http://127.0.0.1:{http_port}"

    @property
    def refusals(self):
        return self.running.service.refusals

    def metadata(self, client: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[client]}"),)

    def headers(self, client: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tokens[client]}"}


async def serve(tmp_path, **overrides) -> Served:
    tokens = {name: secrets.token_urlsafe(24) for name in CLIENTS}
    path = tmp_path / "tokens.yaml"
    entries = "".join(f"  - {{name: {n}, scopes: [score], token: {t}}}\n" for n, t in tokens.items())
    path.write_text("tokens:\n" + entries)
    values = dict(auth_tokens_file=path, refusal_burst=BURST, refusals_per_s=PER_S, drain_notice_s=0.0)
    running = await start(settings({"default": "builtin:tiny-llama"}, **(values | overrides)))
    try:
        port = await running.service.start_http("127.0.0.1", 0)
    except BaseException:
        await stop(running)
        raise
    return Served(running, port, tokens)


@pytest_asyncio.fixture
async def served(tmp_path):
    server = await serve(tmp_path)
    yield server
    await stop(server.running)


def bad_request(rng) -> pb.ScoreRequest:
    return pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 8), completion_ids=[VOCAB + 1])])


def good_request(rng) -> pb.ScoreRequest:
    return pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 8), completion_ids=[5, 6])])


def bad_body(rng) -> dict:
    return {"model": "default", "prompt": [[*rng.integers(3, VOCAB, 8).tolist(), VOCAB + 1]], "max_tokens": 1}


def good_body(rng) -> dict:
    return {"model": "default", "prompt": [rng.integers(3, VOCAB, 8).tolist()], "max_tokens": 1, "prompt_logprobs": 0}


def assert_held_to_the_rate(loop_refusals: int) -> None:
    """A loop of LOOP_S: its burst at once, then PER_S a second (at most; a slow machine gets fewer)."""
    most = BURST + PER_S * LOOP_S + 3
    assert BURST + 2 <= loop_refusals <= most, (loop_refusals, most)


async def test_a_closed_loop_of_refused_grpc_calls_is_held_to_the_rate_and_others_are_not(served, rng, caplog):
    caplog.set_level(logging.INFO, logger="logprob_service.security.refusals")
    before = snapshot(HELD, edge="grpc")
    target = served.running.target
    statuses: dict[str, list[grpc.StatusCode]] = {"looper": [], "other": []}
    end = time.monotonic() + LOOP_S

    async with grpc.aio.insecure_channel(target) as a, grpc.aio.insecure_channel(target) as b:
        looper, other = pb_grpc.LogprobServiceStub(a), pb_grpc.LogprobServiceStub(b)

        async def loop() -> None:
            while time.monotonic() < end:
                try:
                    await looper.ScoreTokens(bad_request(rng), metadata=served.metadata("looper"), timeout=10)
                except grpc.aio.AioRpcError as err:
                    statuses["looper"].append(err.code())

        async def behave() -> None:
            answered = 0
            while time.monotonic() < end:
                response = await other.ScoreTokens(good_request(rng), metadata=served.metadata("other"), timeout=10)
                answered += len(response.scores)
                if answered % 4 == 0 and len(statuses["other"]) < BURST:  # now and then a bad one
                    try:
                        await other.ScoreTokens(bad_request(rng), metadata=served.metadata("other"), timeout=10)
                    except grpc.aio.AioRpcError as err:
                        statuses["other"].append(err.code())
            assert answered > 0

        await asyncio.gather(loop(), behave())

    assert set(statuses["looper"]) == {grpc.StatusCode.INVALID_ARGUMENT}
    assert_held_to_the_rate(len(statuses["looper"]))
    assert 0 < len(statuses["other"]) and set(statuses["other"]) == {grpc.StatusCode.INVALID_ARGUMENT}
    # Every call held was the looper's: the other's few refusals (within its burst) were answered at once.
    held = moved(before, edge="grpc")[HELD]
    assert abs(held - (len(statuses["looper"]) - BURST)) <= 1, (held, len(statuses["looper"]))
    started = [r.fields["client"] for r in caplog.records if r.getMessage() == "refusals held"]
    assert started == ["looper"]  # one line, when its hold started; none for the other client


async def test_a_closed_loop_of_refused_http_calls_is_held_to_the_rate_and_others_are_not(served, rng):
    before = snapshot(HELD, edge="http")
    counts: dict[str, list[int]] = {"looper": [], "other": []}
    end = time.monotonic() + LOOP_S

    async def loop() -> None:
        async with httpx.AsyncClient(base_url=served.base, headers=served.headers("looper"), timeout=10) as http:
            while time.monotonic() < end:
                counts["looper"].append((await http.post("/v1/completions", json=bad_body(rng))).status_code)

    async def behave() -> None:
        async with httpx.AsyncClient(base_url=served.base, headers=served.headers("other"), timeout=10) as http:
            scored = 0
            while time.monotonic() < end:
                answer = await http.post("/v1/completions", json=good_body(rng))
                assert answer.status_code == 200, answer.text
                scored += 1
                if scored % 4 == 0 and len(counts["other"]) < BURST:
                    counts["other"].append((await http.post("/v1/completions", json=bad_body(rng))).status_code)
                    # The body of a held call is let go: none of this client's is held for the looper's.
                    assert served.running.service.http.bodies.held == 0

    await asyncio.gather(loop(), behave())
    assert set(counts["looper"]) == {400}
    assert_held_to_the_rate(len(counts["looper"]))
    assert set(counts["other"]) <= {400}
    assert abs(moved(before, edge="http")[HELD] - (len(counts["looper"]) - BURST)) <= 1


async def until(predicate, seconds: float = 2.0) -> float:
    begun = time.monotonic()
    while not predicate():
        assert time.monotonic() - begun < seconds, "not within the time"
        await asyncio.sleep(0.01)
    return time.monotonic() - begun


async def test_a_held_call_ends_with_its_deadline_its_caller_and_the_servers_drain(tmp_path, rng):
    """Holds of up to 10 s (a burst of 1 at 0.1 a second): each ends long before."""
    served = await serve(tmp_path, refusal_burst=1, refusals_per_s=0.1)
    drained = False
    try:
        async with grpc.aio.insecure_channel(served.running.target) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            call = {"metadata": served.metadata("looper"), "timeout": 30}
            try:
                await stub.ScoreTokens(bad_request(rng), **call)  # the burst: at once
            except grpc.aio.AioRpcError as err:
                assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            # A deadline: gRPC ends the call, and its hold with it.
            begun = time.monotonic()
            try:
                await stub.ScoreTokens(bad_request(rng), metadata=call["metadata"], timeout=0.3)
            except grpc.aio.AioRpcError as err:
                assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - begun < 2
            await until(lambda: served.refusals.held_calls == 0)

            # A caller that hangs up (its body read whole): the hold goes at once.
            async with httpx.AsyncClient(base_url=served.base, headers=served.headers("looper"), timeout=0.3) as http:
                try:
                    await http.post("/v1/completions", json=bad_body(rng))
                except httpx.TimeoutException:
                    pass
            await until(lambda: served.refusals.held_calls == 0)

            # The drain: held calls are answered at once, with their refusal.
            held = asyncio.ensure_future(stub.ScoreTokens(bad_request(rng), **call))
            await until(lambda: served.refusals.held_calls == 1)
            draining = asyncio.ensure_future(served.running.service.drain(served.running.server, 5.0))
            try:
                await asyncio.wait_for(held, 2)
            except grpc.aio.AioRpcError as err:
                assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            await asyncio.wait_for(draining, 5)
            drained = True
    finally:
        if not drained:
            await stop(served.running)
