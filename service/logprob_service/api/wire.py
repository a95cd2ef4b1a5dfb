"""protobuf <-> domain objects: the gRPC edge's conversions (its other modules that see protobuf handle
messages whole: the servicer, the server's assembly, accounting, and ``tensor_pieces``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import numpy as np
from google.protobuf.message import Message
from logprob_proto import logprob_pb2 as pb

from logprob_service.api.status import status_of
from logprob_service.api.tensor_pieces import PieceView
from logprob_service.domain import (
    MAX_TOP_K,
    Commit,
    GroupSpec,
    IpcHandle,
    ModelInfo,
    ScoreJob,
    ScoreOptions,
    ScoreResult,
    SequenceScores,
    SharedTensor,
    SparsePiece,
    TensorPiece,
    TensorSpec,
    TokenSequence,
    UpdateChecked,
    UpdateHeader,
    UpdateMessage,
    UpdateOutcome,
)
from logprob_service.engine import (
    Budget,
    RequestCounts,
    RequestLimits,
    WeightGroup,
    check_counts,
    distinct_prompt_tokens,
    prompt_once,
    sequence_steps,
)
from logprob_service.errors import InvalidArgument, LogprobError

DEFAULT_MODEL = "default"


def model_name(request: pb.ScoreRequest | pb.UpdateWeightsHeader | pb.LoadWeightsRequest) -> str:
    return request.model or DEFAULT_MODEL


def ensure_request_id(request: pb.ScoreRequest) -> None:
    """Give a request without an id one, before anything logs or answers it."""
    request.request_id = request.request_id or str(uuid.uuid4())


# Where a message lies in its request, named only when an error names it: ("sequences", i) or
# ("groups", g) or ("groups", g, j), e.g. sequences[3] or groups[2].completions[5].
Where = tuple[str, int] | tuple[str, int, int]


def _name(where: Where) -> str:
    return f"{where[0]}[{where[1]}]" + (f".completions[{where[2]}]" if len(where) == 3 else "")


def _ids(message: Message, field: str, where: Where) -> np.ndarray:
    """``message``'s ids in ``field``: its repeated int32 field, or its ``*_i32`` bytes beside it."""
    raw: bytes = getattr(message, f"{field}_i32")
    repeated = getattr(message, field)
    if not raw:
        return np.asarray(repeated, dtype=np.int64)
    if repeated:
        raise InvalidArgument(
            f"{_name(where)}.{field}: both {field} and {field}_i32 are set; send the ids in one of them"
        )
    if len(raw) % 4:
        raise InvalidArgument(f"{_name(where)}.{field}_i32: {len(raw)} bytes are not whole little-endian int32 ids")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def _candidates(message: pb.Sequence | pb.Completion, where: Where) -> np.ndarray | None:
    """``message``'s candidate ids as [rows, num_candidates] (``engine.validation`` checks the rows
    against its completion, the width and the ids), or None when it sends none."""
    raw, width = message.candidate_ids_i32, message.num_candidates
    if not raw and not width:
        return None
    name = _name(where)
    if width <= 0:
        raise InvalidArgument(f"{name}.num_candidates: {width} must be >= 1 when candidate_ids_i32 is set")
    if len(raw) % 4:
        raise InvalidArgument(f"{name}.candidate_ids_i32: {len(raw)} bytes are not whole little-endian int32 ids")
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    if not len(ids) or len(ids) % width:
        raise InvalidArgument(
            f"{name}.candidate_ids_i32: {len(ids)} ids are not whole rows of num_candidates {width} "
            "(one row per completion token)"
        )
    return ids.reshape(-1, width)


def _count(message: Message, field: str) -> int:
    """How many ids ``message`` sends in ``field`` (its repeated field or its ``*_i32`` bytes)."""
    return len(getattr(message, field)) + len(getattr(message, f"{field}_i32")) // 4


def _sequence_count(request: pb.ScoreRequest, most: int) -> int:
    """The request's sequences (a group's completions each count), from its lists' lengths: in
    time of its groups, or of none where they alone pass ``most`` (each then counts one)."""
    groups = request.groups
    if len(groups) > most:
        return len(request.sequences) + len(groups)
    return len(request.sequences) + sum(len(group.completions) for group in groups)


# What the answer-size limit counts of a response beyond its values: each SequenceScores' tag and
# length and those of its 7 fields (6 bytes at most each), and the response's own fields beside
# the request id and model name it repeats.
SEQUENCE_BYTES = 48
RESPONSE_BYTES = 128
VALUE_BYTES = 4  # a float32 log-prob, entropy or candidate log-prob; a top-k entry is an int32 id and one


def request_counts(request: pb.ScoreRequest, max_sequences: int) -> RequestCounts:
    """The request's sequences, tokens (``validation.distinct_prompt_tokens``) and answer bytes
    (``ScoreJob.answer_bytes``), from its lists' lengths without converting an id. Past
    ``max_sequences`` only the sequences are counted, which is enough to refuse it: a message of
    millions of sequences costs the length of its lists, not a pass over them."""
    sequences = _sequence_count(request, max_sequences)
    if sequences > max_sequences:
        return RequestCounts(sequences)
    prompts, completions, candidates = [], 0, 0
    for message in request.sequences:
        prompts.append(_count(message, "prompt_ids"))
        completions += _count(message, "completion_ids")
        candidates += len(message.candidate_ids_i32) // 4
    for group in request.groups:
        prompts.append(_count(group, "prompt_ids"))
        for completion in group.completions:
            completions += _count(completion, "completion_ids")
            candidates += len(completion.candidate_ids_i32) // 4
    top_k = min(max(request.top_k, 0), MAX_TOP_K)  # one out of range is refused by name when validated
    values = completions * (1 + request.return_entropy + 2 * top_k) + candidates
    answer = VALUE_BYTES * values + SEQUENCE_BYTES * sequences + RESPONSE_BYTES
    answer += len(request.request_id) + len(request.model)
    return RequestCounts(sequences, distinct_prompt_tokens(prompts, completions), answer)


# ScoreRequest's field numbers (protos/logprob/v1/logprob.proto): its plain sequences, its groups,
# and a group's completions.
SEQUENCES_FIELD = 3
GROUPS_FIELD = 7
COMPLETIONS_FIELD = 2


def count_fields(
    raw: bytes, field: int, more_than: int, inner: tuple[int, int] | None = None, start: int = 0, stop: int = -1
) -> int:
    """How many times the top-level length-delimited ``field`` occurs in the serialized message
    ``raw`` (its bytes ``start:stop``; -1: to the end), read from the wire format without parsing
    it, and stopping once past ``more_than``: a message of millions of sequences is refused after
    ``more_than`` of them, before protobuf builds an object for each (about 160 ms and 160 MB for
    1M one-token sequences). ``inner`` (a field and its own field): each occurrence of the first
    counts as its occurrences of the second (a group as its completions). Malformed bytes end the
    count early: the parse that follows refuses them."""
    count, position = 0, start
    end = len(raw) if stop < 0 else min(stop, len(raw))
    while position < end and count <= more_than:
        # One-byte varints (tags of fields below 16, lengths below 128: nearly all) read inline:
        # the loop runs once a field, a few thousand times for a message refused by its count.
        tag = raw[position]
        if tag < 0x80:
            position += 1
        else:
            tag, position = _varint(raw, position)
        wire_type = tag & 7
        if wire_type == 2:  # length-delimited: a message, packed ids, a string
            length = raw[position] if position < end else 0
            if length < 0x80:
                position += 1
            else:
                length, position = _varint(raw, position)
            number = tag >> 3
            if number == field:
                count += 1
            elif inner is not None and number == inner[0]:
                count += count_fields(raw, inner[1], more_than - count, None, position, min(position + length, end))
            position += length
        elif (position := _skip(raw, position, wire_type)) < 0:
            break
    return count


def request_head(raw: bytes) -> bytes:
    """The bytes of a serialized ScoreRequest before its first sequence or group, which hold its
    request id and model where they come first (protobuf writes a message's fields in the order of
    their numbers): what a refusal by its count names it by, without reading its sequences."""
    position = 0
    while position < len(raw):
        start = position
        tag, position = _varint(raw, position)
        if tag >> 3 in (SEQUENCES_FIELD, GROUPS_FIELD):
            return raw[:start]
        if (position := _skip(raw, position, tag & 7)) < 0:
            return raw[:start]
    return raw


def count_sequences(raw: bytes, more_than: int) -> int:
    """A serialized ScoreRequest's sequences as ``max_sequences_per_request`` counts them (each
    plain sequence, each group's completions), from its bytes, stopping once past ``more_than``."""
    return count_fields(raw, SEQUENCES_FIELD, more_than, (GROUPS_FIELD, COMPLETIONS_FIELD))


def _skip(raw: bytes, position: int, wire_type: int) -> int:
    """Where the field value of ``wire_type`` at ``position`` of ``raw`` ends; -1 for a wire type
    that no field of these messages has (malformed bytes)."""
    if wire_type == 2:  # length-delimited: a message, packed ids, a string
        length, position = _varint(raw, position)
        return position + length
    if wire_type == 0:
        return _varint(raw, position)[1]
    if wire_type in (1, 5):  # fixed 64 or 32 bits
        return position + (8 if wire_type == 1 else 4)
    return -1


def _varint(raw: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while position < len(raw):
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return value, position


# The log line counts the tokens of a request of at most this many sequences: one of more is
# refused by its count, and counting its tokens would take a pass over all of them.
LOGGED_TOKENS_UP_TO = 1 << 16


def request_size(request: pb.ScoreRequest) -> tuple[int, int | None]:
    """Sequences and prompt + completion tokens of a request (a group's prompt once per completion),
    for its log line, read from the message without converting it; tokens None past
    ``LOGGED_TOKENS_UP_TO`` sequences."""
    sequences = _sequence_count(request, LOGGED_TOKENS_UP_TO)
    if sequences > LOGGED_TOKENS_UP_TO:
        return sequences, None
    tokens = sum(_count(s, "prompt_ids") + _count(s, "completion_ids") for s in request.sequences) + sum(
        len(g.completions) * _count(g, "prompt_ids") + sum(_count(c, "completion_ids") for c in g.completions)
        for g in request.groups
    )
    return sequences, tokens


def _sequences(request: pb.ScoreRequest) -> Iterator[TokenSequence]:
    """The request's sequences, then each group's completions as sequences sharing one prompt
    array, each converted as it is read."""
    for i, seq in enumerate(request.sequences):
        where = ("sequences", i)
        yield TokenSequence(_ids(seq, "prompt_ids", where), _ids(seq, "completion_ids", where), _candidates(seq, where))
    for g, group in enumerate(request.groups):
        prompt = _ids(group, "prompt_ids", ("groups", g))
        for j, c in enumerate(group.completions):
            where = ("groups", g, j)
            yield TokenSequence(prompt, _ids(c, "completion_ids", where), _candidates(c, where))


async def job_from_request(
    request: pb.ScoreRequest,
    deadline: float | None,
    client: str,
    limits: RequestLimits | None = None,
    answer_bytes: int = 0,
) -> ScoreJob:
    """The request's job; ``answer_bytes``: its answer's estimate (``request_counts``).

    Its tokens are counted as its ids are converted, each distinct prompt once, as the job counts
    them: the conversion stops as soon as they pass ``limits``' (``InvalidArgument``), so a request
    whose prompts the counts could not tell apart costs the limit's tokens, not its message's. Its
    sequences are converted in slices (``engine.Budget``), the event loop handed back between them."""
    sequences: list[TokenSequence] = []
    tokens = 0
    budget = Budget()
    for seq, cost in prompt_once(_sequences(request)):
        sequences.append(seq)
        tokens += cost
        if limits is not None and tokens > limits.max_tokens_per_request:
            check_counts(RequestCounts(len(sequences), tokens), limits)
        await budget.pause(sequence_steps(seq.num_tokens))
    return ScoreJob(
        request_id=request.request_id,
        model=model_name(request),
        sequences=sequences,
        options=ScoreOptions(
            temperature=request.temperature,  # 0: unset (the engine resolves it)
            return_entropy=request.return_entropy,
            top_k=request.top_k,
            return_routed_experts=request.return_routed_experts,
        ),
        deadline=deadline,
        min_version=request.min_version,
        client=client,
        group_sizes=tuple(len(group.completions) for group in request.groups),
        answer_bytes=answer_bytes,
    )


def _scores(scores: SequenceScores, as_f32: bool) -> pb.SequenceScores:
    entropies = scores.entropies if scores.entropies is not None else np.zeros(0, np.float32)
    # top-k and candidates: always packed bytes ([C, K] row after row), whatever ``as_f32``
    extra: dict[str, object] = {
        field: array.astype(dtype).tobytes()
        for field, array, dtype in (
            ("top_ids_i32", scores.top_ids, "<i4"),
            ("top_logprobs_f32", scores.top_logprobs, "<f4"),
            ("candidate_logprobs_f32", scores.candidate_logprobs, "<f4"),
        )
        if array is not None
    }
    if (routed := scores.routed_experts) is not None:  # [C, layers, top_k], int16 or int32 by the model
        _, layers, top_k = routed.shape
        ids = routed.astype(routed.dtype.newbyteorder("<")).tobytes()
        extra["routed_experts"] = pb.RoutedExperts(layers=layers, top_k=top_k, ids=ids)
    if as_f32:
        return pb.SequenceScores(
            logprobs_f32=scores.logprobs.astype("<f4").tobytes(),
            entropies_f32=entropies.astype("<f4").tobytes(),
            **extra,
        )
    # .tolist(): protobuf reads a list of floats several times faster than a numpy array.
    return pb.SequenceScores(logprobs=scores.logprobs.tolist(), entropies=entropies.tolist(), **extra)


async def response_from_result(result: ScoreResult, scores_f32: bool = False) -> pb.ScoreResponse:
    """The response; scores as float32 bytes when the request asked ``scores_f32``. Its sequences'
    scores are written in slices (``engine.Budget``), the event loop handed back between them."""
    response = pb.ScoreResponse(
        request_id=result.request_id,
        model=result.model,
        model_version=result.model_version,
        metadata=pb.Metadata(
            tokens=result.tokens,
            queue_ns=result.timings.queue_ns,
            compute_ns=result.timings.compute_ns,
            total_ns=result.timings.total_ns,
        ),
    )
    budget, written = Budget(), 0
    for i, scores in enumerate(result.scores):
        # ~10 values a step: a top-k entry its id and log-prob, a float's tolist and copy
        if budget.spent(sequence_steps(scores.logprobs.size + _extra_values(scores))):
            response.scores.extend(_scores(s, scores_f32) for s in result.scores[written : i + 1])
            written = i + 1
            await asyncio.sleep(0)
    response.scores.extend(_scores(s, scores_f32) for s in result.scores[written:])
    return response


def _extra_values(scores: SequenceScores) -> int:
    """The values of ``scores`` beside its log-probs: its entropies, top-k and candidates."""
    arrays = (scores.entropies, scores.top_ids, scores.top_logprobs, scores.candidate_logprobs, scores.routed_experts)
    return sum(array.size for array in arrays if array is not None)


def error_response(request: pb.ScoreRequest, error: LogprobError) -> pb.ScoreResponse:
    """A stream response standing for a failed request."""
    return pb.ScoreResponse(
        request_id=request.request_id,
        model=model_name(request),
        error=pb.Error(code=status_of(error).value[0], message=error.message),
    )


def model_info_to_proto(info: ModelInfo, limits: RequestLimits) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=info.name,
        source=info.source,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        max_positions=info.max_positions or 0,
        dtype=info.dtype,
        device=info.device,
        version=info.version,
        fingerprint=info.fingerprint,
        base_model=info.base_model,
        attention=info.attention,
        determinism=info.determinism,
        num_experts=info.num_experts,
        weight_format=info.weight_format,
        limits=pb.ModelLimits(
            max_sequence_tokens=info.max_positions or 0,
            max_sequences_per_request=limits.max_sequences_per_request,
            max_tokens_per_request=limits.max_tokens_per_request,
            max_queued_tokens=limits.max_queued_tokens,
            max_queued_tokens_per_client=limits.max_queued_tokens_per_client,
        ),
    )


def _update_header(header: pb.UpdateWeightsHeader | pb.LoadWeightsRequest) -> UpdateHeader:
    if not isinstance(header, pb.UpdateWeightsHeader):
        return UpdateHeader(model_name(header), header.version, header.partial)
    base = header.base_version if header.HasField("base_version") else None
    return UpdateHeader(
        model=model_name(header),
        version=header.version,
        partial=header.partial,
        base_version=base,
        streams=max(1, header.streams),
        update_id=header.update_id,
    )


def _piece(t: pb.TensorChunk, data: bytes | memoryview, indices: bytes | memoryview) -> TensorPiece | SparsePiece:
    if t.changed < 0:
        raise InvalidArgument(f"tensor {t.name!r}: changed {t.changed} must be >= 0 (0: a dense piece)")
    if t.changed:
        return SparsePiece(t.name, t.dtype, tuple(t.shape), t.offset, t.changed, indices, data)
    if indices:
        raise InvalidArgument(f"tensor {t.name!r}: indices come only with sparse pieces (changed > 0)")
    return TensorPiece(name=t.name, dtype=t.dtype, shape=tuple(t.shape), offset=t.offset, data=data)


def _update_message(request: pb.UpdateWeightsRequest | PieceView | tuple[PieceView, ...]) -> list[UpdateMessage]:
    """One UpdateWeightsRequest (read by ``tensor_pieces.read_update_request``) as domain messages."""
    if isinstance(request, PieceView):
        return [_piece(request.chunk, request.data, request.indices)]
    if isinstance(request, tuple):  # several pieces, read as views
        return [_piece(view.chunk, view.data, view.indices) for view in request]
    kind = request.WhichOneof("kind")
    if kind == "header":
        return [_update_header(request.header)]
    if kind == "tensor":
        return [_piece(request.tensor, request.tensor.data, request.tensor.indices)]
    if kind == "tensors":
        if not request.tensors.chunks:
            raise InvalidArgument("tensors: an UpdateWeightsRequest's tensors must hold at least one piece")
        return [_piece(chunk, chunk.data, chunk.indices) for chunk in request.tensors.chunks]
    if kind == "commit":
        return [Commit(tensor_count=request.commit.tensor_count)]
    raise InvalidArgument("kind: an UpdateWeightsRequest must set one of header, tensor, tensors, commit")


async def update_messages(
    requests: AsyncIterator[pb.UpdateWeightsRequest | PieceView | tuple[PieceView, ...]],
) -> AsyncIterator[UpdateMessage]:
    """An UpdateWeights stream (read by ``tensor_pieces.read_update_request``) as domain messages.

    Suspended, this generator holds only the request it is in the middle of, so after the commit
    only the commit: an update stops reading there, and the generator may outlive the call, so it
    must not hold a piece then (a piece from a weight receiver holds the receiver's slot of shared
    memory)."""
    async for request in requests:
        for message in _update_message(request):
            yield message


def load_request(request: pb.LoadWeightsRequest) -> tuple[UpdateHeader, str]:
    if not request.path:
        raise InvalidArgument("path: empty; a .safetensors file or a directory on the server is required")
    return _update_header(request), request.path


def update_response(outcome: UpdateOutcome) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(
        model=outcome.model,
        version=outcome.version,
        fingerprint=outcome.fingerprint,
        tensors=outcome.tensors,
        bytes=outcome.bytes,
        staged_on=outcome.staged_on,
        total_ns=outcome.total_ns,
        swap_ns=outcome.swap_ns,
    )


def group_spec(request: pb.InitWeightsUpdateGroupRequest) -> GroupSpec:
    if not request.group_name:
        raise InvalidArgument("group_name: empty; a group needs a name for UpdateWeightsFromDistributed")
    if not 0 < request.master_port < 65536:
        raise InvalidArgument(f"master_port: {request.master_port} is not a TCP port")
    return GroupSpec(
        master_address=request.master_address or "127.0.0.1",
        master_port=request.master_port,
        rank=request.rank_offset,
        world_size=request.world_size,
        name=request.group_name,
        backend=request.backend,
        timeout_s=request.timeout_s,  # 0: the engine's default
    )


def group_response(group: WeightGroup) -> pb.InitWeightsUpdateGroupResponse:
    return pb.InitWeightsUpdateGroupResponse(
        rank=group.rank, world_size=group.world_size, backend=group.backend, device=str(group.device)
    )


def distributed_update(request: pb.DistributedUpdateRequest) -> tuple[UpdateHeader, str, list[TensorSpec]]:
    tensors = [TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in request.tensors]
    return _update_header(request.header), request.group_name, tensors


def ipc_update(request: pb.IpcUpdateRequest) -> tuple[UpdateHeader, str, list[SharedTensor]]:
    tensors = [
        SharedTensor(
            t.name,
            t.dtype,
            tuple(t.shape),
            IpcHandle(
                device_uuid=t.device_uuid,
                storage_offset=t.storage_offset,
                storage_handle=t.storage_handle,
                storage_size_bytes=t.storage_size_bytes,
                storage_offset_bytes=t.storage_offset_bytes,
                ref_counter_handle=t.ref_counter_handle,
                ref_counter_offset=t.ref_counter_offset,
                event_handle=t.event_handle,
                event_sync_required=t.event_sync_required,
            ),
        )
        for t in request.tensors
    ]
    return _update_header(request.header), request.boot_id, tensors


def distributed_response(event: UpdateChecked | UpdateOutcome) -> pb.DistributedUpdateResponse:
    if isinstance(event, UpdateChecked):
        return pb.DistributedUpdateResponse(ready=pb.DistributedUpdateResponse.Ready())
    return pb.DistributedUpdateResponse(done=update_response(event))
