"""The verl checkpoint-engine plugin's push on a GPU: an actor's CUDA weights pushed by CUDA IPC to
the served old-policy model, then old log-probs asked at the pushed version equal a fresh
in-process computation with those weights.

The GPU image has no verl, so this runs the plugin's push code itself (``integrations._push.
WeightPusher``: what ``verl_checkpoint.ServiceCheckpointEngine.send_weights`` stages and pushes
on rank 0) in a trainer process of its own (CUDA IPC maps another process's memory): float32
master weights on the GPU, as verl's FSDP engine exports them, changed as optimizer steps would,
pushed with the default ``transport=auto``. Each push must go by IPC (staged on the server's
GPU, not refused), land as the next version, bit for bit as a gRPC delta push of the same weights
(equal fingerprints), and the scores asked with ``min_version`` at it must equal the float64
forward of those weights within float32 rounding (``ScoreReference``). Skipped without a GPU.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.server import as_lists, new_seed, settings, start, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 2


def trainer(target: str, path: str, device: str, seed: int, sequences: tuple, results: mp.Queue) -> None:
    """The actor: its weights stepped on ``device`` and pushed through the plugin's pusher; per
    step, the push's outcome, the old log-probs asked at its version, and the weights pushed."""
    from logprob_client import LogprobClient
    from logprob_client.integrations._push import WeightPusher

    try:
        actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        generator = torch.Generator(device).manual_seed(seed)
        steps = []
        with LogprobClient(target, model="policy", timeout=120) as client, LogprobClient(target) as other:
            pusher = WeightPusher(client, "policy", "float32")  # transport=auto, as the plugin's default
            by_grpc = WeightPusher(other, "policy", "float32", transport="grpc")
            for _ in range(STEPS):
                with torch.no_grad():
                    for p in actor.parameters():
                        mask = torch.rand(p.shape, device=device, generator=generator) < 0.3
                        p.add_(torch.randn(p.shape, device=device, generator=generator) * 0.02 * mask)
                pushed = pusher.push(actor.state_dict().items())
                logps, entropies = client.score(*sequences, min_version=pushed.version, return_entropy=True)
                again = by_grpc.push(actor.state_dict().items())  # the same weights, as deltas over gRPC
                # As numpy arrays: a torch tensor put on a queue is shared by a file descriptor its
                # sender must still hold when it is read, and this process ends once it has put them.
                weights = {n: t.detach().cpu().numpy().copy() for n, t in actor.state_dict().items()}
                steps.append((pushed, pusher.resolve(next(actor.parameters())), again, logps, entropies, weights))
        results.put(steps)
    except BaseException as err:  # the test process shows what went wrong here
        results.put(err)
        raise


@pytest.mark.parametrize("trainer_device", ["cuda:0", "cuda:1"], ids=["same-gpu", "other-gpu"])
async def test_pushed_by_ipc_then_old_log_probs_at_that_version_are_the_actor_s(tmp_path, trainer_device, rng):
    if torch.device(trainer_device).index >= torch.cuda.device_count():
        pytest.skip(f"needs {trainer_device}")
    model = make_model("qwen2", tied=False, seed=new_seed(rng), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    sequences = random_sequences(rng, 6)
    running = await start(settings({"policy": str(tmp_path)}, device="cuda:0", dtype="float32"))
    try:
        context = mp.get_context("spawn")
        results = context.Queue()
        args = (running.target, str(tmp_path), trainer_device, new_seed(rng), as_lists(sequences), results)
        process = context.Process(target=trainer, args=args)
        process.start()
        outcome = await asyncio.to_thread(results.get, timeout=300)
        await asyncio.to_thread(process.join, 60)
    finally:
        await stop(running)
    if isinstance(outcome, BaseException):
        raise outcome
    for step, (pushed, transport, again, logps, entropies, weights) in enumerate(outcome):
        assert transport == "ipc", "CUDA IPC was refused on the service's host"
        assert pushed.version == 1 + 2 * step and again.version == pushed.version + 1  # the model starts at 0
        assert pushed.staged_on == "cuda:0" and pushed.tensors == len(weights)
        assert pushed.fingerprint == again.fingerprint, f"step {step}: IPC and gRPC landed different weights"
        model.load_state_dict({name: torch.from_numpy(w) for name, w in weights.items()})
        ScoreReference(model, sequences).check(logps, entropies)
    first = outcome[0][3]
    assert max(float(np.abs(a - b).max()) for a, b in zip(first, logps)) > 1e-3, "the steps did not move the scores"
