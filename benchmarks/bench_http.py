"""The GRPO-like workload through the HTTP edge against gRPC, in one run: tokens/s and latency.

Workload: ``bench_batching``'s (256 sequences, prompts ~ U[256, 1024], completions ~ U[64, 4096]
tokens, random ids), model Qwen2 at the 0.5B shape, random weights, bf16. One server in this
process serves both edges over one engine (``common.LoopbackServer`` with the HTTP edge started
beside gRPC). Methods, on the same sequences, alternating pass by pass (gRPC, then each HTTP route,
then again), so drift of the machine hits all alike; each client pulls requests of 8 sequences
from one shared queue, 8 clients:

* gRPC: each client its own ``LogprobClient``, prompt and completion as the workload splits them.
* gRPC whole: the same, each sequence split after its first token: every position from the second
  scored, as vLLM's prompt log-probs do (what ``completions`` and ``generate`` are compared with).
* HTTP ``trl``: TRL <= 1.9's ``/get_sequence_logprobs/`` (``response_format: binary``), a request's
  ``prompt_lengths`` making gRPC's split; ``trl-json``: the same with ``response_format: json``.
* HTTP ``sglang``: SGLang's ``/generate`` (a batch of 8 ``input_ids``, ``logprob_start_len`` each
  prompt's last position).
* HTTP ``completions``: vLLM's ``/v1/completions`` with ``prompt_logprobs``, as TRL 1.16 calls it.
* HTTP ``generate``: vLLM's ``/inference/v1/generate`` with ``prompt_logprobs`` (prime-rl's), one
  sequence a request, a client's 8 sent at once.

``--top-k K`` asks every method for the top K too: gRPC's ``top_k``, TRL's ``top_logprobs``,
SGLang's ``top_logprobs_num``, vLLM's ``prompt_logprobs``.

Each client is a process of its own (a trainer's clients are), so that reading the answers does
not share the server's interpreter; ``--in-process-clients`` makes them threads of the server's
process instead. The untimed first pass of each method (the warm-up) is the check: every answer
read as its caller reads it (JSON by pydantic-core), its values kept. The timed passes read each
HTTP answer's bytes without parsing them: a caller's parsing is its own process's time, and at
top-k 20 a vLLM answer (1,700 bytes of JSON a token, an object per entry) took the clients longer
to parse than the server to write.

Reported per method: tokens/s (real prompt + completion tokens of a pass over its median time), the
ratio to the gRPC method scoring the same positions, p50/p99 ms of one request as its client sees
it, and whether every request's values of the check pass (log-probs, and with top-k the ids and
their log-probs, as the route's caller reads them) equal that gRPC method's bit for bit.

``--asgi`` instead measures the ASGI stacks' own overhead: a JSON echo route of 1,000 token ids
called in-process (no sockets), Starlette (what the edge runs) against FastAPI with a pydantic
request model, microseconds per call.

``--route-cost`` measures each route's whole call in-process on the CPU, over an engine that answers
at once: microseconds per token of request parsing, checks, job, answer and response (what the event
loop spends of the GIL the device thread needs), gRPC's edge beside them, at top-k 0 and 20.

``--encode`` measures the writing of the JSON answers alone: SGLang's ``/generate`` answer and
vLLM's ``prompt_logprobs`` for 8 inputs of ~2,700 tokens, without and with top-20, microseconds per
token (the edge writes them on the event loop's thread, holding the GIL the device thread needs).

On a GPU:

    PYTHONPATH=service:client python3 benchmarks/bench_http.py --repeats 3 --top-k 0
    PYTHONPATH=service:client python3 benchmarks/bench_http.py --repeats 3 --top-k 20

Smoke test on a CPU (tiny Qwen2, float32, 16 short sequences, 2 clients):

    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --smoke
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --asgi
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --encode
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_http.py --route-cost

The table is printed last, and also written to ``$OUT/bench_http.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import gc
import hashlib
import multiprocessing
import queue
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pydantic_core
import torch
from bench_batching import (
    MODEL_NAME,
    Workload,
    fill_workload_defaults,
    make_workload,
    percentile,
    resolve_device,
    server_settings,
)
from common import SHAPES, TINY, LoopbackServer, add_scoring_arguments, build_model, scoring_options
from harness import publish, run_environment, synchronize
from logprob_client import LogprobClient
from logprob_client import wire as client_wire
from logprob_service import host_malloc
from logprob_service.domain import ModelInfo, ScoreJob, ScoreResult, SequenceScores, TokenSequence
from logprob_service.engine import Phase, RequestCounts, RequestLimits, check_counts
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


# ----------------------------------------------------------------------------- the methods

# A sequence's scores as a caller reads them from an answer: the log-probs of the positions gRPC
# returns for the same split, float64 (a JSON number read as Python reads it; gRPC's float32
# widened), and with top-k its [C, k] ids (int64) and log-probs (float64); None without.
Scores = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]


def _whole(sequence: TokenSequence) -> np.ndarray:
    return np.concatenate([sequence.prompt_ids, sequence.completion_ids])


def _scores(logprobs: Any, top_ids: Any = None, top_logprobs: Any = None) -> Scores:
    if top_ids is None:
        return np.asarray(logprobs, dtype=np.float64), None, None
    k = np.shape(top_ids)[-1] if len(top_ids) else 0
    return (
        np.asarray(logprobs, dtype=np.float64),
        np.asarray(top_ids, dtype=np.int64).reshape(-1, k),
        np.asarray(top_logprobs, dtype=np.float64).reshape(-1, k),
    )


def _body(path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    return path, pydantic_core.to_json(body)


def trl_request(group: list[TokenSequence], k: int, response_format: str = "binary") -> list[tuple[str, bytes]]:
    body = {
        "sequences": [_whole(s).tolist() for s in group],
        "prompt_lengths": [len(s.prompt_ids) for s in group],
        "top_logprobs": k,
        "temperature": 1.0,
        "response_format": response_format,
    }
    return [_body("/get_sequence_logprobs/", body)]


def trl_answer(answers: list[Any], group: list[TokenSequence], k: int) -> list[Scores]:
    """TRL 1.9's decoding of the binary answer: the token's own log-probs and the top k, trimmed
    to each completion."""
    (answer,) = answers
    rows, longest, _ = answer["shape"]

    def array(key: str, dtype: str, width: int) -> np.ndarray:
        return np.frombuffer(base64.b64decode(answer[key]), dtype=dtype).reshape(rows, longest, width)

    actual = array("actual_logprobs_b64", "<f4", 1)
    top_ids, top = array("token_ids_b64", "<i4", k), array("logprobs_b64", "<f4", k)
    lengths = answer["completion_lengths"]
    return [_scores(actual[i, :n, 0], *((top_ids[i, :n], top[i, :n]) if k else ())) for i, n in enumerate(lengths)]


def trl_json_answer(answers: list[Any], group: list[TokenSequence], k: int) -> list[Scores]:
    """TRL 1.9's JSON answer: per position the entries by rank, the top k, then the token's own
    where it is not among them."""
    (answer,) = answers
    decoded = []
    for lps, ids, sequence in zip(answer["logprobs"], answer["logprob_token_ids"], group):
        own = sequence.completion_ids.tolist()
        values = [row_lps[row_ids.index(t)] for row_lps, row_ids, t in zip(lps, ids, own)]
        decoded.append(_scores(values, *(([r[:k] for r in ids], [r[:k] for r in lps]) if k else ())))
    return decoded


def sglang_request(group: list[TokenSequence], k: int) -> list[tuple[str, bytes]]:
    body = {
        "input_ids": [_whole(s).tolist() for s in group],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        # SGLang scores the tokens after position logprob_start_len (its entry there is null): the
        # prompt's last position, so the entries after it are the completion's.
        "logprob_start_len": [len(s.prompt_ids) - 1 for s in group],
        "top_logprobs_num": k,
    }
    return [_body("/generate", body)]


def sglang_answer(answers: list[Any], group: list[TokenSequence], k: int) -> list[Scores]:
    """Every entry of ``input_token_logprobs`` (and row of ``input_top_logprobs``) after the null
    first one."""
    decoded = []
    for answer in answers[0]:
        meta = answer["meta_info"]
        values = [entry[0] for entry in meta["input_token_logprobs"][1:]]
        if not k:
            decoded.append(_scores(values))
            continue
        rows = meta["input_top_logprobs"][1:]
        decoded.append(_scores(values, [[e[1] for e in r] for r in rows], [[e[0] for e in r] for r in rows]))
    return decoded


def completions_request(group: list[TokenSequence], k: int) -> list[tuple[str, bytes]]:
    """TRL 1.16's ``get_sequence_logprobs`` body: whole sequences as token-id prompts."""
    body = {
        "model": MODEL_NAME,
        "prompt": [_whole(s).tolist() for s in group],
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": k,
    }
    return [_body("/v1/completions", body)]


def prompt_logprobs_scores(positions: list[Any], k: int) -> Scores:
    """vLLM's ``prompt_logprobs`` from the second position on: each position's first entry is the
    token's own; the top k are the entries of rank 1..k (the token's own among them when it is)."""
    values, top_ids, top_lps = [], [], []
    for entries in positions[1:]:
        values.append(next(iter(entries.values()))["logprob"])
        if k:
            ranked = sorted((e["rank"], int(t), e["logprob"]) for t, e in entries.items() if e["rank"] <= k)
            top_ids.append([t for _, t, _ in ranked])
            top_lps.append([lp for _, _, lp in ranked])
    return _scores(values, *((top_ids, top_lps) if k else ()))


def completions_answer(answers: list[Any], group: list[TokenSequence], k: int) -> list[Scores]:
    return [prompt_logprobs_scores(choice["prompt_logprobs"], k) for choice in answers[0]["choices"]]


def generate_request(group: list[TokenSequence], k: int) -> list[tuple[str, bytes]]:
    """vLLM's ``/inference/v1/generate`` (prime-rl's ``prefill_logprobs``): one sequence a request."""
    params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}
    bodies = [{"model": MODEL_NAME, "token_ids": _whole(s).tolist(), "sampling_params": params} for s in group]
    return [_body("/inference/v1/generate", body) for body in bodies]


def generate_answer(answers: list[Any], group: list[TokenSequence], k: int) -> list[Scores]:
    return [prompt_logprobs_scores(answer["prompt_logprobs"], k) for answer in answers]


@dataclass(frozen=True)
class Route:
    """An HTTP route as the benchmark calls it: the requests of a group (several are sent at once),
    their answers read as a caller does, and whether it scores every position from the second
    (vLLM's prompt log-probs), so that the gRPC method it is compared with splits each sequence
    after its first token, not between prompt and completion."""

    request: Callable[[list[TokenSequence], int], list[tuple[str, bytes]]]
    decode: Callable[[list[Any], list[TokenSequence], int], list[Scores]]
    whole: bool = False


ROUTES: dict[str, Route] = {
    "trl": Route(trl_request, trl_answer),
    "trl-json": Route(functools.partial(trl_request, response_format="json"), trl_json_answer),
    "sglang": Route(sglang_request, sglang_answer),
    "completions": Route(completions_request, completions_answer, whole=True),
    "generate": Route(generate_request, generate_answer, whole=True),
}
GRPC, GRPC_WHOLE = "gRPC", "gRPC whole"


def baseline(method: str) -> str:
    """The gRPC method an HTTP method is compared with: the one scoring the same positions."""
    return GRPC_WHOLE if ROUTES[method.removeprefix("HTTP ")].whole else GRPC


def digest(scores: list[Scores]) -> str:
    """One request's values, every bit of them."""
    hashed = hashlib.sha256()
    for values in scores:
        for array in values:
            if array is not None:
                hashed.update(np.ascontiguousarray(array).tobytes())
    return hashed.hexdigest()


class Caller:
    """One client, of every method: a ``LogprobClient`` and an ``httpx.Client`` (its connections
    kept between requests), taking the workload's groups from a shared queue until a None."""

    def __init__(self, target: str, http_base: str, workload: Workload, k: int) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]  # its own connection, as a trainer's
        self.grpc = LogprobClient(target, model=MODEL_NAME, timeout=600.0, options=options)
        self.http = httpx.Client(base_url=http_base, timeout=600.0, limits=httpx.Limits(max_connections=64))
        self.groups = workload.groups
        self.k = k
        self.results: dict[int, list[Scores]] = {}
        self._sends = ThreadPoolExecutor(workload.group_size, thread_name_prefix="bench-send")

    def drain(self, method: str, work: Any, check: int) -> list[float]:
        """Score groups from ``work`` by ``method`` until a None; each request's milliseconds.
        ``check``: read the answers of every ``check``-th group (0: none) as its caller does, their
        values kept for ``digests``; the others' HTTP answers' bytes are read and not parsed (a
        caller's parsing is its own process's time, not the server's: at top-k 20 a vLLM answer is
        1,700 bytes of JSON a token)."""
        self.results = {}
        latencies = []
        while (index := work.get()) is not None:
            group = self.groups[index]
            begun = time.perf_counter()
            checked = bool(check) and index % check == 0
            scores = self._one(method, group, checked)
            latencies.append((time.perf_counter() - begun) * 1e3)
            if checked:
                self.results[index] = scores
        return latencies

    def _one(self, method: str, group: list[TokenSequence], check: bool) -> list[Scores]:
        if method in (GRPC, GRPC_WHOLE):
            if method == GRPC_WHOLE:
                prompts, completions = [_whole(s)[:1] for s in group], [_whole(s)[1:] for s in group]
            else:
                prompts, completions = [s.prompt_ids for s in group], [s.completion_ids for s in group]
            answer = self.grpc.score(prompts, completions, top_k=self.k)
            if not self.k:
                return [_scores(lp) for lp in answer]
            return [_scores(*values) for values in zip(answer.logprobs, answer.top_ids, answer.top_logprobs)]
        route = ROUTES[method.removeprefix("HTTP ")]
        requests = route.request(group, self.k)
        answers = list(self._sends.map(self._post, requests)) if len(requests) > 1 else [self._post(requests[0])]
        if not check:
            return []
        # Python's cyclic collector off while the answers become Python objects (millions of
        # lists and dicts at top-k 20, none in a cycle): with it on, their parsing took 3-9x longer.
        gc.disable()
        try:
            parsed = [pydantic_core.from_json(answer, allow_inf_nan=True) for answer in answers]
            return route.decode(parsed, group, self.k)
        finally:
            gc.enable()

    def _post(self, request: tuple[str, bytes]) -> bytes:
        path, body = request
        response = self.http.post(path, content=body, headers={"content-type": "application/json"})
        response.raise_for_status()
        return response.content

    def digests(self) -> dict[int, str]:
        return {index: digest(scores) for index, scores in self.results.items()}

    def close(self) -> None:
        self.grpc.close()
        self.http.close()
        self._sends.shutdown()


def _caller_process(connection: Any, work: Any, target: str, http_base: str, workload: Workload, k: int) -> None:
    """A client in its own process (``--client-processes``): runs the parent's commands."""
    caller = Caller(target, http_base, workload, k)
    try:
        while (command := connection.recv()) is not None:
            if command == "digests":
                connection.send(caller.digests())
            else:
                method, check = command
                connection.send(caller.drain(method, work, check))
    finally:
        caller.close()


class Callers:
    """The benchmark's clients: threads of this process (a trainer's clients would share the
    server's interpreter), or each a process of its own (as a trainer's are): a pass is every
    client draining one queue of the workload's groups."""

    def __init__(self, count: int, processes: bool, target: str, http_base: str, workload: Workload, k: int) -> None:
        self.count, self.groups = count, len(workload.groups)
        if processes:
            context = multiprocessing.get_context("spawn")
            self.work: Any = context.Queue()
            self.pipes = []
            self.processes = []
            for _ in range(count):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_caller_process, args=(theirs, self.work, target, http_base, workload, k), daemon=True
                )
                process.start()
                self.pipes.append(ours)
                self.processes.append(process)
        else:
            self.work = queue.SimpleQueue()
            self.callers = [Caller(target, http_base, workload, k) for _ in range(count)]
            self.pool = ThreadPoolExecutor(count, thread_name_prefix="bench-client")
        self.in_processes = processes

    def run_pass(self, method: str, check: int = 0) -> list[float]:
        """One pass of ``method`` over the workload (``check``: ``Caller.drain``'s); every
        request's milliseconds."""
        for item in [*range(self.groups), *[None] * self.count]:
            self.work.put(item)
        if self.in_processes:
            for pipe in self.pipes:
                pipe.send((method, check))
            return [ms for pipe in self.pipes for ms in pipe.recv()]
        futures = [self.pool.submit(caller.drain, method, self.work, check) for caller in self.callers]
        return [ms for future in futures for ms in future.result()]

    def digests(self) -> dict[int, str]:
        """Every request's values of the last pass that checked them, by group."""
        if not self.in_processes:
            return {i: d for caller in self.callers for i, d in caller.digests().items()}
        for pipe in self.pipes:
            pipe.send("digests")
        return {i: d for pipe in self.pipes for i, d in pipe.recv().items()}

    def close(self) -> None:
        if self.in_processes:
            for pipe in self.pipes:
                pipe.send(None)
            deadline = time.monotonic() + 10
            for process in self.processes:  # a client that does not end in time is stopped
                process.join(timeout=max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    process.terminate()
        else:
            for caller in self.callers:
                caller.close()
            self.pool.shutdown()


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> str:
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = TINY if args.smoke else SHAPES[args.shape]
    workload = make_workload(
        args.sequences, args.prompt_range, args.completion_range, shape.vocab, args.group_size, args.seed + 1
    )
    model = build_model(shape, device, dtype, args.seed)
    whole = any(ROUTES[route].whole for route in args.routes)
    methods = [GRPC, *([GRPC_WHOLE] if whole else []), *(f"HTTP {route}" for route in args.routes)]
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    latencies: dict[str, list[float]] = {m: [] for m in methods}
    digests: dict[str, dict[int, str]] = {}
    with OfflineScorer(
        model, options=scoring_options(args, deterministic=True), max_batch_tokens=args.max_batch_tokens
    ) as scorer:
        registry = ModelRegistry()
        registry.add(serve_model(MODEL_NAME, "random", scorer.scorer))
        server = BothEdges(server_settings(args, device), registry)
        with server as target:
            http_base = f"http://127.0.0.1:{server.http_port}"
            callers = Callers(args.clients, args.client_processes, target, http_base, workload, args.top_k)
            try:
                # warm-up (compiled layers, allocator, connections), and the check: every answer
                # read as its caller reads it, its values kept; the timed passes read the bytes
                for method in methods:
                    callers.run_pass(method, check=args.check_every)
                    digests[method] = callers.digests()
                for i in range(args.repeats):
                    for method in methods:
                        synchronize(device)
                        start = time.perf_counter()
                        latencies[method] += callers.run_pass(method)
                        synchronize(device)
                        seconds[method].append(time.perf_counter() - start)
                        print(f"pass {i + 1}/{args.repeats} {method}: {seconds[method][-1]:.2f} s", file=sys.stderr)
            finally:
                callers.close()
    return report(args, device, shape.name, workload, methods, seconds, latencies, digests)


def report(args, device, shape, workload, methods, seconds, latencies, digests) -> str:
    tokens = workload.real_tokens
    rates = {method: tokens / statistics.median(seconds[method]) for method in methods}
    clients = "each in a process of its own" if args.client_processes else "threads of the server's process"
    lines = [
        "# bench_http: the GRPO-like workload through HTTP and gRPC, one server, one run",
        "",
        *run_environment(device),
        f"model: Qwen2 {shape} shape, random weights, {args.dtype}; deterministic on; "
        f"max_batch_tokens {args.max_batch_tokens}",
        f"workload: {len(workload.sequences)} sequences, prompts {args.prompt_range}, completions "
        f"{args.completion_range}, {tokens} tokens a pass; {args.clients} clients ({clients}), requests of "
        f"{args.group_size}; top-k {args.top_k}; {args.repeats} timed passes per method, methods alternating; "
        f"values of {'every group' if args.check_every == 1 else f'every {args.check_every}th group'} checked on an "
        "untimed pass, the timed passes reading HTTP answers unparsed",
        f"{GRPC_WHOLE}: gRPC scoring every position from the second (each sequence split after its first token), "
        "as vLLM's prompt log-probs do: what the vLLM routes are compared with",
        "",
        "| method | tokens/s (median pass) | vs gRPC | p50 ms | p99 ms | every checked value bitwise = gRPC |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for method in methods:
        base = method if method in (GRPC, GRPC_WHOLE) else baseline(method)
        differ = sum(digests[method].get(i) != d for i, d in digests[base].items())
        compared = len(digests[base])
        verdict = "(itself)" if base == method else "yes" if not differ else f"NO ({differ} of {compared} requests)"
        versus = f"{rates[method] / rates[base]:.3f}" + ("" if base == GRPC else f" ({base})")
        lines.append(
            f"| {method} | {rates[method]:,.0f} | {versus} | {percentile(latencies[method], 50):.1f} | "
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


# ----------------------------------------------------------------------------- --route-cost


class InstantEngine:
    """The engine facade as the HTTP edge calls it, answering at once with seeded scores of the
    shapes asked (views of one pool: no work a token), so that a route's call costs only the edge:
    parsing, checks, the job, the answer's writing and its response."""

    phase = Phase.SERVING

    def __init__(self, vocab: int, k: int, pool: int = 1 << 16) -> None:
        rng = np.random.default_rng(0)
        self.limits = RequestLimits(max_sequences_per_request=256, max_tokens_per_request=1 << 22)
        self.info = ModelInfo(MODEL_NAME, "random", "Qwen2", vocab, 1 << 16, "bfloat16", "cpu", 1, "")
        self.logprobs = -rng.exponential(2.0, pool).astype(np.float32)
        self.ranks = rng.integers(k + 1, vocab, pool).astype(np.int32)  # outside the top k, as a token's is
        self.top_ids = rng.integers(0, vocab, (pool, max(k, 1))).astype(np.int32)
        self.top_logprobs = -np.sort(rng.exponential(2.0, (pool, max(k, 1))), axis=1).astype(np.float32)

    def models(self) -> list[ModelInfo]:
        return [self.info]

    def check_counts(self, counts: RequestCounts, limits: RequestLimits | None = None) -> None:
        check_counts(counts, limits or self.limits)

    async def score(self, job: ScoreJob) -> ScoreResult:
        k = job.options.top_k
        scores = []
        for sequence in job.sequences:
            c = len(sequence.completion_ids)
            scores.append(
                SequenceScores(
                    logprobs=self.logprobs[:c],
                    top_ids=self.top_ids[:c, :k] if k else None,
                    top_logprobs=self.top_logprobs[:c, :k] if k else None,
                    ranks=self.ranks[:c] if job.options.return_ranks else None,
                )
            )
        return ScoreResult(job.request_id, job.model, 1, scores, job.num_tokens)


async def _asgi_post(app: Any, path: str, body: bytes) -> int:
    """One POST of ``body`` to ``app`` in-process; the answer's bytes. The caller stays connected."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    connected = asyncio.Event()  # never set: no disconnect comes

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await connected.wait()
        return {"type": "http.disconnect"}

    sent: list[Any] = []

    async def send(message: dict) -> None:
        sent.append(message.get("status", len(message.get("body", b""))))

    await app(scope, receive, send)
    assert sent[0] == 200, sent
    return sum(sent[1:])


def route_cost(sequences: int, k: int, runs: int = 5) -> str:
    """Microseconds per token of each route's whole call in-process (the edge's ASGI app over
    ``InstantEngine``: request parsing, checks, job, answer and response, no device, no sockets),
    and of gRPC's edge (the request parsed, its job built, the response written), for a request of
    ``sequences`` of the GRPO-like workload, at top-k 0 and ``k``. Best of ``runs``, in the
    thread's CPU time: what the event loop spends of the GIL the device thread needs."""
    from logprob_proto import logprob_pb2 as pb
    from logprob_service.api import wire
    from logprob_service.http.app import BodyLimits, Edge
    from logprob_service.http.server import routes

    workload = make_workload(sequences, (256, 1024), (64, 4096), 151_936, sequences, 1)
    group = workload.groups[0]
    tokens = sum(s.num_tokens for s in group)
    host_malloc.keep_freed_blocks()  # as the server's start-up does
    rows = []
    for top in (0, k):
        engine = InstantEngine(151_936, top)
        edge = Edge(engine, None, BodyLimits(1 << 30, 600.0, 1 << 32))  # type: ignore[arg-type]
        app = edge.app(routes(edge))

        async def grpc_call(raw: bytes, engine: InstantEngine = engine) -> int:
            job = wire.job_from_request(pb.ScoreRequest.FromString(raw), None, "", engine.limits)
            result = await engine.score(job)
            return len(wire.response_from_result(result, scores_f32=True).SerializeToString())

        for whole in (False, True):
            prompts = [_whole(s)[:1] if whole else s.prompt_ids for s in group]
            completions = [_whole(s)[1:] if whole else s.completion_ids for s in group]
            request = client_wire.score_request(
                list(zip(prompts, completions)), client_wire.Options(MODEL_NAME, 1.0, False, 0, top_k=top)
            )
            raw = request.SerializeToString()
            rows.append(_best(GRPC_WHOLE if whole else GRPC, top, tokens, runs, functools.partial(grpc_call, raw)))
        for name, route in ROUTES.items():
            requests = route.request(group, top)

            async def calls(requests: list[tuple[str, bytes]] = requests, app: Any = app) -> int:
                return sum([await _asgi_post(app, path, body) for path, body in requests])

            rows.append(_best(f"HTTP {name}", top, tokens, runs, calls))
    return (
        "\n".join(
            [
                f"# bench_http --route-cost: each route's call in-process, {sequences} sequences, {tokens:,} tokens, "
                "an engine that answers at once",
                "",
                *run_environment(torch.device("cpu")),
                f"best of {runs} runs, the thread's CPU time",
                "",
                "| method | top-k | us per token | answer bytes per token |",
                "|---|---:|---:|---:|",
                *rows,
            ]
        )
        + "\n"
    )


def _best(name: str, k: int, tokens: int, runs: int, call: Callable[[], Awaitable[int]]) -> str:
    async def measure() -> tuple[float, int]:
        await call()  # warm: caches, the allocator
        best, size = float("inf"), 0
        for _ in range(runs):
            begun = time.thread_time()
            size = await call()
            best = min(best, time.thread_time() - begun)
        return best, size

    best, size = asyncio.run(measure())
    return f"| {name} | {k} | {best / tokens * 1e6:.3f} | {size / tokens:.0f} |"


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
        "SGLang /generate": lambda item, scores, top: sglang.input_answer(
            item, 0, "rid", scores, top, version=1, latency=0.25, sent=1795664900.5
        ),
        "vLLM prompt_logprobs": lambda item, scores, top: b"".join(vllm.prompt_logprobs(item, scores, top)),
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
    add("--route-cost", action="store_true", help="only each route's whole call in-process, no device (CPU)")
    add("--shape", default="0.5b", choices=sorted(SHAPES), help="the model shape (ignored with --smoke)")
    add("--routes", default="all", help=f"HTTP routes to run: all, or some of {', '.join(ROUTES)}")
    add("--top-k", type=int, default=0, help="top-k asked of every method, as each route's field names it")
    add(
        "--check-every",
        type=int,
        default=None,
        help="check the values of every Nth group on the untimed pass (default: every group at top-k 0, every 8th "
        "with top-k: a top-20 JSON answer is 1,700 bytes a token, slow for the clients to parse)",
    )
    add(
        "--in-process-clients",
        dest="client_processes",
        action="store_false",
        help="the clients as threads of the server's process (default: each client a process of its own)",
    )
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
    if args.check_every is None:
        args.check_every = 8 if args.top_k else 1
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    args.routes = list(ROUTES) if args.routes == "all" else [r.strip() for r in args.routes.split(",") if r.strip()]
    if unknown := set(args.routes) - set(ROUTES):
        parser.error(f"--routes: unknown {sorted(unknown)}; of: {', '.join(ROUTES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.asgi:
        publish(asgi_overhead(args.asgi_calls), "bench_http_asgi.md")
    elif args.route_cost:
        publish(route_cost(args.group_size, 20), "bench_http_route_cost.md")
    elif args.encode:
        publish(encode_cost(8, 2700, 20), "bench_http_encode.md")
    else:
        publish(run(args), "bench_http.md")


if __name__ == "__main__":
    main()
