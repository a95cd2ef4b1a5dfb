"""The README's "Drop-in for vLLM / SGLang / TRL callers" lines and the HTTP guide's "Pointing the
trainers at it" blocks, run as written against a server with both edges: the serve command's flags,
slime's ``--rm-url``, prime-rl's teacher ``base_url`` (the URL its ``prefill_logprobs`` derives
from it) and TRL's ``teacher_model_server_url`` (a flag of its scripts, a field of its config);
the port they name is the one the image, Compose, Kubernetes and ``make serve`` open."""

from __future__ import annotations

import asyncio
import re
import shlex
import tomllib
import warnings

import httpx
import pytest
from logprob_service.cli import build_parser
from transformers import HfArgumentParser, training_args
from trl.generation import vllm_client

from tests.helpers.processes import ROOT
from tests.http.test_peers import bitwise, prime_rl_prefill_body, prompt_logprobs_by_grpc, random_sequences

PLACEHOLDER = "teacher-host:8000"


def section(path: str, heading: str) -> str:
    text = (ROOT / path).read_text()
    start = text.index(heading)
    end = text.index("\n## ", start + len(heading))
    return text[start:end]


README = section("README.md", "## Drop-in for vLLM / SGLang / TRL callers")
GUIDE = section("docs/http.md", "## Pointing the trainers at it")


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def words(block: str) -> list[str]:
    """A block's shell words, comments dropped and continued lines joined."""
    lines = [line for line in block.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]
    return shlex.split(" ".join(lines))


def flag(block: str, name: str) -> str:
    said = [w for w in words(block) if not w.startswith("base_url")]
    return said[said.index(name) + 1]


def here(url: str, served) -> str:
    assert PLACEHOLDER in url, url
    return url.replace(f"http://{PLACEHOLDER}", served.base)


def readme_block() -> str:
    (block,) = blocks(README, "bash")
    return block


@pytest.mark.parametrize("text", [README, GUIDE], ids=["README", "guide"])
def test_the_serve_line_turns_the_edge_on_at_the_port_every_deploy_file_opens(text):
    serve = next(line for b in blocks(text, "bash") for line in b.splitlines() if line.startswith("logprob-service"))
    args = build_parser().parse_args(shlex.split(serve)[1:])
    port = int(args.http_port)
    assert args.command == "serve" and port == int(PLACEHOLDER.rsplit(":", 1)[1])
    assert f"LOGPROB_HTTP_PORT={port}" in (ROOT / "Dockerfile").read_text()
    assert f"--http-port {port}" in (ROOT / "Makefile").read_text()
    assert f'"127.0.0.1:{port}:{port}"' in (ROOT / "deploy" / "compose.yaml").read_text()
    assert f"containerPort: {port}" in (ROOT / "deploy" / "k8s" / "statefulset.yaml").read_text()


async def slimes_reward_func(rm_url: str, tokens: list[int]) -> list[float]:
    """slime's ``reward_func`` payload and ``post_process_rewards``' reading of the answer
    (slime/rollout/on_policy_distillation.py)."""
    payload = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    async with httpx.AsyncClient() as session:
        resp = await session.post(rm_url, json=payload)
        resp.raise_for_status()
        reward = resp.json()
    return [item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]]


async def test_slimes_rm_url_answers_its_reward_func(served, rng):
    guide = next(b for b in blocks(GUIDE, "bash") if "--rm-url" in b)
    said = words(guide)
    assert {"--use-opd", "--custom-rm-path", "--custom-reward-post-process-path"} <= set(said)
    assert said[said.index("--opd-type") + 1] == "sglang"
    (tokens,) = random_sequences(rng, 1, low=5)
    (expected,) = await prompt_logprobs_by_grpc(served, [tokens])
    for block in (readme_block(), guide):
        bitwise(await slimes_reward_func(here(flag(block, "--rm-url"), served), tokens), expected)


async def test_prime_rls_teacher_base_url_reaches_its_prefill_route(served, rng):
    """prime-rl's ``prefill_logprobs`` derives its URL from the teacher's ``base_url``
    (src/prime_rl/utils/client.py) and asks the token's own log-prob and the top 1."""
    (config,) = blocks(GUIDE, "toml")
    algo = tomllib.loads(config)["orchestrator"]["algo"]
    assert algo["type"] == "opd"
    (readme_line,) = re.findall(r'^base_url = "(.*)"$', readme_block(), flags=re.M)
    assert readme_line == algo["teacher"]["base_url"]
    base_url = here(algo["teacher"]["base_url"], served)
    base = base_url.rstrip("/").removesuffix("/v1")
    token_ids = random_sequences(rng, 1, low=4)[0]
    body = prime_rl_prefill_body(token_ids)
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{base}/inference/v1/generate", json=body)
        models = await http.get(f"{base_url}/models")
    assert answer.status_code == 200 and len(answer.json()["prompt_logprobs"]) == len(token_ids)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "default"


async def test_trls_teacher_model_server_url_serves_its_vllm_client(served, rng, monkeypatch):
    """The README's flag, as TRL's scripts parse their config's flags, and the guide's Python line:
    each URL serves TRL 1.16's ``VLLMClient`` as its trainers build it."""
    # The config defaults to bf16, which transformers checks the GPU for: this CPU passes as one.
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-API warning
        from trl.experimental.server_distillation import ServerDistillationConfig

        (from_flag,) = HfArgumentParser(ServerDistillationConfig).parse_args_into_dataclasses(
            ["--output_dir", "out", "--teacher_model_server_url", flag(readme_block(), "--teacher_model_server_url")]
        )
        namespace: dict = {}
        exec(blocks(GUIDE, "python")[0], namespace)  # the guide's own lines
    urls = [from_flag.teacher_model_server_url, namespace["args"].teacher_model_server_url]
    assert urls[0] == urls[1]
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=here(urls[0], served), connection_timeout=10.0)
    sequences = random_sequences(rng, 3)
    result = await asyncio.to_thread(
        client.get_sequence_logprobs, sequences, [1, 1, 1], top_logprobs=from_flag.loss_top_k
    )
    expected = await prompt_logprobs_by_grpc(served, sequences)
    for actual, top, want in zip(result["actual_logprobs"], result["logprobs"], expected):
        bitwise([v[0] for v in actual], want)
        assert [len(row) for row in top] == [from_flag.loss_top_k] * len(want)
