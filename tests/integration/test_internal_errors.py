"""An INTERNAL answer (a bug) names the request id of the one log line that holds its traceback
(issue 38, item 9): the request's own id, or for a request without one (LoadWeights, a weight
update's stream) one made for it. Before, such an answer said "request_id= is in the server log"
with no id to look for. The bug's own words (which may hold paths or values) never reach the caller.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.calls import request
from tests.helpers.server import settings, start, stop

SECRET = "/very/private/path"


@pytest.fixture
async def tiny():
    running = await start(settings({"default": "builtin:tiny-llama"}))
    yield running
    await stop(running)


def failed_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "logprob_service.requests" and r.getMessage() == "failed"]


async def test_an_internal_answer_names_the_request_id_of_its_one_log_line(tiny, caplog, monkeypatch):
    async def broken(*args, **kwargs):
        raise KeyError(SECRET)

    monkeypatch.setattr(tiny.service.device_side.updater, "load", broken)
    monkeypatch.setattr(tiny.service.device_side.scheduler, "submit", broken)
    caplog.set_level(logging.INFO, logger="logprob_service")
    ids = []
    async with grpc.aio.insecure_channel(tiny.target) as channel:
        stub = pb_grpc.LogprobServiceStub(channel)
        calls = (
            ("LoadWeights", lambda: stub.LoadWeights(pb.LoadWeightsRequest(path="/tmp"), timeout=30), None),
            ("LoadWeights", lambda: stub.LoadWeights(pb.LoadWeightsRequest(path="/tmp"), timeout=30), None),
            ("ScoreTokens", lambda: stub.ScoreTokens(request(([1], [2]), request_id="mine"), timeout=30), "mine"),
        )
        for rpc, call, own_id in calls:
            caplog.clear()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            assert info.value.code() == grpc.StatusCode.INTERNAL, rpc
            details = info.value.details()
            assert details.startswith("internal error (KeyError); request_id="), details
            assert SECRET not in details
            request_id = details.removeprefix("internal error (KeyError); request_id=").split()[0]
            assert request_id == own_id if own_id else len(request_id) >= 16, details
            (line,) = failed_lines(caplog)
            assert line.fields["request_id"] == request_id and line.fields["status"] == "INTERNAL"
            assert line.exc_info is not None, "the traceback is in that line"
            ids.append(request_id)
    assert len(set(ids)) == len(ids), "each request's own id"


async def test_a_stream_its_client_cancels_is_cancelled_in_one_info_line(tiny, caplog):
    """A stream cancelled while the server writes answers its client does not read: the write to
    the gone call raised ExecuteBatchError, which was counted INTERNAL and logged as an ERROR with
    its traceback (or, its answers all sent, the stream ended unaccounted for). It is CANCELLED,
    one INFO line."""
    caplog.set_level(logging.DEBUG, logger="logprob_service.requests")
    sent = 2
    # No window growth (BDP probing): the stream's window stays 64 KiB, so the second answer's write
    # blocks for certain; with it, a window grown past both answers let them go first, or not.
    async with grpc.aio.insecure_channel(tiny.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = pb_grpc.LogprobServiceStub(channel).ScoreTokensStream()
        for _ in range(sent):  # answers of about 0.6 MB each, more than the stream's window: nobody reads them
            message = request(([1], list(range(1, 1200))))
            message.top_k = 64
            await call.write(message)
        deadline = asyncio.get_running_loop().time() + 60
        while sum(r.getMessage() == "answered" for r in caplog.records) < sent:  # all scored, writes blocked
            assert asyncio.get_running_loop().time() < deadline, caplog.text
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        call.cancel()
        deadline = asyncio.get_running_loop().time() + 10
        while not failed_lines(caplog):
            assert asyncio.get_running_loop().time() < deadline, caplog.text
            await asyncio.sleep(0.05)
    (line,) = failed_lines(caplog)
    assert line.fields["status"] == "CANCELLED" and line.levelno == logging.INFO, line.fields
    assert line.exc_info is None and not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_long_request_ids_are_cut_in_log_lines_and_answers(tiny, caplog, monkeypatch):
    """A 60 KB request id was logged whole: it is cut to SHOWN_ID_CHARS and its length said."""
    from logprob_service.logs import SHOWN_ID_CHARS

    async def broken(*args, **kwargs):
        raise KeyError(SECRET)

    caplog.set_level(logging.INFO, logger="logprob_service")
    long_id = "r" * 60_000
    async with grpc.aio.insecure_channel(tiny.target) as channel:
        stub = pb_grpc.LogprobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ScoreTokens(request(([1], [2]), model="nope", request_id=long_id), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        monkeypatch.setattr(tiny.service.device_side.scheduler, "submit", broken)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ScoreTokens(request(([1], [2]), request_id=long_id), timeout=30)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "(60000 characters)" in info.value.details()
        assert len(info.value.details()) < 400
    lines = failed_lines(caplog)
    assert len(lines) == 2
    for line in lines:
        assert line.fields["request_id"] == "r" * SHOWN_ID_CHARS + "...(60000 characters)", line.fields
