"""Full garbage collections in the serving process during weight pushes, with and without ``gc_freeze``.

Python's cyclic garbage collector walks every tracked object in a full (generation 2) collection,
holding the interpreter lock: in a server that has imported torch and transformers and holds its
models, some 400,000 objects. This runs the real server (this process, ``LoopbackServer``) and a
client in this process pushing sparse deltas (2% of every weight's elements) back to back, first
with ``gc_freeze`` off, then through a second server with it on (the default: after warm-up the
heap is collected and frozen), and records each full collection's duration (``gc.callbacks``)
and each push's time.

Run: PYTHONPATH=service:client python3 benchmarks/bench_gc.py   (CPU: a 0.5B-like shape, float32)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from common import LoopbackServer, ModelShape, build_model
from harness import publish, run_environment
from logprob_client import LogprobClient
from logprob_client.weights import WeightDeltas
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.settings.model import Settings

SHAPE = ModelShape("Qwen2.5-0.5B-like, vocab 32000", 896, 4864, 24, 14, 2, 32000, 4096)
MODEL = "policy"
DELTA_FRACTION = 0.02

_pauses: list[float] = []
_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _pauses.append(time.perf_counter() - _started[0])


def pushes(target: str, weights: dict[str, torch.Tensor], count: int) -> list[float]:
    """Seconds of each of ``count`` delta pushes, after one that makes the server hold the base."""
    times = []
    with LogprobClient(target, timeout=600) as client:
        client.deltas[MODEL] = WeightDeltas()
        client.update_weights(MODEL, weights, delta=True)
        _pauses.clear()
        for _ in range(count):
            for tensor in weights.values():
                flat = tensor.view(-1)
                flat[torch.randint(flat.numel(), (max(1, int(DELTA_FRACTION * flat.numel())),))] += 0.001
            start = time.perf_counter()
            client.update_weights(MODEL, weights, delta=True)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(SHAPE, device, dtype, seed=0)
    registry = ModelRegistry()
    registry.add(serve_model(MODEL, "random", CausalLMScorer(model)))
    weights = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    gc.callbacks.append(_on_gc)
    rows = []
    for freeze in (False, True):  # unfrozen first: a freeze lasts for the process
        settings = Settings(
            host="127.0.0.1", port=0, metrics_port=0, models={MODEL: "random"}, device=str(device), gc_freeze=freeze
        )
        with LoopbackServer(settings, registry) as target:
            times = pushes(target, weights, args.pushes)
            rows.append((freeze, gc.get_freeze_count(), list(_pauses), times))
    lines = [
        f"# Full garbage collections during {args.pushes} sparse delta pushes: {SHAPE.name}, {dtype}",
        *run_environment(device),
        "",
        "| gc_freeze | objects frozen | full collections | their durations (ms) | push median (s) | push max (s) |",
        "|---|---|---|---|---|---|",
    ]
    for freeze, frozen, pauses, times in rows:
        durations = ", ".join(f"{p * 1000:.0f}" for p in pauses) or "-"
        lines.append(
            f"| {'on' if freeze else 'off'} | {frozen} | {len(pauses)} | {durations} | "
            f"{statistics.median(times):.2f} | {max(times):.2f} |"
        )
    publish("\n".join(lines), "bench_gc.md")


if __name__ == "__main__":
    main()
