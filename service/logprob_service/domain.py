"""Plain domain objects passed between the gRPC edge, the engine, the worker and the models.

Nothing here knows about protobuf or torch: the servicer converts protobuf to these, the
executor converts these to tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from logprob_service.errors import InvalidArgument

# The most top-k ids, and candidate ids, a completion position may ask for.
MAX_TOP_K = 256

# The weight dtypes the server serves and takes in updates, by name, with their element size.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class TokenSequence:
    """One sequence to score: log p(completion_ids[t] | prompt_ids, completion_ids[:t])."""

    prompt_ids: np.ndarray  # [P] int64
    completion_ids: np.ndarray  # [C] int64
    # [C, Kc] int64: at each completion position, Kc <= MAX_TOP_K ids whose log-probs to return
    candidate_ids: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @cached_property
    def prompt_key(self) -> bytes:
        """Equal for sequences with identical prompts (and only for those)."""
        return np.asarray(self.prompt_ids, dtype=np.int64).tobytes()


def prompt_groups(sequences: Sequence[TokenSequence]) -> list[list[int]]:
    """Indices of ``sequences`` grouped by identical prompt, groups in order of their first member."""
    groups: dict[bytes, list[int]] = {}
    for i, seq in enumerate(sequences):
        groups.setdefault(seq.prompt_key, []).append(i)
    return list(groups.values())


@dataclass(frozen=True)
class ScoreOptions:
    """What a request asks of its scoring beside its sequences: built once with its job, and carried
    unchanged to the log-prob op (micro-batches mix only work of one model and equal options; each
    layer reads the fields it acts on). A sequence's candidate ids are its own (``TokenSequence``)."""

    temperature: float = 1.0  # logits are divided by it (0 from an edge: unset, which validation makes 1.0)
    return_entropy: bool = False  # each completion position's entropy
    top_k: int = 0  # 0-MAX_TOP_K: each completion position's K most likely ids and their log-probs
    # each completion token's vocabulary rank (SequenceScores.ranks; the HTTP edge's vLLM routes)
    return_ranks: bool = False
    return_routed_experts: bool = False  # each completion position's MoE router choices (SequenceScores)


DEFAULT_OPTIONS = ScoreOptions()  # log-probs alone, at temperature 1


@dataclass(frozen=True)
class ScoreJob:
    """One ScoreTokens request, validated against its model.

    ``sequences`` holds the request's own sequences, then each of its groups' completions (one
    sequence each, with the group's prompt), group by group; ``group_sizes`` says how many
    completions each group has, so errors can name them as the request did.
    """

    request_id: str
    model: str
    sequences: list[TokenSequence]
    options: ScoreOptions = DEFAULT_OPTIONS
    deadline: float | None = None  # time.monotonic() after which the work is useless
    min_version: int = 0  # score only with weights of at least this version
    client: str = ""  # who asked (security.caller): the fair share counts queued token-equivalents per client
    group_sizes: tuple[int, ...] = ()
    answer_bytes: int = 0  # the edge's estimate of its answer's size, checked against max_answer_bytes

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens of every sequence: the tokens it scores for its caller."""
        return sum(s.num_tokens for s in self.sequences)


@dataclass(frozen=True)
class SequenceScores:
    logprobs: np.ndarray  # [C] float32
    entropies: np.ndarray | None = None  # [C] float32 when asked for
    # With ScoreOptions.top_k = K: [C, K] int32 ids, by descending log-prob (ties: smaller id first),
    # and their [C, K] float32 log-probs.
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    candidate_logprobs: np.ndarray | None = None  # [C, Kc] float32: of TokenSequence.candidate_ids
    # With ScoreOptions.return_ranks: [C] int32, each token's rank in its row's vocabulary, vLLM's: how
    # many ids have a transformed logit at least its own, itself included (1: the most likely).
    ranks: np.ndarray | None = None
    # With ScoreOptions.return_routed_experts: [C, MoE layers, top_k] expert ids (int16 for a model of at
    # most 32,768 experts, else int32), the routing of the row predicting each completion token.
    routed_experts: np.ndarray | None = None


@dataclass(frozen=True)
class Timings:
    queue_ns: int = 0
    compute_ns: int = 0
    total_ns: int = 0


@dataclass(frozen=True)
class ScoreResult:
    request_id: str
    model: str
    model_version: int
    scores: list[SequenceScores]
    tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass(frozen=True)
class ModelInfo:
    """A served model as callers see it (ListModels) and as requests are checked against it."""

    name: str
    source: str
    architecture: str
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_positions: int | None  # longest prompt + completion; None when the config sets none
    dtype: str
    device: str
    version: int
    fingerprint: str
    base_model: str = ""  # a LoRA model's base, whose weights it shares
    attention: str = ""  # which attention backend serves which kind of row (ops.attention)
    determinism: str = ""  # what --deterministic guarantees here (models.scorer.determinism)
    num_experts: int = 0  # experts per MoE layer whose router choices can be returned; 0: no routers
    weight_format: str = ""  # the dtype, or the quantization and its compute mode (models.quantized)


@dataclass(frozen=True)
class IpcHandle:
    """Where a caller's tensor lies in its GPU memory on this host: the fields of torch's
    ``reduce_tensor`` for it (``worker.ipc`` opens them; plain data here)."""

    device_uuid: str
    storage_offset: int  # elements
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class SharedTensor:
    """A tensor of an UpdateWeightsFromIpc request."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    handle: IpcHandle


@dataclass(frozen=True)
class SparseChanges:
    """A sparse update's changes to one weight: the ``live`` weight they apply to (a tensor, opaque
    here), the flat ``indices`` of the changed elements (uint32, ascending) and their new
    ``values`` (raw bytes of ``dtype``)."""

    live: object
    indices: np.ndarray
    values: np.ndarray
    dtype: str


# A weight update's messages (UpdateWeights, LoadWeights, a group's broadcast), as ``api.wire``
# makes them from the wire and ``engine.weights`` takes them in.


def validate_version(field: str, version: int) -> int:
    if version < 0:
        raise InvalidArgument(f"{field}: {version} must be >= 0 (0: unset)")
    return version


@dataclass(frozen=True)
class UpdateHeader:
    model: str
    version: int  # 0: the live version + 1
    partial: bool  # only some weights come; the others keep their live values
    base_version: int | None = None  # the version sparse tensors change (must be the live one)
    streams: int = 1  # the update comes over this many streams together, named by update_id
    update_id: str = ""

    def __post_init__(self) -> None:
        validate_version("version", self.version)
        if self.base_version is not None:
            validate_version("base_version", self.base_version)


@dataclass(frozen=True)
class TensorPiece:
    """Bytes ``[offset, offset + len(data))`` of one tensor's raw little-endian, C-order bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    data: bytes | memoryview  # a view of the received message, where the wire allows

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class SparsePiece:
    """Some of the ``changed`` elements in which one tensor differs from the base version: their flat
    indices (little-endian uint32, ascending) and new values; ``offset`` of them came before."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    changed: int
    indices: bytes | memoryview
    values: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.indices) + len(self.values)


@dataclass(frozen=True)
class Commit:
    tensor_count: int


UpdateMessage = UpdateHeader | TensorPiece | SparsePiece | Commit


@dataclass(frozen=True)
class GroupSpec:
    """A trainer's weight-update group to join (InitWeightsUpdateGroup)."""

    master_address: str
    master_port: int
    rank: int
    world_size: int
    name: str
    backend: str  # "nccl", "gloo", or "" (by device)
    timeout_s: float  # 0: DEFAULT_GROUP_TIMEOUT_S (at most the server's max_group_timeout_s)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a group's rank 0 will broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class UpdateChecked:
    """An update from a group is checked: rank 0 may broadcast."""


@dataclass(frozen=True)
class UpdateOutcome:
    model: str
    version: int
    fingerprint: str
    tensors: int
    bytes: int
    staged_on: str  # "cuda:0", "cpu", or "cuda:0+cpu" when device memory ran short midway
    total_ns: int
    swap_ns: int


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """The raw bytes of a whole tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * DTYPE_BYTES[dtype]
