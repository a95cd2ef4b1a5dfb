"""Tensor parallel on the CPU: ``serve --device cpu --tensor-parallel 2`` (gloo), as users run it.

One server holds three architectures sharded over two processes: Llama (untied lm_head, so the
head is a sharded DTensor), Qwen2 (GQA, tied: each rank uses its rows of the replicated
embedding) and Gemma 2 (logit softcap, attention softcap, sliding window, tied). Their vocabulary
(517) splits unevenly (259 + 258). Checked: scores and entropies against the float64 reference
from each model's own full logits (the float32 tolerance of ``ScoreReference``); fingerprints
equal to the whole model's (each sharded weight is digested whole); weight updates refused.

Also through the same server: a lone long sequence runs layer by layer in chunks, and a GRPO
group runs its prompt once (the completions' attention reads the prompt's rows), on every rank.

Then the failure contract: killing a follower rank makes the server stop serving and exit (code
3, no hang), and the same command serves again, with the same scores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
from logprob_client import LogprobClient
from logprob_client.errors import FailedPrecondition
from logprob_service.api.probe import check as health_check
from logprob_service.domain import TokenSequence
from logprob_service.models.weights import model_fingerprint

from tests.helpers.models import VOCAB, ScoreReference, make_model, random_sequences
from tests.helpers.processes import free_port, launch, wait_serving
from tests.helpers.seeds import session_seed
from tests.helpers.server import as_lists
from tests.helpers.topk import assert_top_k, full_logp

ARCHITECTURES = {"llama": False, "qwen2": True, "gemma2": True}  # name -> tied lm_head
EXIT_GROUP_LOST = 3
START_TIMEOUT_S = 180.0  # two processes import torch and transformers, then load on both


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The three models, each saved as a checkpoint directory the ranks read their shards from."""
    made = {}
    for name, tied in ARCHITECTURES.items():
        model = make_model(name, tied=tied, seed=session_seed(f"tensor-parallel-{name}"))
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        made[name] = (model, directory)
    return made


# A lone sequence longer than this runs layer by layer in chunks (models.chunked), on every rank.
LONG_SEQUENCE_TOKENS, CHUNK_TOKENS = 96, 40


def serve(models, port: int, log) -> subprocess.Popen:
    flags = [f"--model={name}={directory}" for name, (_, directory) in models.items()]
    long = [f"--long-sequence-tokens={LONG_SEQUENCE_TOKENS}", f"--chunk-tokens={CHUNK_TOKENS}"]
    return launch(
        *flags, *long, "--device=cpu", "--tensor-parallel=2", f"--port={port}", "--metrics-port=0", stdout=log
    )


@contextlib.contextmanager
def running(models, port: int, log_path) -> Iterator[subprocess.Popen]:
    """The server, SERVING; stopped (SIGTERM) on the way out if it still runs."""
    with log_path.open("w") as log:
        proc = serve(models, port, log)
        try:
            wait_serving(f"127.0.0.1:{port}", proc, timeout=START_TIMEOUT_S)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    port = free_port()
    with running(models, port, tmp_path_factory.mktemp("tp-log") / "server.log") as proc:
        yield proc, port


@pytest.mark.numerical
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_sharded_models_score_as_the_whole_model(models, server, name, rng):
    model, _ = models[name]
    _, port = server
    sequences = random_sequences(rng, 6)
    temperature = float(rng.uniform(0.6, 1.6))
    with LogprobClient(f"127.0.0.1:{port}", model=name) as client:
        logprobs, entropies = client.score(*as_lists(sequences), temperature=temperature, return_entropy=True)
    ScoreReference(model, sequences, temperature).check(logprobs, entropies)


@pytest.mark.numerical
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_long_sequences_run_in_chunks_and_groups_run_their_prompt_once(models, server, name, rng):
    model, _ = models[name]
    _, port = server
    vocab = model.config.vocab_size
    long = TokenSequence(rng.integers(0, vocab, 60), rng.integers(0, vocab, 150))  # 210 > 96: in chunks
    prompt = rng.integers(0, vocab, 30)
    group = [TokenSequence(prompt, rng.integers(0, vocab, int(n))) for n in rng.integers(1, 40, 4)]
    with LogprobClient(f"127.0.0.1:{port}", model=name) as client:
        (lone,) = client.score(*as_lists([long]))
        (shared,) = client.score_groups([prompt], [[s.completion_ids for s in group]])
    ScoreReference(model, [long, *group]).check([lone, *shared])


@pytest.mark.numerical
def test_top_k_and_candidates_merge_over_the_ranks(models, server, rng):
    # Gemma 2 (softcap): each rank's top-k of its 259 or 258 ids, merged (ops.vocab_parallel)
    model, _ = models["gemma2"]
    _, port = server
    sequences = random_sequences(rng, 3)
    candidates = [rng.integers(0, VOCAB, (len(s.completion_ids), 5)) for s in sequences]
    with LogprobClient(f"127.0.0.1:{port}", model="gemma2") as client:
        out = client.score(*as_lists(sequences), top_k=256, candidate_ids=candidates, temperature=0.8)
    reference = ScoreReference(model, sequences, 0.8)
    reference.check(out.logprobs)
    for seq, top_ids, top_lps, cands, got in zip(
        sequences, out.top_ids, out.top_logprobs, candidates, out.candidate_logprobs
    ):
        logp = full_logp(model, seq, 0.8)
        assert_top_k(top_ids, top_lps, logp, 256, reference.atol)
        np.testing.assert_allclose(got, np.take_along_axis(logp, cands, -1), atol=reference.atol, rtol=0)


def test_fingerprints_are_the_whole_models_and_updates_are_refused(models, server):
    _, port = server
    with LogprobClient(f"127.0.0.1:{port}") as client:
        infos = {info.name: info for info in client.list_models()}
        for name, (model, _) in models.items():
            assert infos[name].fingerprint == model_fingerprint(model), name
            assert "tensor parallel, 2 ranks" in infos[name].device
        with pytest.raises(FailedPrecondition, match="tensor-parallel"):
            client.update_weights("llama", models["llama"][0].state_dict())


def followers(server_pid: int) -> list[int]:
    """The server's child processes that are tensor-parallel ranks (not the resource tracker)."""
    children = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server_pid)], capture_output=True, text=True, check=True
    )
    return [int(line.split()[0]) for line in children.stdout.splitlines() if "multiprocessing.spawn" in line]


def test_a_lost_rank_stops_the_server_and_a_restart_serves_again(models, tmp_path, rng):
    port = free_port()
    target = f"127.0.0.1:{port}"
    sequences = random_sequences(rng, 3)
    with running(models, port, tmp_path / "first.log") as proc:
        with LogprobClient(target, model="qwen2") as client:
            before = client.score(*as_lists(sequences))
        (rank1,) = followers(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(60) == EXIT_GROUP_LOST
    assert "tensor-parallel group lost" in (tmp_path / "first.log").read_text()
    assert not health_check(target, timeout_s=1)[0]

    with running(models, port, tmp_path / "second.log") as proc:
        with LogprobClient(target, model="qwen2") as client:
            after = client.score(*as_lists(sequences))
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
