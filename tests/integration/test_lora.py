"""LoRA models served on a shared base (NAME=BASE+ADAPTER_DIR), through a real server (CPU, float32).

References: the base model, and PEFT's own model of base + adapter (unmerged, as the server runs it),
each scored by a float64 forward (``tests.helpers.models.reference_scores``). Tolerance: see
tests/helpers/tolerances.py.
(A merged model is not the right reference: folding B A into W rounds W + s B A to float32, an error
the served, unmerged model does not make.)
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient, FailedPrecondition
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from tests.helpers.models import make_model, random_sequences
from tests.helpers.server import as_lists, assert_scores_match, live, new_seed, settings, start, stop

pytestmark = pytest.mark.numerical

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def make_adapter(base, path: Path, rng: np.random.Generator, *, rank: int = 8) -> dict[str, torch.Tensor]:
    """A random (non-zero, so it changes the scores) adapter on a copy of ``base``, saved to ``path``."""
    torch.manual_seed(new_seed(rng))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(base), config)
    peft.save_pretrained(path)
    return get_peft_model_state_dict(peft)


def with_adapter(base, adapter_dir: Path):
    """PEFT's own model of base + adapter, unmerged: x W^T + s (x A^T) B^T, as the server computes it."""
    return PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()


@pytest.fixture
def base_dir(tmp_path: Path, rng) -> Path:
    make_model("llama", tied=False, seed=new_seed(rng)).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def storage_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


async def test_base_and_lora_models_share_one_copy_and_score_as_peft(base_dir, tmp_path, rng):
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    make_adapter(base, tmp_path / "a1", rng)
    make_adapter(base, tmp_path / "a2", rng, rank=4)
    running = await start(
        settings({"ref": str(base_dir), "policy": f"ref+{tmp_path / 'a1'}", "other": f"ref+{tmp_path / 'a2'}"})
    )
    try:
        registry = running.service.device_side.registry
        params = [p for served in registry for p in served.scorer.model.parameters()]
        base_bytes = sum(p.nbytes for p in base.parameters())
        adapter_bytes = sum(p.nbytes for n, p in registry.get("ref").scorer.model.named_parameters() if "lora_" in n)
        assert adapter_bytes > 0
        assert storage_bytes(params) == base_bytes + adapter_bytes  # one copy of the base for three models

        sequences = random_sequences(rng, 5)
        async with AsyncLogprobClient(running.target) as client:
            infos = {m.name: m for m in await client.list_models()}
            assert infos["policy"].base_model == infos["other"].base_model == "ref"
            assert len({infos[n].fingerprint for n in infos}) == 3
            # Interleaved, so the active adapter must switch between micro-batches.
            for name, reference in [
                ("policy", with_adapter(base, tmp_path / "a1")),
                ("ref", base),
                ("other", with_adapter(base, tmp_path / "a2")),
                ("ref", base),
                ("policy", with_adapter(base, tmp_path / "a1")),
            ]:
                assert_scores_match(reference, sequences, await client.score(*as_lists(sequences), model=name))
    finally:
        await stop(running)


async def test_updating_a_lora_model_replaces_only_its_adapter(base_dir, tmp_path, rng):
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    make_adapter(base, tmp_path / "a1", rng)
    new_adapter = make_adapter(base, tmp_path / "a2", rng)  # same rank and targets: the trainer's next step
    running = await start(settings({"ref": str(base_dir), "policy": f"ref+{tmp_path / 'a1'}"}))
    try:
        sequences = random_sequences(rng, 4)
        async with AsyncLogprobClient(running.target, model="policy") as client:
            ref_before = await live(client, "ref")
            result = await client.update_weights("policy", new_adapter)
            assert result.version == 1 and result.tensors == len(new_adapter)
            assert_scores_match(
                with_adapter(base, tmp_path / "a2"), sequences, await client.score(*as_lists(sequences))
            )
            assert_scores_match(base, sequences, await client.score(*as_lists(sequences), model="ref"))
            assert await live(client, "ref") == ref_before

            # The same adapter from disk, as a trainer on a shared filesystem would hand it over.
            assert (await client.load_weights("policy", str(tmp_path / "a1"))).version == 2
            assert_scores_match(
                with_adapter(base, tmp_path / "a1"), sequences, await client.score(*as_lists(sequences))
            )

            # The shared base cannot change under its LoRA models.
            with pytest.raises(FailedPrecondition, match="shared base of the LoRA models 'policy'"):
                await client.update_weights("ref", base.state_dict())
    finally:
        await stop(running)
