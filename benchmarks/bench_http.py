"""The GRPO-like workload through the HTTP edge against gRPC, in one run: tokens/s and latency.

Workload: ``bench_batching``'s (256 sequences, prompts ~ U[256, 1024], completions ~ U[64, 4096]
tokens, random ids), model Qwen2 at the 0.5B shape, random weights, bf16. One server in this
process serves both edges over one engine (``common.LoopbackServer`` with the HTTP edge started
beside gRPC). Methods, on the same sequences, alternating pass by pass (gRPC, then each HTTP route,
then again), so drift of the machine hits all alike:

* gRPC: ``bench_batching.grpc_pass``: 8 client threads, each its own ``LogprobClient``, pulling
  requests of 8 sequences from a shared queue.
* HTTP, TRL's ``/get_sequence_logprobs/`` (``response_format: binary``, ``top_logprobs: 0``): the
  same 8 threads and requests, each thread its own ``httpx.Client``; a request's
  ``prompt_lengths`` make the same split as gRPC's prompt / completion.
* HTTP, SGLang's ``/generate`` (a batch of 8 ``input_ids``, ``logprob_start_len`` each prompt's
  length): JSON numbers, the heavier answer.
* HTTP, vLLM's ``/v1/completions`` as TRL 1.16 calls it (``--routes`` adds ``completions``; not
  run by default): every position from the second scored, an object per token in the answer.

The clients run in this process, so their decoding of JSON answers shares the interpreter with the
server (a trainer's runs in its own).

Reported per method: tokens/s (real prompt + completion tokens of a pass over its median time), the
ratio to gRPC's, p50/p99 ms of one request as its client sees it (8 in flight), and whether the
first request's log-probs equal gRPC's bit for bit.

``--asgi`` instead measures the ASGI stacks' own overhead: a JSON echo route of 1,000 token ids
called in-process (no sockets), Starlette (what the edge runs) against FastAPI with a pydantic
request model, microseconds per call.

``--encode`` measures the writing of the JSON answers alone: SGLang's ``/generate`` answer and
vLLM's ``prompt_logprobs`` for 8 inputs of ~2,700 tokens, without and with top-20, microseconds per
token (the edge writes them on the event loop's thread, holding the GIL the device thread needs).

On a GPU:

    PYTHONPATH=service:client python3 benchmarks/bench_http.py

Smoke test on a CPU (tiny Qwen2, float32, 16 short sequences, 2 clients):

    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --smoke
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --asgi
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --encode

The table is printed last, and also written to ``$OUT/bench_http.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import queue
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import torch
from bench_batching import (
    MODEL_NAME,
    PassResult,
    Workload,
    fill_workload_defaults,
    grpc_pass,
    make_workload,
    open_clients,
    percentile,
    resolve_device,
    server_settings,
)
from common import SHAPES, TINY, LoopbackServer, add_scoring_arguments, build_model, scoring_options
from harness import publish, run_environment, synchronize
from logprob_service.domain import TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.served import serve_model
from logprob_service.offline import OfflineScorer
from pydantic import BaseModel


class BothEdges(LoopbackServer):
    """The loopback server with the HTTP edge started beside gRPC (``http_port`` once entered)."""

    http_port = 0

    async def _start(self) -> int:
        port = await super()._start()
        assert self._service is not None
        self.http_port = await self._service.start_http(self._settings.host, 0)
        return port


# ----------------------------------------------------------------------------- HTTP passes


def trl_request(group: list[TokenSequence]) -> tuple[str, dict[str, Any]]:
    body = {
        "sequences": [np.concatenate([s.prompt_ids, s.completion_ids]).tolist() for s in group],
        "prompt_lengths": [len(s.prompt_ids) for s in group],
        "top_logprobs": 0,
        "temperature": 1.0,
        "response_format": "binary",
    }
    return "/get_sequence_logprobs/", body


def trl_answer(answer: dict[str, Any], group: list[TokenSequence]) -> list[np.ndarray]:
    """TRL 1.9's decoding of the binary answer: the token's own log-probs, trimmed to each completion."""
    shape = answer["shape"]
    actual = np.frombuffer(base64.b64decode(answer["actual_logprobs_b64"]), dtype=np.float32)
    actual = actual.reshape(shape[0], shape[1], 1)
    return [actual[i, :length, 0] for i, length in enumerate(answer["completion_lengths"])]


def sglang_request(group: list[TokenSequence]) -> tuple[str, dict[str, Any]]:
    body = {
        "input_ids": [np.concatenate([s.prompt_ids, s.completion_ids]).tolist() for s in group],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        # SGLang scores the tokens after position logprob_start_len (its entry there is null): the
        # prompt's last position, so the entries after it are the completion's.
        "logprob_start_len": [len(s.prompt_ids) - 1 for s in group],
    }
    return "/generate", body


def sglang_answer(answer: list[dict[str, Any]], group: list[TokenSequence]) -> list[np.ndarray]:
    """The completion's log-probs: every entry of ``input_token_logprobs`` after the null first one."""
    return [
        np.array([item[0] for item in a["meta_info"]["input_token_logprobs"][1:]], dtype=np.float32) for a in answer
    ]


def completions_request(group: list[TokenSequence]) -> tuple[str, dict[str, Any]]:
    """TRL 1.16's ``get_sequence_logprobs`` body: whole sequences as token-id prompts."""
    body = {
        "model": MODEL_NAME,
        "prompt": [np.concatenate([s.prompt_ids, s.completion_ids]).tolist() for s in group],
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
    }
    return "/v1/completions", body


def completions_answer(answer: dict[str, Any], group: list[TokenSequence]) -> list[np.ndarray]:
    """The completion positions of each choice's ``prompt_logprobs``, as TRL 1.16 slices them."""
    return [
        np.array(
            [next(iter(e.values()))["logprob"] for e in choice["prompt_logprobs"][len(s.prompt_ids) :]],
            dtype=np.float32,
        )
        for choice, s in zip(answer["choices"], group)
    ]


# Route: (request, answer decoding, whether it splits each sequence where gRPC does). /v1/completions
# scores every position from the second (vLLM's prompt log-probs): the same tokens run, more
# log-prob rows, and a different split, so its log-probs need not equal gRPC's bit for bit.
ROUTES: dict[str, tuple[Callable, Callable, bool]] = {
    "trl": (trl_request, trl_answer, True),
    "sglang": (sglang_request, sglang_answer, True),
    "completions": (completions_request, completions_answer, False),
}


def http_pass(sessions: list[httpx.Client], workload: Workload, route: str) -> PassResult:
    """As ``grpc_pass``: every client thread pulls requests of ``group_size`` sequences from one queue."""
    request, decode, _ = ROUTES[route]
    work: queue.SimpleQueue[tuple[int, list[TokenSequence]]] = queue.SimpleQueue()
    for item in enumerate(workload.groups):
        work.put(item)
    latencies: list[float] = []
    results: dict[int, list[np.ndarray]] = {}

    def drain(session: httpx.Client) -> None:
        while True:
            try:
                index, group = work.get_nowait()
            except queue.Empty:
                return
            path, body = request(group)
            start = time.perf_counter()
            response = session.post(path, json=body)
            response.raise_for_status()
            results[index] = decode(response.json(), group)
            latencies.append((time.perf_counter() - start) * 1e3)

    with ThreadPoolExecutor(len(sessions), thread_name_prefix="bench-http") as pool:
        for future in [pool.submit(drain, session) for session in sessions]:
            future.result()
    return PassResult(latencies, [lp.astype(np.float64) for lp in results[0]], results)


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> str:
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = TINY if args.smoke else SHAPES[args.shape]
    workload = make_workload(
        args.sequences, args.prompt_range, args.completion_range, shape.vocab, args.group_size, args.seed + 1
    )
    model = build_model(shape, device, dtype, args.seed)
    methods = ["gRPC", *(f"HTTP {route}" for route in args.routes)]
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    latencies: dict[str, list[float]] = {m: [] for m in methods}
    first: dict[str, list[np.ndarray]] = {}
    with OfflineScorer(
        model, options=scoring_options(args, deterministic=True), max_batch_tokens=args.max_batch_tokens
    ) as scorer:
        registry = ModelRegistry()
        registry.add(serve_model(MODEL_NAME, "random", scorer.scorer))
        server = BothEdges(server_settings(args, device), registry)
        with server as target:
            clients = open_clients(target, args.clients)
            sessions = [
                httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=600.0)
                for _ in range(args.clients)
            ]
            passes: dict[str, Callable[[], PassResult]] = {"gRPC": lambda: grpc_pass(clients, workload)}
            for route in args.routes:
                passes[f"HTTP {route}"] = lambda route=route: http_pass(sessions, workload, route)
            try:
                for method in methods:  # warm-up: compiled layers, allocator, connections
                    passes[method]()
                for i in range(args.repeats):
                    for method in methods:
                        synchronize(device)
                        start = time.perf_counter()
                        result = passes[method]()
                        synchronize(device)
                        seconds[method].append(time.perf_counter() - start)
                        latencies[method] += result.latencies_ms
                        first[method] = result.first
                        print(f"pass {i + 1}/{args.repeats} {method}: {seconds[method][-1]:.2f} s", file=sys.stderr)
            finally:
                for client in clients:
                    client.close()
                for session in sessions:
                    session.close()
    return report(args, device, shape.name, workload, methods, seconds, latencies, first)


def report(args, device, shape, workload, methods, seconds, latencies, first) -> str:
    tokens = workload.real_tokens
    grpc_rate = tokens / statistics.median(seconds["gRPC"])
    lines = [
        "# bench_http: the GRPO-like workload through HTTP and gRPC, one server, one run",
        "",
        *run_environment(device),
        f"model: Qwen2 {shape} shape, random weights, {args.dtype}; deterministic on; "
        f"max_batch_tokens {args.max_batch_tokens}",
        f"workload: {len(workload.sequences)} sequences, prompts {args.prompt_range}, completions "
        f"{args.completion_range}, {tokens} tokens a pass; {args.clients} clients, requests of {args.group_size}; "
        f"{args.repeats} timed passes per method, methods alternating",
        "",
        "| method | tokens/s (median pass) | vs gRPC | p50 ms | p99 ms | first request bitwise = gRPC |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for method in methods:
        rate = tokens / statistics.median(seconds[method])
        same = all(np.array_equal(a, b) for a, b in zip(first[method], first["gRPC"], strict=True))
        comparable = method == "gRPC" or ROUTES[method.removeprefix("HTTP ")][2]
        verdict = ("yes" if same else "NO") if comparable else f"n/a (another split; {'equal' if same else 'differs'})"
        lines.append(
            f"| {method} | {rate:,.0f} | {rate / grpc_rate:.3f} | {percentile(latencies[method], 50):.1f} | "
            f"{percentile(latencies[method], 99):.1f} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- --asgi


class EchoBody(BaseModel):
    """FastAPI's request model of the echo route (at module level: FastAPI resolves annotations here)."""

    ids: list[int]


def asgi_overhead(calls: int) -> str:
    """Microseconds per in-process call of a JSON echo route of 1,000 ids on each stack."""
    import pydantic_core
    from fastapi import FastAPI
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def echo(request: Request) -> Response:
        ids = pydantic_core.from_json(await request.body())["ids"]
        return Response(pydantic_core.to_json({"ids": ids}), media_type="application/json")

    fastapi = FastAPI()

    @fastapi.post("/echo")
    async def fastapi_echo(body: EchoBody) -> dict:
        return {"ids": body.ids}

    stacks = {"Starlette (the edge's)": Starlette(routes=[Route("/echo", echo, methods=["POST"])]), "FastAPI": fastapi}
    payload = pydantic_core.to_json({"ids": list(range(1000))})

    async def call(app) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "path": "/echo",
            "raw_path": b"/echo",
            "root_path": "",
            "scheme": "http",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}

        status = []

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(scope, receive, send)
        assert status == [200], status

    async def measure() -> list[str]:
        rows = []
        for name, app in stacks.items():
            for _ in range(200):
                await call(app)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    await call(app)
                best = min(best, (time.perf_counter() - start) / calls)
            rows.append(f"| {name} | {best * 1e6:.0f} |")
        return rows

    rows = asyncio.run(measure())
    return (
        "\n".join(
            [
                "# bench_http --asgi: a JSON echo route of 1,000 ids, called in-process (no sockets)",
                "",
                *run_environment(torch.device("cpu")),
                f"best of 5 runs of {calls} calls each",
                "",
                "| stack | us per call |",
                "|---|---:|",
                *rows,
            ]
        )
        + "\n"
    )


# ----------------------------------------------------------------------------- --encode


def encode_cost(sequences: int, tokens: int, k: int, runs: int = 5) -> str:
    """Microseconds per token of writing the answers' JSON alone (no scoring, no HTTP): SGLang's
    ``/generate`` (``logprob_start_len`` 0: a triple per token) and vLLM's ``prompt_logprobs`` of
    ``sequences`` inputs of about ``tokens`` ids each, float32 log-probs from a seeded RNG, without
    and with top-``k``. Best of ``runs`` runs, in the process's CPU time (what the event loop's
    thread spends; on a shared machine wall time counts the other processes' turns too)."""
    from logprob_service.domain import SequenceScores
    from logprob_service.http import sglang, vllm
    from logprob_service.http.scoring import Item

    rng = np.random.default_rng(0)
    vocab = 151_936  # Qwen2's
    inputs = []
    for _ in range(sequences):
        ids = rng.integers(0, vocab, int(rng.integers(tokens * 9 // 10, tokens * 11 // 10 + 1)))
        rows = len(ids) - 1
        top_ids = rng.integers(0, vocab, (rows, k)).astype(np.int32)
        # the token itself among the top-k at half the positions, as a trained model's often are
        hits = np.flatnonzero(rng.random(rows) < 0.5)
        top_ids[hits, rng.integers(0, k, len(hits))] = ids[1:][hits]
        scores = SequenceScores(
            logprobs=-rng.exponential(2.0, rows).astype(np.float32),
            top_ids=top_ids,
            top_logprobs=-np.sort(rng.exponential(2.0, (rows, k)), axis=1).astype(np.float32),
        )
        inputs.append((Item(ids, 1, "input_ids"), scores))
    total = sum(len(item.ids) for item, _ in inputs)
    writers = {
        "SGLang /generate": lambda item, scores, top: sglang.input_answer(item, 0, "rid", scores, top, 0.25),
        "vLLM prompt_logprobs": lambda item, scores, top: vllm.prompt_logprobs(item, scores, top),
    }
    rows = []
    for name, write in writers.items():
        for top in (0, k):
            best, size = float("inf"), 0
            for _ in range(runs):
                begun = time.process_time()
                size = sum(len(write(item, scores, top)) for item, scores in inputs)
                best = min(best, time.process_time() - begun)
            rows.append(f"| {name} | {top} | {best / total * 1e6:.3f} | {size / total:.0f} |")
    return (
        "\n".join(
            [
                f"# bench_http --encode: the JSON of {sequences} answers, {total:,} tokens, no scoring",
                "",
                *run_environment(torch.device("cpu")),
                f"best of {runs} runs, CPU time",
                "",
                "| answer | top-k | us per token | bytes per token |",
                "|---|---:|---:|---:|",
                *rows,
            ]
        )
        + "\n"
    )


def int_pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny model, 16 short sequences, cpu, float32: checks the script runs")
    add("--asgi", action="store_true", help="only the ASGI stacks' overhead (CPU)")
    add("--asgi-calls", type=int, default=2000, help="calls per timed run of --asgi")
    add("--encode", action="store_true", help="only the cost of writing the JSON answers (CPU)")
    add("--shape", default="0.5b", choices=sorted(SHAPES), help="the model shape (ignored with --smoke)")
    add("--routes", default="trl,sglang", help=f"HTTP routes to run, of: {', '.join(ROUTES)}")
    add("--device", default=None, help="torch device (default: cuda, or cpu with --smoke)")
    add("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: bf16 on cuda, else fp32")
    add("--sequences", type=int, default=None, help="sequences in the workload (default 256; 16 with --smoke)")
    add("--prompt-range", type=int_pair, default=None, help="LOW,HIGH prompt tokens (default 256,1024; 4,16 smoke)")
    add("--completion-range", type=int_pair, default=None, help="LOW,HIGH completion tokens (default 64,4096; 2,24)")
    add("--group-size", type=int, default=8, help="sequences per request")
    add("--clients", type=int, default=None, help="concurrent clients per method (default 8; 2 with --smoke)")
    add("--max-batch-tokens", type=int, default=None, help="the service's budget of real tokens per micro-batch")
    add("--max-batch-sequences", type=int, default=256, help="the service's sequences per micro-batch")
    add("--repeats", type=int, default=None, help="timed passes per method (default 5; 2 with --smoke)")
    add_scoring_arguments(parser)
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fill_workload_defaults(args, args.smoke, repeats=2 if args.smoke else 5)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    args.routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if unknown := set(args.routes) - set(ROUTES):
        parser.error(f"--routes: unknown {sorted(unknown)}; of: {', '.join(ROUTES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.asgi:
        publish(asgi_overhead(args.asgi_calls), "bench_http_asgi.md")
    elif args.encode:
        publish(encode_cost(8, 2700, 20), "bench_http_encode.md")
    else:
        publish(run(args), "bench_http.md")


if __name__ == "__main__":
    main()
