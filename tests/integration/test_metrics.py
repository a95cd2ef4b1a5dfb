"""Every series moves as it should after scoring, errors and overload; the request log lines.

The series are process-wide (one registry per process), and earlier tests have moved them, so
each test compares values before and after what it does.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service import __version__
from prometheus_client import REGISTRY

from tests.helpers.calls import Gate, call, expect, request
from tests.helpers.metrics import moved, snapshot, value
from tests.helpers.server import start, stop, test_settings


def random_sequences(rng: np.random.Generator, n: int) -> list[tuple[list[int], list[int]]]:
    return [
        (
            rng.integers(0, 4096, int(rng.integers(1, 40))).tolist(),
            rng.integers(0, 4096, int(rng.integers(1, 40))).tolist(),
        )
        for _ in range(n)
    ]


HISTOGRAMS = (
    "logprob_request_duration_seconds",
    "logprob_request_queue_duration_seconds",
    "logprob_request_compute_duration_seconds",
)


async def test_a_scored_request_moves_its_series_by_its_own_figures(running, rng):
    seqs = random_sequences(rng, 3)
    tokens = sum(len(p) + len(c) for p, c in seqs)  # < max_batch_tokens: one micro-batch
    model = {"model": "default"}
    counters = snapshot("logprob_tokens_scored_total", "logprob_sequences_scored_total", **model)
    requests = snapshot("logprob_requests_total", protocol="grpc", rpc="ScoreTokens", code="OK", **model)
    histograms = snapshot(*(f"{h}_{part}" for h in HISTOGRAMS for part in ("count", "sum")), **model)
    on_cpu = {**model, "device": "cpu"}  # micro-batch series also name the device that ran them
    batches = snapshot(
        *(f"logprob_batch_{kind}_{part}" for kind in ("tokens", "sequences") for part in ("count", "sum")), **on_cpu
    )

    # The queue gauges are this process's, shared by every server a test run starts: a request
    # moves them from where they stand, and leaves them there.
    queue = snapshot("logprob_queue_requests", "logprob_queue_tokens", **model)
    response = await call(running.target, request(*seqs))

    assert moved(counters, **model) == {"logprob_tokens_scored_total": tokens, "logprob_sequences_scored_total": 3}
    assert moved(requests, protocol="grpc", rpc="ScoreTokens", code="OK", **model) == {"logprob_requests_total": 1}
    assert moved(batches, **on_cpu) == {
        "logprob_batch_tokens_count": 1,
        "logprob_batch_tokens_sum": tokens,
        "logprob_batch_sequences_count": 1,
        "logprob_batch_sequences_sum": 3,
    }
    # The histograms observe the very timings the response's metadata carries.
    meta = response.metadata
    assert meta.tokens == tokens and meta.total_ns >= meta.queue_ns + meta.compute_ns > 0
    delta = moved(histograms, **model)
    for histogram, ns in zip(HISTOGRAMS, (meta.total_ns, meta.queue_ns, meta.compute_ns)):
        assert delta[f"{histogram}_count"] == 1
        assert delta[f"{histogram}_sum"] == pytest.approx(ns / 1e9, rel=1e-9, abs=1e-12)
    # The request left the queue.
    assert moved(queue, **model) == {"logprob_queue_requests": 0, "logprob_queue_tokens": 0}


async def test_stream_requests_count_one_by_one_with_their_own_status(running, rng):
    before = {
        code: value("logprob_requests_total", protocol="grpc", model="default", rpc="ScoreTokensStream", code=code)
        for code in ("OK", "INVALID_ARGUMENT")
    }
    bad = request(([1, 2], [3, 99999]), request_id="bad")
    good = request(*random_sequences(rng, 2), request_id="good")
    async with grpc.aio.insecure_channel(running.target) as channel:
        call_ = pb_grpc.LogprobServiceStub(channel).ScoreTokensStream(iter([good, bad]))
        answers = {r.request_id: r async for r in call_}
        assert await call_.code() == grpc.StatusCode.OK
    assert answers["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not answers["good"].HasField(
        "error"
    )
    after = {
        code: value("logprob_requests_total", protocol="grpc", model="default", rpc="ScoreTokensStream", code=code)
        for code in before
    }
    # One count per request; the stream's own OK status is not a request of its own.
    assert {code: after[code] - before[code] for code in before} == {"OK": 1, "INVALID_ARGUMENT": 1}


async def test_errors_count_by_status_with_served_model_names_only(running, caplog):
    def counts() -> dict[tuple[str, str, str], float]:
        keys = [
            ("default", "ScoreTokens", "INVALID_ARGUMENT"),
            ("", "ScoreTokens", "NOT_FOUND"),
            ("", "ListModels", "OK"),
            ("gemma", "ScoreTokens", "OK"),
        ]
        return {k: value("logprob_requests_total", protocol="grpc", model=k[0], rpc=k[1], code=k[2]) for k in keys}

    before, tokens_before = counts(), value("logprob_tokens_scored_total", model="default")
    with caplog.at_level(logging.DEBUG, logger="logprob_service.requests"):
        await expect(running.target, request(([1, 2], [4096]), request_id="too-big"), grpc.StatusCode.INVALID_ARGUMENT)
        await expect(running.target, request(([1], [2]), model="nope"), grpc.StatusCode.NOT_FOUND)
        async with grpc.aio.insecure_channel(running.target) as channel:
            await pb_grpc.LogprobServiceStub(channel).ListModels(pb.ListModelsRequest())
        ok = await call(running.target, request(([5, 6, 7], [8, 9]), model="gemma", request_id="fine"))
    after = counts()
    assert {k: after[k] - before[k] for k in before} == dict.fromkeys(before, 1)
    assert (
        value("logprob_requests_total", protocol="grpc", model="nope", rpc="ScoreTokens", code="NOT_FOUND") == 0
    )  # no such series
    assert value("logprob_tokens_scored_total", model="default") == tokens_before  # failures score nothing

    # One log line per request: DEBUG when answered, WARNING when failed, each with its fields.
    lines = {r.fields.get("request_id") or r.fields["rpc"]: r for r in caplog.records if hasattr(r, "fields")}
    failed, fine = lines["too-big"], lines["fine"]
    assert failed.levelno == logging.WARNING and fine.levelno == logging.DEBUG
    assert failed.fields["status"] == "INVALID_ARGUMENT" and "4096" in failed.fields["error"]
    assert failed.fields["model"] == "default" and failed.fields["tokens"] == 3 and failed.fields["sequences"] == 1
    meta = ok.metadata
    assert fine.fields["model"] == "gemma" and fine.fields["tokens"] == 5 and fine.fields["status"] == "OK"
    assert (fine.fields["queue_ms"], fine.fields["compute_ms"], fine.fields["total_ms"]) == (
        round(meta.queue_ns / 1e6, 3),
        round(meta.compute_ns / 1e6, 3),
        round(meta.total_ns / 1e6, 3),
    )
    assert lines["ListModels"].levelno == logging.DEBUG


async def test_overload_is_counted_and_the_queue_gauges_show_the_backlog(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint, max_queued_tokens=4000, max_batch_tokens=512))
    assert (value("logprob_queue_tokens_limit"), value("logprob_batch_tokens_limit")) == (4000, 512)
    assert value("logprob_batch_sequences_limit") == running.service.settings.max_batch_sequences
    gate = Gate(running)
    refused_before = value(
        "logprob_requests_total", protocol="grpc", model="default", rpc="ScoreTokens", code="RESOURCE_EXHAUSTED"
    )
    try:
        queue = snapshot("logprob_queue_requests", "logprob_queue_tokens", model="default")
        big = [([i + 1] * 100, [2] * 100) for i in range(16)]  # distinct prompts: each counts
        blocker = asyncio.create_task(call(running.target, request(*big)))  # 3200 tokens
        await gate.wait_entered()
        assert moved(queue, model="default") == {"logprob_queue_requests": 1, "logprob_queue_tokens": 3200}
        await expect(running.target, request(*big[:5]), grpc.StatusCode.RESOURCE_EXHAUSTED)
        # the refused one never entered
        assert moved(queue, model="default") == {"logprob_queue_requests": 1, "logprob_queue_tokens": 3200}
        gate.release.set()
        await blocker
    finally:
        gate.restore()
        await stop(running)
    assert (
        value("logprob_requests_total", protocol="grpc", model="default", rpc="ScoreTokens", code="RESOURCE_EXHAUSTED")
        == refused_before + 1
    )
    assert moved(queue, model="default") == {"logprob_queue_requests": 0, "logprob_queue_tokens": 0}


async def test_model_and_build_info(running):
    info = running.service.device_side.registry.get("gemma").info
    labels = {
        "model": "gemma",
        "architecture": info.architecture,
        "source": info.source,
        "dtype": "float32",
        "weight_format": "float32",
        "device": "cpu",
        "version": "0",
        "fingerprint": info.fingerprint,
    }
    assert value("logprob_model_info", **labels) == 1
    assert REGISTRY.get_sample_value("logprob_model_version", {"model": "gemma"}) == info.version == 0
    build = next(f for f in REGISTRY.collect() if f.name == "logprob_build")
    assert [s.labels["version"] for s in build.samples] == [__version__]
    assert build.samples[0].labels["torch"] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU case: no GPU series samples")
async def test_gpu_series_are_declared_without_samples_on_a_cpu_server(running, metrics_url):
    scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=10).read().decode())
    for name in ("allocated", "reserved", "free", "total", "peak_allocated"):
        assert f"# TYPE logprob_gpu_memory_{name}_bytes gauge" in scraped
        assert f"\nlogprob_gpu_memory_{name}_bytes{{" not in scraped
    assert "# TYPE logprob_gpu_memory_batch_peak_bytes histogram" in scraped
    assert "logprob_gpu_memory_batch_peak_bytes_count" not in scraped  # no micro-batch ran on a GPU
    assert "\nprocess_resident_memory_bytes " in scraped  # host memory: prometheus-client's process collector


async def test_a_push_over_several_calls_counts_as_one_request(policy_server):
    """A push's calls (UpdateWeightsHeader.streams, one update_id) were each counted: 24
    "requests" for 6 pushes over 4 calls. A push counts once, as it went live or failed."""
    from logprob_client import AsyncLogprobClient, FailedPrecondition

    state = policy_server.scorer("policy").model.state_dict()
    ok = {"model": "policy", "rpc": "UpdateWeights", "code": "OK", "protocol": "grpc"}
    refused = {**ok, "code": "FAILED_PRECONDITION"}
    before = snapshot("logprob_requests_total", **ok), snapshot("logprob_requests_total", **refused)
    async with AsyncLogprobClient(policy_server.target, model="policy") as client:
        for streams in (4, 3, 1):
            await client.update_weights("policy", state, streams=streams)
        with pytest.raises(FailedPrecondition):  # version 1 is not above the live 3: every call refused
            await client.update_weights("policy", state, streams=4, version=1)
    assert moved(before[0], **ok) == {"logprob_requests_total": 3}
    assert moved(before[1], **refused) == {"logprob_requests_total": 1}
