"""Soak: four trainers push weights to a server subprocess (CLI, CPU, builtin tiny-llama, one model
each) while two scorers score plain sequences and shared-prompt groups, for a seeded minute or so.

Each trainer's pushes are cut off at random: by a deadline (the client's own, from 5 to 300 ms, its
error then saying whether the push went live), by cancelling the raw call at a random point
(before its header, midway, or 0-1.5 ms after its commit; ListModels on the call's own connection
then says whether it went live), or not at all; some versions come by LoadWeights instead. Every
version is the trainer's own step, and its weights are drawn from it.

Afterwards: every model's update slot is free (a push goes through); the versions that went live,
by the server's log, are exactly those the trainers were told went live; every score equals the
float64 result of the weights of the version its response reports; and SIGTERM ends the server
within its drain time."""

from __future__ import annotations

import asyncio
import re
import signal
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from logprob_client import AsyncLogprobClient, Cancelled, DeadlineExceeded, UpdateAborted
from logprob_client.weights import update_requests
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.api.probe import check as health_check
from logprob_service.domain import TokenSequence
from logprob_service.models.builtin import build_builtin, tiny_llama_config
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from tests.helpers.calls import parsed
from tests.helpers.models import ScoreReference
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.pushes import cancelled_push, cut_point

MODELS = ("t0", "t1", "t2", "t3")  # one per trainer
STEPS = 30  # pushes and loads per trainer
GRACE_S = 10.0  # the server's drain time
EXIT_MARGIN_S = 10.0  # the interpreter's own exit after the drain, on a loaded 2-core machine
VOCAB = tiny_llama_config().vocab_size
# What a trainer does at a step, and how often.
KINDS = {"deadline": 0.35, "cancel": 0.35, "push": 0.15, "load": 0.15}


@dataclass
class Told:
    """What each trainer was told of each of its versions: went live (True) or not."""

    live: dict[str, dict[int, bool]] = field(default_factory=lambda: defaultdict(dict))
    deadlines: int = 0  # pushes past their deadline (the client said whether they went live)


def weights_for(base: dict[str, torch.Tensor], seed: int, model: str, version: int) -> dict[str, torch.Tensor]:
    """A version's weights: the builtin model's, with noise drawn from (seed, model, version)."""
    if version == 0:
        return base
    generator = torch.Generator().manual_seed(seed * 7919 + MODELS.index(model) * 1009 + version)
    return {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in base.items()}


def score_requests(rng: np.random.Generator) -> list[tuple[pb.ScoreRequest, list[TokenSequence]]]:
    """A few requests, each of plain sequences and a group of completions sharing one prompt, and
    their sequences in the order of the answer's scores."""
    out = []
    for _ in range(3):
        plain = [
            (rng.integers(0, VOCAB, int(rng.integers(1, 24))), rng.integers(0, VOCAB, int(rng.integers(1, 16))))
            for _ in range(2)
        ]
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 24)))
        completions = [rng.integers(0, VOCAB, int(rng.integers(1, 16))) for _ in range(3)]
        request = pb.ScoreRequest(
            sequences=[pb.Sequence(prompt_ids=p.tolist(), completion_ids=c.tolist()) for p, c in plain],
            groups=[
                pb.SequenceGroup(
                    prompt_ids=prompt.tolist(),
                    completions=[pb.Completion(completion_ids=c.tolist()) for c in completions],
                )
            ],
        )
        out.append((request, [TokenSequence(p, c) for p, c in plain] + [TokenSequence(prompt, c) for c in completions]))
    return out


async def trainer(
    model: str, target: str, rng: np.random.Generator, seed: int, base, told: Told, tmp_path: Path
) -> None:
    async with AsyncLogprobClient(target, model=model) as client, grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LogprobServiceStub(channel)
        for version in range(1, STEPS + 1):
            weights = weights_for(base, seed, model, version)
            kind = rng.choice(list(KINDS), p=list(KINDS.values()))
            streams, chunk = int(rng.choice([1, 4])), int(rng.choice([1 << 16, 4 << 20]))
            try:
                if kind == "deadline":
                    timeout = float(rng.uniform(0.005, 0.3))
                    try:
                        await client.update_weights(
                            model, weights, version=version, streams=streams, chunk_bytes=chunk, timeout=timeout
                        )
                        went_live = True
                    except (DeadlineExceeded, Cancelled) as err:
                        assert err.push_outcome is not None and err.push_outcome.went_live is not None, err
                        went_live = err.push_outcome.went_live
                        told.deadlines += 1
                elif kind == "cancel":
                    messages = parsed(
                        update_requests(model, weights, version=version, partial=False, chunk_bytes=chunk)
                    )
                    await cancelled_push(stub, messages, *cut_point(rng, messages, after_commit=0.75))
                    # On the cancelled call's connection: answered after the call's end, and after
                    # its update if the server had its commit.
                    (info,) = [
                        m for m in (await stub.ListModels(pb.ListModelsRequest(), timeout=60)).models if m.name == model
                    ]
                    went_live = info.version == version
                elif kind == "push":
                    await client.update_weights(
                        model, weights, version=version, streams=streams, chunk_bytes=chunk, timeout=60
                    )
                    went_live = True
                else:
                    path = tmp_path / f"{model}-{version}.safetensors"
                    await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in weights.items()}, path)
                    await client.load_weights(model, str(path), version=version, timeout=60)
                    went_live = True
            except UpdateAborted:  # the slot still held by this trainer's last cut-off push, finishing
                went_live = False
            told.live[model][version] = went_live


async def scorer(target: str, rng: np.random.Generator, requests, seen: list, stop: asyncio.Event) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LogprobServiceStub(channel)
        while not stop.is_set():
            model, r = str(rng.choice(MODELS)), int(rng.integers(len(requests)))
            request = pb.ScoreRequest()
            request.CopyFrom(requests[r][0])
            request.model = model
            response = await stub.ScoreTokens(request, timeout=60)
            seen.append(
                (model, response.model_version, r, [np.asarray(s.logprobs, np.float32) for s in response.scores])
            )


async def test_soak_cut_off_pushes_scoring_and_loads(tmp_path, rng, seed):
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = launch(
            *("--port", str(port), "--metrics-port", "0", "--device", "cpu"),
            *(arg for name in MODELS for arg in ("--model", f"{name}=builtin:tiny-llama")),
            *("--grace-period-s", str(GRACE_S), "--drain-notice-s", "0.1", "--max-batch-tokens", "512"),
            stdout=log,
        )
    target = f"127.0.0.1:{port}"
    base = build_builtin("tiny-llama").state_dict()
    requests = score_requests(rng)
    told, seen, stop = Told(), [], asyncio.Event()
    try:
        await asyncio.to_thread(wait_serving, target, proc)
        generators = [np.random.default_rng([seed, i]) for i in range(len(MODELS) + 2)]
        scorers = [asyncio.ensure_future(scorer(target, generators[-i], requests, seen, stop)) for i in (1, 2)]
        await asyncio.gather(
            *(trainer(m, target, generators[i], seed, base, told, tmp_path) for i, m in enumerate(MODELS))
        )
        stop.set()
        await asyncio.gather(*scorers)

        # Every update slot is free: a push goes through on each model.
        async with AsyncLogprobClient(target) as client:
            for model in MODELS:
                final = STEPS + 1
                result = await client.update_weights(
                    model, weights_for(base, seed, model, final), version=final, timeout=60
                )
                assert result.version == final
                told.live[model][final] = True
        assert health_check(target, timeout_s=5)[0], "the server is not SERVING"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, GRACE_S + EXIT_MARGIN_S) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    text = log_path.read_text()
    for model in MODELS:
        logged = {int(v) for v in re.findall(rf"model '{model}': version (\d+) live", text)}
        said = {v for v, live in told.live[model].items() if live}
        assert logged == said, f"model {model!r}: live by the log {sorted(logged)}, told live {sorted(said)}"
    assert told.deadlines, "no push passed its deadline: the soak cut nothing off by deadline"

    # Every score is that of the weights of the version its response reports.
    assert len({(m, v) for m, v, _, _ in seen}) > len(MODELS), "the scorers saw no version but the first"
    by_version = defaultdict(list)
    for model, version, r, logprobs in seen:
        by_version[model, version].append((r, logprobs))
    reference = LlamaForCausalLM(tiny_llama_config())
    for (model, version), answers in sorted(by_version.items()):
        reference.load_state_dict(weights_for(base, seed, model, version))
        exact = {r: ScoreReference(reference.eval(), requests[r][1]) for r in {r for r, _ in answers}}
        for r, logprobs in answers:
            exact[r].check(logprobs)
