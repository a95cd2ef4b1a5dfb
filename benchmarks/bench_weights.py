"""Weight updates over gRPC on loopback: throughput, extra device memory, and scoring latency meanwhile.

A server (this process; the real grpc.aio server on a background thread) holds a random model of
the Qwen2.5-1.5B shape in bf16 (3.1 GB). A separate *pusher* process, the trainer's side, holds
new random weights of the same shape in host memory and streams them with
``LogprobClient.update_weights`` (tensor by tensor, ``--chunk-mib`` pieces, over ``--streams``
calls at once, the client's defaults). A separate *load* process scores GRPO-like requests back
to back from several threads and records each latency.

Measured, in one run:
  1. update alone, staged on the GPU (over one stream, and over ``--streams``) and (forced by a
     huge staging reserve) on the host: GB/s seen by the client, the server's total and swap
     time, and the peak device memory above what was allocated before the update (the staged
     copy of the weights, when on the GPU); also from a pusher started with glibc's thresholds
     raised (``CLIENT_MALLOC_ENV``, as the README advises trainers), and from one whose weights are
     on the GPU;
  2. sparse deltas (``update_weights(..., delta=True)``) of 2% of every tensor's elements: time,
     bytes sent, and both against the dense push from the same tensors: from host memory (copies
     held on the host), and from the GPU (copies held and compared there, ``on_device``);
  3. scoring latency p50/p99 with no update (after an unrecorded warm-up), then while updates run
     back to back: with update streams yielding to micro-batch launches (the server's default,
     ``update_yield_to_launches``), then read at full speed (a second server over the same model);
  4. with ``--weight-receivers N`` (default 2): a further server over the same model with N weight
     receivers, pushed to on their ports: dense pushes from host memory and from the GPU, GPU-held
     deltas, and scoring latency while its pushes run (``--quick`` leaves out the MALLOC_* pusher,
     host staging and the full-speed phase);
  5. with ``--push-processes N`` (default 2): dense pushes from a client with that many push
     processes (``LogprobClient(push_processes=N)``), to the receivers (from host memory and from
     the GPU, and scoring latency meanwhile) and to the first server's port.

Run: PYTHONPATH=service:client python3 benchmarks/bench_weights.py   (--tiny for a CPU smoke run)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from common import LoopbackServer, ModelShape, build_model
from harness import peak_allocated, publish, reset_peak, run_environment
from logprob_client.pushes import STREAMS_PER_RECEIVER
from logprob_client.weights import DEFAULT_CHUNK_BYTES, DEFAULT_STREAMS
from logprob_service import host_malloc
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.settings.model import Settings

QWEN25_15B = ModelShape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, 131072)
TINY = ModelShape("tiny Qwen2", 64, 128, 2, 4, 2, 1000, 256)
MODEL = "policy"
GiB = 1024**3
DELTA_FRACTION = 0.02  # of each tensor's elements changed between two delta pushes
# Between the untimed delta push and the timed one: a trainer steps between two pushes (seconds in
# RL), and what a delta push leaves to do after it returns (the held copies taking its changes,
# the next push's page-locked buffer: WeightDeltas) is done meanwhile, not in the timed push.
TRAINER_STEP_S = 1.0
WARM_UP_S = 4.0  # scoring before the first phase, not recorded: the kernels' first launches


# ----------------------------------------------------------------------------- other processes


def pusher(
    target: str,
    spec: list[tuple[str, tuple[int, ...], torch.dtype]],
    chunk_bytes: int,
    on_gpu: bool,
    push_processes: int,
    jobs,
    results,
) -> None:
    """The trainer's side: new weights in host memory (or on the GPU, its copies for deltas held
    there too: ``WeightDeltas(on_device=True)``), pushed once per job received, a (kind, streams)
    pair: "push" dense; "delta" a sparse delta, after an untimed delta push that makes the server
    hold what the client does, of ``DELTA_FRACTION`` of every tensor's elements changed (an RL
    step's small update), ``TRAINER_STEP_S`` after it. ``push_processes``: the client's option of
    that name."""
    from logprob_client import LogprobClient
    from logprob_client.weights import WeightDeltas

    torch.manual_seed(1)
    device = "cuda" if on_gpu else "cpu"
    weights = {name: (torch.randn(shape, device=device) * 0.02).to(dtype) for name, shape, dtype in spec}
    with LogprobClient(target, timeout=600, push_processes=push_processes) as client:
        client.deltas[MODEL] = WeightDeltas(on_device=on_gpu)
        if push_processes:  # a first push starts them: timed pushes are a trainer's steady state
            start = time.perf_counter()
            client.update_weights(MODEL, weights, chunk_bytes=chunk_bytes)
            print(f"first push, starting {push_processes} push processes: {time.perf_counter() - start:.2f} s")
        results.put("ready")
        while (job := jobs.get()) is not None:
            kind, streams = job
            delta = kind == "delta"
            options = {"chunk_bytes": chunk_bytes, "streams": streams, "delta": delta}
            if delta:
                client.update_weights(MODEL, weights, **options)
                for tensor in weights.values():
                    flat = tensor.view(-1)
                    where = torch.randint(flat.numel(), (max(1, int(DELTA_FRACTION * flat.numel())),), device=device)
                    flat[where] += 0.001
                time.sleep(TRAINER_STEP_S)  # the trainer's step between two pushes
            start = time.perf_counter()
            result = client.update_weights(MODEL, weights, **options)
            results.put((time.perf_counter() - start, result))


def load(target: str, vocab: int, lengths: tuple[int, int], threads: int, seconds: float, results) -> None:
    """Scoring load: ``threads`` callers, each one request after another, for ``seconds``; the
    first second (connections, first calls) is not recorded."""
    from logprob_client import LogprobClient

    rng = np.random.default_rng(0)
    prompt, completion = lengths
    requests = [
        ([rng.integers(0, vocab, prompt).tolist()] * 4, [rng.integers(0, vocab, completion).tolist() for _ in range(4)])
        for _ in range(8)
    ]
    latencies: list[float] = []
    errors: list[BaseException] = []
    recorded_from = time.perf_counter() + 1.0
    deadline = recorded_from + seconds
    with LogprobClient(target, timeout=120, model=MODEL) as client:

        def caller(i: int) -> None:
            try:
                while (start := time.perf_counter()) < deadline:
                    client.score(*requests[i % len(requests)])
                    if start >= recorded_from:
                        latencies.append(time.perf_counter() - start)
                    i += 1
            except BaseException as err:
                errors.append(err)

        pool = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    results.put(errors[0] if errors else latencies)


# ----------------------------------------------------------------------------- measurements


@dataclass
class Update:
    client: str
    to: str
    staged: str
    streams: int
    seconds: float
    gbytes: float
    server_total_s: float
    swap_s: float
    extra_gib: float


def push_once(updates: Pusher, device: torch.device, staged: str, streams: int, kind: str = "push") -> Update:
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    reset_peak(device)
    updates.jobs.put((kind, streams))
    seconds, result = updates.results.get(timeout=900)
    extra = (peak_allocated(device) - before) / GiB if device.type == "cuda" else float("nan")
    assert result.staged_on == staged, f"expected staging on {staged}, the server staged on {result.staged_on}"
    print(
        f"{updates.label} to {updates.to}, {kind}: {seconds:.2f} s, {result.bytes / 1e9 / seconds:.2f} GB/s", flush=True
    )
    return Update(
        updates.label, updates.to, staged, streams, seconds, result.bytes / 1e9, result.total_s, result.swap_s, extra
    )


# What a trainer's launcher sets to keep its client's message buffers warm, as the server does for
# itself (logprob_service.host_malloc, README "Weight updates").
CLIENT_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(host_malloc.MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(host_malloc.TRIM_THRESHOLD),
}


class Pusher:
    """A pusher process for the server at ``target``: ``with Pusher(...) as updates``. ``on_gpu``:
    its weights on the GPU; ``malloc_env``: started with ``CLIENT_MALLOC_ENV``; ``push_processes``:
    its client's option; ``to``: what the server takes pushes on, for the tables."""

    def __init__(
        self,
        ctx,
        target: str,
        spec,
        chunk_bytes: int,
        on_gpu: bool = False,
        malloc_env: bool = False,
        push_processes: int = 0,
        to: str = "server port",
    ):
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.malloc_env, self.to = malloc_env, to
        self.label = (
            ("GPU" if on_gpu else "host")
            + (", MALLOC_* set" if malloc_env else "")
            + (f", {push_processes} push processes" if push_processes else "")
        )
        self.process = ctx.Process(
            target=pusher, args=(target, spec, chunk_bytes, on_gpu, push_processes, self.jobs, self.results)
        )

    def __enter__(self) -> Pusher:
        saved = dict(os.environ)
        if self.malloc_env:  # a spawned process's glibc reads them as it starts
            os.environ.update(CLIENT_MALLOC_ENV)
        try:
            self.process.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert self.results.get(timeout=600) == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        self.jobs.put(None)
        self.process.join()


def load_lengths(shape: ModelShape) -> tuple[int, int]:
    """Prompt and completion tokens of each sequence of the scoring load."""
    return min(256, shape.max_positions // 4), min(512, shape.max_positions // 2)


def load_phase(
    ctx,
    target: str,
    shape: ModelShape,
    args,
    updates: Pusher | None = None,
    streams: int | None = None,
    seconds: float | None = None,
) -> tuple[list[float], int]:
    """Latencies of the scoring load over one phase of ``seconds`` (default ``--load-seconds``),
    with ``updates`` (a pusher) pushing over ``streams`` calls (``--streams``) back to back
    meanwhile (None: no updates); and how many pushes went live during it."""
    seconds = args.load_seconds if seconds is None else seconds
    load_results = ctx.Queue()
    proc = ctx.Process(
        target=load, args=(target, shape.vocab, load_lengths(shape), args.load_threads, seconds, load_results)
    )
    proc.start()
    pushed = 0
    if updates is not None:
        end = time.perf_counter() + 1.0 + seconds
        while time.perf_counter() < end:
            updates.jobs.put(("push", streams or args.streams))
            updates.results.get(timeout=900)
            pushed += 1
    latencies = load_results.get(timeout=900)
    if isinstance(latencies, BaseException):
        raise RuntimeError("the scoring load failed") from latencies
    proc.join()
    if torch.cuda.is_available():
        # The servers run in this process and share the GPU with the trainers the bench starts
        # after this phase: the scorer's cached blocks go back to the driver, as if the trainer
        # had a GPU of its own. Left cached, they held 78 GiB once (a run of 2026-11-25), and a
        # trainer's process starting after the phase failed to allocate its weights.
        torch.cuda.empty_cache()
    print(f"scoring phase: {len(latencies)} requests, {pushed} pushes", flush=True)
    return latencies, pushed


def quantiles(latencies: list[float]) -> tuple[float, float, int]:
    ms = np.asarray(latencies) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), len(ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke run)")
    parser.add_argument(
        "--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="update piece size (client side)"
    )
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS, help="calls per push (client side)")
    parser.add_argument("--repeats", type=int, default=3, help="updates per staging mode")
    parser.add_argument("--load-seconds", type=float, default=20, help="each scoring-load phase")
    parser.add_argument("--load-threads", type=int, default=4)
    parser.add_argument(
        "--weight-receivers", type=int, default=2, help="weight receivers of a further server pushed to (0: none)"
    )
    parser.add_argument(
        "--push-processes",
        type=int,
        default=2,
        help="also push from a client with this many push processes, to the port and the receivers (0: not)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="leave out the MALLOC_* pusher, host staging and the full-speed phase"
    )
    args = parser.parse_args()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda:0")
    shape = TINY if args.tiny else QWEN25_15B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(shape, device, dtype, seed=0)
    spec = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied
    weights_gb = sum(t.nbytes for t in model.parameters()) / 1e9
    registry = ModelRegistry()
    registry.add(serve_model(MODEL, "random", CausalLMScorer(model)))
    settings = Settings(host="127.0.0.1", port=0, metrics_port=0, models={MODEL: "random"}, device=str(device))

    ctx = mp.get_context("spawn")
    chunk_bytes = int(args.chunk_mib * 2**20)
    repeats = range(args.repeats)
    phases = {}
    rs = max(DEFAULT_STREAMS, STREAMS_PER_RECEIVER * args.weight_receivers)  # calls of a push to the receivers
    with LoopbackServer(settings, registry) as target, Pusher(ctx, target, spec, chunk_bytes) as updates:
        updates_done = [
            push_once(updates, device, str(device), streams) for streams in sorted({1, args.streams}) for _ in repeats
        ]
        deltas = [push_once(updates, device, str(device), args.streams, "delta") for _ in repeats]
        if not args.quick:
            with Pusher(ctx, target, spec, chunk_bytes, malloc_env=True) as tuned:
                updates_done += [push_once(tuned, device, str(device), args.streams) for _ in repeats]
        if device.type == "cuda":
            with Pusher(ctx, target, spec, chunk_bytes, on_gpu=True) as on_gpu:
                updates_done += [push_once(on_gpu, device, str(device), args.streams) for _ in repeats]
                deltas += [push_once(on_gpu, device, str(device), args.streams, "delta") for _ in repeats]
        if device.type == "cuda" and not args.quick:
            # A second server on the same model, whose reserve forces host staging.
            host_settings = settings.model_copy(update={"update_staging_reserve_bytes": 10**15})
            with (
                LoopbackServer(host_settings, registry) as host_target,
                Pusher(ctx, host_target, spec, chunk_bytes) as q,
            ):
                updates_done += [push_once(q, device, "cpu", args.streams) for _ in repeats]

        # Scoring latency: a phase without updates, one with updates back to back (yielding to
        # launches, the default), and one with them read at full speed, through a second server;
        # after a warm-up, not recorded (the first launches of the load's shapes).
        load_phase(ctx, target, shape, args, seconds=WARM_UP_S)
        phases["no update"] = load_phase(ctx, target, shape, args)
        phases["updates running, yielding to launches"] = load_phase(ctx, target, shape, args, updates)
        if not args.quick:
            full_speed = settings.model_copy(update={"update_yield_to_launches": False})
            with LoopbackServer(full_speed, registry) as free_target, Pusher(ctx, free_target, spec, chunk_bytes) as q:
                phases["updates running, read at full speed"] = load_phase(ctx, free_target, shape, args, q)
        if args.weight_receivers:
            # A server on the same model with weight receivers: pushes go to their ports, over the
            # client's default number of calls for them.
            to = f"{args.weight_receivers} receivers"
            with_receivers = settings.model_copy(update={"weight_receivers": args.weight_receivers})
            with LoopbackServer(with_receivers, registry) as r_target:
                phases[f"no update, server with {to}"] = load_phase(ctx, r_target, shape, args)
                with Pusher(ctx, r_target, spec, chunk_bytes, to=to) as r:
                    updates_done += [push_once(r, device, str(device), rs) for _ in repeats]
                    phases[f"updates over {to}, yielding to launches"] = load_phase(ctx, r_target, shape, args, r, rs)
                if device.type == "cuda":
                    with Pusher(ctx, r_target, spec, chunk_bytes, on_gpu=True, to=to) as rg:
                        updates_done += [push_once(rg, device, str(device), rs) for _ in repeats]
                        deltas += [push_once(rg, device, str(device), rs, "delta") for _ in repeats]
                if args.push_processes:
                    # From a client whose calls are made by its push processes.
                    n = args.push_processes
                    with Pusher(ctx, r_target, spec, chunk_bytes, push_processes=n, to=to) as rp:
                        updates_done += [push_once(rp, device, str(device), rs) for _ in repeats]
                        phases[f"updates over {to} from {n} push processes, yielding to launches"] = load_phase(
                            ctx, r_target, shape, args, rp, rs
                        )
                    if device.type == "cuda":
                        with Pusher(ctx, r_target, spec, chunk_bytes, on_gpu=True, push_processes=n, to=to) as rgp:
                            updates_done += [push_once(rgp, device, str(device), rs) for _ in repeats]
                            deltas += [push_once(rgp, device, str(device), rs, "delta") for _ in repeats]
        if args.push_processes:
            with Pusher(ctx, target, spec, chunk_bytes, push_processes=args.push_processes) as p:
                updates_done += [push_once(p, device, str(device), args.streams) for _ in repeats]
        final_version = registry.get(MODEL).info.version

    lines = [
        f"# Weight updates over gRPC on loopback: {shape.name}, {dtype}, {weights_gb:.2f} GB of weights",
        *run_environment(device),
        f"client pieces: {args.chunk_mib:g} MiB; pusher and scoring load in their own processes; "
        f"{final_version} updates went live in all",
        "",
        "| client's tensors | pushed to | staged on | streams | client time (s) | GB/s | server total (s) | swap (s) | "
        "peak extra GPU memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for u in updates_done:
        lines.append(
            f"| {u.client} | {u.to} | {u.staged} | {u.streams} | {u.seconds:.2f} | {u.gbytes / u.seconds:.2f} | "
            f"{u.server_total_s:.2f} | {u.swap_s:.3f} | {u.extra_gib:.2f} |"
        )

    def dense(delta: Update) -> float:
        """The median dense push from the same tensors to the same port(s), over as many streams,
        staged on ``device``."""
        same = (delta.client, delta.to, str(device), delta.streams)
        return statistics.median(u.seconds for u in updates_done if (u.client, u.to, u.staged, u.streams) == same)

    lines += [
        "",
        f"Sparse deltas: {DELTA_FRACTION:.0%} of every tensor's elements changed since the version the server "
        f"holds, pushed over {args.streams} streams ({rs} to the receivers); against the median dense push from "
        f"the same tensors over as many streams, staged on {device}, above",
        "",
        "| client's tensors and held copies | pushed to | client time (s) | bytes sent (GB) | of the dense bytes "
        "| dense push (s) | x faster than dense | server total (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for u in deltas:
        lines.append(
            f"| {u.client} | {u.to} | {u.seconds:.2f} | {u.gbytes:.3f} | {u.gbytes * 1e9 / weights_gb / 1e9:.1%} | "
            f"{dense(u):.2f} | {dense(u) / u.seconds:.2f}x | {u.server_total_s:.2f} |"
        )
    lengths = load_lengths(shape)
    lines += [
        "",
        f"Scoring load: {args.load_threads} callers, each 4 x ({lengths[0]} prompt + {lengths[1]} completion) "
        "tokens per request, "
        f"{args.load_seconds:g} s per phase",
        "",
        "| phase | updates during it | requests | p50 (ms) | p99 (ms) | mean (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for phase, (latencies, pushed) in phases.items():
        p50, p99, n = quantiles(latencies)
        lines.append(f"| {phase} | {pushed} | {n} | {p50:.1f} | {p99:.1f} | {statistics.mean(latencies) * 1000:.1f} |")
    publish("\n".join(lines), "bench_weights.md")


if __name__ == "__main__":
    main()
