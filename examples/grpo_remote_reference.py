"""GRPO with TRL, the reference model served by logprob-service.

A short run of TRL's GRPOTrainer on ``builtin:tiny-llama`` on the CPU with a toy reward. The
reference log-probs of the KL term (``beta > 0``) come from a logprob-service: a local one this
script starts as a subprocess, or the one at ``--target`` (``make serve`` serves the reference it
expects: ``builtin:tiny-llama`` as ``default``). Prints the KL and the loss at every step, and the
reward at every step that generated (with ``--num-iterations`` N, TRL generates every N steps).
Needs the server and TRL extras (``make install`` has both).

    python examples/grpo_remote_reference.py                 # starts a local service, 5 steps
    python examples/grpo_remote_reference.py --steps 20 --num-iterations 2
    python examples/grpo_remote_reference.py --target localhost:50051   # against `make serve`
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator

import grpc
from datasets import Dataset
from grpc_health.v1 import health_pb2, health_pb2_grpc
from logprob_client import LogprobClient
from logprob_client.integrations.trl import RemoteReference, RemoteReferenceGRPOTrainer
from logprob_service.models.builtin import build_builtin, tiny_llama_tokenizer
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from trl import GRPOConfig

# TRL 1.16 still uses transformers' old gradient-checkpointing names; the warnings are not ours to fix.
warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)

PROMPTS = ["The cat sat on", "Once upon a time", "def add(a, b):", "Roses are red,", "1, 2, 3,", "Dear Sir,"]


def low_half_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """Toy reward: the share of a completion's tokens in the lower half of the vocabulary.

    A stand-in for a reward model that even a randomly initialized policy can learn in a few steps.
    """
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class PrintKLAndLoss(TrainerCallback):
    """One line per step from TRL's logs: ``kl`` and ``loss`` come every step, ``reward`` only from
    a step that generated (with ``num_iterations`` > 1, the steps that reuse a batch log none)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "kl" in logs:
            line = f"step {state.global_step:3d}  kl {logs['kl']:.6f}  loss {logs['loss']:+.6f}"
            if logs.get("reward") is not None:
                line += f"  reward {logs['reward']:.3f}"
            print(line, flush=True)


@contextlib.contextmanager
def local_service(model_name: str, timeout_s: float = 300.0) -> Iterator[str]:
    """``logprob-service serve`` in a subprocess on a free loopback port; yields its target once
    the standard gRPC health check says SERVING (models loaded and warmed up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "logprob_service.cli", "serve", "--port", str(port), "--metrics-port", "0"]
    options = ["--device", "cpu", "--model", f"{model_name}=builtin:tiny-llama", "--log-level", "WARNING"]
    server = subprocess.Popen([*command, *options])
    try:
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout_s
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"logprob-service exited with code {server.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"logprob-service at {target} not SERVING after {timeout_s} s")
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                time.sleep(0.2)
        yield target
    finally:
        server.terminate()  # SIGTERM: the service drains and exits
        server.wait(timeout=60)


def train(target: str, reference: str, steps: int, beta: float, num_iterations: int, output_dir: str) -> None:
    policy = build_builtin("tiny-llama")  # the same seeded weights the service serves as the reference
    args = GRPOConfig(
        output_dir=output_dir,
        beta=beta,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=16,
        max_steps=steps,
        num_iterations=num_iterations,
        learning_rate=3e-3,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    with LogprobClient(target) as client:
        trainer = RemoteReferenceGRPOTrainer(
            model=policy,
            reward_funcs=low_half_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
            processing_class=tiny_llama_tokenizer(),
            reference=RemoteReference(client, model=reference),
            callbacks=[PrintKLAndLoss()],
        )
        for noisy in (PrinterCallback, ProgressCallback):  # keep the output to one line per step
            trainer.remove_callback(noisy)
        trainer.train()


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a running logprob-service (default: start a local one)")
    parser.add_argument(
        "--reference", default="default", help="the served model's name (default: default, as `make serve` serves it)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--beta", type=float, default=0.1, help="KL coefficient (> 0: the reference is used)")
    parser.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per generated batch (TRL's)")
    return parser


def main() -> None:
    args = argument_parser().parse_args()
    options = (args.reference, args.steps, args.beta, args.num_iterations)
    with tempfile.TemporaryDirectory(prefix="grpo-remote-reference-") as output_dir:
        if args.target:
            train(args.target, *options, output_dir)
            return
        with local_service(args.reference) as target:
            train(target, *options, output_dir)


if __name__ == "__main__":
    main()
