"""``score_async`` against the real server: the same values as the blocking ``score``, and the
trainer's own work runs while the RPC is inside the server's scoring step.

Overlap is proven with events, not sleeps: the server's scorer is held (``Gate``) once it has
started on the request, the trainer's work runs while it is held, and only then is it released;
a ``score_async`` that waited for its answer would never return while the scorer is held, so the
test would fail (the gate gives up after its timeout and the call errors).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch
from logprob_client import LogprobClient

from tests.helpers.calls import Gate, assert_matches_reference, random_batch, trl_layout


def dense_batch(rng: np.random.Generator, rows: int):
    """TRL's layout as torch tensors, with one row whose completion is fully masked."""
    prompts, completions = random_batch(rng, rows, 4096)
    prompt_ids, prompt_mask, completion_ids, completion_mask = map(
        torch.from_numpy, trl_layout(rng, prompts, completions)
    )
    completion_mask[int(rng.integers(rows))] = 0
    return prompts, completions, prompt_ids, prompt_mask, completion_ids, completion_mask


def assert_dense_matches_reference(
    running, prompts, completions, completion_mask, logprobs, entropies=None, temperature=1.0
):
    """Each unmasked row of a (B, C) result against the float64 reference of its sequence."""
    rows = [i for i in range(len(prompts)) if completion_mask[i].any()]
    assert_matches_reference(
        running,
        "default",
        [prompts[i] for i in rows],
        [completions[i] for i in rows],
        [logprobs[i, : len(completions[i])].numpy() for i in rows],
        temperature=temperature,
        entropies=None if entropies is None else [entropies[i, : len(completions[i])].numpy() for i in rows],
    )


async def test_score_async_equals_score_and_the_reference(running, rng):
    prompts, completions, prompt_ids, prompt_mask, completion_ids, completion_mask = dense_batch(rng, 9)
    kwargs = dict(prompt_mask=prompt_mask, completion_mask=completion_mask, temperature=0.7, return_entropy=True)

    def both():
        # 2 rows per RPC: several RPCs in flight for each call, against a 16-sequence server limit.
        with LogprobClient(running.target, max_sequences_per_rpc=2) as client:
            future = client.score_async(prompt_ids, completion_ids, **kwargs)
            return client.score(prompt_ids, completion_ids, **kwargs), future.result()

    (blocking, blocking_ent), (overlapped, overlapped_ent) = await asyncio.to_thread(both)
    # The two calls' sequences may share micro-batches differently, and fp32 GEMMs round
    # differently with the batch's shape: not bit for bit equal, so each is checked against the
    # exact answer.
    for logprobs, entropies in ((blocking, blocking_ent), (overlapped, overlapped_ent)):
        assert torch.equal(logprobs[completion_mask == 0], torch.zeros(int((completion_mask == 0).sum())))
        assert_dense_matches_reference(
            running, prompts, completions, completion_mask, logprobs, entropies, temperature=0.7
        )


async def test_trainer_work_runs_while_the_server_scores(running, rng):
    prompts, completions, prompt_ids, prompt_mask, completion_ids, completion_mask = dense_batch(rng, 6)
    gate = Gate(running)
    timeline: list[tuple[str, float]] = []

    def trainer_step():
        with LogprobClient(running.target) as client:
            future = client.score_async(
                prompt_ids, completion_ids, prompt_mask=prompt_mask, completion_mask=completion_mask
            )
            timeline.append(("score_async returned", time.monotonic()))
            assert gate.entered.wait(10), "the request never reached the scorer"
            timeline.append(("server scoring", time.monotonic()))
            # Trainer-side work meanwhile: a forward pass of a local model, as generating batch k+1 would.
            model = running.scorer("default").model
            with torch.no_grad():
                next_batch = model(torch.from_numpy(rng.integers(0, 4096, (4, 32)))).logits
            pending_during_work = not future.done()
            timeline.append(("trainer work done", time.monotonic()))
            gate.release.set()
            result = future.result()
            timeline.append(("result", time.monotonic()))
            return next_batch, pending_during_work, result

    try:
        next_batch, pending_during_work, result = await asyncio.to_thread(trainer_step)
    finally:
        gate.restore()
    assert next_batch.shape == (4, 32, 4096)
    assert pending_during_work, "the RPC finished before the trainer's work did: nothing overlapped"
    assert [name for name, _ in timeline] == ["score_async returned", "server scoring", "trainer work done", "result"]
    assert [t for _, t in timeline] == sorted(t for _, t in timeline)
    assert_dense_matches_reference(running, prompts, completions, completion_mask, result)
