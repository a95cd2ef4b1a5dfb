"""The README's "Drop-in for vLLM / SGLang / TRL callers" lines, run as written against a server
with both edges: the serve command's flags, slime's ``--rm-url``, prime-rl's teacher ``base_url``
(the URL its ``prefill_logprobs`` derives from it) and TRL's ``teacher_model_server_url``; the
port they name is the one the image, Compose, Kubernetes and ``make serve`` open."""

from __future__ import annotations

import asyncio
import re
import shlex
import tomllib
import warnings

import httpx
from logprob_service.cli import build_parser
from transformers import training_args
from trl.generation import vllm_client

from tests.helpers.processes import ROOT
from tests.http.test_peers import bitwise, prompt_logprobs_by_grpc, random_sequences

HEADING = "## Drop-in for vLLM / SGLang / TRL callers"
PLACEHOLDER = "teacher-host:8000"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(HEADING)
    end = text.index("\n## ", start + len(HEADING))
    return text[start:end]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(), flags=re.DOTALL)


def flags(block: str) -> list[str]:
    return shlex.split(block.replace("\\\n", " "))


def test_the_serve_line_turns_the_edge_on_at_the_port_every_deploy_file_opens():
    serve = next(b for b in blocks("bash") if b.startswith("logprob-service serve"))
    words = flags(serve)
    args = build_parser().parse_args(words[1:])
    port = int(args.http_port)
    assert args.command == "serve" and port == int(PLACEHOLDER.rsplit(":", 1)[1])
    assert f"LOGPROB_HTTP_PORT={port}" in (ROOT / "Dockerfile").read_text()
    assert f"--http-port {port}" in (ROOT / "Makefile").read_text()
    assert f'"127.0.0.1:{port}:{port}"' in (ROOT / "deploy" / "compose.yaml").read_text()
    assert f"containerPort: {port}" in (ROOT / "deploy" / "k8s" / "statefulset.yaml").read_text()


def here(url: str, served) -> str:
    assert PLACEHOLDER in url, url
    return url.replace(f"http://{PLACEHOLDER}", served.base)


async def test_slimes_rm_url_answers_its_reward_func(served, rng):
    slime = next(b for b in blocks("bash") if "--rm-url" in b)
    words = flags(slime)
    assert {"--use-opd", "--opd-type", "--custom-rm-path", "--custom-reward-post-process-path"} <= set(words)
    assert words[words.index("--opd-type") + 1] == "sglang"
    rm_url = here(words[words.index("--rm-url") + 1], served)
    (tokens,) = random_sequences(rng, 1, low=5)
    payload = {  # slime/rollout/on_policy_distillation.py, reward_func
        "input_ids": tokens,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    async with httpx.AsyncClient() as session:
        resp = await session.post(rm_url, json=payload)
        resp.raise_for_status()
        reward = resp.json()
    (expected,) = await prompt_logprobs_by_grpc(served, [tokens])
    bitwise([item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]], expected)


async def test_prime_rls_teacher_base_url_reaches_its_prefill_route(served, rng):
    """prime-rl's ``prefill_logprobs`` derives its URL from the teacher's ``base_url``."""
    (config,) = blocks("toml")
    teacher = tomllib.loads(config)["orchestrator"]["algo"]["teacher"]
    assert tomllib.loads(config)["orchestrator"]["algo"]["type"] == "opd"
    base_url = here(teacher["base_url"], served)
    base = base_url.rstrip("/").removesuffix("/v1")  # src/prime_rl/utils/client.py
    body = {
        "model": "default",
        "token_ids": random_sequences(rng, 1, low=4)[0],
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1},
    }
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{base}/inference/v1/generate", json=body)
        models = await http.get(f"{base_url}/models")
    assert answer.status_code == 200 and len(answer.json()["prompt_logprobs"]) == len(body["token_ids"])
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "default"


async def test_trls_teacher_model_server_url_serves_its_vllm_client(served, rng, monkeypatch):
    (code,) = blocks("python")
    namespace: dict = {}
    # The config defaults to bf16, which transformers checks the GPU for: this CPU passes as one.
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-API warning
        exec(code, namespace)  # the README's own lines
    url = here(namespace["args"].teacher_model_server_url, served)
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url, connection_timeout=10.0)
    sequences = random_sequences(rng, 3)
    result = await asyncio.to_thread(client.get_sequence_logprobs, sequences, [1, 1, 1], top_logprobs=0)
    expected = await prompt_logprobs_by_grpc(served, sequences)
    for actual, want in zip(result["actual_logprobs"], expected):
        bitwise([v[0] for v in actual], want)
    top = await asyncio.to_thread(client.get_sequence_logprobs, sequences, [1, 1, 1], top_logprobs=1)
    assert [len(row) for row in top["logprobs"][0]] == [1] * (len(sequences[0]) - 1)
