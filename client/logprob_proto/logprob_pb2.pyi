from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sequence(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "prompt_ids_i32", "completion_ids_i32", "candidate_ids_i32", "num_candidates")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids_i32: bytes
    completion_ids_i32: bytes
    candidate_ids_i32: bytes
    num_candidates: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., prompt_ids_i32: _Optional[bytes] = ..., completion_ids_i32: _Optional[bytes] = ..., candidate_ids_i32: _Optional[bytes] = ..., num_candidates: _Optional[int] = ...) -> None: ...

class SequenceGroup(_message.Message):
    __slots__ = ("prompt_ids", "completions", "prompt_ids_i32")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    prompt_ids_i32: bytes
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., prompt_ids_i32: _Optional[bytes] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("completion_ids", "completion_ids_i32", "candidate_ids_i32", "num_candidates")
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids_i32: bytes
    candidate_ids_i32: bytes
    num_candidates: int
    def __init__(self, completion_ids: _Optional[_Iterable[int]] = ..., completion_ids_i32: _Optional[bytes] = ..., candidate_ids_i32: _Optional[bytes] = ..., num_candidates: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "model", "sequences", "groups", "temperature", "return_entropy", "min_version", "scores_f32", "top_k", "return_routed_experts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    RETURN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORES_F32_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    groups: _containers.RepeatedCompositeFieldContainer[SequenceGroup]
    temperature: float
    return_entropy: bool
    min_version: int
    scores_f32: bool
    top_k: int
    return_routed_experts: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[SequenceGroup, _Mapping]]] = ..., temperature: _Optional[float] = ..., return_entropy: _Optional[bool] = ..., min_version: _Optional[int] = ..., scores_f32: _Optional[bool] = ..., top_k: _Optional[int] = ..., return_routed_experts: _Optional[bool] = ...) -> None: ...

class SequenceScores(_message.Message):
    __slots__ = ("logprobs", "entropies", "logprobs_f32", "entropies_f32", "top_ids_i32", "top_logprobs_f32", "candidate_logprobs_f32", "routed_experts")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPIES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_F32_FIELD_NUMBER: _ClassVar[int]
    ENTROPIES_F32_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_F32_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOGPROBS_F32_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    entropies: _containers.RepeatedScalarFieldContainer[float]
    logprobs_f32: bytes
    entropies_f32: bytes
    top_ids_i32: bytes
    top_logprobs_f32: bytes
    candidate_logprobs_f32: bytes
    routed_experts: RoutedExperts
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., entropies: _Optional[_Iterable[float]] = ..., logprobs_f32: _Optional[bytes] = ..., entropies_f32: _Optional[bytes] = ..., top_ids_i32: _Optional[bytes] = ..., top_logprobs_f32: _Optional[bytes] = ..., candidate_logprobs_f32: _Optional[bytes] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("layers", "top_k", "ids")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    top_k: int
    ids: bytes
    def __init__(self, layers: _Optional[int] = ..., top_k: _Optional[int] = ..., ids: _Optional[bytes] = ...) -> None: ...

class Metadata(_message.Message):
    __slots__ = ("tokens", "queue_ns", "compute_ns", "total_ns")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    queue_ns: int
    compute_ns: int
    total_ns: int
    def __init__(self, tokens: _Optional[int] = ..., queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "model", "model_version", "scores", "metadata", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    model_version: int
    scores: _containers.RepeatedCompositeFieldContainer[SequenceScores]
    metadata: Metadata
    error: Error
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[SequenceScores, _Mapping]]] = ..., metadata: _Optional[_Union[Metadata, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelLimits(_message.Message):
    __slots__ = ("max_sequence_tokens", "max_sequences_per_request", "max_tokens_per_request", "max_queued_tokens", "max_queued_tokens_per_client")
    MAX_SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_PER_CLIENT_FIELD_NUMBER: _ClassVar[int]
    max_sequence_tokens: int
    max_sequences_per_request: int
    max_tokens_per_request: int
    max_queued_tokens: int
    max_queued_tokens_per_client: int
    def __init__(self, max_sequence_tokens: _Optional[int] = ..., max_sequences_per_request: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ..., max_queued_tokens: _Optional[int] = ..., max_queued_tokens_per_client: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "max_positions", "dtype", "version", "fingerprint", "limits", "source", "device", "base_model", "attention", "determinism", "num_experts", "weight_format")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    max_positions: int
    dtype: str
    version: int
    fingerprint: str
    limits: ModelLimits
    source: str
    device: str
    base_model: str
    attention: str
    determinism: str
    num_experts: int
    weight_format: str
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., dtype: _Optional[str] = ..., version: _Optional[int] = ..., fingerprint: _Optional[str] = ..., limits: _Optional[_Union[ModelLimits, _Mapping]] = ..., source: _Optional[str] = ..., device: _Optional[str] = ..., base_model: _Optional[str] = ..., attention: _Optional[str] = ..., determinism: _Optional[str] = ..., num_experts: _Optional[int] = ..., weight_format: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "weight_receiver_ports")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RECEIVER_PORTS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    weight_receiver_ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., weight_receiver_ports: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsHeader(_message.Message):
    __slots__ = ("model", "version", "partial", "base_version", "streams", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    partial: bool
    base_version: int
    streams: int
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., partial: _Optional[bool] = ..., base_version: _Optional[int] = ..., streams: _Optional[int] = ..., update_id: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data", "changed", "indices")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    changed: int
    indices: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., changed: _Optional[int] = ..., indices: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsCommit(_message.Message):
    __slots__ = ("tensor_count",)
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    tensor_count: int
    def __init__(self, tensor_count: _Optional[int] = ...) -> None: ...

class TensorChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("header", "tensor", "commit", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    header: UpdateWeightsHeader
    tensor: TensorChunk
    commit: UpdateWeightsCommit
    tensors: TensorChunks
    def __init__(self, header: _Optional[_Union[UpdateWeightsHeader, _Mapping]] = ..., tensor: _Optional[_Union[TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[UpdateWeightsCommit, _Mapping]] = ..., tensors: _Optional[_Union[TensorChunks, _Mapping]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("model", "path", "version", "partial")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    path: str
    version: int
    partial: bool
    def __init__(self, model: _Optional[str] = ..., path: _Optional[str] = ..., version: _Optional[int] = ..., partial: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("model", "version", "fingerprint", "tensors", "bytes", "staged_on", "total_ns", "swap_ns")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_ON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    SWAP_NS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    fingerprint: str
    tensors: int
    bytes: int
    staged_on: str
    total_ns: int
    swap_ns: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., fingerprint: _Optional[str] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., staged_on: _Optional[str] = ..., total_ns: _Optional[int] = ..., swap_ns: _Optional[int] = ...) -> None: ...

class InitWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightsUpdateGroupResponse(_message.Message):
    __slots__ = ("rank", "world_size", "backend", "device")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    backend: str
    device: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class DestroyWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class DestroyWeightsUpdateGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DistributedUpdateRequest(_message.Message):
    __slots__ = ("header", "group_name", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    header: UpdateWeightsHeader
    group_name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, header: _Optional[_Union[UpdateWeightsHeader, _Mapping]] = ..., group_name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class DistributedUpdateResponse(_message.Message):
    __slots__ = ("ready", "done")
    class Ready(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    READY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ready: DistributedUpdateResponse.Ready
    done: UpdateWeightsResponse
    def __init__(self, ready: _Optional[_Union[DistributedUpdateResponse.Ready, _Mapping]] = ..., done: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ...) -> None: ...

class IpcTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "device_uuid", "storage_offset", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    device_uuid: str
    storage_offset: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., device_uuid: _Optional[str] = ..., storage_offset: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class IpcUpdateRequest(_message.Message):
    __slots__ = ("header", "boot_id", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    header: UpdateWeightsHeader
    boot_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[IpcTensor]
    def __init__(self, header: _Optional[_Union[UpdateWeightsHeader, _Mapping]] = ..., boot_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[IpcTensor, _Mapping]]] = ...) -> None: ...
