"""Calls to a running server as tests make them: raw requests and stubs (where the client's
retries would hide what the server answered), random batches, a gate that holds the model, and
checking answers against the exact scores."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

import grpc
import numpy as np
import pytest
from logprob_client.weights import Message, join, update_streams
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from tests.helpers.models import as_sequences, assert_scores_close
from tests.helpers.waiting import TIMEOUT_S


def request(*seqs, groups=(), model="", temperature=0.0, request_id="") -> pb.ScoreRequest:
    """``seqs``: (prompt, completion) pairs; ``groups``: (prompt, [completion, ...]) pairs."""
    return pb.ScoreRequest(
        request_id=request_id,
        model=model,
        temperature=temperature,
        sequences=[pb.Sequence(prompt_ids=p, completion_ids=c) for p, c in seqs],
        groups=[
            pb.SequenceGroup(prompt_ids=p, completions=[pb.Completion(completion_ids=c) for c in cs])
            for p, cs in groups
        ],
    )


def update_calls(*args, **keywords) -> list[list[bytes]]:
    """``logprob_client.weights.update_streams(*args, **keywords)``: each call's messages serialized."""
    return [list(map(join, call)) for call in update_streams(*args, **keywords)]


def parsed(messages: Iterable[bytes | Message]) -> list[pb.UpdateWeightsRequest]:
    """An UpdateWeights stream as ``logprob_client.weights`` makes it (messages serialized, or in
    parts), read back as messages."""
    return [pb.UpdateWeightsRequest.FromString(m if isinstance(m, bytes) else join(m)) for m in messages]


def unpacked(requests: Iterable[pb.UpdateWeightsRequest]) -> list[pb.UpdateWeightsRequest]:
    """``requests`` with each that holds several pieces (``tensors``) replaced by one request per
    piece, in order: the stream as a server takes it."""
    out = []
    for r in requests:
        if r.WhichOneof("kind") == "tensors":
            assert len(r.tensors.chunks) > 1, "a message holds several pieces, or sends its one as `tensor`"
            out += [pb.UpdateWeightsRequest(tensor=chunk) for chunk in r.tensors.chunks]
        else:
            out.append(r)
    return out


async def call(target: str, req: pb.ScoreRequest, timeout: float = 30.0):
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.LogprobServiceStub(channel).ScoreTokens(req, timeout=timeout)


async def expect(target, req, code, *fragments, timeout=30.0) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(target, req, timeout)
    err = info.value
    assert err.code() == code, err.details()
    for fragment in fragments:
        assert fragment in err.details(), (fragment, err.details())
    return err


OK = ([1, 2, 3], [4, 5])


class Gate:
    """Holds the scorer of a model until released, counting the sequences of each micro-batch."""

    def __init__(self, running, model="default"):
        self.scorer = running.scorer(model)
        self.original = self.scorer.launch
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[int] = []
        self.scorer.launch = self._launch

    async def wait_entered(self) -> None:
        """Return once a micro-batch of the model has reached the gate."""
        assert await asyncio.to_thread(self.entered.wait, TIMEOUT_S), "no micro-batch reached the model"

    def _launch(self, batch, options):
        self.calls.append(len(batch.completion_lengths))
        self.entered.set()
        assert self.release.wait(TIMEOUT_S), "test never released the gate"
        return self.original(batch, options)

    def restore(self):
        self.release.set()
        self.scorer.launch = self.original


def random_batch(rng: np.random.Generator, n: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(n)]
    completions = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(n)]
    return prompts, completions


def assert_matches_reference(running, model_name, prompts, completions, logprobs, temperature=1.0, entropies=None):
    model = running.scorer(model_name).model
    assert_scores_close(model, as_sequences(prompts, completions), logprobs, entropies, temperature)


def trl_layout(rng, prompts, completions, pad_id=0):
    """Left-padded prompts and right-padded completions with masks, as TRL's GRPOTrainer holds them."""
    b, p_len, c_len = len(prompts), max(map(len, prompts)), max(map(len, completions))
    prompt_ids = np.full((b, p_len), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((b, p_len), dtype=np.int64)
    completion_ids = np.full((b, c_len), pad_id, dtype=np.int64)
    completion_mask = np.zeros((b, c_len), dtype=np.int64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, p_len - len(p) :], prompt_mask[i, p_len - len(p) :] = p, 1
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = c, 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def random_sequence(rng, prompt: int, completion: int) -> tuple[list[int], list[int]]:
    return rng.integers(0, 4096, prompt).tolist(), rng.integers(0, 4096, completion).tolist()
