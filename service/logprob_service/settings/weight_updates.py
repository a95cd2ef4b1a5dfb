"""The weight-update settings: how updates are received, checked and staged.

A group of fields that ``model.Settings`` takes in by inheriting this class, so they are flags,
variables and file keys like every other setting; a module of its own keeps the model readable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode

from logprob_service.settings.sources import split_list

# Defaults shared with the engine, which runs without settings (tests, OfflineScorer).
DEFAULT_UPDATE_IDLE_TIMEOUT_S = 30.0
DEFAULT_MAX_GROUP_TIMEOUT_S = 300.0


class WeightUpdateSettings(BaseSettings):
    update_staging_reserve_bytes: int = Field(
        4 * 1024**3,
        ge=0,
        description=(
            "UpdateWeights/LoadWeights stage incoming tensors on the GPU while at least this much device "
            "memory stays free, else in host memory."
        ),
    )
    check_finite_weights: bool = Field(
        True,
        description=(
            "Refuse a weight update (UpdateWeights, LoadWeights, from a group or by IPC) any of whose tensors "
            "holds a NaN or an infinity, with INVALID_ARGUMENT naming the tensor (nothing applied): one such "
            "value turns the model's every score into NaN. Checked where each tensor is staged, beside its "
            "digest (benchmarks/bench_finite_check.py measures the cost)."
        ),
    )
    load_weights_roots: Annotated[tuple[Path, ...], NoDecode, BeforeValidator(split_list)] = Field(
        (),
        description=(
            "Directories LoadWeights may read files under (comma-separated), with the served checkpoints' own "
            "directories; every file is checked after its symlinks are followed. Empty: any regular file the "
            "server's user may read. Never /proc, /sys or /dev, nor FIFOs, devices or sockets."
        ),
    )
    keep_freed_host_memory: bool = Field(
        True,
        description=(
            "Tell glibc's allocator to keep freed blocks of up to 32 MiB (and up to 1 GiB of freed heap) for "
            "reuse: the server's copies of each received weight piece then land in warm pages, not freshly "
            "mapped ones (no page faults; on one H100 host gRPC carried 20-30% more, on another no steady "
            "change). The price: up to 1 GiB more resident host memory. Off: glibc's defaults (or MALLOC_* "
            "variables)."
        ),
    )
    weight_receivers: int = Field(
        0,
        ge=0,
        le=16,
        description=(
            "Processes of the server's own that also take UpdateWeights calls, each on a port of its own "
            "(ListModels announces them; logprob_client spreads a push's streams over them). Each copies "
            "what gRPC receives in its own interpreter and hands the messages over through shared memory "
            "(12 slots of 4 MiB each); the serving process checks and stages them as it would from its own "
            "port. All of a push's streams must reach this process: use them when trainers reach one server "
            "by its own address. 0: pushes come to the serving port only."
        ),
    )
    weight_receiver_port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "First port of the weight receivers (they take consecutive ports from it); 0: free ports, "
            "announced by ListModels. Open the same ports to trainers as the gRPC port."
        ),
    )
    gc_freeze: bool = Field(
        True,
        description=(
            "Once the models are loaded and warm, collect and freeze what is alive (Python's gc.freeze): the "
            "garbage collector's full collections then skip the ~400,000 objects of torch, transformers and the "
            "models, which took 0.2-0.4 s each and stalled pushes and scoring. Objects alive at start-up that "
            "later become cyclic garbage are then never freed (start-up objects live for the process anyway)."
        ),
    )
    update_yield_to_launches: bool = Field(
        True,
        description=(
            "UpdateWeights streams are not read while a micro-batch is being launched (each message at most "
            "0.1 s later): receiving holds the server's one Python interpreter lock, which the device thread "
            "needs for every kernel it launches, so scoring latency holds during pushes."
        ),
    )
    update_idle_timeout_s: float = Field(
        DEFAULT_UPDATE_IDLE_TIMEOUT_S,
        gt=0,
        description=(
            "An UpdateWeights stream from which no message comes for this long is aborted (ABORTED), and the "
            "model's update slot freed: a client that holds a stream open without sending cannot hold the "
            "model's updates."
        ),
    )
    max_group_timeout_s: float = Field(
        DEFAULT_MAX_GROUP_TIMEOUT_S,
        gt=0,
        description=(
            "Largest timeout_s an InitWeightsUpdateGroup may ask for (more is refused, INVALID_ARGUMENT): how "
            "long a join may wait for a trainer, and the group's broadcasts for its tensors. A join blocked on "
            "an unreachable trainer holds a thread that long; at most 4 joins run at once."
        ),
    )
    max_version_wait_s: float = Field(
        300.0,
        ge=0,
        description="Longest a request with min_version waits for that version (its deadline, if sooner, wins).",
    )

    @field_validator("load_weights_roots")
    @classmethod
    def _roots_are_directories(cls, roots: tuple[Path, ...]) -> tuple[Path, ...]:
        for root in roots:
            if not root.expanduser().is_dir():
                raise ValueError(f"load_weights_roots: {str(root)!r} is not a directory")
        # Resolved once: LoadWeights compares them with files' paths, their symlinks followed.
        return tuple(root.expanduser().resolve() for root in roots)
