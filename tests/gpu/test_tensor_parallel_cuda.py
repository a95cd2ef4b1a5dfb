"""Tensor parallel on two GPUs: ``serve --device cuda:0,cuda:1 --tensor-parallel 2`` (NCCL), as users run it.

Three bfloat16 architectures sharded over two processes (Llama untied, Qwen2 GQA tied, Gemma 2
with both softcaps and a sliding window), scored through the fused kernel on each rank's
vocabulary slice: the scores are within the bfloat16 tolerance of ``ScoreReference`` (the served
path against float64, given the model's own bfloat16 error), and each fingerprint is the whole
model's. Skipped without two GPUs.
"""

from __future__ import annotations

import signal

import pytest
import torch
from logprob_client import LogprobClient
from logprob_service.models.weights import model_fingerprint

from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.seeds import session_seed
from tests.helpers.server import as_lists

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ARCHITECTURES = {"llama": False, "qwen2": True, "gemma2": True}  # name -> tied lm_head


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = {}
    for name, tied in ARCHITECTURES.items():
        model = make_model(name, tied=tied, seed=session_seed(f"tp-cuda-{name}"), dtype=torch.bfloat16)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        models[name] = (model, directory)
    port = free_port()
    flags = [f"--model={name}={directory}" for name, (_, directory) in models.items()]
    log_path = tmp_path_factory.mktemp("tp-log") / "server.log"
    with log_path.open("w") as log:
        proc = launch(
            *flags, "--device=cuda:0,cuda:1", "--tensor-parallel=2", f"--port={port}", "--metrics-port=0", stdout=log
        )
        try:
            wait_serving(f"127.0.0.1:{port}", proc, timeout=300)
            yield models, f"127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log_path.read_text()[-3000:]


@pytest.mark.numerical
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_two_gpus_score_as_the_model(served, name, rng):
    models, target = served
    model, _ = models[name]
    sequences = random_sequences(rng, 8, max_len=80)
    temperature = float(rng.uniform(0.6, 1.6))
    with LogprobClient(target, model=name) as client:
        logprobs, entropies = client.score(*as_lists(sequences), temperature=temperature, return_entropy=True)
        infos = {info.name: info for info in client.list_models()}
    ScoreReference(model, sequences, temperature, dtype=torch.bfloat16).check(logprobs, entropies)
    assert infos[name].fingerprint == model_fingerprint(model)
