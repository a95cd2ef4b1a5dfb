"""The committed stubs are exactly what `make proto` generates from the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto(tmp_path):
    gen = load_generator()
    for generated in gen.generate(tmp_path):
        committed = gen.STUBS_DIR / generated.name
        assert committed.read_text() == generated.read_text(), (
            f"{committed.relative_to(ROOT)} is stale: run `make proto` and commit the result"
        )


def test_stub_service_matches_the_proto_service():
    from logprob_proto import logprob_pb2

    service = logprob_pb2.DESCRIPTOR.services_by_name["LogprobService"]
    assert service.full_name == "logprob.v1.LogprobService"
    assert [m.name for m in service.methods] == [
        "ScoreTokens",
        "ScoreTokensStream",
        "ListModels",
        "UpdateWeights",
        "LoadWeights",
        "InitWeightsUpdateGroup",
        "UpdateWeightsFromDistributed",
        "DestroyWeightsUpdateGroup",
        "UpdateWeightsFromIpc",
    ]
    stream = service.methods_by_name["ScoreTokensStream"]
    assert stream.client_streaming and stream.server_streaming
    update = service.methods_by_name["UpdateWeights"]
    assert update.client_streaming and not update.server_streaming
    distributed = service.methods_by_name["UpdateWeightsFromDistributed"]
    assert not distributed.client_streaming and distributed.server_streaming
