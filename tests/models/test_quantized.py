"""Quantized checkpoints (models.quantized): served exactly as their dequantized weights, or refused.

Each layout is a tiny checkpoint written in the format's real layout (tests/helpers/quantized.py).
Reference: a float64 forward of the checkpoint's dequantized weights (Q * S, exact in float64);
tolerance: as exact as that model's own float32 forward (``ScoreReference``), since on the CPU the
served weights-only path is a float32 forward of the same dequantized weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from logprob_service.errors import InvalidArgument
from logprob_service.models.checkpoint import ModelLoadError
from logprob_service.models.loading import load_causal_lm
from logprob_service.models.quantized import (
    Fp8Experts,
    Fp8Linear,
    Mxfp4Experts,
    describe_weights,
    quantized_layers,
    weight_format,
)
from logprob_service.models.served import load_served_model, serve_lora_model
from logprob_service.offline import OfflineScorer
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.fp8 import FP8, dequantize
from logprob_service.ops.mxfp4 import dequantize_mxfp4
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.quantized import (
    FP8_DIMS,
    LAYOUTS,
    W8A8_DIMS,
    quantized_linears,
    write_checkpoint,
    write_mxfp4_checkpoint,
)

CPU = torch.device("cpu")
ARCHS = [("llama", False), ("qwen2", True)]  # Llama; Qwen2 with GQA and a tied lm_head


@pytest.fixture
def dense(rng):
    return make_model("llama", tied=False, seed=int(rng.integers(1 << 30)), dims=FP8_DIMS)


@pytest.mark.numerical
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("arch,tied", ARCHS, ids=[a for a, _ in ARCHS])
def test_a_quantized_checkpoint_scores_its_dequantized_weights(tmp_path, layout, arch, tied, rng):
    model = make_model(arch, tied=tied, seed=int(rng.integers(1 << 30)), dims=FP8_DIMS)
    reference = write_checkpoint(tmp_path, model, layout)
    served = load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)
    layers = quantized_layers(served)
    assert len(layers) == len(quantized_linears(model)) and all(layer.weight.dtype == FP8 for layer in layers)
    assert served.get_output_embeddings().weight.dtype == torch.float32  # the lm_head stays dense
    sequences = random_sequences(rng, 6, max_len=30)
    with OfflineScorer(served, logprob_op=LogprobOp("eager"), max_batch_tokens=100) as scorer:
        out = scorer.score(sequences, temperature=0.8, return_entropy=True)
    ScoreReference(reference, sequences, temperature=0.8).check([s.logprobs for s in out], [s.entropies for s in out])


def test_the_fp8_layout_reads_as_transformers_reads_it(tmp_path, dense):
    """transformers' own loader (on a CPU it dequantizes the checkpoint) and the served FP8 layers
    give the same float32 weights: the checkpoint is in the layout transformers reads."""
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    if torch.cuda.is_available():
        pytest.skip("with a GPU, transformers keeps the checkpoint in FP8 (its kernels need the hub)")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ours = load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)
    for name in quantized_linears(dense):
        layer = ours.get_submodule(name)
        assert isinstance(layer, Fp8Linear)
        mine = dequantize(layer.weight, layer.scale, layer.block, torch.float32)
        assert torch.equal(mine, theirs.get_submodule(name).weight), name


def test_list_models_names_the_format_and_the_compute_mode(tmp_path, dense):
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    served = load_served_model("ref", str(tmp_path), device=CPU, dtype=torch.float32, logprob_op=LogprobOp("eager"))
    assert served.info.weight_format == "fp8: fp8 e4m3, blocks 128x128, weights-only (14 layers; the rest float32)"
    assert served.info.dtype == "float32"
    with pytest.raises(ModelLoadError, match=r"fp8_compute 'w8a8' cannot run this layer .*K of 512"):
        load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32, fp8_compute="w8a8")
    assert describe_weights(dense, torch.float32) == "float32"


def test_the_w8a8_mode_quantizes_the_activations_of_every_quantized_layer(tmp_path, rng):
    """Each layer's W8A8 arithmetic is checked against its definition in tests/ops/test_fp8.py; its
    error against the dequantized model is measured by benchmarks/bench_fp8.py (an activation
    rounded to e4m3 can move a log-prob by far more than float32 does, so no tight bound holds
    here). Here: every quantized layer computes so, and the scores are not the weights-only ones."""
    dense = make_model("llama", tied=False, seed=int(rng.integers(1 << 30)), dims=W8A8_DIMS)
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    sequences = random_sequences(rng, 3, max_len=20)
    scores = {}
    for compute in ("weights-only", "w8a8"):
        model = load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32, fp8_compute=compute)
        assert {layer.compute for layer in quantized_layers(model)} == {compute}
        with OfflineScorer(model, logprob_op=LogprobOp("eager")) as scorer:
            scores[compute] = [s.logprobs for s in scorer.score(sequences)]
    assert any((a != b).any() for a, b in zip(scores["weights-only"], scores["w8a8"]))


@pytest.mark.parametrize(
    "spec,named",
    [
        ({"quant_method": "awq", "bits": 4}, "'awq': this quantization method is not served"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128]"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}},
            },
            "8-bit int",
        ),
    ],
)
def test_any_other_format_is_refused_at_start_up_naming_it(tmp_path, dense, spec, named):
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": spec}))
    with pytest.raises(ModelLoadError) as err:
        load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)
    message = str(err.value)
    assert named in message and f"{tmp_path}/config.json" in message and "Served: fp8" in message, message


def test_a_dense_checkpoint_has_no_format(dense):
    assert weight_format(dense.config, "x") is None


def test_an_8_bit_tensor_for_a_dense_parameter_is_refused_not_cast(tmp_path, dense):
    """A quantized tensor where the model holds a dense one (here: the scales removed, so no layer
    is quantized but the weights are FP8) is refused, naming the tensor."""
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    del state[f"{name}.weight_scale_inv"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}.weight' is float8_e4m3fn in the checkpoint"):
        load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)


def test_scales_that_do_not_fit_the_declared_blocks_are_refused(tmp_path, dense):
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"scales do not fit a \d+ x \d+ weight in blocks of 64 x 64"):
        load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)


def test_a_lora_adapter_on_a_quantized_base_is_refused(tmp_path, dense):
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    base = load_served_model("base", str(tmp_path), device=CPU, dtype=torch.float32, logprob_op=LogprobOp("eager"))
    with pytest.raises(ModelLoadError, match=r"served quantized .*LoRA adapters are served on dense bases only"):
        serve_lora_model("tuned", base, str(tmp_path / "adapter"))


def test_a_quantized_weight_takes_its_dense_tensor_or_its_quantized_ones_but_no_dense_delta(tmp_path, dense):
    write_checkpoint(tmp_path, dense, "fp8-blocks")
    served = load_served_model("ref", str(tmp_path), device=CPU, dtype=torch.float32, logprob_op=LogprobOp("eager"))
    target = served.updatable()
    name = "model.layers.1.self_attn.q_proj.weight"
    assert target.check(name, "float8_e4m3fn", (256, 128)) is target.live[name]  # as served
    conversion = target.check(name, "bfloat16", (256, 128))  # dense: quantized on arrival
    assert conversion.writes == (name, "model.layers.1.self_attn.q_proj.weight_scale_inv")
    with pytest.raises(
        InvalidArgument, match=rf"tensor '{name}': shape \[128, 128\] does not match the model's \[256, 128\]"
    ):
        target.check(name, "bfloat16", (128, 128))
    with pytest.raises(InvalidArgument, match=rf"tensor '{name}': served fp8: .* a sparse delta of its dense weight"):
        target.check(name, "bfloat16", (256, 128), sparse=True)
    # A full update of the dense state dict covers every scale.
    assert target.missing(dense.state_dict()) == []


@pytest.mark.numerical
def test_an_mxfp4_gpt_oss_scores_its_dequantized_experts(tmp_path, rng):
    model = make_model("gpt_oss", tied=False, seed=int(rng.integers(1 << 30)))
    reference = write_mxfp4_checkpoint(tmp_path, model)
    served = load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)
    banks = quantized_layers(served)
    assert len(banks) == model.config.num_hidden_layers and all(isinstance(b, Mxfp4Experts) for b in banks)
    assert all(b.gate_up_proj_blocks.dtype == torch.uint8 for b in banks)
    assert describe_weights(served, torch.float32).startswith("mxfp4: experts e2m1 with e8m0 scales per 32 values")
    sequences = random_sequences(rng, 3, max_len=20)  # the float64 reference of an MoE is slow
    with OfflineScorer(served, logprob_op=LogprobOp("eager"), max_batch_tokens=100) as scorer:
        out = scorer.score(sequences, temperature=0.8)
    ScoreReference(reference, sequences, temperature=0.8).check([s.logprobs for s in out])


def test_mxfp4_blocks_read_as_transformers_reads_them(tmp_path, rng):
    """transformers' own loader (on a CPU it dequantizes gpt-oss's MXFP4) gives the banks' weights
    the served banks compute with."""
    model = make_model("gpt_oss", tied=False, seed=int(rng.integers(1 << 30)))
    write_mxfp4_checkpoint(tmp_path, model)
    if torch.cuda.is_available():
        pytest.skip("with a GPU, transformers keeps MXFP4 for its own kernels (from the hub)")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ours = load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)
    for name, bank in ours.named_modules():
        if isinstance(bank, Mxfp4Experts):
            for proj in bank.PROJECTIONS:
                mine = dequantize_mxfp4(getattr(bank, f"{proj}_blocks"), getattr(bank, f"{proj}_scales"), torch.float32)
                assert torch.equal(mine.transpose(1, 2), getattr(theirs.get_submodule(name), proj)), (name, proj)


@pytest.mark.numerical
@pytest.mark.parametrize("layout", ["fp8-blocks", "ct-channel"])
def test_fp8_expert_banks_score_their_dequantized_experts(tmp_path, layout, rng):
    """Qwen3-MoE with FP8 experts as such checkpoints keep them (each expert's projections apart,
    with their scales): stacked into FP8 banks, dequantized per bank inside its forward."""
    dims = {**FP8_DIMS, "moe_intermediate_size": 128}
    model = make_model("qwen3_moe", tied=False, seed=int(rng.integers(1 << 30)), dims=dims)
    reference = write_checkpoint(tmp_path, model, layout)
    served = load_causal_lm(str(tmp_path), device=CPU, dtype=torch.float32)
    banks = [m for m in quantized_layers(served) if isinstance(m, Fp8Experts)]
    assert len(banks) == model.config.num_hidden_layers and all(b.gate_up_proj.dtype == FP8 for b in banks)
    sequences = random_sequences(rng, 3, max_len=20)  # the float64 reference of an MoE is slow
    with OfflineScorer(served, logprob_op=LogprobOp("eager"), max_batch_tokens=100) as scorer:
        out = scorer.score(sequences, temperature=0.8)
    ScoreReference(reference, sequences, temperature=0.8).check([s.logprobs for s in out])
