"""On-policy distillation with TRL, the teacher served by logprob-service.

A short run of TRL's ``ServerDistillationTrainer`` (``trl.experimental``, TRL 1.16) on the CPU:
the student (``builtin:tiny-llama``'s architecture, its weights perturbed) samples completions,
and the teacher's top-k log-probs at every completion position come from a logprob-service
(``top_k``), through ``logprob_client.integrations.trl_teacher``. The loss is
TRL's forward KL over the teacher's top-k (``beta=0``, ``loss_top_k``), with the tail bucket
(``loss_add_tail``). Prints the loss at every step. The service is a local one this script starts
as a subprocess (``builtin:tiny-llama`` as ``default``: the teacher), or the one at ``--target``.

    python examples/distill_trl.py                          # starts a local service, 5 steps, top-20
    python examples/distill_trl.py --steps 20 --top-k 128
    python examples/distill_trl.py --target localhost:50051  # against `make serve`

``logprob_client.losses`` has the same divergences for trainers of one's own
(``top_k_forward_kl``, ``top_k_generalized_jsd``, and ``reverse_kl_advantages`` /
``reverse_kl_loss`` from the teacher's log-probs of the sampled tokens alone).
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from datasets import Dataset
from grpo_remote_reference import PROMPTS, local_service
from logprob_client import LogprobClient
from logprob_client.integrations.trl_teacher import ServiceDistillationTrainer, ServiceTeacher
from logprob_service.models.builtin import build_builtin, tiny_llama_tokenizer
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from trl.experimental.server_distillation import ServerDistillationConfig

warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*experimental.*", category=UserWarning)


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step:3d}  loss {logs['loss']:.6f}", flush=True)


def student() -> torch.nn.Module:
    """The teacher's architecture with its weights moved by seeded noise: a student that differs."""
    model = build_builtin("tiny-llama")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def train(target: str, teacher: str, steps: int, top_k: int, output_dir: str) -> None:
    args = ServerDistillationConfig(
        output_dir=output_dir,
        teacher_model_server_url=f"grpc://{target}",  # TRL requires one; ServiceTeacher is what answers
        loss_top_k=top_k,
        loss_add_tail=True,
        beta=0.0,
        per_device_train_batch_size=4,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=3e-3,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    with LogprobClient(target) as client:
        trainer = ServiceDistillationTrainer(
            model=student(),
            teacher=ServiceTeacher(client, model=teacher),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
            processing_class=tiny_llama_tokenizer(),
            callbacks=[PrintLoss()],
        )
        for noisy in (PrinterCallback, ProgressCallback):  # one line per step
            trainer.remove_callback(noisy)
        trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a running logprob-service (default: start a local one)")
    parser.add_argument("--teacher", default="default", help="the served teacher's name (default: default)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=20, help="the teacher's top-k per position (1-256)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distill-trl-") as output_dir:
        if options.target:
            train(options.target, options.teacher, options.steps, options.top_k, output_dir)
            return
        with local_service(options.teacher) as target:
            train(target, options.teacher, options.steps, options.top_k, output_dir)


if __name__ == "__main__":
    main()
