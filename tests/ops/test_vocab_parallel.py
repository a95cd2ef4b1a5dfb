"""The vocab-parallel log-prob stage on the gloo backend, against the float64 reference of full logits.

Each world size spawns its ranks once (one CPU process each); every rank scores all cases with its
slice of the lm_head rows, as ``models.tensor_parallel.head_shard`` slices them (torch.chunk's
split: the 97-token vocabulary is 49 + 48 over 2 ranks, 33 + 33 + 31 over 3), through the eager
op in float32 and the fused kernel in float16 (Triton's interpreter). Every target shard occurs.
Checked: every rank returns the same scores, bit for bit, and they are within ``OP_FP32`` of
the float64 log-probs and entropies of the whole vocabulary (the combination adds a few float32
roundings of values of the size of the log-sum-exp, ~1e-6, to the op's own error).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import LogitTransform
from logprob_service.ops.vocab_parallel import vocab_parallel_logprobs

from tests.helpers import tolerances
from tests.helpers.op_reference import random_case, reference
from tests.helpers.processes import free_port
from tests.helpers.seeds import session_seed

pytestmark = pytest.mark.numerical

VOCAB = 97


@dataclass(frozen=True)
class Case:
    n: int
    h: int
    kernel: str  # "eager" or "triton"
    dtype: torch.dtype
    transform: LogitTransform
    bias: bool
    seed: int


def cases() -> list[Case]:
    transforms = [LogitTransform(), LogitTransform(scale=0.25, softcap=4.0, temperature=1.7)]
    made = []
    for kernel, dtype in (("eager", torch.float32), ("triton", torch.float16)):
        for t, transform in enumerate(transforms):
            for bias in (False, True):
                n = 1 if (t, bias) == (0, False) else 41  # one lone row, else enough to hit every shard
                name = f"vocab-parallel-{kernel}-{t}-{bias}"
                made.append(Case(n, 32, kernel, dtype, transform, bias, session_seed(name)))
    return made


def inputs(case: Case):
    return random_case(case.n, case.h, VOCAB, dtype=case.dtype, bias=case.bias, seed=case.seed)


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # as tests/conftest.py sets it for this process's parent
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    step = -(-VOCAB // world)
    start, stop = min(step * rank, VOCAB), min(step * (rank + 1), VOCAB)
    results = []
    for case in cases():
        hidden, weight, targets, bias = inputs(case)
        scores = vocab_parallel_logprobs(
            hidden,
            weight[start:stop],
            targets,
            vocab_start=start,
            group=dist.group.WORLD,
            op=LogprobOp(case.kernel),
            bias_shard=bias[start:stop] if bias is not None else None,
            transform=case.transform,
            return_entropy=True,
        )
        results.append((scores.logprobs, scores.entropies))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """What each rank of a group of ``request.param`` returned for every case."""
    world = request.param
    out = tmp_path_factory.mktemp(f"vocab-parallel-{world}")
    mp.spawn(run_rank, args=(world, free_port(), str(out)), nprocs=world)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


def test_every_rank_gets_the_same_scores(ranks):
    for rank in ranks[1:]:
        for (lp, ent), (lp0, ent0) in zip(rank, ranks[0], strict=True):
            assert torch.equal(lp, lp0) and torch.equal(ent, ent0)


def test_scores_match_the_whole_vocabulary(ranks):
    all_cases = cases()
    step = -(-VOCAB // len(ranks))
    assert {int(t) // step for c in all_cases for t in inputs(c)[2]} == set(range(len(ranks)))  # every shard
    for case, (logprobs, entropies) in zip(all_cases, ranks[0], strict=True):
        hidden, weight, targets, bias = inputs(case)
        want_lp, want_ent = reference(hidden, weight, targets, bias, case.transform)
        torch.testing.assert_close(logprobs.double(), want_lp, atol=tolerances.OP_FP32, rtol=0, msg=str(case))
        torch.testing.assert_close(entropies.double(), want_ent, atol=tolerances.OP_FP32, rtol=0, msg=str(case))
