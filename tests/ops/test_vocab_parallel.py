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
from logprob_service.domain import ScoreOptions
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import LogitTransform
from logprob_service.ops.vocab_parallel import vocab_parallel_logprobs

from tests.helpers import tolerances
from tests.helpers.op_reference import random_case, reference, transformed_logits
from tests.helpers.processes import free_port, leave_rank
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


TOP_K = 40  # more than the 31 ids of the smallest shard of 3: it pads


def candidates(case: Case) -> torch.Tensor:
    """[n, 7] ids of every shard."""
    g = torch.Generator().manual_seed(case.seed + 1)
    return torch.randint(0, VOCAB, (case.n, 7), generator=g)


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # as tests/conftest.py sets it for this process's parent
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    step = -(-VOCAB // world)
    start, stop = min(step * rank, VOCAB), min(step * (rank + 1), VOCAB)

    def shard_scores(case, **options):
        """This rank's call of the op on its vocabulary shard of ``case``'s inputs."""
        hidden, weight, targets, bias = inputs(case)
        return vocab_parallel_logprobs(
            hidden,
            weight[start:stop],
            targets,
            vocab_start=start,
            group=dist.group.WORLD,
            op=LogprobOp(case.kernel),
            bias_shard=bias[start:stop] if bias is not None else None,
            transform=case.transform,
            **options,
        )

    results = []
    for case in cases():
        scores = shard_scores(case, options=ScoreOptions(return_entropy=True))
        results.append((scores.logprobs, scores.entropies))
    topk = []  # eager only: the fused top-k is slow in the interpreter (tests/ops/test_topk.py has it)
    for case in cases():
        if case.kernel == "eager":
            scores = shard_scores(case, options=ScoreOptions(top_k=TOP_K), candidates=candidates(case))
            topk.append((scores.top_ids, scores.top_logprobs, scores.candidate_logprobs))
    torch.save((results, topk, unfinished_flags(rank, start, stop)), Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()
    leave_rank()


def unfinished_flags(rank: int, start: int, stop: int) -> list[bool]:
    """The fused top-k's ``top_k_incomplete`` (ops.lm_head.repair) as this rank returns it: with no
    repair round and, on rank 1 alone, no key of its shard surviving stage 1; then as normal."""
    from logprob_service.ops.lm_head import fused_logprobs, repair

    case = next(c for c in cases() if c.kernel == "triton" and c.n > 1)
    hidden, weight, targets, _ = inputs(case)
    real = fused_logprobs.sample_thresholds
    flags = []
    for unfinished in (True, False):
        if unfinished and rank == 1:
            fused_logprobs.sample_thresholds = lambda hidden, *args: (torch.full((len(hidden),), 2**63 - 1),) * 2
        repair.REPAIR_ROUNDS = 0 if unfinished else 3
        scores = vocab_parallel_logprobs(
            hidden,
            weight[start:stop],
            targets,
            vocab_start=start,
            group=dist.group.WORLD,
            op=LogprobOp("triton"),
            options=ScoreOptions(top_k=5),
        )
        fused_logprobs.sample_thresholds = real
        flags.append(bool(scores.top_k_incomplete))
    return flags


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """What each rank of a group of ``request.param`` returned for every case."""
    world = request.param
    out = tmp_path_factory.mktemp(f"vocab-parallel-{world}")
    mp.spawn(run_rank, args=(world, free_port(), str(out)), nprocs=world)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def scores(ranks):
    """Each rank's (log-probs, entropies) per case."""
    return [rank[0] for rank in ranks]


def test_every_rank_gets_the_same_scores(scores):
    for rank in scores[1:]:
        for (lp, ent), (lp0, ent0) in zip(rank, scores[0], strict=True):
            assert torch.equal(lp, lp0) and torch.equal(ent, ent0)


def test_scores_match_the_whole_vocabulary(scores):
    all_cases = cases()
    step = -(-VOCAB // len(scores))
    assert {int(t) // step for c in all_cases for t in inputs(c)[2]} == set(range(len(scores)))  # every shard
    for case, (logprobs, entropies) in zip(all_cases, scores[0], strict=True):
        hidden, weight, targets, bias = inputs(case)
        want_lp, want_ent = reference(hidden, weight, targets, bias, case.transform)
        torch.testing.assert_close(logprobs.double(), want_lp, atol=tolerances.OP_FP32, rtol=0, msg=str(case))
        torch.testing.assert_close(entropies.double(), want_ent, atol=tolerances.OP_FP32, rtol=0, msg=str(case))


def test_top_k_and_candidates_match_the_whole_vocabulary(ranks):
    eager = [case for case in cases() if case.kernel == "eager"]
    for rank in ranks[1:]:
        for got, want in zip(rank[1], ranks[0][1], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    for case, (top_ids, top_lps, cand_lps) in zip(eager, ranks[0][1], strict=True):
        hidden, weight, _, bias = inputs(case)
        logp = transformed_logits(hidden, weight, bias, case.transform).log_softmax(-1)
        want_vals = torch.sort(logp, dim=-1, descending=True).values
        assert top_ids.dtype == torch.int32 and top_ids.shape == (case.n, TOP_K)
        torch.testing.assert_close(top_lps.double(), want_vals[:, :TOP_K], atol=tolerances.OP_FP32, rtol=0)
        torch.testing.assert_close(top_lps.double(), logp.gather(1, top_ids.long()), atol=tolerances.OP_FP32, rtol=0)
        assert (top_ids.long().sort(-1).values.diff(dim=-1) > 0).all()
        want_c = logp.gather(1, candidates(case))
        torch.testing.assert_close(cand_lps.double(), want_c, atol=tolerances.OP_FP32, rtol=0)


def test_a_shard_left_unfinished_flags_every_rank(ranks):
    # rank 1's fused top-k unfinished: every rank's scores say so (Launched.fetch then fails the
    # micro-batch on rank 0; the followers go on, worker.tensor_parallel); no flag otherwise
    assert [rank[2] for rank in ranks] == [[True, False]] * len(ranks)
