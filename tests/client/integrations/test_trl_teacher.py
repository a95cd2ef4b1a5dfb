"""``integrations.trl_teacher``: the service answers TRL's ``get_sequence_logprobs`` in vLLM's
format (top-k per completion position, the actual token's log-prob),
``examples/distill_trl.py`` trains TRL's ServerDistillationTrainer against it, and a TRL whose
trainer ``__init__`` moved is refused naming what moved."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")

import trl
from logprob_client import LogprobClient
from logprob_client.integrations.trl import CHECKED_TRL_VERSION, TRLVersionError
from logprob_client.integrations.trl_teacher import ServiceTeacher, check_teacher_compatible
from trl.experimental.server_distillation import ServerDistillationTrainer
from trl.trainer.distillation_trainer import DistillationTrainer

ROOT = Path(__file__).resolve().parents[3]


async def test_get_sequence_logprobs_in_vllm_format(running, rng):
    prompts = [rng.integers(0, 4096, n).tolist() for n in (3, 5, 2)]
    completions = [rng.integers(0, 4096, n).tolist() for n in (4, 0, 2)]  # the second has no completion
    with LogprobClient(running.target) as client:
        teacher = ServiceTeacher(client)
        got = await asyncio.to_thread(
            teacher.get_sequence_logprobs, [p + c for p, c in zip(prompts, completions)], [3, 5, 2], 7, 0.9
        )
        want = await asyncio.to_thread(
            client.score, [prompts[0], prompts[2]], [completions[0], completions[2]], top_k=7, temperature=0.9
        )
    assert got["logprobs"][1] == [] and got["actual_token_ids"][1] == []
    for i, j in ((0, 0), (2, 1)):
        assert np.array_equal(np.asarray(got["logprob_token_ids"][i]), want.top_ids[j])
        assert np.array_equal(np.asarray(got["logprobs"][i], np.float32), want.top_logprobs[j])
        assert np.array_equal(np.asarray(got["actual_logprobs"][i], np.float32)[:, 0], want.logprobs[j])
        assert [t for (t,) in got["actual_token_ids"][i]] == completions[i]


def test_distill_example_trains_against_the_service():
    path = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distill_trl.py"), "--steps", "2", "--top-k", "8"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", done.stdout, re.M)]
    assert len(losses) == 2 and all(loss > 0 for loss in losses), done.stdout  # the student differs from the teacher


class SetsMore(DistillationTrainer):
    """A TRL release whose server trainer copies one more setting (ServiceDistillationTrainer would not)."""

    def __init__(self, model, args=None):
        super().__init__(model=model, teacher_model=None, args=args)
        self.loss_top_k = args.loss_top_k
        self.teacher_retries = args.teacher_retries


class NotADistillationTrainer(DistillationTrainer.__mro__[1]):
    __init__ = ServerDistillationTrainer.__init__


@pytest.mark.parametrize(
    "trainer_cls,problem",
    [
        (SetsMore, "SetsMore.__init__ now also uses teacher_retries"),
        (NotADistillationTrainer, "NotADistillationTrainer no longer derives from DistillationTrainer"),
    ],
    ids=["sets-more", "other-base"],
)
def test_a_moved_trainer_init_is_refused_naming_what_moved(trainer_cls, problem):
    check_teacher_compatible()  # the installed TRL's
    with pytest.raises(TRLVersionError) as info:
        check_teacher_compatible(trainer_cls)
    for fragment in (problem, f"TRL {trl.__version__}", f"checked against TRL {CHECKED_TRL_VERSION}"):
        assert fragment in str(info.value), (fragment, str(info.value))


def test_the_trainer_is_refused_without_its_config():
    from logprob_client.integrations.trl_teacher import ServiceDistillationTrainer

    with pytest.raises(ValueError, match="args: a ServerDistillationConfig is needed"):
        ServiceDistillationTrainer(model="never-loaded", teacher=ServiceTeacher(None))
