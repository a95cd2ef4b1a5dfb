"""What the finiteness check of weight updates costs (``check_finite_weights``, ``ops.finite``).

The server stages each tensor of an update where the swap will read it and digests it there
(``worker.staging.DeviceStager``); with the check on it also queues one reduction per tensor
(``ops.finite.probe``: ``torch.aminmax``), or for a sparse update one pass over its changed values,
read back with the digests. Here the staging of a whole update of a model's weights (Qwen2.5-1.5B
shape, bf16, random) runs with the check off and on, as the server runs it for:

  received    an UpdateWeights push: each tensor's bytes written in 4 MiB pieces from host memory
              into its staged place on the device (``Stager.receive``), then digested;
  host        the same, with no device room (a huge staging reserve): staged in host memory, the
              digest on the device piece by piece, the probe on the host;
  device      tensors already on the device (UpdateWeightsFromIpc, a group's broadcast): copied;
  sparse 2%   a delta changing 2% of every tensor's elements (``stage_changes``);
  resident    the probes alone, and the digests alone, of weights resident on the device.

Each row: the median wall time of ``--repeats`` updates after a warm-up (everything staged and
read back), without and with the check, the difference, and that difference as a share of the
staging alone and of a push at ``--push-gbps`` (a whole dense push of the 1.5B shape over gRPC
took about 1 s at 2.5-3 GB/s, benchmarks/RESULTS.md). The check is on by default if it costs a
push under 5%.

Run: PYTHONPATH=service:client python3 benchmarks/bench_finite_check.py   (--tiny for a CPU smoke run)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from common import SHAPES, TINY, ModelShape, build_model
from harness import publish, run_environment, time_calls
from logprob_service.domain import SparseChanges
from logprob_service.models.weights import dtype_name, pending_digest, settle
from logprob_service.ops import finite
from logprob_service.worker.staging import DeviceStager

PIECE_BYTES = 4 << 20  # the client's pieces (logprob_client.weights.DEFAULT_CHUNK_BYTES)
DELTA_FRACTION = 0.02
NO_ROOM = 1 << 60  # a staging reserve no device has: everything staged in host memory


def host_weights(shape: ModelShape, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of ``shape`` (each stored weight once, tied ones once) in host memory."""
    model = build_model(shape, torch.device("meta"), dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(p.shape, generator=generator) * 0.02).to(dtype)
        for name, p in model.named_parameters()  # tied weights once, as a push sends them
    }


def stage_received(weights: dict[str, torch.Tensor], device: torch.device, reserve: int, check: bool) -> None:
    """An UpdateWeights push's staging: pieces written into place, then digested (and probed)."""
    stager = DeviceStager(device, reserve, check)
    pending, staged = [], []
    for tensor in weights.values():
        received = stager.receive(dtype_name(tensor.dtype), tuple(tensor.shape))
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        for offset in range(0, raw.size, PIECE_BYTES):
            received.write(offset, memoryview(raw[offset : offset + PIECE_BYTES]))
        copies, digest = received.finish()
        staged.append(copies)
        pending.append(digest)
    stager.finish(pending, list(weights))


def stage_resident(weights: dict[str, torch.Tensor], device: torch.device, check: bool) -> None:
    """An update from the device's own memory (IPC, broadcast): each tensor copied and digested."""
    stager = DeviceStager(device, 0, check)
    staged = [stager.stage(tensor, copy=True) for tensor in weights.values()]
    stager.finish([digest for _, digest in staged], list(weights))


def delta(live: dict[str, torch.Tensor], rng: np.random.Generator) -> list[SparseChanges]:
    """2% of each live weight's elements changed to new (finite) values."""
    changes = []
    for tensor in live.values():
        n = tensor.numel()
        indices = np.unique(rng.integers(0, n, max(1, int(n * DELTA_FRACTION)))).astype(np.uint32)
        values = (torch.randn(indices.size) * 0.02).to(tensor.dtype).view(torch.uint8).numpy()
        changes.append(SparseChanges(tensor, indices, values, dtype_name(tensor.dtype)))
    return changes


def stage_delta(changes: list[SparseChanges], names: list[str], device: torch.device, check: bool) -> None:
    stager = DeviceStager(device, 0, check)
    staged = stager.stage_changes(changes)
    stager.finish([digest for _, digest in staged], names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--push-gbps", type=float, default=2.5, help="a dense push's rate, for the last column")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else SHAPES[args.shape]
    dtype = torch.bfloat16
    weights = host_weights(shape, dtype, args.seed)
    nbytes = sum(t.nbytes for t in weights.values())
    names = list(weights)
    resident = {name: t.to(device) for name, t in weights.items()}
    changes = delta(resident, np.random.default_rng(args.seed))
    push_ms = nbytes / (args.push_gbps * 1e9) * 1e3

    def timed(fn: Callable[[], None]) -> float:
        return time_calls(fn, device, warmup=1, repeats=args.repeats).median_ms

    rows: list[tuple[str, float, float]] = []
    cases: list[tuple[str, Callable[[bool], None]]] = [
        ("received", lambda check: stage_received(weights, device, 0, check)),
        ("host", lambda check: stage_received(weights, device, NO_ROOM, check)),
        ("device", lambda check: stage_resident(resident, device, check)),
        ("sparse 2%", lambda check: stage_delta(changes, names, device, check)),
    ]
    for label, run in cases:
        if label == "host" and device.type != "cuda":
            continue  # on the CPU every tensor is staged in host memory already
        off, on = timed(lambda run=run: run(False)), timed(lambda run=run: run(True))
        rows.append((label, off, on))
        print(f"{label}: {off:.1f} ms without the check, {on:.1f} ms with it", flush=True)
    tensors = list(resident.values())
    digests = timed(lambda: settle([pending_digest(t, device) for t in tensors]))
    probes = timed(lambda: finite.nonfinite([finite.probe(t) for t in tensors]))

    lines = [
        f"# Finiteness check of weight updates: {shape.name}, {dtype_name(dtype)}, {len(weights)} tensors, "
        f"{nbytes / 1e9:.2f} GB",
        "",
        *run_environment(device),
        "",
        f"Median of {args.repeats} updates after a warm-up; a push at {args.push_gbps:g} GB/s takes {push_ms:.0f} ms.",
        "",
        "| staging | without check (ms) | with check (ms) | check (ms) | % of the staging | % of a push |",
        "|---|---|---|---|---|---|",
    ]
    for label, off, on in rows:
        cost = on - off
        shares = f"{100 * cost / off:+.1f}% | {100 * cost / push_ms:+.1f}%"
        lines.append(f"| {label} | {off:.1f} | {on:.1f} | {cost:+.1f} | {shares} |")
    lines += [
        "",
        f"Weights resident on the device: the probes alone {probes:.1f} ms, the digests alone {digests:.1f} ms "
        f"({100 * probes / push_ms:.1f}% and {100 * digests / push_ms:.1f}% of a push).",
    ]
    publish("\n".join(lines), "bench_finite_check.md")


if __name__ == "__main__":
    main()
