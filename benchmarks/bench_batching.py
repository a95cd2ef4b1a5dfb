"""A GRPO-like scoring workload, three ways side by side: tokens/s, peak memory, latency, GPU busy.

Workload: 256 sequences, prompt lengths ~ U[256, 1024] and completion lengths ~ U[64, 4096] tokens
(uniform, inclusive), random token ids in [1, vocab) (seeded numpy rng; 0 is only ever padding).
Models: Qwen2ForCausalLM with the Qwen2.5-0.5B and Qwen2.5-1.5B shapes, random weights
(transformers' init, seeded), bf16, eval mode. Tokens/s always counts real tokens only:
sum(prompt + completion) over the 256 sequences, whatever padding a method computes.

Methods, on the same sequences:

(a) trainer baseline (TRL GRPOTrainer style): groups of 8 sequences in workload order; each group
    is padded to its longest prompt (left) + longest completion (right), run through
    ``model(input_ids, attention_mask=mask, logits_to_keep=C_max + 1)`` (SDPA), then
    ``logits[:, :-1]`` and TRL's row-looped ``selective_log_softmax`` (bf16 log-probs).
(b) the service in-process: ``OfflineScorer.score`` (the server's queue, loop and device worker)
    over all 256 sequences (Karmarkar-Karp balanced micro-batches under ``--max-batch-tokens``,
    packed without padding, varlen attention, chunked float32 lm_head), results copied to host memory.
(c) the service through gRPC: the real ``grpc.aio`` server in this process (a background asyncio
    thread), 8 client threads, each with its own ``LogprobClient`` (own connection), pulling the
    256 sequences as 32 requests of 8 from a shared queue.

Each method: ``--warmup`` untimed passes over the whole workload, then ``--repeats`` timed passes
(device synchronized around each); tokens/s uses the median pass. Reported per method:

* peak extra GiB: peak allocated bytes over the timed passes (``common.peak_allocated``) minus what was allocated before
  the method ran (weights and inputs); for (c) it covers the server, which shares this process.
* p50/p99 ms over all timed passes: (a) one 8-sequence micro-batch (device time, CUDA events);
  (b) one packed micro-batch of ``OfflineScorer.score`` (host time from its launch to the next launch);
  (c) one 8-sequence ScoreTokens round trip as its client sees it, 8 requests in flight, so
  queueing behind the other clients' requests is included.
* GPU busy %: the GPU's utilization sampled every ``--sample-ms`` in a background thread
  (``torch.cuda.utilization``, i.e. NVML, when pynvml is installed, else ``nvidia-smi``), averaged
  over the samples taken during the timed passes.
* max |log p - (a)| over the first 8 sequences' completion tokens, for (b) and (c): a sanity check;
  (a) rounds log-probs to bf16 (spacing 1/16 near -12), so differences up to a few 1e-2 are noise.

On a GPU (both shapes; by a FLOP estimate, not yet timed, a few minutes on an H200, more with
``--sweep-batch-tokens 16384,32768,65536``):

    PYTHONPATH=service:client python3 benchmarks/bench_batching.py

Smoke test on a CPU (tiny Qwen2, float32, 16 short sequences, 2 clients; memory and busy n/a):

    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_batching.py --smoke

``--top-k 20,256`` also runs (c) asking each of those top-k per completion position (a
teacher's distribution for distillation), with a table of tokens/s against (c) without, and
the answers' packed bytes per pass (4 bytes of log-prob + 8 K of ids and log-probs per token):

    PYTHONPATH=service:client python3 benchmarks/bench_batching.py --top-k 20,256

The tables are printed last, and also written to ``$OUT/bench_batching.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from common import (
    SHAPES,
    TINY,
    LoopbackServer,
    ModelShape,
    add_scoring_arguments,
    build_model,
    layers_label,
    scoring_options,
    selective_log_softmax,
)
from harness import peak_allocated, publish, release, reset_peak, run_environment, synchronize
from logprob_client import LogprobClient, Overloaded
from logprob_service.domain import TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.compiled import eager_layers
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.offline import OfflineScorer
from logprob_service.settings.model import DEFAULT_MAX_BATCH_TOKENS, Settings
from transformers import PreTrainedModel

GiB = 1024**3
MODEL_NAME = "bench"


# ----------------------------------------------------------------------------- models


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    sequences: list[TokenSequence]
    group_size: int  # sequences per baseline micro-batch and per gRPC request

    @property
    def groups(self) -> list[list[TokenSequence]]:
        """Consecutive groups of ``group_size`` sequences, in workload order."""
        n = self.group_size
        return [self.sequences[i : i + n] for i in range(0, len(self.sequences), n)]

    @property
    def real_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.sequences)

    @property
    def padded_tokens(self) -> int:
        """Token positions the baseline runs the body on: each group padded to P_max + C_max."""
        return sum(len(g) * (_longest_prompt(g) + _longest_completion(g)) for g in self.groups)

    @property
    def baseline_logit_rows(self) -> int:
        """lm_head rows the baseline computes: C_max + 1 per sequence of each group."""
        return sum(len(g) * (_longest_completion(g) + 1) for g in self.groups)


def _longest_prompt(group: Sequence[TokenSequence]) -> int:
    return max(len(s.prompt_ids) for s in group)


def _longest_completion(group: Sequence[TokenSequence]) -> int:
    return max(len(s.completion_ids) for s in group)


def make_workload(
    n: int, prompt_range: tuple[int, int], completion_range: tuple[int, int], vocab: int, group_size: int, seed: int
) -> Workload:
    """``n`` sequences with uniform lengths and random ids in [1, vocab). Lengths are drawn
    first, so they do not depend on ``vocab``."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)  # [n]
    completion_lens = rng.integers(completion_range[0], completion_range[1] + 1, size=n)  # [n]
    sequences = [
        TokenSequence(
            prompt_ids=rng.integers(1, vocab, size=p, dtype=np.int64),
            completion_ids=rng.integers(1, vocab, size=c, dtype=np.int64),
        )
        for p, c in zip(prompt_lens, completion_lens)
    ]
    return Workload(sequences, group_size)


# ----------------------------------------------------------------------------- (a) trainer baseline


@dataclass(frozen=True)
class PaddedGroup:
    """A trainer's micro-batch: prompts left-padded, completions right-padded (TRL's layout)."""

    input_ids: torch.Tensor  # [B, P_max + C_max] int64, 0 on padding
    attention_mask: torch.Tensor  # [B, P_max + C_max] int64, 1 on real tokens
    completion_ids: torch.Tensor  # [B, C_max] int64, 0 on padding
    completion_lengths: list[int]


def pad_group(group: Sequence[TokenSequence], device: torch.device) -> PaddedGroup:
    p_max, c_max = _longest_prompt(group), _longest_completion(group)
    ids = np.zeros((len(group), p_max + c_max), dtype=np.int64)  # [B, L]
    mask = np.zeros_like(ids)  # [B, L]
    for row, s in enumerate(group):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[row, p_max - p : p_max] = s.prompt_ids
        ids[row, p_max : p_max + c] = s.completion_ids
        mask[row, p_max - p : p_max + c] = 1
    input_ids = torch.from_numpy(ids).to(device)
    return PaddedGroup(
        input_ids=input_ids,
        attention_mask=torch.from_numpy(mask).to(device),
        completion_ids=input_ids[:, p_max:],
        completion_lengths=[len(s.completion_ids) for s in group],
    )


def trl_logprobs(model: PreTrainedModel, group: PaddedGroup) -> torch.Tensor:
    """TRL GRPOTrainer's per-token log-probs of one micro-batch: [B, C_max], bf16.

    TRL also divides the logits by the sampling temperature (one more [B, C, V] copy, even at
    T = 1); left out here, so this is TRL's best case. No position_ids, as in TRL: HF numbers
    positions 0..L-1 over the left padding, which RoPE's relative form makes harmless.
    """
    c_max = group.completion_ids.shape[1]
    out = model(
        input_ids=group.input_ids, attention_mask=group.attention_mask, use_cache=False, logits_to_keep=c_max + 1
    )
    logits = out.logits[:, :-1]  # [B, C_max, V]: the last position predicts past the sequence
    return selective_log_softmax(logits, group.completion_ids)  # [B, C_max]


class IntervalTimer:
    """Times intervals of device work: CUDA events on CUDA (no host sync), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[Any, Any]] = []
        self._start: Any = None

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        self._marks.append((self._start, self._now()))

    def elapsed_ms(self) -> list[float]:
        """Every interval's duration; waits for the device."""
        if not self._cuda:
            return [(end - start) * 1e3 for start, end in self._marks]
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self._marks]


@dataclass
class PassResult:
    """One pass over the whole workload."""

    latencies_ms: list[float]  # one per micro-batch or request
    first: list[np.ndarray]  # the first group's completion log-probs, float64, one per sequence
    by_group: dict[int, list[np.ndarray]] = field(default_factory=dict)  # gRPC: every group's, as returned


@torch.inference_mode()
def baseline_pass(model: PreTrainedModel, groups: list[PaddedGroup], device: torch.device) -> PassResult:
    timer = IntervalTimer(device)
    first: torch.Tensor | None = None
    for group in groups:
        timer.start()
        logprobs = trl_logprobs(model, group)  # [B, C_max] bf16, kept by a trainer as old log-probs
        timer.stop()
        first = logprobs if first is None else first
    assert first is not None
    latencies = timer.elapsed_ms()
    rows = first.double().cpu().numpy()  # [B, C_max]
    return PassResult(latencies, [rows[i, :c] for i, c in enumerate(groups[0].completion_lengths)])


# ----------------------------------------------------------------------------- (b) service in-process


@contextlib.contextmanager
def launch_times(scorer: CausalLMScorer) -> Iterator[list[float]]:
    """Record the host time at which ``scorer`` launches each micro-batch (this instance only)."""
    starts: list[float] = []
    launch = scorer.launch

    def timed_launch(*args: Any, **kwargs: Any) -> Any:
        starts.append(time.perf_counter())
        return launch(*args, **kwargs)

    scorer.launch = timed_launch  # type: ignore[method-assign]  # shadows the method on the instance
    try:
        yield starts
    finally:
        del scorer.launch


def service_pass(scorer: OfflineScorer, workload: Workload) -> PassResult:
    """``scorer.score`` over the whole workload; micro-batches run one after another."""
    with launch_times(scorer.scorer) as starts:
        scores = scorer.score(workload.sequences)
    ends = [*starts[1:], time.perf_counter()]
    first = [s.logprobs.astype(np.float64) for s in scores[: workload.group_size]]
    return PassResult([(end - start) * 1e3 for start, end in zip(starts, ends)], first)


# ----------------------------------------------------------------------------- (c) service via gRPC


def server_settings(args: argparse.Namespace, device: torch.device) -> Settings:
    return Settings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models={MODEL_NAME: "random weights, built by benchmarks/bench_batching.py"},
        device=str(device),
        max_batch_tokens=args.max_batch_tokens,
        max_batch_sequences=args.max_batch_sequences,
    )


def open_clients(target: str, n: int, **client_options: Any) -> list[LogprobClient]:
    # A local subchannel pool gives each client its own connection, as separate trainer
    # processes would have (gRPC otherwise shares one subchannel between identical channels).
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [LogprobClient(target, model=MODEL_NAME, timeout=600.0, options=options, **client_options) for _ in range(n)]


def grpc_pass(clients: list[LogprobClient], workload: Workload, top_k: int = 0) -> PassResult:
    """Every client thread pulls requests of ``group_size`` sequences from one shared queue
    (asking each for ``top_k`` ids and log-probs per completion token too, when set)."""
    work: queue.SimpleQueue[tuple[int, list[TokenSequence]]] = queue.SimpleQueue()
    for item in enumerate(workload.groups):
        work.put(item)
    latencies: list[float] = []
    results: dict[int, list[np.ndarray]] = {}

    def drain(client: LogprobClient) -> None:
        while True:
            try:
                index, group = work.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            answer = client.score([s.prompt_ids for s in group], [s.completion_ids for s in group], top_k=top_k)
            logprobs = answer.logprobs if top_k else answer
            latencies.append((time.perf_counter() - start) * 1e3)
            results[index] = logprobs

    with ThreadPoolExecutor(len(clients), thread_name_prefix="bench-client") as pool:
        for future in [pool.submit(drain, client) for client in clients]:
            future.result()
    return PassResult(latencies, [lp.astype(np.float64) for lp in results[0]], results)


def timed_passes(target: str, count: int, workload: Workload, repeats: int) -> tuple[list[float], dict]:
    """``count`` clients of ``target``: a warm-up pass, then ``repeats`` timed passes; their seconds,
    and the last one's log-probs by request (``PassResult.by_group``)."""
    clients = open_clients(target, count)
    try:
        grpc_pass(clients, workload)  # warm-up: compiled layers, allocator, connections
        seconds, by_group = [], {}
        for _ in range(repeats):
            start = time.perf_counter()
            by_group = grpc_pass(clients, workload).by_group
            seconds.append(time.perf_counter() - start)
    finally:
        for client in clients:
            client.close()
    return seconds, by_group


# ----------------------------------------------------------------------------- GPU busy


def nvml_query(device: torch.device) -> Callable[[], float] | None:
    """``torch.cuda.utilization`` (NVML through pynvml / nvidia-ml-py), if it works here."""
    try:
        torch.cuda.utilization(device)
    except Exception:  # pynvml missing, or NVML unusable
        return None
    return lambda: float(torch.cuda.utilization(device))


def nvidia_smi_ids(device: torch.device) -> list[str]:
    """Ways to name ``device`` to ``nvidia-smi -i``, most exact first: its UUID, then its index
    as CUDA_VISIBLE_DEVICES maps it (nvidia-smi numbers GPUs in PCI order, ignoring that variable)."""
    ids = []
    with contextlib.suppress(Exception):
        ids.append(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
    index = device.index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    ids.append(visible[index] if index < len(visible) else str(index))
    return ids


def nvidia_smi_query(device: torch.device) -> Callable[[], float] | None:
    """One ``nvidia-smi`` call per sample, for the first way of naming the GPU that answers."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    for gpu_id in nvidia_smi_ids(device):
        cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", gpu_id]

        def query(cmd: list[str] = cmd) -> float:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
            return float(out.split()[0])

        try:
            query()
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            continue
        return query
    return None


class BusySampler:
    """Samples the GPU's utilization in a background thread; averages it over time windows.

    NVML's ``utilization.gpu`` (what nvidia-smi shows, and what ``torch.cuda.utilization`` reads)
    is the percent of time, over the driver's last sample period (1/6 s to 1 s depending on the
    GPU), during which at least one kernel was running. It says how often the GPU had work, not
    how well that work used the SMs. A sample taken just after a window opens partly covers the
    time before it, so short windows read a little low.
    """

    def __init__(self, query: Callable[[], float], source: str, interval_s: float) -> None:
        self.source = source
        self._query = query
        self._interval_s = interval_s
        self._samples: list[tuple[float, float]] = []  # (time.perf_counter() when read, percent)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gpu-busy", daemon=True)

    @classmethod
    def for_device(cls, device: torch.device, interval_s: float) -> BusySampler | None:
        if device.type != "cuda":
            return None
        if (query := nvml_query(device)) is not None:
            return cls(query, "torch.cuda.utilization (NVML)", interval_s)
        if (query := nvidia_smi_query(device)) is not None:
            return cls(query, "nvidia-smi --query-gpu=utilization.gpu", interval_s)
        print("GPU busy: neither pynvml nor nvidia-smi works here; reported as n/a", file=sys.stderr)
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            with contextlib.suppress(Exception):
                value = self._query()
                self._samples.append((time.perf_counter(), value))
            self._stop.wait(max(0.0, self._interval_s - (time.perf_counter() - started)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self, windows: Sequence[tuple[float, float]]) -> tuple[float | None, int]:
        """Mean percent of the samples read inside any of ``windows``, and how many there were."""
        inside = [v for t, v in list(self._samples) if any(start <= t <= end for start, end in windows)]
        return (statistics.fmean(inside) if inside else None), len(inside)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Measured:
    method: str
    seconds: float | None = None  # median wall time of one pass; None: failed
    peak_extra_gib: float | None = None  # None: not measured (CPU) or failed
    latencies_ms: list[float] = field(default_factory=list)
    busy_percent: float | None = None
    busy_samples: int = 0
    units_per_pass: int = 0  # micro-batches or requests in one pass
    first: list[np.ndarray] | None = None
    note: str = ""


@dataclass(frozen=True)
class Harness:
    """How every method is run and measured."""

    device: torch.device
    sampler: BusySampler | None
    warmup: int
    repeats: int

    def measure(self, method: str, run_pass: Callable[[], PassResult]) -> Measured:
        """Warm-up passes, then timed passes; out of memory (or another failure) becomes a note."""
        log(f"  {method}")
        try:
            return self._timed_passes(method, run_pass)
        except (torch.OutOfMemoryError, Overloaded):  # through gRPC the service reports its OOM as Overloaded
            note = "OOM"
        except Exception as err:
            traceback.print_exc()
            note = f"failed ({type(err).__name__})"
        # Released here, outside the except blocks: their tracebacks held the failed pass's tensors.
        release(self.device)
        log(f"    {note}")
        return Measured(method=method, note=note)

    def _timed_passes(self, method: str, run_pass: Callable[[], PassResult]) -> Measured:
        device, cuda = self.device, self.device.type == "cuda"
        release(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        for i in range(self.warmup):
            started = time.perf_counter()
            run_pass()
            log(f"    warm-up {i + 1}/{self.warmup}: {time.perf_counter() - started:.2f} s")
        release(device)
        reset_peak(device)
        windows: list[tuple[float, float]] = []
        latencies: list[float] = []
        result: PassResult | None = None
        for i in range(self.repeats):
            result = None  # the previous pass's outputs go before the next pass runs
            synchronize(device)
            start = time.perf_counter()
            result = run_pass()
            synchronize(device)
            windows.append((start, time.perf_counter()))
            latencies += result.latencies_ms
            log(f"    pass {i + 1}/{self.repeats}: {windows[-1][1] - start:.2f} s")
        assert result is not None
        peak = (peak_allocated(device) - base) / GiB if cuda else None
        busy, samples = self.sampler.mean(windows) if self.sampler is not None else (None, 0)
        return Measured(
            method=method,
            seconds=statistics.median(end - start for start, end in windows),
            peak_extra_gib=peak,
            latencies_ms=latencies,
            busy_percent=busy,
            busy_samples=samples,
            units_per_pass=len(result.latencies_ms),
            first=result.first,
        )


def max_abs_diff(measured: Measured, reference: Measured) -> float | None:
    if measured.first is None or reference.first is None:
        return None
    return max(float(np.abs(a - b).max()) for a, b in zip(measured.first, reference.first, strict=True))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- one shape


# The service's goals: (c) tokens/s over (a)'s, per shape; and the GPU kept busy through gRPC.
SPEEDUP_GOALS = {"Qwen2.5-0.5B": 3.0, "Qwen2.5-1.5B": 2.5}
BUSY_GOAL_PERCENT = 90
DETERMINISTIC_COST_GOAL = 0.03  # at most 3% of tokens/s lost with --deterministic on


@dataclass
class ShapeReport:
    shape: ModelShape
    model_line: str
    rows: list[Measured]  # (a), (b), (c)
    sweep: list[tuple[int, Measured]]  # (max_batch_tokens, (b) with it)
    top_k: list[tuple[int, Measured]] = field(default_factory=list)  # (K, (c) asking top_k K), K = 0 first


def deterministic_label(scorer: OfflineScorer) -> str:
    return ", deterministic" if scorer.scorer.options.deterministic else ""


def run_in_process(harness: Harness, scorer: OfflineScorer, workload: Workload) -> Measured:
    """(b): ``scorer.score`` over the whole workload."""
    method = (
        f"(b) service in-process: OfflineScorer.score, max_batch_tokens {scorer.max_batch_tokens}"
        f"{deterministic_label(scorer)}"
    )
    return harness.measure(method, lambda: service_pass(scorer, workload))


def answer_bytes(workload: Workload, top_k: int) -> int:
    """The packed arrays a pass's answers carry: a float32 log-prob per completion token, and
    with ``top_k`` K, K int32 ids and K float32 log-probs more (protobuf framing not counted)."""
    tokens = sum(len(s.completion_ids) for group in workload.groups for s in group)
    return tokens * (4 + 8 * top_k)


def run_grpc(
    harness: Harness, scorer: OfflineScorer, workload: Workload, args: argparse.Namespace, top_k: int = 0
) -> Measured:
    """(c): the real server in this process, serving ``scorer``'s model; clients in threads."""
    registry = ModelRegistry()
    registry.add(serve_model(MODEL_NAME, "random", scorer.scorer))
    method = (
        f"(c) service via gRPC: {args.clients} clients, requests of {workload.group_size} sequences, "
        f"max_batch_tokens {args.max_batch_tokens}{deterministic_label(scorer)}"
        + (f", top_k {top_k}, answers {answer_bytes(workload, top_k) / 2**20:,.1f} MiB per pass" if top_k else "")
    )
    log("  starting the gRPC server (weights fingerprint, warm-up)")
    with LoopbackServer(server_settings(args, harness.device), registry) as target:
        clients = open_clients(target, args.clients)
        try:
            return harness.measure(method, lambda: grpc_pass(clients, workload, top_k))
        finally:
            for client in clients:
                client.close()


def run_baseline(harness: Harness, model: PreTrainedModel, workload: Workload) -> Measured:
    """(a): the model switched back to SDPA, as trainers run HF models; inputs padded up front."""
    model.set_attn_implementation("sdpa")
    groups = [pad_group(g, harness.device) for g in workload.groups]
    method = (
        f"(a) trainer baseline: pad, sdpa, logits_to_keep, selective_log_softmax, "
        f"micro-batches of {workload.group_size}"
    )
    with eager_layers(model.base_model):  # stock layers, whatever a scorer did to the model before
        return harness.measure(method, lambda: baseline_pass(model, groups, harness.device))


def run_shape(shape: ModelShape, args: argparse.Namespace, harness: Harness, dtype: torch.dtype) -> ShapeReport:
    log(f"{shape.name} shape: building the model")
    model = build_model(shape, harness.device, dtype, args.seed)
    workload = workload_for(args, shape.vocab)
    baseline = run_baseline(harness, model, workload)

    rows, service = [baseline], ""
    top_k: list[tuple[int, Measured]] = []
    # Off before on: turning cuBLAS split-K off is process-wide (ops.determinism) and stays off.
    for deterministic in {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]:
        # The scorer switches the model to its attention and compiles its layers.
        options = scoring_options(args, deterministic=deterministic)
        with OfflineScorer(
            model, options=options, max_batch_tokens=args.max_batch_tokens, max_batch_sequences=args.max_batch_sequences
        ) as scorer:
            rows += [run_in_process(harness, scorer, workload), run_grpc(harness, scorer, workload, args)]
            if args.top_k and not top_k:  # with the first scorer (--deterministic off, unless only on)
                top_k = [(0, rows[-1])] + [(k, run_grpc(harness, scorer, workload, args, k)) for k in args.top_k]
            service += f"service{', deterministic' if deterministic else ''}: attention {scorer.served.info.attention}"
            service += f"; {layers_label(scorer.scorer)}; {scorer.served.info.determinism}\n"
    sweep = []
    for value in args.sweep_batch_tokens:
        with OfflineScorer(
            model, options=options, max_batch_tokens=value, max_batch_sequences=args.max_batch_sequences
        ) as sweep_scorer:
            sweep.append((value, run_in_process(harness, sweep_scorer, workload)))
    return ShapeReport(shape, f"{describe_model(shape, model)}\n{service.rstrip()}", rows, sweep, top_k)


def workload_for(args: argparse.Namespace, vocab: int) -> Workload:
    return make_workload(
        args.sequences, args.prompt_range, args.completion_range, vocab, args.group_size, args.seed + 1
    )


# ----------------------------------------------------------------------------- report


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def tokens_per_s(m: Measured, workload: Workload) -> float | None:
    return workload.real_tokens / m.seconds if m.seconds else None


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _memory_latency_busy_cells(m: Measured) -> list[str]:
    """The last four columns of both tables: peak extra GiB, p50 ms, p99 ms, GPU busy %."""
    return [
        m.note or _num(m.peak_extra_gib, ".2f"),
        _num(percentile(m.latencies_ms, 50), ".1f"),
        _num(percentile(m.latencies_ms, 99), ".1f"),
        _num(m.busy_percent, ".1f"),
    ]


def format_table(rows: list[Measured], workload: Workload) -> str:
    base = tokens_per_s(rows[0], workload)
    lines = [
        "| method | tokens/s | x baseline | peak extra GiB | p50 ms | p99 ms | GPU busy % |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in rows:
        rate = tokens_per_s(m, workload)
        cells = [m.method, m.note or _num(rate, ",.0f"), _num(rate / base if rate and base else None, ".2f")]
        lines.append(f"| {' | '.join(cells + _memory_latency_busy_cells(m))} |")
    return "\n".join(lines)


def format_sweep(sweep: list[tuple[int, Measured]], workload: Workload) -> str:
    lines = [
        "(b) by max_batch_tokens:",
        "",
        "| max_batch_tokens | micro-batches | tokens/s | peak extra GiB | p50 ms | p99 ms | GPU busy % |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for value, m in sweep:
        cells = [str(value), str(m.units_per_pass or "n/a"), m.note or _num(tokens_per_s(m, workload), ",.0f")]
        lines.append(f"| {' | '.join(cells + _memory_latency_busy_cells(m))} |")
    return "\n".join(lines)


TOP_K_COST_GOAL = {20: 0.15}  # the goal: top_k 20 costs at most 15% of (c)'s tokens/s


def format_top_k(top_k: list[tuple[int, Measured]], workload: Workload) -> str:
    base = tokens_per_s(top_k[0][1], workload)
    lines = [
        "(c) by top_k (teacher outputs):",
        "",
        "| top_k | tokens/s | x top_k 0 | answers MiB per pass | peak extra GiB | p50 ms | p99 ms | GPU busy % |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    goals = []
    for k, m in top_k:
        rate = tokens_per_s(m, workload)
        ratio = rate / base if rate and base else None
        cells = [str(k), m.note or _num(rate, ",.0f"), _num(ratio, ".3f"), f"{answer_bytes(workload, k) / 2**20:,.2f}"]
        lines.append(f"| {' | '.join(cells + _memory_latency_busy_cells(m))} |")
        if k in TOP_K_COST_GOAL and ratio is not None:
            met = 1 - ratio <= TOP_K_COST_GOAL[k]
            goals.append(
                f"top_k {k} costs {100 * (1 - ratio):.1f}% ({'met' if met else 'NOT met'}, <= {TOP_K_COST_GOAL[k]:.0%})"
            )
    return "\n".join(lines + (["", "goal: " + "; ".join(goals)] if goals else []))


def format_checks(shape: ModelShape, rows: list[Measured], workload: Workload) -> str:
    """The sanity check against (a) and the goals, as plain lines."""
    baseline, in_process, via_grpc = rows[:3]  # with --deterministic both, (b) and (c) with it on follow
    n = workload.group_size
    diffs = ", ".join(f"{m.method[:3]} {_num(max_abs_diff(m, baseline), '.3g')}" for m in (in_process, via_grpc))
    lines = [
        f"max |log p - (a)| over the first {n} sequences: {diffs}",
        f"per pass: (a) {baseline.units_per_pass} micro-batches, (b) {in_process.units_per_pass} packed "
        f"micro-batches, (c) {via_grpc.units_per_pass} requests; GPU busy samples during timed passes: "
        f"{', '.join(f'{m.method[:3]} {m.busy_samples}' for m in rows)}",
    ]
    base, grpc_rate = tokens_per_s(baseline, workload), tokens_per_s(via_grpc, workload)
    if base and grpc_rate:
        speedup = grpc_rate / base
        busy = via_grpc.busy_percent
        memory = (
            f"{via_grpc.peak_extra_gib:.2f} vs {baseline.peak_extra_gib:.2f} GiB"
            if via_grpc.peak_extra_gib is not None and baseline.peak_extra_gib is not None
            else "n/a"
        )
        goal = SPEEDUP_GOALS.get(shape.name)
        verdict = (
            "no goal at this shape" if goal is None else f">= {goal:.1f}: {'met' if speedup >= goal else 'NOT met'}"
        )
        lines.append(
            f"goals: (c) tokens/s over (a)'s: {speedup:.3f}x ({verdict}); "
            f"(c) GPU busy >= {BUSY_GOAL_PERCENT}%: {_num(busy, '.1f')}"
            f"{'' if busy is None else (' (met)' if busy >= BUSY_GOAL_PERCENT else ' (NOT met)')}; "
            f"peak memory (c) vs (a): {memory}"
        )
    if len(rows) == 5:
        costs = []
        for off, on in zip(rows[1:3], rows[3:5], strict=True):
            rate_off, rate_on = tokens_per_s(off, workload), tokens_per_s(on, workload)
            cost = 1 - rate_on / rate_off if rate_off and rate_on else None
            verdict = "" if cost is None else f" ({'met' if cost <= DETERMINISTIC_COST_GOAL else 'NOT met'})"
            costs.append(f"{off.method[:3]} {_num(None if cost is None else 100 * cost, '.1f')}%{verdict}")
        lines.append(f"goal: deterministic costs <= {DETERMINISTIC_COST_GOAL:.0%} of tokens/s: {', '.join(costs)}")
    return "\n".join(lines)


def describe_model(shape: ModelShape, model: PreTrainedModel) -> str:
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    return (
        f"{shape.name} shape: Qwen2ForCausalLM, hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"{shape.layers} layers, {shape.heads}/{shape.kv_heads} heads, vocab {shape.vocab}, tied; random weights, "
        f"{str(model.dtype).removeprefix('torch.')}; weights {weights_gib:.2f} GiB"
    )


def describe_run(args: argparse.Namespace, device: torch.device, workload: Workload, busy_source: str) -> str:
    real, completion = workload.real_tokens, workload.completion_tokens
    n = args.group_size
    return "\n".join(
        [
            "# GRPO-like scoring: trainer baseline vs the service",
            "",
            *run_environment(device),
            f"workload: {len(workload.sequences)} sequences, prompt U[{args.prompt_range[0]}, "
            f"{args.prompt_range[1]}] + completion U[{args.completion_range[0]}, {args.completion_range[1]}] "
            f"tokens, random ids (seed "
            f"{args.seed + 1}); real tokens {real:,} ({real - completion:,} prompt + {completion:,} completion)",
            f"baseline (a) in groups of {n} padded to P_max + C_max: {workload.padded_tokens:,} token positions "
            f"({workload.padded_tokens / real:.2f}x the real tokens) and {workload.baseline_logit_rows:,} lm_head rows "
            f"({workload.baseline_logit_rows / completion:.2f}x the completion tokens)",
            f"service: max_batch_tokens {args.max_batch_tokens}, max_batch_sequences {args.max_batch_sequences}, "
            f"default (auto) lm_head kernel; (c): {args.clients} client threads, "
            f"{len(workload.groups)} requests of {n} sequences, server in this process",
            f"each method: {args.warmup} warm-up + {args.repeats} timed passes over the whole workload; tokens/s = "
            "real tokens / median pass; p50/p99 over all timed passes: (a) one micro-batch "
            f"({'device time, CUDA events' if device.type == 'cuda' else 'wall time'}), "
            "(b) one packed micro-batch (launch to next launch), (c) one request's round trip with "
            f"{args.clients} in flight",
            f"GPU busy: {busy_source}",
        ]
    )


def format_report(header: str, reports: list[ShapeReport], workload: Workload) -> str:
    sections = [header]
    for r in reports:
        section = [
            f"## {r.model_line}",
            "",
            format_table(r.rows, workload),
            "",
            format_checks(r.shape, r.rows, workload),
        ]
        if r.sweep:
            section += ["", format_sweep(r.sweep, workload)]
        if r.top_k:
            section += ["", format_top_k(r.top_k, workload)]
        sections.append("\n".join(section))
    return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------------------- main


def int_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def fill_workload_defaults(args: argparse.Namespace, smoke: bool, **more: Any) -> None:
    """Set each workload option the command line left None: the GRPO-like workload, or with
    ``smoke`` a tiny one on the CPU; ``more``: the calling benchmark's own (e.g. ``repeats``).
    The benchmarks that run this workload (bench_moe, bench_http) take these defaults too."""
    defaults = {
        "device": "cpu" if smoke else "cuda",
        "sequences": 16 if smoke else 256,
        "prompt_range": (4, 16) if smoke else (256, 1024),
        "completion_range": (2, 24) if smoke else (64, 4096),
        "clients": 2 if smoke else 8,
        "max_batch_tokens": 128 if smoke else DEFAULT_MAX_BATCH_TOKENS,
        **more,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny model, 16 short sequences, cpu, float32: checks the script runs")
    add("--shapes", default="0.5b,1.5b", help=f"comma-separated, of: {', '.join(SHAPES)} (ignored with --smoke)")
    add("--device", default=None, help="torch device (default: cuda, or cpu with --smoke)")
    add("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: bf16 on cuda, else fp32")
    add("--sequences", type=int, default=None, help="sequences in the workload (default 256; 16 with --smoke)")
    add("--prompt-range", type=int_pair, default=None, help="LOW,HIGH prompt tokens (default 256,1024; 4,16 smoke)")
    add("--completion-range", type=int_pair, default=None, help="LOW,HIGH completion tokens (default 64,4096; 2,24)")
    add("--group-size", type=int, default=8, help="sequences per baseline micro-batch and per gRPC request")
    add("--clients", type=int, default=None, help="concurrent gRPC clients (default 8; 2 with --smoke)")
    add("--max-batch-tokens", type=int, default=None, help="the service's budget of real tokens per micro-batch")
    add("--max-batch-sequences", type=int, default=256, help="the service's sequences per micro-batch")
    add("--sweep-batch-tokens", type=int_list, default=[], help="also run (b) with each, e.g. 16384,32768,65536")
    add("--top-k", type=int_list, default=[], help="also run (c) asking each top_k, e.g. 20,256")
    add("--warmup", type=int, default=1, help="untimed passes per method first")
    add("--repeats", type=int, default=None, help="timed passes per method (default 3; 2 with --smoke)")
    add("--sample-ms", type=float, default=100.0, help="GPU utilization sampling interval")
    add_scoring_arguments(parser)
    add("--seed", type=int, default=0)
    add(
        "--deterministic",
        default="off",
        choices=["off", "on", "both"],
        help="the service's deterministic setting; both: (b) and (c) with it off, then on (its cost, in one run)",
    )
    args = parser.parse_args(argv)
    smoke = args.smoke
    fill_workload_defaults(args, smoke, repeats=2 if smoke else 3)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    args.shape_list = [TINY] if smoke else [SHAPES[s.strip()] for s in args.shapes.split(",") if s.strip()]
    if min(args.sequences, args.group_size, args.clients, args.max_batch_tokens, args.repeats) < 1:
        parser.error("--sequences, --group-size, --clients, --max-batch-tokens and --repeats must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    longest = args.prompt_range[1] + args.completion_range[1]
    for shape in args.shape_list:
        if longest > shape.max_positions:
            raise SystemExit(f"longest sequence ({longest} tokens) > {shape.name}'s {shape.max_positions} positions")
    sampler = BusySampler.for_device(device, args.sample_ms / 1e3)
    if sampler is not None:
        sampler.start()
    harness = Harness(device, sampler, args.warmup, args.repeats)
    try:
        reports = []
        for shape in args.shape_list:
            reports.append(run_shape(shape, args, harness, dtype))
            gc.collect()  # the shape's model, scorers and server go before the next model is built
            release(device)
    finally:
        if sampler is not None:
            sampler.stop()
    # Token counts do not depend on the vocabulary: lengths are drawn before ids.
    workload = workload_for(args, args.shape_list[0].vocab)
    busy_source = (
        f"{sampler.source}, every {args.sample_ms:g} ms, mean over the timed passes "
        "(percent of time a kernel was running)"
        if sampler is not None
        else "n/a (no CUDA device, or no way to read its utilization)"
    )
    report = format_report(describe_run(args, device, workload, busy_source), reports, workload)
    publish(report, "bench_batching.md")


if __name__ == "__main__":
    main()
