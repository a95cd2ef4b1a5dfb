"""verl's reference step on a GRPO-like batch: verl's own ref worker on GPU 0 against the
``logprob_service`` engine with the service on GPU 1.

Both runs go through verl 0.9.1's own code, in this process (no Ray workers): its
``ActorRolloutRefWorker`` (role "ref") built from its hydra config, and the ref step of its
trainer, ``RayPPOTrainer._compute_ref_log_prob`` (``left_right_2_no_padding``, the worker,
``no_padding_2_padding``), on the same ``DataProto`` batches.

  1. verl: the stock ref (``FSDPActorConfig``, verl's FSDP engine, bf16, remove-padding on with
     flash-attn; without flash-attn installed, the same packed rows through FlashAttention-2's varlen
     kernel as torch ships it, ``register_varlen_attention``; said in the table);
  2. service: the three override lines of docs/verl.md; ``logprob-service serve`` on GPU 1 in bf16.

Workload: ``--prompts`` prompts x ``--n`` responses (GRPO groups), prompt lengths uniform in
[prompt_len / 2, prompt_len], response lengths in [response_len / 8, response_len], rows shuffled
(verl's length balancing). Model: Qwen2.5-1.5B and 7B shapes, random weights (speed and memory
depend on shapes only), saved once as an HF checkpoint that both load.

Reported per shape and run: the time the trainer waits for the ref log-probs (median over
``--steps`` after ``--warmup``, device synchronized), tokens/s per GPU used (prompt + response
tokens of the batch; verl uses GPU 0, the service GPU 1 and nothing of GPU 0), the trainer GPU's
peak allocated memory during the step, the largest difference of each run's ref log-probs from an
fp32 forward of the model (``--check-rows`` rows, float64 log-softmax), and between the two runs
(both bf16; response tokens only). ``--profile`` writes the op table of verl's first timed step
(torch's profiler: minutes for a 20 s step).

Ray and datasets (and pyarrow under it) are imported by verl's modules but unused on this path, and their
wheels (79 and 55 MiB) cannot travel to the GPU machine: where they are missing, empty
stand-ins are registered for them (``stand_in``). Wheels the GPU machine needs besides the project's:
verl-0.9.1, tensordict-0.10.0 (with pyvers<0.2, orjson, cloudpickle, importlib_metadata, zipp),
omegaconf, hydra-core, antlr4-python3-runtime==4.9.3, codetiming
(about 3 MiB in all; docs/verl.md has the commands).

Run (2 GPUs): PYTHONPATH=service:client python benchmarks/bench_verl.py [--shapes 1.5b 7b]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from common import SHAPES, build_model
from harness import publish, run_environment

ROOT = Path(__file__).resolve().parent.parent


class _Anything:
    """Whatever a stood-in module is asked for: callable (a decorator returns what it decorates),
    subscriptable, a base class, false."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Anything(self._name + "()")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (object,)

    def __getitem__(self, key):
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops: set[str]) -> None:
        self.tops = tops

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__file__ = f"<stand-in for {spec.name}>"  # inspect.getmodule takes a module without one for built-in
        module.__getattr__ = lambda name: _Anything(f"{spec.name}.{name}")  # PEP 562
        return module

    def exec_module(self, module) -> None:
        pass


def stand_in(*packages: str) -> list[str]:
    """Empty stand-ins for those of ``packages`` that are not installed; the ones stood in."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        sys.meta_path.insert(0, _StandIns(set(missing)))
    return missing


VARLEN_FA2 = "varlen_fa2"


def register_varlen_attention() -> None:
    """transformers attention ``varlen_fa2``: FlashAttention-2's varlen kernel as torch ships it
    (``torch.nn.attention.varlen.varlen_attn``), for verl's remove-padding path where the
    flash-attn package is not installed. verl then runs as its docs recommend (packed rows, one
    varlen kernel), not padded: the same kernel flash-attn's ``flash_attn_varlen_func`` runs.

    Packed rows come as one [1, heads, T, D] batch whose position ids restart at 0 at each
    sequence (verl's ``position_ids_rmpad``); the sequence starts are where they are 0."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def varlen_fa2(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        position_ids = kwargs.get("position_ids")
        if query.shape[0] != 1 or position_ids is None or sliding_window is not None:
            raise ValueError("varlen_fa2 takes verl's packed rows: batch 1, position ids, no sliding window")
        total = query.shape[2]
        starts = (position_ids.reshape(-1) == 0).nonzero().flatten()
        cu = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
        groups = q.shape[1] // k.shape[1]  # torch's varlen_attn takes as many K/V heads as query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0))  # causal
        return out.unsqueeze(0), None  # [1, T, heads, D], as flash_attention_2 returns

    AttentionInterface.register(VARLEN_FA2, varlen_fa2)
    AttentionMaskInterface.register(VARLEN_FA2, flash_attention_mask)


def rollout(rng: np.random.Generator, prompts: int, n: int, prompt_len: int, response_len: int, vocab: int):
    rows = []
    for _ in range(prompts):
        prompt = rng.integers(100, vocab, int(rng.integers(prompt_len // 2, prompt_len + 1)))
        rows += [
            (prompt, rng.integers(100, vocab, int(rng.integers(response_len // 8, response_len + 1)))) for _ in range(n)
        ]
    return [rows[i] for i in rng.permutation(len(rows))]


def reference_log_probs(model_dir: Path, rows, device: torch.device, temperature: float) -> list[torch.Tensor]:
    """Each row's response log-probs from an fp32 copy of the model, one unpadded row at a time,
    log-softmax in float64: what both runs' bf16 answers are held to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    out = []
    with torch.no_grad():
        for prompt, response in rows:
            ids = torch.as_tensor(np.concatenate([prompt, response]), device=device)[None]
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
            out.append(logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1).cpu())
    del model
    torch.cuda.empty_cache()
    return out


def response_diff(a: torch.Tensor, b: torch.Tensor, rows) -> float:
    """Largest |a - b| over the response tokens of ``rows`` ([B, R] right-padded log-probs: what
    the padding holds is nobody's answer)."""
    return max(
        float((a[i, : len(r)].double().cpu() - b[i, : len(r)].double().cpu()).abs().max())
        for i, (_, r) in enumerate(rows)
    )


def compose_config(model_dir: Path, extra: list[str]):
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=False",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.ref.fsdp_config.dtype=bfloat16",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


class _Trainer:
    def __init__(self, worker) -> None:
        self.ref_in_actor, self.ref_policy_wg = False, worker


def time_ref_steps(worker, batches, device: torch.device, warmup: int, profile: Path | None = None):
    """Time verl's ref step on each batch after ``warmup``; with ``profile``, the first timed step
    runs under torch's profiler and its op table (by CPU and by CUDA time) is written there."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    times, outputs = [], []
    for i, batch in enumerate(batches):
        torch.cuda.synchronize(device)
        if i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        profiler = torch.profiler.profile() if profile and i == warmup else contextlib.nullcontext()
        start = time.perf_counter()
        with profiler:
            out = RayPPOTrainer._compute_ref_log_prob(_Trainer(worker), batch)
            torch.cuda.synchronize(device)
        if isinstance(profiler, torch.profiler.profile):
            table = profiler.key_averages()
            profile.write_text(
                "\n\n".join(
                    table.table(sort_by=key, row_limit=30) for key in ("self_cpu_time_total", "self_cuda_time_total")
                )
            )
        if i >= warmup:
            times.append(time.perf_counter() - start)
            outputs.append(out.batch["ref_log_prob"])
    return times, outputs, torch.cuda.max_memory_allocated(device)


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    from logprob_service.api.probe import check

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode}")
        if check(target, timeout_s=1)[0]:
            return
        time.sleep(1)
    raise TimeoutError(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5b", "7b"], choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-token-len", type=int, default=16384, help="verl's log_prob_max_token_len_per_gpu")
    parser.add_argument("--trainer-gpu", type=int, default=0)
    parser.add_argument("--service-gpu", type=int, default=1)
    parser.add_argument("--port", type=int, default=50571)
    parser.add_argument("--check-rows", type=int, default=4, help="rows held to an fp32 forward (0: none)")
    parser.add_argument("--profile", action="store_true", help="write verl's first timed step's op table to $OUT")
    args = parser.parse_args()

    stood_in = stand_in("ray", "datasets", "uvicorn", "fastapi", "torchdata", "cachetools", "pylatexenc")
    device = torch.device("cuda", args.trainer_gpu)
    torch.cuda.set_device(device)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=device)
    from logprob_client.integrations.verl import padded_batch  # verl's padded batch, as the tests build it
    from verl.workers.engine_workers import ActorRolloutRefWorker

    flash = importlib.util.find_spec("flash_attn") is not None
    if not flash:
        register_varlen_attention()
    attention = "flash_attention_2" if flash else VARLEN_FA2
    verl_attention = [
        f"+actor_rollout_ref.model.override_config.attn_implementation={attention}",
        "actor_rollout_ref.model.use_remove_padding=True",
    ]
    batching = [
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={args.max_token_len}",
    ]
    lines = [
        "| shape | run | ref wait (s, median) | tokens/s/GPU | trainer GPU peak (GiB) | max abs diff vs fp32 forward"
        " | max abs diff vs verl |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in args.shapes:
        shape = SHAPES[key]
        rng = np.random.default_rng(1234)
        batches_rows = [
            rollout(rng, args.prompts, args.n, args.prompt_len, args.response_len, shape.vocab)
            for _ in range(args.warmup + args.steps)
        ]
        tokens = statistics.mean(sum(len(a) + len(b) for a, b in rows) for rows in batches_rows[args.warmup :])
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / key
            build_model(shape, device, torch.bfloat16, seed=1234).save_pretrained(model_dir)
            torch.cuda.empty_cache()
            checked = batches_rows[args.warmup][: args.check_rows]  # the first timed batch's first rows
            reference = reference_log_probs(model_dir, checked, device, args.temperature)
            padded_reference = torch.nn.utils.rnn.pad_sequence(reference, batch_first=True)

            config = compose_config(model_dir, [*verl_attention, *batching])
            worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
            worker.init_model()
            profile = Path(os.environ.get("OUT", ".")) / f"bench_verl_profile_{key}.txt" if args.profile else None
            times, verl_out, peak = time_ref_steps(
                worker, [padded_batch(r, args.temperature) for r in batches_rows], device, args.warmup, profile
            )
            verl_error = response_diff(verl_out[0].cpu(), padded_reference, checked)
            kernel = "flash-attn" if flash else "torch's FA2 varlen kernel"
            label = f"verl (FSDP, remove-padding, {kernel})"
            median = statistics.median(times)
            lines.append(
                f"| {shape.name} | {label} | {median:.3f} | {tokens / median:,.0f} | {peak / 2**30:.2f} | "
                f"{verl_error:.3g} | 0 |"
            )
            del worker
            torch.cuda.empty_cache()

            target = f"127.0.0.1:{args.port}"
            # The project first, then whatever the caller's path holds (where the server's wheels may lie).
            path = [str(ROOT / "service"), str(ROOT / "client"), *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
            proc = subprocess.Popen(
                [sys.executable, "-m", "logprob_service.cli", "serve", "--host", "127.0.0.1", "--port", str(args.port),
                 "--metrics-port", str(args.port + 1), "--device", f"cuda:{args.service_gpu}", "--dtype", "bfloat16",
                 "--model", f"ref={model_dir}"],
                env=env,
            )  # fmt: skip
            try:
                wait_serving(target, proc)
                config = compose_config(
                    model_dir,
                    [
                        "actor_rollout_ref.ref._target_=logprob_client.integrations.verl.ServiceRefConfig",
                        f"+actor_rollout_ref.ref.service.address={target}",
                        "+actor_rollout_ref.ref.service.model=ref",
                        *batching,
                    ],
                )
                worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
                worker.init_model()
                times, served_out, peak = time_ref_steps(
                    worker, [padded_batch(r, args.temperature) for r in batches_rows], device, args.warmup
                )
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            diff = max(
                response_diff(a.cpu(), b.cpu(), rows)
                for a, b, rows in zip(verl_out, served_out, batches_rows[args.warmup :])
            )
            median = statistics.median(times)
            served_error = response_diff(served_out[0].cpu(), padded_reference, checked)
            lines.append(
                f"| {shape.name} | service (GPU {args.service_gpu}) | {median:.3f} | {tokens / median:,.0f} | "
                f"{peak / 2**30:.2f} | {served_error:.3g} | {diff:.3g} |"
            )
    workload = (
        f"{args.prompts} prompts x {args.n} responses, prompts <= {args.prompt_len}, responses <= {args.response_len} "
        f"tokens ({tokens:,.0f} tokens a batch), temperature {args.temperature}"
    )
    notes = [f"stood in for (not installed, unused here): {', '.join(stood_in)}"] if stood_in else []
    publish("\n".join([*run_environment(device), workload, *notes, "", *lines]), "bench_verl.md")


if __name__ == "__main__":
    main()
