"""A request's cost over gRPC, known before its work: a message of a million sequences refused by
its counts while others are answered, an answer gRPC could not send refused before it is
computed, and a stream whose client stops reading its answers stops being read."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api import wire

from tests.helpers.calls import expect
from tests.helpers.server import settings, start, stop

VOCAB = 4096  # builtin:tiny-llama's


def _counting(running) -> list:
    """Each job the engine is asked to score, from now on."""
    jobs: list = []
    engine = running.service.engine
    score = engine.score

    async def counted(job):
        jobs.append(job)
        return await score(job)

    engine.score = counted
    return jobs


@pytest.mark.serial  # health's answers are timed
async def test_a_message_of_a_million_sequences_is_refused_by_its_counts_while_health_answers():
    """8 MB of one-token sequences, under the receive limit: INVALID_ARGUMENT naming the limit,
    counted from the bytes before protobuf parses them; health checks meanwhile answer as usual.
    (Before: each sequence built first, 12 s on this machine, every caller waiting; then the parse
    alone, about 160 ms and 160 MB.)"""
    running = await start(settings({"default": "builtin:tiny-llama"}))
    request = pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=[1], completion_ids=[2])] * 1_000_000)
    done = asyncio.Event()
    health_s: list[float] = []
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest())

            async def poll() -> None:
                while not done.is_set():
                    begun = time.perf_counter()
                    await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                    health_s.append(time.perf_counter() - begun)

            poller = asyncio.create_task(poll())
            begun = time.perf_counter()
            try:
                await expect(
                    running.target,
                    request,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "more than 4096 sequences",
                    "limit of 4096",
                    "before the message was read whole",
                )
            finally:
                refused_s = time.perf_counter() - begun
                done.set()
                await poller
        assert refused_s < 4.0, refused_s
        assert max(health_s) < 1.0, max(health_s)
    finally:
        await stop(running)


async def test_an_answer_larger_than_grpc_sends_is_refused_before_its_work(rng):
    """top-k 256 on 2,100 completion tokens answers 4.3 MB, past a 4 MiB max_message_bytes:
    INVALID_ARGUMENT naming the limit, nothing scored. (Before: computed in full, then
    RESOURCE_EXHAUSTED "Sent message larger than max" and an ERROR traceback.)"""
    running = await start(settings({"default": "builtin:tiny-llama"}, max_message_bytes=4 * 2**20))
    try:
        jobs = _counting(running)
        request = pb.ScoreRequest(
            sequences=[pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 8), completion_ids=rng.integers(3, VOCAB, 2100))],
            top_k=256,
        )
        await expect(running.target, request, grpc.StatusCode.INVALID_ARGUMENT, "max_message_bytes", "4194304 bytes")
        assert not jobs
        request.top_k = 200  # 3.4 MB: sent
        response = await pb_grpc.LogprobServiceStub(grpc.aio.insecure_channel(running.target)).ScoreTokens(request)
        assert len(response.scores[0].top_ids_i32) == 2100 * 200 * 4
    finally:
        await stop(running)


async def test_a_stream_whose_client_stops_reading_stops_being_read(rng):
    """A client sends 200 requests of 263 KB answers on one stream and reads none: the server
    takes on requests while their answers pending stay within max_stream_answer_bytes (1 MiB:
    3 of them), so it scores a few, not all 200, and holds no more. (Before: every request read,
    scored and its answer queued: +1 GB in 90 s on a CPU.)"""
    running = await start(settings({"default": "builtin:tiny-llama"}, max_stream_answer_bytes=2**20))
    try:
        jobs = _counting(running)
        request = pb.ScoreRequest(
            sequences=[pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 4), completion_ids=rng.integers(3, VOCAB, 128))],
            top_k=256,
        )
        # Without BDP probing the client's receive window stays at HTTP/2's 64 KiB: the transport
        # then holds little beyond the answers the server keeps pending.
        async with grpc.aio.insecure_channel(running.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            call = pb_grpc.LogprobServiceStub(channel).ScoreTokensStream()

            async def send() -> None:
                for _ in range(200):
                    await call.write(request)

            sender = asyncio.create_task(send())
            # Wait until the server has scored nothing more for a while (the sends are held back).
            seen, still_since = -1, time.monotonic()
            deadline = time.monotonic() + 60
            while time.monotonic() - still_since < 1.5 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                if len(jobs) != seen:
                    seen, still_since = len(jobs), time.monotonic()
            scored = len(jobs)
            sender.cancel()
            call.cancel()
        assert 3 <= scored <= 8, scored  # 3 pending; what the transport holds besides
    finally:
        await stop(running)


async def test_a_stream_that_is_read_gets_every_answer(rng):
    """The same stream, read: every request is answered, in any order, matched by request id."""
    running = await start(settings({"default": "builtin:tiny-llama"}, max_stream_answer_bytes=2**20))
    try:
        requests = [
            pb.ScoreRequest(
                request_id=str(i),
                sequences=[
                    pb.Sequence(prompt_ids=rng.integers(3, VOCAB, 4), completion_ids=rng.integers(3, VOCAB, 64))
                ],
                top_k=256,
            )
            for i in range(12)
        ]
        async with grpc.aio.insecure_channel(running.target) as channel:
            answers = [r async for r in pb_grpc.LogprobServiceStub(channel).ScoreTokensStream(iter(requests))]
        assert sorted(int(a.request_id) for a in answers) == list(range(12))
        assert all(not a.HasField("error") and len(a.scores[0].logprobs) == 64 for a in answers)
        assert np.isfinite(answers[0].scores[0].logprobs).all()
    finally:
        await stop(running)


async def test_a_request_past_its_clients_share_is_refused_by_its_counts_before_its_job_is_built(rng, monkeypatch):
    """A client 10 tokens short of its fair share: an 80-token call is refused on each edge
    (RESOURCE_EXHAUSTED and HTTP 429, with the admission's message and retry hint) from the
    request's counts, before any job is built or checked; a 4-token call is answered. (Before:
    the whole job built and validated, then refused by the admission.)"""
    from logprob_service.engine import engine as engine_module
    from logprob_service.http import sglang

    running = await start(settings({"default": "builtin:tiny-llama"}))
    try:
        http_port = await running.service.start_http("127.0.0.1", 0)
        admission = running.service.engine.scheduler.admission
        admission.client_tokens["127.0.0.1"] = admission.max_queued_tokens_per_client - 10  # both edges' caller
        built: list[str] = []
        for module, name in ((wire, "job_from_request"), (engine_module, "validate_job"), (sglang, "ids_of")):
            original = getattr(module, name)

            def spy(*args, _original=original, _name=name, **keywords):
                built.append(_name)
                return _original(*args, **keywords)

            monkeypatch.setattr(module, name, spy)
        ids = rng.integers(3, VOCAB, (4, 20))
        big = pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=row[:4], completion_ids=row[4:]) for row in ids])
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ScoreTokens(big)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queued_tokens_per_client" in refused.value.details(), refused.value.details()
            assert "grpc-retry-pushback-ms" in dict(refused.value.trailing_metadata())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
                body = {
                    "input_ids": ids.tolist(),
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                }
                answer = await http.post("/generate", json=body)
                assert answer.status_code == 429, answer.text
                assert "max_queued_tokens_per_client" in answer.text and "retry-after" in answer.headers
                assert not built, built
                small = pb.ScoreRequest(sequences=[pb.Sequence(prompt_ids=ids[0, :2], completion_ids=ids[0, 2:4])])
                assert len((await stub.ScoreTokens(small)).scores[0].logprobs) == 2
                body["input_ids"] = ids[0, :4].tolist()
                assert (await http.post("/generate", json=body)).status_code == 200
        assert built.count("validate_job") == 2, built
    finally:
        await stop(running)


async def test_a_stream_message_of_too_many_sequences_is_answered_with_its_error_unparsed(rng, monkeypatch):
    """max_sequences_per_request 4: a ScoreTokensStream message of 5 sequences between two of 1 is
    answered with its error (INVALID_ARGUMENT, its request id) counted from its bytes, protobuf
    parsing only its head, and the stream goes on. (Before: parsed whole, then refused by its
    counts.)"""
    parsed: list[int] = []
    parse = pb.ScoreRequest.FromString

    def spy(raw: bytes) -> pb.ScoreRequest:
        parsed.append(len(raw))
        return parse(raw)

    monkeypatch.setattr(pb.ScoreRequest, "FromString", spy)  # before the server registers its deserializers
    running = await start(settings({"default": "builtin:tiny-llama"}, max_sequences_per_request=4))
    try:

        def request(request_id: str, sequences: int) -> pb.ScoreRequest:
            ids = rng.integers(3, VOCAB, (sequences, 12))
            return pb.ScoreRequest(
                request_id=request_id,
                sequences=[pb.Sequence(prompt_ids=row[:4], completion_ids=row[4:]) for row in ids],
            )

        requests = [request("a", 1), request("many", 5), request("b", 1)]
        async with grpc.aio.insecure_channel(running.target) as channel:
            answers = {
                a.request_id: a async for a in pb_grpc.LogprobServiceStub(channel).ScoreTokensStream(iter(requests))
            }
        assert sorted(answers) == ["a", "b", "many"]
        assert answers["many"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "more than 4 sequences" in answers["many"].error.message, answers["many"].error.message
        assert not answers["a"].HasField("error") and len(answers["b"].scores[0].logprobs) == 8
        assert requests[1].ByteSize() not in parsed and len(parsed) == 3, (parsed, requests[1].ByteSize())
    finally:
        await stop(running)
