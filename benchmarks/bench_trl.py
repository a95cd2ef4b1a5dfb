"""TRL's GRPOTrainer on the GPU, with and without its reference and old-policy log-probs offloaded.

The policy: a Llama-architecture model with the body of Qwen2.5-0.5B (hidden 896, 24 layers, 14/2
heads, intermediate 4864) and the 4096-token vocabulary of the builtin character tokenizer (TRL
needs text in and out), random weights, saved as a checkpoint that every run starts from.

Runs, one after the other, the same seed and GRPO settings (``num_iterations`` 2, so TRL needs
old-policy log-probs; ``beta`` > 0, so it needs reference ones):

  1. TRL alone: ``GRPOTrainer``, its reference model and the old-policy forward on the trainer's GPU;
  2. offloaded: ``RemoteReferenceGRPOTrainer`` with ``RemoteReference`` and ``RemotePolicy`` on a
     ``logprob-service serve`` process on the same GPU (what a one-GPU node runs), the policy's
     weights pushed to it after each optimizer step that changed them (``transport="auto"``: CUDA
     IPC, since the server is on this host).

Reported per run: seconds per optimizer step (median over the steps after ``--warmup``, the
device synchronized), split into the step's generation-and-scoring phase (TRL's
``_generate_and_score_completions``, which holds the reference and old-policy scoring, and in the
offloaded run the weight push) and the rest (loss, backward, optimizer); the trainer's peak device
memory; and the losses of both runs (they sample alike, from the same seed; bf16 rounding differs
between the paths, so they agree only roughly).

Run: PYTHONPATH=service:client python3 benchmarks/bench_trl.py   (TRL and datasets needed: the [trl] extra;
``--smoke``: the builtin tiny model on the CPU, a few short steps, to check the script)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from harness import publish, run_environment
from logprob_client import LogprobClient
from logprob_client.integrations.trl import RemotePolicy, RemoteReference, RemoteReferenceGRPOTrainer
from logprob_service.api.probe import check as health_check
from logprob_service.models.builtin import seeded_init_, tiny_llama_config, tiny_llama_tokenizer
from transformers import LlamaForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234


def reward(completion_ids: list[list[int]], **_) -> list[float]:
    """A toy reward (the share of low ids): the policy moves, so each step's weights differ."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


QWEN25_05B_BODY = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}


def save_policy(path: Path, dtype: torch.dtype, smoke: bool) -> None:
    config = tiny_llama_config()
    if not smoke:
        config.update(QWEN25_05B_BODY)
    seeded_init_(LlamaForCausalLM(config)).to(dtype).save_pretrained(path)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Timings(TrainerCallback):
    """Each optimizer step's wall time, and the time of its generation phase (if it had one)."""

    steps: list[float] = field(default_factory=list)
    generation: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    _start: float = 0.0
    _generated: float = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self._start, self._generated = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.steps.append(time.perf_counter() - self._start)
        self.generation.append(self._generated)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def timed(self, generate):
        def timed_generate(inputs):
            synchronize()
            start = time.perf_counter()
            out = generate(inputs)
            synchronize()
            self._generated += time.perf_counter() - start
            return out

        return timed_generate


def train(trainer_cls, policy_dir: Path, out_dir: Path, args, **kwargs) -> tuple[Timings, int]:
    config = GRPOConfig(
        output_dir=str(out_dir),
        num_iterations=2,  # each generation serves two optimizer steps: TRL needs old-policy log-probs
        beta=0.04,
        temperature=0.9,
        num_generations=8,
        per_device_train_batch_size=args.batch,
        max_completion_length=args.completion,
        max_steps=args.steps,
        learning_rate=1e-5,
        logging_steps=1,
        seed=SEED,
        bf16=not args.smoke,
        use_cpu=args.smoke,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    prompts = [f"Prompt {i}: count the letters of the alphabet" for i in range(64)]
    timings = Timings()
    trainer = trainer_cls(
        model=str(policy_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny_llama_tokenizer(),
        callbacks=[timings],
        **kwargs,
    )
    trainer._generate_and_score_completions = timings.timed(trainer._generate_and_score_completions)
    if not args.smoke:
        torch.cuda.reset_peak_memory_stats()
    transformers.set_seed(SEED)
    trainer.train()
    peak = 0 if args.smoke else torch.cuda.max_memory_allocated()
    del trainer
    if not args.smoke:
        torch.cuda.empty_cache()
    return timings, peak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(policy_dir: Path, port: int, log: Path, device: torch.device) -> subprocess.Popen:
    """``logprob-service serve`` on ``device``, serving the policy's checkpoint as the reference and
    as the old policy; returns once it is SERVING."""
    path = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "logprob_service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--metrics-port", "0", "--device", str(device)]
    command += ["--model", f"ref={policy_dir}", "--model", f"policy={policy_dir}"]
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log}")
        if health_check(f"127.0.0.1:{port}", timeout_s=1)[0]:
            return proc
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"the server never became SERVING: see {log}")


def summary(name: str, timings: Timings, peak: int, warmup: int) -> str:
    steps, generation = timings.steps[warmup:], timings.generation[warmup:]
    rest = [s - g for s, g in zip(steps, generation, strict=True)]
    with_generation = [g for g in generation if g > 0]
    return (
        f"| {name} | {statistics.median(steps):.3f} | {statistics.mean(steps):.3f} | "
        f"{statistics.median(with_generation) if with_generation else float('nan'):.3f} | "
        f"{statistics.median(rest):.3f} | {peak / 2**30:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--batch", type=int, default=64, help="completions per step (8 per prompt)")
    parser.add_argument("--completion", type=int, default=256, help="tokens per completion")
    parser.add_argument("--smoke", action="store_true", help="the builtin tiny model on the CPU, a few short steps")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.batch, args.completion = 3, 1, 8, 8
    elif not torch.cuda.is_available():
        sys.exit("bench_trl.py measures GPU steps: no CUDA device here (--smoke runs on the CPU)")
    device = torch.device("cpu" if args.smoke else "cuda:0")

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        policy_dir = tmp_path / "policy"
        save_policy(policy_dir, torch.float32 if args.smoke else torch.bfloat16, args.smoke)
        alone, alone_peak = train(GRPOTrainer, policy_dir, tmp_path / "alone", args)

        port = free_port()
        log = Path(os.environ.get("OUT", tmp)) / "bench_trl_server.log"
        server = start_server(policy_dir, port, log, device)
        try:
            with LogprobClient(f"127.0.0.1:{port}", timeout=600) as client:
                old_policy = RemotePolicy(client, model="policy")
                remote, remote_peak = train(
                    RemoteReferenceGRPOTrainer,
                    policy_dir,
                    tmp_path / "offloaded",
                    args,
                    reference=RemoteReference(client, model="ref"),
                    old_policy=old_policy,
                )
                pushes = old_policy.served.version
                by_ipc = old_policy.served.pusher is not None and old_policy.served.pusher.last_transport == "ipc"
                transport = "CUDA IPC" if by_ipc else "gRPC (dense, then sparse deltas)"
        finally:
            server.terminate()
            server.wait(timeout=60)

    step_ratio = statistics.median(alone.steps[args.warmup :]) / statistics.median(remote.steps[args.warmup :])
    lines = [
        "# TRL GRPOTrainer: reference and old-policy log-probs in the trainer, or offloaded to logprob-service",
        *run_environment(device),
        f"policy: Llama architecture, {'builtin:tiny-llama' if args.smoke else 'Qwen2.5-0.5B body'}, vocab 4096; "
        f"{args.batch} completions of {args.completion} tokens per step (8 per prompt), num_iterations 2, "
        f"beta 0.04; {args.steps} steps per run, the first {args.warmup} left out",
        f"offloaded: a logprob-service process on the same GPU serves the reference and the old policy; "
        f"the policy's weights went to it {pushes} times by {transport}",
        "",
        "| run | s/step (median) | s/step (mean) | generation phase, steps that generate (s) | rest of a step (s) "
        "| trainer's peak GPU memory (GiB) |",
        "|---|---:|---:|---:|---:|---:|",
        summary("TRL alone", alone, alone_peak, args.warmup),
        summary("offloaded to logprob-service", remote, remote_peak, args.warmup),
        "",
        f"TRL alone / offloaded, median s/step: {step_ratio:.2f}x",
        f"losses, TRL alone: {', '.join(f'{x:.4f}' for x in alone.losses)}",
        f"losses, offloaded: {', '.join(f'{x:.4f}' for x in remote.losses)}",
    ]
    publish("\n".join(lines), "bench_trl.md")


if __name__ == "__main__":
    main()
