"""The vocab-parallel lm_head stage on two GPUs (NCCL), against the same fused kernel on one.

A Qwen2.5-7B-like lm_head (H 3584, V 152064, bf16; logits of std ~3) over 4096 rows, softcap and
temperature on and off: each GPU runs the fused kernel on half the vocabulary and one all-gather
combines the per-token statistics. Goal (issue 19): within 1e-4 nats of TP=1. Both sides read the
same bf16 operands and accumulate in float32; they differ only in summation order (the vocabulary
splits, and the combination's few float32 roundings of values of the size of the log-sum-exp,
~1e-6 each), so 1e-4 is a bound with room, not a fit. Skipped without two GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from logprob_service.domain import ScoreOptions
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import LogitTransform
from logprob_service.ops.vocab_parallel import vocab_parallel_logprobs

from tests.helpers.op_reference import random_case
from tests.helpers.processes import free_port
from tests.helpers.seeds import session_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

N, H, V = 4096, 3584, 152064
TRANSFORMS = [LogitTransform(), LogitTransform(softcap=30.0, temperature=0.7)]
GOAL_NATS = 1e-4


def run_rank(rank: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hidden, weight, targets, _ = random_case(N, H, V, dtype=torch.bfloat16, seed=session_seed("vocab-parallel-cuda"))
    hidden, weight, targets = hidden.cuda(), weight.cuda(), targets.cuda()
    op = LogprobOp("triton", invariant=True)
    start = rank * V // 2
    results = []
    for transform in TRANSFORMS:
        split = vocab_parallel_logprobs(
            hidden,
            weight[start : start + V // 2],
            targets,
            vocab_start=start,
            group=dist.group.WORLD,
            op=op,
            transform=transform,
            options=ScoreOptions(return_entropy=True),
        )
        whole = op(hidden, weight, targets, transform=transform, options=ScoreOptions(return_entropy=True))
        results.append([t.cpu() for t in (split.logprobs, split.entropies, whole.logprobs, whole.entropies)])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_gpus_match_one_within_the_goal(tmp_path):
    mp.spawn(run_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for transform, (lp, ent, lp1, ent1), other in zip(TRANSFORMS, ranks[0], ranks[1], strict=True):
        assert torch.equal(lp, other[0]) and torch.equal(ent, other[1])  # every rank the same scores
        assert (lp - lp1).abs().max().item() <= GOAL_NATS, transform
        assert (ent - ent1).abs().max().item() <= GOAL_NATS, transform
        assert lp1.std() > 0.5  # the logits really spread (not a near-uniform softmax)
