"""UpdateWeights / LoadWeights / min_version through a real server on loopback (CPU, float32).

Reference for every score: a model freshly loaded with the same weights, scored in float64 from
its own full logits (``tests.helpers.models.reference_scores``). Tolerance 1e-5 (float32 on the CPU).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient, DeadlineExceeded, FailedPrecondition, InvalidRequest, UpdateAborted
from logprob_client.weights import update_requests
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_service.models.weights import model_fingerprint
from transformers import AutoModelForCausalLM

from tests.helpers.calls import OK, Gate, parsed, request
from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.server import as_lists, assert_scores_match, live, new_seed, settings, start, stop
from tests.helpers.waiting import eventually

ATOL = 1e-5


@pytest.fixture
def served(policy_server):
    return policy_server


async def test_after_an_update_scores_are_those_of_the_new_weights(served, tmp_path, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    new.save_pretrained(tmp_path)
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    sequences = random_sequences(rng, 6)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        before = await live(client, "policy")
        result = await client.update_weights("policy", new.state_dict(), chunk_bytes=4096)  # many pieces each
        assert (result.version, result.tensors) == (1, len(new.state_dict()))
        assert result.bytes == sum(t.nbytes for t in new.state_dict().values())
        after = await live(client, "policy")
        assert after.version == 1 and after.fingerprint == result.fingerprint != before.fingerprint
        assert after.fingerprint == model_fingerprint(fresh)  # equal fingerprints, equal weights
        assert_scores_match(fresh, sequences, await client.score(*as_lists(sequences)))

        # A partial update replaces only what it brings; its version is the trainer's own step.
        layer = "model.layers.1.mlp.down_proj.weight"
        tweaked = new.state_dict()[layer] + 0.01 * torch.randn_like(new.state_dict()[layer])
        result = await client.update_weights("policy", {layer: tweaked}, version=120, partial=True)
        assert (result.version, result.tensors) == (120, 1)
        with torch.no_grad():
            fresh.get_parameter(layer).copy_(tweaked)
        assert_scores_match(fresh, sequences, await client.score(*as_lists(sequences)))
        assert (await live(client, "policy")).fingerprint == model_fingerprint(fresh)


async def test_load_weights_from_a_checkpoint_directory(served, tmp_path, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    new.save_pretrained(tmp_path)
    sequences = random_sequences(rng, 4)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        result = await client.load_weights("policy", str(tmp_path), version=7)
        assert result.version == 7 and result.tensors == len(new.state_dict())
        assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))
        with pytest.raises(InvalidRequest, match="path"):
            await client.load_weights("policy", str(tmp_path / "nowhere"))


async def test_a_tied_model_takes_a_checkpoint_without_its_lm_head(tmp_path, rng):
    """save_pretrained drops lm_head.weight of a tied model: it is the embedding, and counts as sent."""
    old, new = (make_model("gemma2", tied=True, seed=new_seed(rng)) for _ in range(2))
    old.save_pretrained(tmp_path / "old")
    new.save_pretrained(tmp_path / "new")
    running = await start(settings({"gemma": str(tmp_path / "old")}))
    try:
        sequences = random_sequences(rng, 3)
        async with AsyncLogprobClient(running.target, model="gemma") as client:
            assert (await client.load_weights("gemma", str(tmp_path / "new"))).version == 1
            assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))
            state = {k: v for k, v in new.state_dict().items() if k != "model.embed_tokens.weight"}
            assert (await client.update_weights("gemma", state)).version == 2  # lm_head.weight alone covers it

            # Both tied names with equal bytes: one weight. With other bytes, which one landed would
            # depend on which of the push's calls came first: refused, over one call or several.
            both = new.state_dict()
            assert (await client.update_weights("gemma", both)).version == 3
            other = {**both, "lm_head.weight": both["lm_head.weight"] + 1.0}
            for streams in (1, 4):
                with pytest.raises(
                    InvalidRequest, match=r"tensor '(lm_head|model\.embed_tokens)\.weight': is the same"
                ):
                    await client.update_weights("gemma", other, streams=streams)
            assert (await live(client, "gemma")).version == 3
            assert_scores_match(new, sequences, await client.score(*as_lists(sequences)))
    finally:
        await stop(running)


async def test_concurrent_scoring_never_sees_a_mixed_version(served, rng):
    """Scoring runs on while three updates land; each response must equal the reference of the
    version it reports. Requests are larger than one micro-batch (256 tokens), so they are split,
    and the swap must wait for a split request's parts."""
    versions = {0: AutoModelForCausalLM.from_pretrained(served.service.settings.models["policy"]).eval()}
    versions |= {v: make_model("llama", tied=False, seed=new_seed(rng)) for v in (1, 2, 3)}
    requests = [random_sequences(rng, 10, max_len=60) for _ in range(4)]
    expected = {(v, r): ScoreReference(model, seqs) for v, model in versions.items() for r, seqs in enumerate(requests)}
    seen: list[tuple[int, int, list[np.ndarray]]] = []
    stop_scoring = asyncio.Event()

    async def score_forever(stub: pb_grpc.LogprobServiceStub) -> None:
        while not stop_scoring.is_set():
            for r, seqs in enumerate(requests):
                response = await stub.ScoreTokens(
                    pb.ScoreRequest(
                        model="policy",
                        sequences=[pb.Sequence(prompt_ids=p, completion_ids=c) for p, c in zip(*as_lists(seqs))],
                    )
                )
                seen.append((response.model_version, r, [np.asarray(s.logprobs) for s in response.scores]))

    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        stub = pb_grpc.LogprobServiceStub(channel)
        scorers = [asyncio.create_task(score_forever(stub)) for _ in range(3)]
        for v in (1, 2, 3):
            # Each version scores some requests before the next lands: the order the test needs.
            await eventually(
                lambda v=v: any(seen_v == v - 1 for seen_v, _, _ in seen), f"a response of version {v - 1}"
            )
            await client.update_weights("policy", versions[v].state_dict())
        await eventually(lambda: any(seen_v == 3 for seen_v, _, _ in seen), "a response of version 3")
        stop_scoring.set()
        await asyncio.gather(*scorers)

    assert {v for v, _, _ in seen} == {0, 1, 2, 3}
    for version, r, logprobs in seen:
        expected[version, r].check([np.asarray(lp, dtype=np.float32) for lp in logprobs])


def good_update(model) -> dict[str, torch.Tensor]:
    return {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("break_it", "status", "names"),
    [
        (lambda s: s | {"model.norm.weight": torch.randn(7)}, grpc.StatusCode.INVALID_ARGUMENT, "model.norm.weight"),
        (
            lambda s: s | {"lm_head.weight": s["lm_head.weight"].double()},
            grpc.StatusCode.INVALID_ARGUMENT,
            "lm_head.weight",
        ),
        (lambda s: s | {"model.layers.9.bogus": torch.randn(3)}, grpc.StatusCode.INVALID_ARGUMENT, "layers.9.bogus"),
        (
            lambda s: {k: v for k, v in s.items() if "layers.0.mlp.up_proj" not in k},
            grpc.StatusCode.INVALID_ARGUMENT,
            "model.layers.0.mlp.up_proj.weight",
        ),
    ],
    ids=["wrong-shape", "wrong-dtype", "unknown-name", "missing-tensor"],
)
async def test_a_bad_update_leaves_the_live_weights_and_names_the_tensor(served, break_it, status, names, rng):
    sequences = random_sequences(rng, 3)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        before, scores = await live(client, "policy"), await client.score(*as_lists(sequences))
        broken = break_it(good_update(served.scorer("policy").model))
        with pytest.raises(Exception) as caught:
            await client.update_weights("policy", broken)
        assert caught.value.code == status and names in caught.value.message
        assert await live(client, "policy") == before
        for got, want in zip(await client.score(*as_lists(sequences)), scores):
            np.testing.assert_array_equal(got, want)


async def test_a_stream_cut_midway_or_ended_early_changes_nothing(served):
    model = served.scorer("policy").model
    new = good_update(model)
    messages = parsed(update_requests("policy", new, version=0, partial=False, chunk_bytes=1000))
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        stub = pb_grpc.LogprobServiceStub(channel)
        before = await live(client, "policy")

        # Ended early: the client half-closes in the middle of a tensor, without a commit.
        middle = next(i for i in range(len(messages) // 2, len(messages)) if messages[i].tensor.offset > 0)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.UpdateWeights(iter(messages[:middle]))
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert f"in tensor {messages[middle].tensor.name!r}" in caught.value.details()
        assert "before its commit" in caught.value.details()

        # Cut: the client goes away in the middle of a tensor.
        async def stalls_midway():
            for message in messages[:middle]:
                yield message
            await asyncio.Event().wait()

        call = stub.UpdateWeights(stalls_midway())
        updater = served.service.device_side.updater
        await eventually(lambda: updater.updating("policy"), "the update to start")
        call.cancel()
        await eventually(lambda: not updater.updating("policy"), "the cancelled update to end")
        assert await live(client, "policy") == before

        # The slot is free again and a whole update goes through.
        assert (await client.update_weights("policy", new)).version == before.version + 1


async def test_pieces_in_messages_of_their_own_or_several_to_a_message_land_alike(served):
    """Older clients send each piece in a message of its own; this one packs small pieces several
    to a message (``tensors``). Both land the same weights."""
    new = good_update(served.scorer("policy").model)
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        stub = pb_grpc.LogprobServiceStub(channel)
        before = await live(client, "policy")
        fingerprints = []
        for pack in (False, True):
            messages = parsed(update_requests("policy", new, version=0, partial=False, chunk_bytes=4096, pack=pack))
            assert any(m.WhichOneof("kind") == "tensors" for m in messages) == pack
            response = await stub.UpdateWeights(iter(messages))
            assert response.tensors == len(new) and response.bytes == sum(t.nbytes for t in new.values())
            fingerprints.append(response.fingerprint)
        assert fingerprints[0] == fingerprints[1] != before.fingerprint
        assert (await live(client, "policy")).version == before.version + 2


@pytest.mark.parametrize(
    ("message", "details"),
    [
        (pb.UpdateWeightsRequest(), "kind: an UpdateWeightsRequest must set one of header, tensor, tensors, commit"),
        (pb.UpdateWeightsRequest(tensors=pb.TensorChunks()), "tensors: an UpdateWeightsRequest's tensors must hold"),
    ],
    ids=["nothing", "no-piece"],
)
async def test_a_message_of_no_kind_or_no_piece_is_refused(served, message, details):
    header = pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(model="policy"))
    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        before = await live(client, "policy")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.LogprobServiceStub(channel).UpdateWeights(iter([header, message]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details in caught.value.details()
        assert await live(client, "policy") == before


async def test_versions_only_go_up(served):
    async with AsyncLogprobClient(served.target, model="policy") as client:
        state = served.scorer("policy").model.state_dict()
        await client.update_weights("policy", state, version=5)
        with pytest.raises(FailedPrecondition, match="version: 5 is not above"):
            await client.update_weights("policy", state, version=5)
        messages = parsed(update_requests("policy", state, version=0, partial=False))
        messages[-1].commit.tensor_count += 1
        async with grpc.aio.insecure_channel(served.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.LogprobServiceStub(channel).UpdateWeights(iter(messages))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "commit.tensor_count" in caught.value.details()
        assert (await live(client, "policy")).version == 5


async def test_min_version_waits_for_the_update(served, rng):
    new = make_model("llama", tied=False, seed=new_seed(rng))
    sequences = random_sequences(rng, 3)
    async with AsyncLogprobClient(served.target, model="policy") as client:
        waiting = asyncio.create_task(client.score(*as_lists(sequences), min_version=1))
        await asyncio.sleep(0.3)
        assert not waiting.done(), "version 1 is not live yet"
        await client.update_weights("policy", new.state_dict())
        assert_scores_match(new, sequences, await asyncio.wait_for(waiting, 30))


async def test_min_version_that_never_comes_fails_with_failed_precondition(llama_checkpoint):
    running = await start(settings({"policy": str(llama_checkpoint)}, max_version_wait_s=0.3))
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            with pytest.raises(FailedPrecondition, match="min_version: model 'policy' is at version 0; version 3"):
                await client.score([[1, 2]], [[3]], min_version=3)
    finally:
        await stop(running)


async def test_a_refused_update_gets_its_status_while_the_client_is_still_sending(served):
    """Refused at its header, an update's status must reach a client that is still writing tensors.
    grpc.aio reports INTERNAL "Internal error from Core" for a write that fails because the call
    already ended (grpc/grpc#36066). Without the server reading the stream to its end, 16 of 200
    such refusals came back that way here: 100 tries would all pass with probability
    (184/200)^100 < 1e-3, so this test catches the fix's absence."""
    state = served.scorer("policy").model.state_dict()
    async with AsyncLogprobClient(served.target, model="policy") as client:
        await client.update_weights("policy", state, version=3)
        for _ in range(100):
            with pytest.raises(FailedPrecondition, match="version: 2 is not above"):
                await client.update_weights("policy", state, version=2, chunk_bytes=4096)


async def test_one_update_of_a_model_at_a_time(served):
    state = served.scorer("policy").model.state_dict()
    messages = parsed(update_requests("policy", state, version=0, partial=False))
    release = asyncio.Event()

    async def slow():
        yield messages[0]
        await release.wait()
        for message in messages[1:]:
            yield message

    async with grpc.aio.insecure_channel(served.target) as channel, AsyncLogprobClient(served.target) as client:
        stub = pb_grpc.LogprobServiceStub(channel)
        first = stub.UpdateWeights(slow())  # the call starts at once
        await eventually(lambda: served.service.device_side.updater.updating("policy"), "the first update to start")
        with pytest.raises(UpdateAborted, match="another update of 'policy' is in progress"):
            await client.update_weights("policy", state)
        release.set()
        assert (await first).version == 1


async def test_a_push_cancelled_after_its_commit_goes_live_logged_and_listed(served, caplog):
    """The commit reached the server, then the caller cancelled (its swap held behind a launch):
    the push goes live all the same, the log says so, and ListModels answers only once it has,
    so the caller can learn the push's fate from it."""
    caplog.set_level(logging.INFO, logger="logprob_service.engine.weights.updater")
    messages = parsed(update_requests("policy", good_update(served.scorer("policy").model), version=7, partial=False))
    gate = Gate(served, "policy")
    try:
        async with grpc.aio.insecure_channel(served.target) as channel:
            stub = pb_grpc.LogprobServiceStub(channel)
            held = stub.ScoreTokens(request(OK, model="policy"), timeout=60)
            await gate.wait_entered()

            async def then_hold():
                for message in messages:
                    yield message
                await asyncio.Event().wait()

            push = stub.UpdateWeights(then_hold())
            scheduler = served.service.device_side.scheduler
            await eventually(lambda: "policy" in scheduler.pending_swaps, "the commit, its swap waiting")
            push.cancel()
            listed = asyncio.ensure_future(stub.ListModels(pb.ListModelsRequest(), timeout=60))
            done, _ = await asyncio.wait([listed], timeout=0.5)
            assert not done, "ListModels answered while a push past its commit was still to go live"
            gate.release.set()
            (policy,) = [m for m in (await listed).models if m.name == "policy"]
            assert policy.version == 7
            await held
    finally:
        gate.restore()
    assert any("version 7 live" in r.getMessage() for r in caplog.records)
    await eventually(lambda: not served.service.device_side.updater.updating("policy"), "the update slot to be free")


async def test_a_push_past_its_deadline_says_whether_it_went_live(llama_checkpoint):
    """A push's calls pass their deadline: the client asks ListModels before it raises, and its
    error says whether the push went live. Past the commit (its swap held behind a launch): it
    did, as version 0's live + 1. Midway (the stream read slowly while the launch is held): it
    did not, and never does."""
    running = await start(settings({"policy": str(llama_checkpoint)}, update_yield_to_launches=False))
    state = running.scorer("policy").model.state_dict()
    gate = Gate(running, "policy")
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            held = asyncio.ensure_future(client.score([[1, 2, 3]], [[4, 5]], timeout=60))
            await gate.wait_entered()
            pushing = asyncio.ensure_future(client.update_weights("policy", state, timeout=2.0))
            await asyncio.sleep(3.0)  # past the push's deadline: its calls have failed, ListModels waits
            gate.release.set()
            with pytest.raises(DeadlineExceeded) as caught:
                await pushing
            outcome = caught.value.push_outcome
            assert (outcome.version, outcome.live_version, outcome.went_live) == (1, 1, True)
            assert "went live" in caught.value.message
            await held
    finally:
        gate.restore()
        await stop(running)

    # Midway: the stream is read slowly (0.1 s a message while a launch is held), the deadline passes.
    running = await start(settings({"policy": str(llama_checkpoint)}))
    gate = Gate(running, "policy")
    try:
        async with AsyncLogprobClient(running.target, model="policy") as client:
            held = asyncio.ensure_future(client.score([[1, 2, 3]], [[4, 5]], timeout=60))
            await gate.wait_entered()
            with pytest.raises(DeadlineExceeded) as caught:
                await client.update_weights("policy", state, version=9, chunk_bytes=4096, streams=1, timeout=1.0)
            outcome = caught.value.push_outcome
            assert (outcome.version, outcome.live_version, outcome.went_live) == (9, 0, False)
            assert "did not go live" in caught.value.message
            gate.release.set()
            await held
            await eventually(
                lambda: not running.service.device_side.updater.updating("policy"), "the update slot to be free"
            )
            assert (await live(client, "policy")).version == 0
    finally:
        gate.restore()
        await stop(running)
