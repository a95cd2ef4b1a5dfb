"""Quantized checkpoints over a tensor-parallel group of two CPU processes (gloo), in their own precision.

One spawned group serves every format (tests/helpers/quantized.py writes each checkpoint in its
real layout, widths multiples of 128): a Llama in the five FP8 layouts (block-scaled ``fp8``,
``fp8`` per tensor, compressed-tensors per channel, per tensor and per block), a Qwen3-MoE with
FP8 experts, and gpt-oss with MXFP4 experts and attention sinks. Each rank loads each through
``load_served_model`` (its shards of the codes and scales read as stored), scores the same
sequences, digests its weights (a collective) and reports what it holds. Checked here: the scores
against the float64 forward of the dequantized weights (``ScoreReference``: the float32 criterion,
as for one process), each rank holding only its shards (half of every code tensor; the scales
split by block with them or whole), the fingerprint equal to the unsharded model's, and a weight
push refused. Then the refusals that need no group: a shard that would cut an FP8 block, and a
shard the W8A8 GEMM cannot take. Only the weights-only mode is scored: on the CPU the W8A8 mode's
arithmetic is an emulation of the GPU kernel, and its error is measured on GPUs (bench_fp8.py).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from logprob_service.domain import ScoreOptions
from logprob_service.errors import FailedPrecondition
from logprob_service.models.checkpoint import ModelLoadError, SafetensorsSource
from logprob_service.models.loading import load_causal_lm
from logprob_service.models.quantized import Fp8Linear, describe_weights, quantized_skeleton, weight_format
from logprob_service.models.scorer import ScoringOptions
from logprob_service.models.served import load_served_model
from logprob_service.models.tensor_parallel import TensorParallel, fp8_split
from logprob_service.models.weights import model_fingerprint
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.worker.packing import pack
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tests.helpers.models import ScoreReference, make_model, random_sequences
from tests.helpers.processes import leave_rank
from tests.helpers.quantized import FP8_DIMS, LAYOUTS, write_checkpoint, write_mxfp4_checkpoint
from tests.helpers.seeds import session_seed

WORLD = 2
CPU = torch.device("cpu")


def _rank(rank: int, directory: str, names: list[str], sequences: list, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel(rank=rank, world=WORLD, mesh=DeviceMesh("cpu", list(range(WORLD))))
        report = {}
        for name in names:
            served = load_served_model(
                name,
                f"{directory}/{name}",
                device=CPU,
                dtype=torch.float32,
                logprob_op=LogprobOp("eager"),
                options=ScoringOptions(compile_layers="off"),
                tensor_parallel=tp,
            )
            scores = [s.logprobs for s in served.scorer.launch(pack(sequences), ScoreOptions()).fetch()]
            held = {
                key: (tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape), str(p.dtype))
                for key, p in served.scorer.model.state_dict().items()
            }
            try:
                served.updatable()
                refusal = ""
            except FailedPrecondition as err:
                refusal = str(err)
            report[name] = (scores, held, served.info.fingerprint, served.info.weight_format, refusal)
        Path(f"{out}.{rank}").write_bytes(pickle.dumps(report))
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """The checkpoints (name -> the float64 reference of their dequantized weights), the sequences,
    and what each rank reported."""
    directory = tmp_path_factory.mktemp("tp-quantized")
    rng = np.random.default_rng(session_seed("tensor-parallel-quantized"))
    seeds = iter(rng.integers(1 << 30, size=10).tolist())
    references = {}
    for layout in sorted(LAYOUTS):
        model = make_model("llama", tied=False, seed=next(seeds), dims=FP8_DIMS)
        references[layout] = write_checkpoint(directory / layout, model, layout)
    moe = make_model("qwen3_moe", tied=False, seed=next(seeds), dims={**FP8_DIMS, "moe_intermediate_size": 128})
    references["qwen3-moe-fp8"] = write_checkpoint(directory / "qwen3-moe-fp8", moe, "fp8-blocks")
    references["gpt-oss-mxfp4"] = write_mxfp4_checkpoint(
        directory / "gpt-oss-mxfp4", make_model("gpt_oss", tied=False, seed=next(seeds))
    )
    sequences = random_sequences(rng, 3, max_len=20)
    out = directory / "report"
    mp.start_processes(
        _rank, args=(str(directory), list(references), sequences, str(out)), nprocs=WORLD, start_method="spawn"
    )
    reports = [pickle.loads(Path(f"{out}.{rank}").read_bytes()) for rank in range(WORLD)]
    return directory, references, sequences, reports


@pytest.mark.numerical
@pytest.mark.parametrize("name", [*sorted(LAYOUTS), "qwen3-moe-fp8", "gpt-oss-mxfp4"])
def test_a_sharded_quantized_checkpoint_scores_holds_and_digests_as_the_whole_one(group, name):
    directory, references, sequences, reports = group
    whole = load_causal_lm(str(directory / name), device=CPU, dtype=torch.float32)
    full = {key: (tuple(p.shape), str(p.dtype)) for key, p in whole.state_dict().items()}
    reference = ScoreReference(references[name], sequences)
    for rank, report in enumerate(reports):
        scores, held, print_, fmt, refusal = report[name]
        reference.check(scores)
        assert print_ == model_fingerprint(whole), rank
        assert fmt == describe_weights(whole, torch.float32)
        assert "served tensor-parallel: its weights cannot be updated" in refusal
        # Each rank holds half of every code tensor of the layers (FP8 weights, MXFP4 blocks).
        assert held.keys() == full.keys()
        for key, (shape, dtype) in full.items():
            if dtype in ("torch.float8_e4m3fn", "torch.uint8") and ".layers." in key:
                assert held[key][1] == dtype and torch.Size(held[key][0]).numel() * WORLD == torch.Size(shape).numel()
    held = reports[0][name][1]
    for key, shape in SHARDS[name].items():
        assert held[f"model.layers.0.{key}"][0] == shape, key


# What rank 0 holds of layer 0 (the whole: q 256 x 128, k 128 x 128, o 128 x 256, MLP 256 wide;
# Qwen3-MoE: 4 experts of width 128; gpt-oss: 4 heads of 16, 4 experts of width 96, MXFP4).
_LLAMA = {
    "self_attn.q_proj.weight": (128, 128),
    "self_attn.o_proj.weight": (128, 128),
    "mlp.down_proj.weight": (128, 128),
}
SHARDS = {
    # 128 x 128 blocks: q's 2 block rows split; k's one block row (128 rows: 64 a rank) is whole on
    # each rank; o's 2 block columns split.
    "fp8-blocks": {
        **_LLAMA,
        "self_attn.q_proj.weight_scale_inv": (1, 1),
        "self_attn.k_proj.weight_scale_inv": (1, 1),
        "self_attn.k_proj.weight": (64, 128),
        "self_attn.o_proj.weight_scale_inv": (1, 1),
    },
    "ct-block": {**_LLAMA, "self_attn.q_proj.weight_scale": (1, 1), "self_attn.o_proj.weight_scale": (1, 1)},
    # per channel: a colwise layer's scales split with its rows, a rowwise one's are whole
    "ct-channel": {**_LLAMA, "self_attn.q_proj.weight_scale": (128, 1), "self_attn.o_proj.weight_scale": (128, 1)},
    "fp8-tensor": {**_LLAMA, "self_attn.q_proj.weight_scale_inv": (), "self_attn.o_proj.weight_scale_inv": ()},
    "ct-tensor": {**_LLAMA, "self_attn.q_proj.weight_scale": (1,), "self_attn.o_proj.weight_scale": (1,)},
    "qwen3-moe-fp8": {
        "self_attn.q_proj.weight": (128, 128),
        "mlp.experts.gate_up_proj": (2, 256, 128),
        "mlp.experts.gate_up_proj_scale_inv": (2, 2, 1),
        "mlp.experts.down_proj": (2, 128, 128),
    },
    "gpt-oss-mxfp4": {
        "self_attn.q_proj.weight": (32, 64),
        "self_attn.sinks": (2,),
        "self_attn.o_proj.weight": (64, 32),
        "mlp.experts.gate_up_proj_blocks": (2, 192, 2, 16),
        "mlp.experts.gate_up_proj_scales": (2, 192, 2),
        "mlp.experts.down_proj_bias": (2, 64),
        "mlp.router.weight": (4, 64),
    },
}


def _layer(tmp_path: Path, layout: str, name: str, dims: dict, compute: str = "weights-only") -> Fp8Linear:
    """The FP8 layer ``name`` of a Llama of ``dims`` checkpointed in ``layout``, as loaded (meta)."""
    model = make_model("llama", tied=False, seed=0, dims=dims)
    write_checkpoint(tmp_path, model, layout)
    config = model.config
    fmt = weight_format(
        type(config).from_dict({**config.to_dict(), "quantization_config": LAYOUTS[layout][0]}), "x", compute
    )
    return quantized_skeleton(SafetensorsSource(tmp_path), config, fmt, torch.float32, "sdpa").get_submodule(name)


def test_a_shard_that_would_cut_an_fp8_block_is_refused_naming_the_layer(tmp_path):
    dims = {**FP8_DIMS, "intermediate_size": 384}  # 192 rows a rank: one and a half blocks
    layer = _layer(tmp_path, "fp8-blocks", "model.layers.0.mlp.gate_proj", dims)
    with pytest.raises(
        ModelLoadError,
        match=r"tensor parallel 2: FP8 layer layers.0.mlp.gate_proj: its 384 output rows over 2 ranks are 192 each, "
        r"not whole blocks of 128 \(its scales are per 128x128 block\)",
    ):
        fp8_split("layers.0.mlp.gate_proj", layer, "colwise", 2)
    assert fp8_split("x", layer, "colwise", 3) == (0, True)  # 128 rows a rank
    down = _layer(tmp_path, "ct-channel", "model.layers.0.mlp.down_proj", dims)
    assert fp8_split("x", down, "rowwise", 2) == (1, False)  # per channel: any columns, the scales whole


def test_a_shard_the_w8a8_gemm_cannot_take_is_refused(tmp_path):
    dims = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    o_proj = _layer(tmp_path, "fp8-blocks", "model.layers.0.self_attn.o_proj", dims, "w8a8")
    with pytest.raises(
        ModelLoadError, match=r"FP8 layer o: fp8_compute 'w8a8' cannot run a rank's 512 x 256 shard .*K of 512"
    ):
        fp8_split("o", o_proj, "rowwise", 2)
    down = _layer(tmp_path, "fp8-blocks", "model.layers.0.mlp.down_proj", dims, "w8a8")
    assert fp8_split("down", down, "rowwise", 2) == (1, True)  # 512 inputs a rank
