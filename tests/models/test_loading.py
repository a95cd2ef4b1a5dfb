"""Loading a hub id with no hub to ask: the local cache at once, or a clear error at once (offline,
transformers retried each file for about 30 s, then answered that it could not connect)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from logprob_service.models.loading import ModelLoadError, load_causal_lm
from transformers import AutoModelForCausalLM

from tests.helpers.models import ARCHITECTURES, make_model
from tests.helpers.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def load(source: str):
    return load_causal_lm(source, device=torch.device("cpu"), dtype=torch.float32)


def test_a_hub_id_not_in_the_cache_fails_at_once_when_the_hub_does_not_answer(monkeypatch, tmp_path):
    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load("no-such-org/no-such-model")
    assert time.monotonic() - started < 10  # transformers' retries took 20-30 s
    assert str(info.value).startswith(
        f"'no-such-org/no-such-model' is not a local directory, and as a hub id it is neither in the local cache "
        f"({tmp_path}) nor can it be downloaded (no answer from http://127.0.0.1:"
    )


def test_a_hub_id_not_in_the_cache_fails_at_once_offline(monkeypatch, tmp_path):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"nor can it be downloaded \(HF_HUB_OFFLINE is set\)$"):
        load("no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="'a b' is neither a local directory nor a hub id"):
        load("a b")


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_does_not_answer(tmp_path, rng):
    """In a process of its own: transformers reads HF_HUB_CACHE when imported."""
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abc"
    model = make_model("llama", tied=False, seed=int(rng.integers(1 << 30)))
    model.save_pretrained(snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abc")
    code = (
        "import time, torch; from logprob_service.models.loading import load_causal_lm; t = time.monotonic(); "
        "m = load_causal_lm('org/tiny', device=torch.device('cpu'), dtype=torch.float32); "
        "print(time.monotonic() - t, float(sum(p.double().sum() for p in m.parameters())))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "client")]),
        "HF_HUB_CACHE": str(tmp_path),
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seconds, total = map(float, done.stdout.split())
    assert seconds < 10
    assert total == pytest.approx(sum(float(p.detach().double().sum()) for p in model.parameters()), rel=1e-12)


def test_a_warning_of_huggingface_hub_is_printed_once():
    """huggingface_hub's logger had a stderr handler of its own and passed its records on to the
    server's: each retry warning came twice. (A process of its own: the handler is made when
    huggingface_hub is first imported, on the stderr of that moment.)"""
    code = (
        "import logging; from logprob_service.logs import configure_logging; "
        "import logprob_service.models.loading; configure_logging('INFO', 'text'); "
        "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "client")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("Retrying in 1s") == 1, done.stderr


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_checkpoint_of_every_family_loads_with_an_attention_its_class_runs(arch, tmp_path, seed):
    """gpt-oss's class refuses SDPA (its sinks): asked for it, transformers raised and the load failed."""
    model = make_model(arch, tied=False, seed=seed)
    model.save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    assert type(loaded) is type(model)
    assert loaded.config._attn_implementation == ("eager" if arch in ("gemma2", "gpt_oss") else "sdpa")
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_bf16_load_keeps_the_buffers_transformers_keeps(arch, tmp_path, seed):
    """The rotary inv_freq stays float32 as in transformers' own bf16 model: ``model.to(bfloat16)``
    rounded it, which moved log-probs by up to 0.96 at position 1,658 (Qwen2.5-1.5B shape, H200)."""
    make_model(arch, tied=False, seed=seed).save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = dict(hf.named_buffers())
    assert want.keys() == dict(loaded.named_buffers()).keys()
    assert any(name.endswith("inv_freq") and b.dtype == torch.float32 for name, b in want.items())
    for name, got in loaded.named_buffers():
        assert got.dtype == want[name].dtype, name
        torch.testing.assert_close(got, want[name], atol=0, rtol=0, msg=name)
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.bfloat16, name


def test_a_bf16_load_computes_what_transformers_bf16_model_computes(tmp_path, seed):
    """Bitwise the same logits as ``from_pretrained(dtype=bfloat16)`` over 600 positions."""
    make_model("llama", tied=False, seed=seed).save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(0, hf.config.vocab_size, (1, 600), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf(ids).logits)
