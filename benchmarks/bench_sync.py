"""A trainer's weight sync to a server on the same node: by broadcast (InitWeightsUpdateGroup +
UpdateWeightsFromDistributed, NCCL) or by CUDA IPC (UpdateWeightsFromIpc).

The server (this process, the real grpc.aio server on a background thread) holds a random model
of the Qwen2.5-7B shape in bf16 (14.1 GB, 339 tensors) on ``--server-device``. A separate *trainer* process
holds new weights of the same shape on ``--trainer-device`` and pushes them ``--repeats`` times:
``--via broadcast`` with ``logprob_client.collective.WeightBroadcaster`` (names and shapes over
gRPC, tensors by NCCL broadcast), ``--via ipc`` with ``LogprobClient.update_weights_ipc`` (CUDA
IPC handles over gRPC, a device-to-device copy by the server). Measured in one run: the push's
time as the trainer sees it (until the new version is live) and the server's total and swap
times, beside a device-to-device copy of the same bytes (``torch.Tensor.copy_``, trainer's GPU to
server's), the rate the memory or interconnect allows in this process.

Run: PYTHONPATH=service:client python3 benchmarks/bench_sync.py --via ipc --server-device cuda:0 \
       --trainer-device cuda:0            (one GPU: trainer and server share it)
     PYTHONPATH=service:client python3 benchmarks/bench_sync.py --via ipc      (two GPUs)
     PYTHONPATH=service:client python3 benchmarks/bench_sync.py --via broadcast (two GPUs)
(``--via broadcast --tiny --backend gloo`` on the CPU: checks that the script runs, nothing more.)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import statistics
import time

import torch
from common import SHAPES, TINY, LoopbackServer, build_model
from harness import publish, run_environment
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.settings.model import Settings

MODEL = "policy"


def trainer(target: str, via: str, port: int, spec, device: str, backend: str, repeats: int, results) -> None:
    """The trainer's side: new weights on its device, pushed ``repeats`` times."""
    from logprob_client import LogprobClient
    from logprob_client.collective import WeightBroadcaster

    torch.manual_seed(1)
    weights = {name: (torch.randn(shape, device=device) * 0.02).to(dtype) for name, shape, dtype in spec}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(LogprobClient(target, timeout=600))
        if via == "ipc":
            push = functools.partial(client.update_weights_ipc, MODEL, weights)
        else:
            sync = WeightBroadcaster(client, master_port=port, backend=backend, device=device, timeout_s=300)
            stack.enter_context(sync).connect()
            push = functools.partial(sync.push, MODEL, weights)
        for _ in range(repeats):
            start = time.perf_counter()
            result = push()
            results.put((time.perf_counter() - start, result))


def copy_rate(nbytes: int, source: str, destination: str) -> float:
    """GB/s of one ``copy_`` of ``nbytes`` from ``source`` to ``destination`` (the median of three)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=source)
    b = torch.empty(nbytes, dtype=torch.uint8, device=destination)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--via", default="broadcast", choices=["broadcast", "ipc"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (with --backend gloo: the CPU)")
    parser.add_argument("--shape", default="7b", choices=list(SHAPES))
    parser.add_argument("--server-device", default="cuda:1")
    parser.add_argument("--trainer-device", default="cuda:0")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--port", type=int, default=29612, help="the trainer's TCP store")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.backend == "gloo":
        args.server_device = args.trainer_device = "cpu"

    shape = TINY if args.tiny else SHAPES[args.shape]
    device = torch.device(args.server_device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(shape, device, dtype, seed=0)
    spec = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied
    nbytes = sum(t.nbytes for t in model.parameters())
    registry = ModelRegistry()
    registry.add(serve_model(MODEL, "random", CausalLMScorer(model)))
    settings = Settings(host="127.0.0.1", port=0, metrics_port=0, models={MODEL: "random"}, device=str(device))

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with LoopbackServer(settings, registry) as target:
        proc = ctx.Process(
            target=trainer,
            args=(target, args.via, args.port, spec, args.trainer_device, args.backend, args.repeats, results),
        )
        proc.start()
        pushes = [results.get(timeout=1800) for _ in range(args.repeats)]
        proc.join()
    peer = copy_rate(nbytes, args.trainer_device, args.server_device) if device.type == "cuda" else None

    lines = [
        f"# Weights by {args.via}: {shape.name}, {dtype}, {nbytes / 1e9:.2f} GB"
        + (f", {args.backend}" if args.via == "broadcast" else "")
        + f", "
        f"trainer on {args.trainer_device}, server on {args.server_device}",
        *run_environment(device),
        "",
        "| push | trainer's time (s) | GB/s | server total (s) | swap (s) | version |",
        "|---|---|---|---|---|---|",
    ]
    for i, (seconds, result) in enumerate(pushes):
        lines.append(
            f"| {i + 1} | {seconds:.3f} | {nbytes / seconds / 1e9:.1f} | {result.total_s:.3f} | {result.swap_s:.3f} | "
            f"{result.version} |"
        )
    if peer is not None:
        lines += ["", f"device-to-device copy of the same bytes ({args.trainer_device} -> {args.server_device}): "
                  f"{peer:.1f} GB/s, {nbytes / peer / 1e9:.3f} s"]  # fmt: skip
    publish("\n".join(lines), f"bench_sync_{args.via}.md")


if __name__ == "__main__":
    main()
