"""The server's settings model, ``Settings``, and ``load_settings``, which reads it as the CLI does.

Every field is also a CLI flag (``cli.py`` derives the flags from this model), so the field's
description is the one piece of documentation for both. The weight-update fields are a group of
their own (``weight_updates``) that ``Settings`` takes in by inheritance: one flat model, so each
of them, like every other setting, has one flag, one ``LOGPROB_*`` variable and one file key.

``load_settings`` refuses, before anything starts, what the model cannot: an unknown ``LOGPROB_*``
variable, a malformed config file, a model path that does not exist. Its errors name the setting
as the user wrote it: the flag, the variable or the file (``sources`` holds that machinery).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, FilePath, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from logprob_service.settings.errors import StartupError
from logprob_service.settings.sources import (
    ENV_PREFIX,
    Origins,
    model_source_problems,
    parse_model_specs,
    split_list,
)
from logprob_service.settings.weight_updates import WeightUpdateSettings

MiB = 1024**2
DEFAULT_MODEL_SOURCE = "builtin:tiny-llama"
# Defaults shared with the code that runs without settings (ScoringOptions, OfflineScorer).
DEFAULT_LONG_SEQUENCE_TOKENS = 65536
DEFAULT_CHUNK_TOKENS = 32768
# One packed micro-batch: as many tokens as the longest sequence run whole, so packing adds no
# peak memory that one such sequence does not already take (1.5% more tokens/s than 32768 on the
# GRPO workload at the 0.5B shape, H200; benchmarks/history/2026-11-21--2026-11-28.md).
DEFAULT_MAX_BATCH_TOKENS = DEFAULT_LONG_SEQUENCE_TOKENS
DEFAULT_MAX_BATCH_SEQUENCES = 256


class Settings(WeightUpdateSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)
    # The config file's settings, the lowest-precedence source (load_settings reads the file).
    config_file_values: ClassVar[dict[str, Any]] = {}

    # Where to listen.
    host: str = Field(
        "127.0.0.1", description="Address the gRPC, HTTP (http_port) and metrics ports bind to (0.0.0.0 for all)."
    )
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int = Field(
        9481, ge=0, le=65535, description="Port of the Prometheus /metrics HTTP endpoint (0 disables it)."
    )
    http_port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "Port of the HTTP edge (docs/http.md): the log-prob calls trainers make to vLLM (/v1/completions, "
            "/inference/v1/generate), SGLang (/generate) and TRL (/get_sequence_logprobs/), with /health and "
            "/v1/models, over the same engine, tokens, TLS and limits as gRPC. 0: off."
        ),
    )
    http_max_body_bytes: int = Field(
        64 * MiB,
        ge=MiB,
        description=(
            "Largest HTTP request body; a larger one is refused (413) by its Content-Length, or as it arrives, "
            "before any of it is parsed."
        ),
    )

    http_max_buffered_body_bytes: int = Field(
        256 * MiB,
        ge=MiB,
        description=(
            "Request body bytes the HTTP edge holds at once, over every connection (bodies being read and those "
            "of requests in progress); a body that would pass it is refused (503, retryable) as it arrives."
        ),
    )
    http_max_connections: int = Field(
        0,
        ge=0,
        description=(
            "Open HTTP connections; one past it is answered 503 and closed at once. 0: derived from the open-file "
            "limit (half of what is left after 512 descriptors for gRPC, files and weight receivers; at most 4096), "
            "so that HTTP connections never take the descriptors the rest of the server needs."
        ),
    )
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Longest an HTTP connection may take to send a request's head (from its opening, or from the end of "
            "the answer before); past it the connection is closed. Idle keep-alive connections close after 5 s."
        ),
    )
    http_body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest an HTTP request may take to send its whole body; past it: 408, and the connection closed.",
    )
    http_trusted_proxies: Annotated[tuple[str, ...], NoDecode, BeforeValidator(split_list)] = Field(
        (),
        description=(
            "Addresses (or networks, or *) of reverse proxies whose X-Forwarded-For and X-Forwarded-Proto the HTTP "
            "edge believes (comma-separated): a caller's address, and so its fair share without tokens, is then "
            "the one the proxy names. Empty: those headers are ignored and the caller is its connection's address."
        ),
    )

    # What to serve, where.
    models: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {"default": DEFAULT_MODEL_SOURCE},
        description=(
            "Models to serve as NAME=SOURCE (repeatable flag --model; env: comma-separated or JSON). "
            "SOURCE: builtin:tiny-llama, a local HF checkpoint directory, a hub id, or BASE+ADAPTER_DIR: "
            "a LoRA model sharing the weights of the served model BASE, with a PEFT adapter directory. "
            "A path that does not exist stops the start."
        ),
    )
    device: str = Field(
        "auto",
        description=(
            "Torch device(s): cuda (every visible GPU; the start fails, saying why, where CUDA cannot start), "
            "auto (cuda, else the CPU with a warning), cpu, cuda:N, or a comma-separated list "
            "(cuda:0,cuda:1): one replica of each model per device, micro-batches spread over them (data parallel). "
            "With tensor_parallel N: the N devices of the group (auto, cuda: the first N GPUs)."
        ),
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description=(
            "Shard every model over this many devices (one process each, rank 0 serving gRPC): for models "
            "larger than one GPU. 1: off. Such models cannot take weight updates or LoRA adapters."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype: auto (bfloat16 on cuda, float32 on cpu)."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from checkpoints (transformers).")
    fp8_compute: Literal["weights-only", "w8a8"] = Field(
        "weights-only",
        description=(
            "How an FP8 checkpoint's linear layers compute (their weights stay in FP8 either way): weights-only "
            "(each weight dequantized inside its layer, bf16 activations: the dequantized model's scores, what a "
            "trainer computes) or w8a8 (activations quantized per token and 128-group, FP8 tensor cores: faster, "
            "with the error stated in the README's weight formats)."
        ),
    )

    # Scoring.
    logprob_kernel: Literal["auto", "triton", "eager"] = Field(
        "auto",
        description=(
            "lm_head + log-sum-exp implementation: auto (the fused Triton kernel on cuda, eager chunks on cpu), "
            "triton (force the kernel; cuda only), eager (force fp32 chunks)."
        ),
    )
    lm_head_chunk_bytes: int = Field(
        256 * MiB,
        ge=MiB,
        description="Eager lm_head path: byte budget of one (rows, vocab) float32 logit slab.",
    )
    attention_backend: Literal["auto", "cudnn", "flash", "exact"] = Field(
        "auto",
        description=(
            "Packed attention: auto (torch's cuDNN SDPA for a lone sequence, else cuDNN's ragged kernel when "
            "nvidia-cudnn-frontend is installed, else FlashAttention-2 varlen, else the exact loop), or the "
            "backend to start from (cudnn, flash, exact); a backend that cannot compute a layer exactly "
            "(softcapping, dtype) hands it to the next."
        ),
    )
    long_sequence_tokens: int = Field(
        DEFAULT_LONG_SEQUENCE_TOKENS,
        ge=1,
        description=(
            "A micro-batch of one sequence longer than this runs layer by layer in chunks of chunk_tokens: "
            "memory beyond the weights grows linearly with its length, never with the MLP width."
        ),
    )
    chunk_tokens: int = Field(
        DEFAULT_CHUNK_TOKENS, ge=1, description="Tokens of one chunk of a long sequence (see long_sequence_tokens)."
    )
    compile_layers: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "torch.compile the decoder layers' norms and MLPs to fuse their elementwise kernels: auto (on cuda; "
            "left eager, with a warning, if compiling fails), on (also on cpu; a failure stops the start), off."
        ),
    )
    share_prompts: bool = Field(
        True,
        description=(
            "Sequences of a micro-batch with identical prompts (GRPO's completions of one prompt) run the prompt once; "
            "the token budget counts the tokens run."
        ),
    )
    deterministic: bool = Field(
        True,
        description=(
            "Bitwise batch-invariant scores on CUDA: a sequence's log-probs and entropies do not depend on what "
            "shares its micro-batch (fixed lm_head kernel splits, cuBLAS split-K off, one attention kernel for every "
            "row, LoRA adapters in the model's dtype); ListModels says what holds. On the CPU only run to run. "
            "Costs 0.2-0.3% of tokens/s on an H200."
        ),
    )
    input_embeddings: Literal["device", "host"] = Field(
        "device",
        description=(
            "Where an untied model's input embedding table lives on a GPU: device, or host (pinned host memory: each "
            "micro-batch's rows are gathered there and copied up, which frees vocabulary x hidden x 2 bytes of device "
            "memory, 1.16 GiB for Qwen3-8B, for a copy of tokens x hidden x 2 bytes a micro-batch). A tied embedding "
            "is the lm_head's weight and stays on the device; so does one under tensor parallel."
        ),
    )
    max_batch_tokens: int = Field(
        DEFAULT_MAX_BATCH_TOKENS,
        ge=1,
        description=(
            "Real tokens (prompt + completion, no padding; a shared prompt's completions also count their reads "
            "of it) in one packed micro-batch; a longer sequence is scored alone."
        ),
    )
    max_batch_sequences: int = Field(
        DEFAULT_MAX_BATCH_SEQUENCES, ge=1, description="Sequences in one packed micro-batch."
    )
    max_wait_ms: float = Field(
        2.0, ge=0, description="When the device is idle: how long to wait for more work to fill a micro-batch."
    )
    max_wait_quiet_ms: float = Field(
        0.25,
        ge=0,
        description=(
            "When the device is idle, waiting for more work (max_wait_ms) ends once no request has arrived for "
            "this long: a burst of requests is batched, a lone request is not held."
        ),
    )

    # Limits and overload.
    max_sequences_per_request: int = Field(
        4096, ge=1, description="Most sequences in one ScoreRequest (a group's completions each count)."
    )
    max_tokens_per_request: int = Field(
        1_048_576,
        ge=1,
        description="Most tokens in one ScoreRequest: each distinct prompt once, plus every completion.",
    )
    max_answer_bytes: int = Field(
        256 * MiB,
        ge=MiB,
        description=(
            "Largest answer to one request, as its edge encodes it (gRPC: 4 bytes a log-prob, entropy or candidate "
            "log-prob, 8 a top-k entry; HTTP: the peer's JSON, 25-100 bytes an entry), estimated from the request's "
            "counts before any work: a larger one is refused (INVALID_ARGUMENT, HTTP 400), and over gRPC so is one "
            "past max_message_bytes. The default lets one request keep the device busy: over gRPC a full "
            "micro-batch (65,536 completion tokens) at the largest top-k (256) answers 134 MB, and the whole "
            "max_tokens_per_request at top-k 30 fits; while it is built an answer takes up to 6x its size of host "
            "memory (HTTP's JSON), so one request holds at most about 1.5 GB."
        ),
    )
    max_stream_answer_bytes: int = Field(
        256 * MiB,
        ge=MiB,
        description=(
            "ScoreTokensStream: answers of one stream being computed or waiting to be sent, by their estimate "
            "(max_answer_bytes). While they reach it the stream reads no further request, so a client that "
            "stops reading its answers holds back its own sends (HTTP/2 flow control) instead of the server's "
            "memory. A request is always read when nothing of its stream is pending."
        ),
    )
    max_queued_tokens: int = Field(
        4_194_304,
        ge=1,
        description=(
            "Tokens admitted but not yet scored, counted as they run (a shared prompt once in each micro-batch, "
            "its completions' reads of it too); beyond it requests get RESOURCE_EXHAUSTED."
        ),
    )
    max_connection_age_s: float = Field(
        300.0,
        ge=0,
        description=(
            "Clients are asked to reconnect (GOAWAY; in-flight calls finish) after a connection is this old, so "
            "clients balancing over a DNS name (a headless Service) find new replicas. 0: never."
        ),
    )
    max_queued_tokens_per_client: int = Field(
        2_097_152,
        ge=1,
        description=(
            "Fair share: tokens (counted as for max_queued_tokens) one client (its token's name; without "
            "authentication, its IP address) may have "
            "admitted but not yet scored; beyond it that client's requests get RESOURCE_EXHAUSTED while others' "
            "are still admitted."
        ),
    )
    refusal_burst: int = Field(
        20,
        ge=1,
        description=(
            "Refused calls (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED; HTTP 400, 401, 403, "
            "404, 405, 413) one client (as the fair share names it) may have answered at once; past it, each further "
            "refusal of that client is held until refusals_per_s allows it, so a client resending refused calls "
            "as soon as they are answered runs at that rate, not at the server's. The default passes a split call "
            "whose parts are all refused (the client cancels the rest at the first) and any one-off bad request."
        ),
    )
    refusals_per_s: float = Field(
        5.0,
        ge=0,
        description=(
            "How fast a client past refusal_burst gets its refused calls answered (its burst refills at this "
            "rate; a held call waits at most refusal_burst / refusals_per_s, ends when its caller goes or its "
            "deadline passes, and is answered at once on SIGTERM). At ~1-10 ms of server CPU a refusal, 5 a "
            "second costs a looping client under 5% of a core. 0: refusals are never held."
        ),
    )
    max_message_bytes: int = Field(
        256 * MiB, ge=4 * MiB, description="Largest gRPC message received or sent (gRPC's default is 4 MiB)."
    )
    max_concurrent_rpcs_per_connection: int = Field(
        128,
        ge=1,
        description=(
            "RPCs in flight on one client connection (HTTP/2 max concurrent streams); a client's further RPCs "
            "wait for a free stream instead of failing. A logprob_client connection holds one for its health watch."
        ),
    )

    # Security (SECURITY.md).
    tls_cert_file: FilePath | None = Field(
        None, description="PEM certificate chain the gRPC and HTTP ports present; with tls_key_file it turns TLS on."
    )
    tls_key_file: FilePath | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: FilePath | None = Field(
        None,
        description="PEM CA certificates; when set, clients must present a certificate they signed (mutual TLS).",
    )
    auth_tokens_file: FilePath | None = Field(
        None,
        description=(
            "YAML or JSON file of bearer tokens (name, scopes, token or its sha256); when set, every "
            "LogprobService call, and every HTTP route but /health, needs a token."
        ),
    )
    auth_tokens: SecretStr | None = Field(
        None,
        description=(
            "Environment only, never a flag: a token document like auth_tokens_file's, added to the file's tokens."
        ),
    )

    # Lifecycle and logs.
    grace_period_s: float = Field(
        30.0, ge=0, description="On SIGTERM/SIGINT: how long in-flight RPCs may take to finish."
    )
    drain_notice_s: float = Field(
        1.0,
        ge=0,
        description=(
            "On SIGTERM/SIGINT, the first part of the grace period: health NOT_SERVING and new RPCs "
            "refused with UNAVAILABLE while the server still takes calls, so clients watching health "
            "(logprob_client does) move to other replicas before it stops taking them."
        ),
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or json: one JSON object per line, request fields as keys."
    )

    @model_validator(mode="after")
    def _request_fits_queue(self) -> Settings:
        for queue in ("max_queued_tokens", "max_queued_tokens_per_client"):
            if self.max_tokens_per_request > getattr(self, queue):
                raise ValueError(
                    f"max_tokens_per_request ({self.max_tokens_per_request}) must not exceed {queue} "
                    f"({getattr(self, queue)}): a request larger than the queue could never be admitted"
                )
        return self

    @model_validator(mode="after")
    def _receiver_ports_free(self) -> Settings:
        if not (self.weight_receivers and self.weight_receiver_port):
            return self
        ports = range(self.weight_receiver_port, self.weight_receiver_port + self.weight_receivers)
        if ports[-1] > 65535:
            raise ValueError(f"weight_receiver_port {ports[0]} + {self.weight_receivers} receivers passes port 65535")
        for name in ("port", "metrics_port", "http_port"):
            if getattr(self, name) in ports:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) is among the weight receivers' ports {ports[0]}-{ports[-1]}"
                )
        return self

    @model_validator(mode="after")
    def _http_port_free(self) -> Settings:
        for name in ("port", "metrics_port"):
            if self.http_port and self.http_port == getattr(self, name):
                raise ValueError(f"http_port ({self.http_port}) is also {name}; give each its own port")
        return self

    @model_validator(mode="after")
    def _tls_files_go_together(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        return self

    @model_validator(mode="after")
    def _http_body_fits_buffer(self) -> Settings:
        if self.http_max_buffered_body_bytes < self.http_max_body_bytes:
            raise ValueError(
                f"http_max_buffered_body_bytes ({self.http_max_buffered_body_bytes}) must not be below "
                f"http_max_body_bytes ({self.http_max_body_bytes}): a body of the largest size could never be read"
            )
        return self

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> dict[str, str]:
        models = parse_model_specs(value)
        if not models:
            raise ValueError("at least one model must be served")
        return models

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: flags (passed as init kwargs) > environment > the config file.
        return (init_settings, env_settings, InitSettingsSource(settings_cls, dict(cls.config_file_values)))


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Settings as the CLI reads them: ``overrides`` (its flags) > the environment (``LOGPROB_*``)
    > ``config_file`` (YAML; default: the file ``LOGPROB_CONFIG`` names, if any) > defaults.

    Raises StartupError, one line per problem, each naming the flag, variable or file to fix: a
    missing or malformed config file, an unknown ``LOGPROB_*`` variable or file key, an invalid
    value, a model path that does not exist.
    """
    origins = Origins(Settings.model_fields, overrides, config_file)
    problems = origins.unknown_variables()

    class FileSettings(Settings):
        config_file_values = origins.file_values

    try:
        loaded = FileSettings(**overrides)
    except ValidationError as err:
        raise StartupError("\n".join(problems + [origins.problem(e) for e in err.errors()])) from None
    where = origins.where("models", with_value=False)
    problems += [f"{problem} ({where})" for problem in model_source_problems(loaded.models)]
    if problems:
        raise StartupError("\n".join(problems))
    # A plain Settings, which pickles (weight receivers and tensor-parallel ranks get a copy).
    return Settings.model_construct(loaded.model_fields_set, **dict(loaded))
