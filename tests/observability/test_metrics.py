"""Prometheus series from stats records and from each server's view of its models (``observability.metrics``)."""

from __future__ import annotations

from dataclasses import dataclass

from logprob_service.domain import ModelInfo, Timings
from logprob_service.observability import metrics
from logprob_service.stats import BatchLaunched, MemorySnapshot, QueueChanged, RequestScored

from tests.helpers.metrics import value


@dataclass(eq=False)
class View:
    """A server's ``stats.ServerView``, as the start-up module's reads its engine."""

    infos: list[ModelInfo]
    memory: dict[str, MemorySnapshot]

    def models(self) -> list[ModelInfo]:
        return list(self.infos)

    def device_memory(self) -> dict[str, MemorySnapshot]:
        return dict(self.memory)


def info(name: str, version: int = 0) -> ModelInfo:
    return ModelInfo(
        name, "src", "LlamaForCausalLM", 100, 64, "float32", "cpu", version, f"fp-{version}", weight_format="float32"
    )


def test_records_move_their_series():
    sink = metrics.PrometheusStats()
    before = value("logprob_tokens_scored_total", model="obs-m"), value("logprob_queue_tokens", model="obs-m")
    shared_before = value("logprob_prompt_tokens_shared_total", model="obs-m")
    sink.record(QueueChanged("obs-m", tokens=30))
    sink.record(BatchLaunched("obs-m", tokens=30, sequences=2, shared_tokens=12))
    assert value("logprob_prompt_tokens_shared_total", model="obs-m") == shared_before + 12
    sink.record(RequestScored("obs-m", tokens=30, sequences=2, timings=Timings(1, 2, 3_000_000)))
    assert value("logprob_tokens_scored_total", model="obs-m") == before[0] + 30
    assert value("logprob_queue_tokens", model="obs-m") == before[1] + 30
    assert value("logprob_request_duration_seconds_sum", model="obs-m") >= 0.003


def test_models_are_read_from_the_view_at_scrape_time_and_labels_stay_bounded():
    view = View([info("obs-live")], {})
    metrics.track(view)
    assert metrics.model_label("obs-live") == "obs-live" and metrics.model_label("nobody") == ""
    assert value("logprob_model_version", model="obs-live") == 0
    view.infos[0] = info("obs-live", version=3)  # a weight swap: no one republishes anything
    assert value("logprob_model_version", model="obs-live") == 3
    labels = dict(
        model="obs-live",
        architecture="LlamaForCausalLM",
        source="src",
        dtype="float32",
        weight_format="float32",
        device="cpu",
    )
    assert value("logprob_model_info", **labels, version="3", fingerprint="fp-3") == 1
    assert value("logprob_model_info", **labels, version="0", fingerprint="fp-0") == 0  # gone with the swap


def test_gpu_memory_is_read_from_the_view_at_scrape_time():
    view = View([info("obs-gpu")], {"cuda:7": MemorySnapshot(10, 20, 30, 40, 15)})
    metrics.track(view)
    assert value("logprob_gpu_memory_reserved_bytes", device="cuda:7") == 20
    assert value("logprob_gpu_memory_peak_allocated_bytes", device="cuda:7") == 15
    view.memory["cuda:7"] = MemorySnapshot(11, 21, 29, 40, 16)
    assert value("logprob_gpu_memory_reserved_bytes", device="cuda:7") == 21
    del view  # a server gone: its devices' series go with it
    assert value("logprob_gpu_memory_reserved_bytes", device="cuda:7") == 0
