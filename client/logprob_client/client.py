"""``LogprobClient`` (blocking) and ``AsyncLogprobClient`` (asyncio): the same API.

from logprob_client import LogprobClient

with LogprobClient("localhost:50051") as client:
    logprobs = client.score([[1, 2, 3]], [[4, 5]])   # [array([-8.1, -7.9], dtype=float32)]
    groups = client.score_groups([[1, 2, 3]], [[[4, 5], [6]]])  # [[array([...]), array([...])]]
    pending = client.score_async([[1, 2, 3]], [[4, 5]])  # returns at once; RPCs in flight
    logprobs = pending.result()

A scoring call first waits for a connection to the server, at most ``connect_timeout_s`` (else
``Unavailable``, naming the target and the connection error), then for a SERVING replica within
its deadline (``channel.py``). Every scoring call is cut into parts within
``max_sequences_per_rpc`` / ``max_tokens_per_rpc`` (``split.py``), sent as that many ScoreTokens
RPCs at once, and reassembled in order. Consecutive sequences with one prompt travel as one
``SequenceGroup``, the prompt sent once, and ids and scores as little-endian bytes (``wire.py``).
An error the server answers about one of the caller's sequences names it as the caller did
(``completion_ids[3][1]``, ``wire.caller_error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import grpc
import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from .channel import CONNECT_TIMEOUT_S, AioConnectionWatch, Connection, ConnectionWatch, channel_target
from .errors import Cancelled, DeadlineExceeded, LogprobError, PermissionDenied, PushOutcome, error_from_rpc
from .future import ScoreFuture
from .inputs import Prepared, flatten_groups, prepare, regroup
from .ipc import ipc_request
from .push_processes import FRAMING_BYTES, PushProcesses
from .resume import StreamResume
from .split import DEFAULT_MAX_SEQUENCES_PER_RPC, DEFAULT_MAX_TOKENS_PER_RPC, RpcLimits, split
from .weights import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STREAMS,
    Message,
    UpdateResult,
    WeightDeltas,
    join,
    named_tensors,
    update_streams,
)
from .wire import (
    ModelInfo,
    Options,
    ScoreInput,
    caller_error,
    collect,
    model_info,
    repeats_prompt,
    result,
    score_request,
)

DEFAULT_TIMEOUT_S = 120.0
# A push's calls by default: 2 per weight receiver the server announces, at least DEFAULT_STREAMS
# (H100 hosts, 1.5B shape, 4 receivers and 4 push processes: 2.4 GB/s over 8 calls against 1.7-1.9
# over 4 on one host; on another, 2 receivers over 4 calls ran as fast as 4 over 8; RESULTS.md).
STREAMS_PER_RECEIVER = 2
# UpdateWeights, called with messages framed by ``weights`` (pieces framed around tensor bytes).
_UPDATE_WEIGHTS = f"/{pb.DESCRIPTOR.services_by_name['LogprobService'].full_name}/UpdateWeights"
# A push that ends so may have gone live all the same (its commit reached the server first): the
# client asks ListModels before it raises (``PushOutcome``).
_INTERRUPTED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
# What grpc.aio reports for a call whose request write failed because the call had ended
# (grpc/grpc#36066): the status is lost.
_STATUS_LOST = "Internal error from Core"


class ScoreKeywords(TypedDict, total=False):
    """The keywords of ``score``, ``score_async`` and ``score_many`` (all optional).

    ``model``: the model to score with (default: the client's); ``temperature``: the sampling
    temperature the log-probs are taken at (1.0); ``return_entropy``: also return each token's
    entropy, as a second value (False); ``min_version``: score only with weights of at least this
    version, waiting for it within the deadline (0: any; ``FailedPrecondition`` when it does not
    come, naming it and the live version); ``timeout``: this call's deadline in
    seconds (the client's). ``score`` and ``score_async`` also take ``prompt_mask`` and
    ``completion_mask`` (dense inputs, ``logprob_client.inputs``); ``score_many`` takes
    ``return_exceptions`` (a failed batch's error takes its place instead of being raised).
    """

    model: str | None
    temperature: float
    return_entropy: bool
    min_version: int
    timeout: float | None
    prompt_mask: Any
    completion_mask: Any
    return_exceptions: bool


class UpdateKeywords(TypedDict, total=False):
    """The keywords of ``update_weights``: ``version`` (0: the live one + 1), ``partial`` (False: every
    weight must come; True: only those given are replaced), ``chunk_bytes`` (the size of the pieces
    tensors are streamed in), ``streams`` (how many UpdateWeights calls carry the push at once, each
    with its share of the tensors: 4, or 2 per weight receiver the server announces if that is more;
    1 with ``legacy_wire``), ``timeout`` (seconds), ``delta``
    (send only what changed since this client's last delta push of the model:
    ``weights.WeightDeltas``)."""

    version: int
    partial: bool
    chunk_bytes: int
    streams: int
    timeout: float | None
    delta: bool


@dataclass(frozen=True)
class _Update:
    """A push, prepared: its calls' messages, where each call goes (None: the given channel), the
    calls' timeout, and the size of their pieces; its model and version, and the model's live
    version before it where the client knows it."""

    calls: list[Iterator[Message]]
    targets: list[str] | None
    timeout: float
    chunk_bytes: int
    model: str = ""
    version: int = 0
    live: int | None = None

    def interrupted(self, error: LogprobError, listed: Sequence[pb.ListModelsResponse]) -> LogprobError:
        """``error`` of a push cancelled or past its deadline, saying whether the push went live, from
        what ListModels answered after it (on several connections: the latest, the highest version)."""
        model = self.model or "default"
        version = self.version or (self.live + 1 if self.live is not None else None)
        infos = [m for answer in listed for m in answer.models if m.name == model]
        now = max(infos, key=lambda m: m.version, default=None)
        if now is None:
            outcome = PushOutcome(model, version, None, "", None)
        else:
            went_live = None if version is None or now.version > version else now.version == version
            outcome = PushOutcome(model, version, now.version, now.fingerprint, went_live)
        return _with_outcome(error, outcome)


def _with_outcome(error: LogprobError, outcome: PushOutcome) -> LogprobError:
    told = type(error)(f"{error.message}; {outcome}", error.code)
    told.push_outcome = outcome
    return told


def _status_lost(error: LogprobError) -> bool:
    return error.code == grpc.StatusCode.INTERNAL and error.message == _STATUS_LOST


def _interrupted(error: LogprobError) -> bool:
    """Whether a push's call ended without the server's answer: cancelled, past its deadline, or
    its status lost."""
    return error.code in _INTERRUPTED or _status_lost(error)


def _push_error(err: grpc.RpcError | LogprobError, deadline: float) -> LogprobError:
    """The typed error of a push's failed call. Past the push's deadline, a lost status (a write
    failed as the call had ended) or a call grpc cancelled itself is that deadline."""
    error = err if isinstance(err, LogprobError) else error_from_rpc(err)
    if (_status_lost(error) or error.code == grpc.StatusCode.CANCELLED) and time.monotonic() >= deadline:
        return DeadlineExceeded(
            f"the push's deadline passed while it was sending (gRPC reported {error}; grpc/grpc#36066)",
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    return error


def _unsent(error: LogprobError, model: str, version: int) -> LogprobError:
    """``error`` of the ListModels before a push: the push was never sent, which a cancelled or
    timed-out one's error says."""
    if not _interrupted(error):
        return error
    return _with_outcome(error, PushOutcome(model or "default", version or None, None, "", went_live=False))


@dataclass(frozen=True)
class _Scoring:
    """A scoring call, prepared: each batch's layout and requests, and how to answer."""

    calls: list[tuple[Prepared, list[pb.ScoreRequest]]]
    return_entropy: bool
    timeout: float
    return_exceptions: bool

    @property
    def requests(self) -> list[pb.ScoreRequest]:
        return [request for _, requests in self.calls for request in requests]

    def result(self, responses: Sequence[pb.ScoreResponse]) -> Any:
        """The one batch's answer from its responses, in part order."""
        ((prepared, _),) = self.calls
        return result(prepared, responses, self.return_entropy)

    def error(self, part: int, code: grpc.StatusCode, message: str) -> LogprobError:
        """The one batch's error for the failure of its RPC ``part``, in the caller's terms
        (``wire.caller_error``)."""
        ((prepared, requests),) = self.calls
        return caller_error(prepared, requests, part, code, message)

    def collected(self, responses: dict[str, pb.ScoreResponse]) -> list[Any]:
        return collect(self.calls, responses, self.return_entropy, self.return_exceptions)


class _Client:
    """What both clients share: the connection, defaults, request building and splitting.

    ``target``: a gRPC target ("host:port", "dns:///host:port") or a list of "host:port"
    replicas; calls are spread round-robin over every address it resolves to (``channel.py``).
    ``timeout``: deadline of every call, seconds (overridable per call). ``connect_timeout_s``: how
    long a scoring call waits for a connection to the server before it raises ``Unavailable``
    naming the target and the connection error (a server that was reached, even one still
    loading, keeps the call's whole deadline; ``channel.ConnectionWatch``). A target gRPC cannot
    parse is a ``ValueError`` here. ``model``: the model of
    calls that name none. ``max_sequences_per_rpc`` / ``max_tokens_per_rpc``: a scoring call larger
    than either is split into several RPCs in flight together (keep them within the server's
    per-request limits). ``share_prompts``: consecutive sequences with one prompt go as one
    ``SequenceGroup``, the prompt sent once, and are kept in one RPC (False: every sequence whole).
    Ids go as int32 bytes and scores come back as float32 bytes; ``legacy_wire=True`` sends v1
    requests instead (every sequence whole, repeated fields), for servers older than these fields
    (2026-11-23); it also pushes weights as those servers take them (over one call, each piece in
    a message of its own; several pieces to a message came 2026-11-25). ``weight_receivers``: a
    push's streams go to the server's weight receivers when it announces some (ListModels; the
    server's ``weight_receivers`` setting) and the target is one "host:port": the same host, their
    ports (False, or a token without the score scope, which ListModels needs: always the target).
    ``push_processes``: that many processes of the client's own make a push's calls, its messages
    handed over through shared memory (``push_processes.py``; 0: this process makes them).
    ``connection``: the fields of ``channel.Connection`` (``max_attempts``: UNAVAILABLE and RESOURCE_EXHAUSTED are
    retried with exponential backoff up to that many tries, within the deadline; other failures
    raise at once; ``options``; TLS: ``tls``, ``tls_ca_file``, ``tls_cert_file``,
    ``tls_key_file``, ``tls_server_name``; a bearer token: ``token`` or ``token_file``). With
    ``channel=`` (a channel of the client's kind), those are the channel's business: build it
    with ``channel.open_channel``.
    """

    _aio: bool

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        model: str = "default",
        max_sequences_per_rpc: int = DEFAULT_MAX_SEQUENCES_PER_RPC,
        max_tokens_per_rpc: int = DEFAULT_MAX_TOKENS_PER_RPC,
        share_prompts: bool = True,
        legacy_wire: bool = False,
        weight_receivers: bool = True,
        push_processes: int = 0,
        channel: Any = None,
        **connection: Any,
    ) -> None:
        self.model = model
        self.share_prompts = share_prompts
        self.deltas: dict[str, WeightDeltas] = {}  # per model: what delta pushes left on the server
        self.legacy_wire = legacy_wire
        self.weight_receivers = weight_receivers
        self.timeout = timeout
        self.rpc_limits = RpcLimits(max_sequences_per_rpc, max_tokens_per_rpc)
        self.connection = Connection(**connection)
        if channel is not None and self.connection.security():
            raise ValueError(
                f"{', '.join(self.connection.security())} cannot apply to a given channel: "
                "pass them to open_channel(...) instead"
            )
        if push_processes < 0 or (push_processes and channel is not None):
            raise ValueError(
                f"push_processes must be >= 0, got {push_processes}"
                if push_processes < 0
                else "push_processes needs a target, not a given channel (its processes open channels of their own)"
            )
        self.push_processes = push_processes
        self._processes: PushProcesses | None = None  # started at the first push that uses them
        self._target = None if channel is not None else target
        self._channel = channel if channel is not None else self.connection.open(target, aio=self._aio)
        self._stub = pb_grpc.LogprobServiceStub(self._channel)
        described = "the given channel" if channel is not None else _described(target)
        self._connected = (AioConnectionWatch if self._aio else ConnectionWatch)(
            self._channel, described, connect_timeout_s
        )
        # A push's streams, each on a connection of its own (``channel.py``), by target: opened at
        # the first push that needs them and kept; with a given channel, they share it.
        self._push_channels: dict[str, list[Any]] = {}

    @property
    def _receivers_host(self) -> str | None:
        """The host of this client's one "host:port" target, where the server's weight receivers
        listen; None when pushes go to the target itself (receivers off, a given channel, replicas
        or a target with a scheme)."""
        target = self._target if isinstance(self._target, str) else None
        if not self.weight_receivers or self.legacy_wire or target is None or "/" in target:
            return None
        host, _, port = target.rpartition(":")
        return host if host and port.isdigit() and (":" not in host or host.startswith("[")) else None

    def _push_targets(self, streams: int, receiver_ports: Sequence[int]) -> list[str] | None:
        """Where each of a push's ``streams`` calls goes: spread over the server's weight receivers
        when it announces some, else to the target; None with a given channel (all go there)."""
        if self._target is None:
            return None
        host = self._receivers_host
        if host is not None and receiver_ports:
            return [f"{host}:{receiver_ports[i % len(receiver_ports)]}" for i in range(streams)]
        return [channel_target(self._target)] * streams

    def _stream_channels(self, streams: int, targets: list[str] | None) -> list[Any]:
        """The channels of a push over ``streams`` calls (to ``targets``, each on a connection of its
        own; None: the given channel)."""
        if targets is None:
            channels = [self._channel] * streams
        else:
            channels, taken = [], dict.fromkeys(targets, 0)
            for target in targets:
                opened = self._push_channels.setdefault(target, [])
                if taken[target] == len(opened):
                    opened.append(self.connection.open(target, aio=self._aio, own_connection=True))
                channels.append(opened[taken[target]])
                taken[target] += 1
        return channels

    @staticmethod
    def _pusher(channel: Any) -> Any:
        """UpdateWeights on ``channel``, taking messages (``weights.Message``)."""
        return channel.stream_unary(
            _UPDATE_WEIGHTS, request_serializer=join, response_deserializer=pb.UpdateWeightsResponse.FromString
        )

    def _asked_after(self, update: _Update, channels: list[Any]) -> list[Any]:
        """Where ListModels is asked after a push cancelled or past its deadline: the push's own
        connections where they lead to the serving port, as each answers only after what came
        before on it (the ends of the push's calls included); else (weight receivers, push
        processes) the client's."""
        own = update.targets is None or (
            self._target is not None and set(update.targets) == {channel_target(self._target)}
        )
        return list(dict.fromkeys(channels)) if own and channels else [self._channel]

    def _push_processes_for(self, chunk_bytes: int) -> PushProcesses:
        """The client's push processes, with slots for ``chunk_bytes`` pieces (started again with
        larger slots for a push with larger pieces than any before)."""
        slot_bytes = max(chunk_bytes, DEFAULT_CHUNK_BYTES) + FRAMING_BYTES
        if self._processes is None or self._processes.slot_bytes < slot_bytes:
            if self._processes is not None:
                self._processes.close()
            self._processes = PushProcesses(self.connection, self.push_processes, slot_bytes)
        return self._processes

    def _close_push_processes(self) -> None:
        if self._processes is not None:
            self._processes.close()
            self._processes = None

    def _all_channels(self) -> list[Any]:
        return [self._channel, *(channel for opened in self._push_channels.values() for channel in opened)]

    @property
    def max_attempts(self) -> int:
        return self.connection.max_attempts

    def prepare(
        self,
        inputs: Iterable[ScoreInput | Prepared],
        *,
        model: str | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        min_version: int = 0,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> _Scoring:
        """Check the options and build every batch's requests, one per part (none when every
        completion is masked out: that answer is all zeros, made locally, as the server would
        refuse an empty request). A batch is a ``ScoreInput``, or one ``inputs.prepare`` made."""
        if not (temperature > 0 and np.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        if min_version < 0:
            raise ValueError(f"min_version must be >= 0 (0: any version), got {min_version}")
        options = Options(model or self.model, temperature, return_entropy, min_version)
        calls = []
        for inp in inputs:
            prepared = (
                inp
                if isinstance(inp, Prepared)
                else prepare(inp.prompt_ids, inp.completion_ids, inp.prompt_mask, inp.completion_mask)
            )
            if not prepared.sequences and prepared.dense_shape is not None:
                calls.append((prepared, []))
                continue
            seqs = prepared.sequences
            repeats = repeats_prompt(seqs) if self.share_prompts else [False] * len(seqs)
            shared = [len(p) if repeat else 0 for (p, _), repeat in zip(seqs, repeats, strict=True)]
            parts = split([len(p) + len(c) for p, c in seqs], self.rpc_limits, shared)
            requests = [
                score_request(
                    seqs[part], options, repeats=repeats[part] if self.share_prompts else None, legacy=self.legacy_wire
                )
                for part in parts
            ]
            calls.append((prepared, requests))
        return _Scoring(calls, return_entropy, timeout or self.timeout, return_exceptions)

    def prepare_one(
        self, prompt_ids: Any, completion_ids: Any, keywords: ScoreKeywords, group_sizes: Sequence[int] | None = None
    ) -> _Scoring:
        """``prepare`` of one batch given as ``score`` takes it (``group_sizes``: the lists are
        ``flatten_groups``' of ``score_groups``' groups, which errors then name)."""
        masks = {name: keywords.pop(name, None) for name in ("prompt_mask", "completion_mask")}  # type: ignore[misc]
        return self.prepare([prepare(prompt_ids, completion_ids, **masks, group_sizes=group_sizes)], **keywords)

    def prepare_groups(
        self, prompt_ids: Any, completion_ids: Any, keywords: ScoreKeywords
    ) -> tuple[_Scoring, list[int]]:
        """``prepare`` of ``score_groups``' groups, and their sizes."""
        prompts, completions, sizes = flatten_groups(prompt_ids, completion_ids)
        return self.prepare_one(prompts, completions, keywords, group_sizes=sizes), sizes

    def update(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        receiver_ports: Sequence[int],
        *,
        version: int = 0,
        partial: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        streams: int | None = None,
        timeout: float | None = None,
        delta: bool = False,
        live: int | None = None,
    ) -> _Update:
        """A push's UpdateWeights calls (each read lazily, a tensor at a time) and where each goes:
        spread over the server's weight receivers (``receiver_ports``) where it has some. ``live``:
        the model's live version, where known (it tells a version-0 push's version)."""
        if streams is None:  # servers before 2026-11-24 take one
            streams = 1 if self.legacy_wire else max(DEFAULT_STREAMS, STREAMS_PER_RECEIVER * len(receiver_ports))
        make = self.deltas.setdefault(model, WeightDeltas()).update_streams if delta else update_streams
        calls = make(
            model,
            weights,
            version=version,
            partial=partial,
            chunk_bytes=chunk_bytes,
            streams=streams,
            pack=not self.legacy_wire,
        )
        targets = self._push_targets(len(calls), receiver_ports)
        return _Update(calls, targets, timeout or self.timeout, chunk_bytes, model, version, live)

    def _pushed(self, model: str, keywords: UpdateKeywords, response: pb.UpdateWeightsResponse) -> UpdateResult:
        """A push's result; a delta push's also becomes what the server holds."""
        result = UpdateResult.from_proto(response)
        if keywords.get("delta"):
            self.deltas[model].pushed(result.version)
        return result

    def _again_dense(self, model: str, keywords: UpdateKeywords, error: LogprobError) -> bool:
        """Whether a failed push goes again, dense: a delta refused because the server no longer
        holds its base version (a dense push cannot fail so, so this happens once at most)."""
        if not (keywords.get("delta") and self.deltas[model].stale(error)):
            return False
        self.deltas[model].reset()
        return True

    @staticmethod
    def load_request(model: str, path: str, version: int, partial: bool) -> pb.LoadWeightsRequest:
        return pb.LoadWeightsRequest(model=model, path=str(path), version=version, partial=partial)


def _ports_and_live(listed: pb.ListModelsResponse | None, model: str) -> tuple[Sequence[int], int | None]:
    """From ListModels before a push (None: not asked): the weight receivers' ports and the model's
    live version."""
    if listed is None:
        return (), None
    live = next((m.version for m in listed.models if m.name == (model or "default")), None)
    return listed.weight_receiver_ports, live


class LogprobClient(_Client):
    """Blocking client (arguments: see ``_Client``)."""

    _aio = False

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One RPC; its failure raised as the typed error of its status."""
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    def score(self, prompt_ids: Any, completion_ids: Any, **keywords: Unpack[ScoreKeywords]) -> Any:
        """Log-probs of every completion token (and entropies, as a second value, when asked).

        Lists in -> list of float32 arrays out; 2-D arrays/tensors in -> one (B, C) array/tensor
        out (see ``logprob_client.inputs``). Keywords: ``ScoreKeywords``.
        """
        return self.score_async(prompt_ids, completion_ids, **keywords).result()

    def score_groups(
        self, prompt_ids: Sequence[Any], completion_ids: Sequence[Sequence[Any]], **keywords: Unpack[ScoreKeywords]
    ) -> Any:
        """Log-probs of GRPO groups: ``completion_ids[g]`` holds the completions of ``prompt_ids[g]``;
        the answer is one list of float32 arrays per group (with ``return_entropy``, a pair of such).
        Each prompt is sent, and run, once for its whole group. Keywords: ``ScoreKeywords``."""
        scoring, sizes = self.prepare_groups(prompt_ids, completion_ids, keywords)
        return regroup(self._send(scoring).result(), sizes)

    def score_async(self, prompt_ids: Any, completion_ids: Any, **keywords: Unpack[ScoreKeywords]) -> ScoreFuture:
        """``score`` without waiting: the RPCs are sent before this returns, and ``.result()``
        gives what ``score`` would have returned. The inputs are read before it returns, so the
        caller may reuse their buffers at once.
        """
        return self._send(self.prepare_one(prompt_ids, completion_ids, keywords))

    def _send(self, scoring: _Scoring) -> ScoreFuture:
        """A prepared scoring call's RPCs, sent; they fail as ``Unavailable`` when no connection
        comes within ``connect_timeout_s`` (``channel.ConnectionWatch``)."""
        calls = [
            self._stub.ScoreTokens.future(request, timeout=scoring.timeout, wait_for_ready=True)
            for request in scoring.requests
        ]
        return ScoreFuture(calls, scoring.result, scoring.error, self._connected.watch(scoring.timeout, calls))

    def score_many(self, inputs: Iterable[ScoreInput], **keywords: Unpack[ScoreKeywords]) -> list[Any]:
        """Score several batches pipelined over one stream; results in input order.

        A batch larger than the RPC limits goes as several requests on the stream. A failed
        batch raises its typed error, or, with ``return_exceptions``, takes its place. A stream
        broken by UNAVAILABLE or RESOURCE_EXHAUSTED (a server restart) is resumed on a new one
        with the requests still unanswered (``resume.py``).
        """
        scoring = self.prepare(inputs, **keywords)
        resume = StreamResume(scoring.requests, scoring.timeout, self.max_attempts)
        while (delay := resume.retry_after_s(self._stream_once(resume))) is not None:
            time.sleep(delay)
        return scoring.collected(resume.responses)

    def _stream_once(self, resume: StreamResume) -> grpc.RpcError | None:
        """Send the unanswered requests on one stream, once connected, and take its answers; how
        it broke, if it did."""
        self._connected.wait(resume.remaining_s())
        stream = self._stub.ScoreTokensStream(**resume.next_stream())
        stream.add_done_callback(self._connected.answered)
        try:
            for response in stream:
                resume.take(response)
        except grpc.RpcError as err:
            return err
        return None

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return [model_info(m) for m in self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout).models]

    def update_weights(
        self, model: str, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], **keywords: Unpack[UpdateKeywords]
    ) -> UpdateResult:
        """Push new weights for ``model``; they go live at once, as ``version`` (0: live + 1).

        ``weights``: a state dict or ``(name, tensor)`` pairs (torch tensors or numpy arrays, in
        the served dtype; for a LoRA model, its PEFT adapter state dict). ``partial=False`` needs
        every weight; ``True`` replaces only those given. Tensors are streamed one
        ``chunk_bytes`` piece at a time. ``delta=True`` (an RL trainer's policy, every step): after
        this client's first delta push of the model, only what changed since is sent, each tensor
        sparse or dense by its share of changed elements, unchanged ones not at all
        (``weights.WeightDeltas``, held in ``client.deltas[model]``); if the server no longer holds
        that version (a restart, another pusher), the push is sent again dense. Needs the admin
        scope where authentication is on. Keywords: ``UpdateKeywords``.
        """
        if keywords.get("delta"):
            weights = list(named_tensors(weights))  # read again if the server left the base
        while True:
            try:
                listed = self._listed(keywords.get("timeout") or self.timeout)
            except LogprobError as err:
                raise _unsent(err, model, keywords.get("version", 0)) from None
            ports, live = _ports_and_live(listed, model)
            try:
                update = self.update(model, weights, ports, live=live, **keywords)
                return self._pushed(model, keywords, self._push(update))
            except LogprobError as err:
                if not self._again_dense(model, keywords, err):
                    raise

    def _listed(self, timeout: float) -> pb.ListModelsResponse | None:
        """ListModels before a push, for the ports of the server's weight receivers, where a push
        can use them; None when it cannot (a given channel, replicas), or this client's token may
        not list models (the score scope): it pushes to the target."""
        if self._receivers_host is None:
            return None
        try:
            return self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        except PermissionDenied:
            return None

    def _push(self, update: _Update) -> pb.UpdateWeightsResponse:
        """The UpdateWeights calls of one push, made together (each stream is read on a thread of
        gRPC's, or with ``push_processes``, of this client's); all answer alike, so the first is
        returned, or the first error raised."""
        if update.targets is not None and self.push_processes:
            push = self._push_processes_for(update.chunk_bytes).start(update.targets, update.calls, update.timeout)
            try:
                return pb.UpdateWeightsResponse.FromString(push.wait())
            except LogprobError as err:
                raise self._told(update, err, []) from None
        channels = self._stream_channels(len(update.calls), update.targets)
        deadline = time.monotonic() + update.timeout
        calls = [self._pusher(c).future(stream, timeout=update.timeout) for c, stream in zip(channels, update.calls)]
        try:
            responses = [call.result() for call in calls]  # every call, not just the first
            return responses[0]
        except grpc.RpcError as err:
            for call in calls:
                call.cancel()
            raise self._told(update, _push_error(err, deadline), channels) from None

    def _told(self, update: _Update, error: LogprobError, channels: list[Any]) -> LogprobError:
        """A failed push's error; of one cancelled or past its deadline, saying whether it went live
        all the same (ListModels, asked as ``_asked_after`` says, with the client's timeout: the
        push's may have passed, and the answer waits for a commit the server had in progress)."""
        if not _interrupted(error):
            return error
        listed = []
        for channel in self._asked_after(update, channels):
            with contextlib.suppress(grpc.RpcError):  # the error then says the outcome is unknown
                ask = pb_grpc.LogprobServiceStub(channel).ListModels
                listed.append(ask(pb.ListModelsRequest(), timeout=self.timeout))
        return update.interrupted(error, listed)

    def update_weights_ipc(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int = 0,
        partial: bool = False,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Push new weights for ``model`` from this process's GPU memory to a server on this host,
        by CUDA IPC (``logprob_client.ipc``): only handles cross gRPC; the server copies the
        tensors device to device. ``weights`` as for ``update_weights``, as CUDA torch tensors; they
        are held, and must not change, until this returns. Raises ``FailedPrecondition`` where the
        server is on another host, does not see this GPU or has no peer access to it (then push
        with ``update_weights``). Needs the admin scope where authentication is on."""
        request, kept = ipc_request(model, weights, version=version, partial=partial)
        response = self._call(self._stub.UpdateWeightsFromIpc, request, timeout)
        del kept  # the server is done with them
        return UpdateResult.from_proto(response)

    def load_weights(
        self, model: str, path: str, *, version: int = 0, partial: bool = False, timeout: float | None = None
    ) -> UpdateResult:
        """Make the server load ``model``'s weights from ``path`` on its own disk (a .safetensors
        file, an HF checkpoint directory, or for a LoRA model a PEFT adapter directory)."""
        request = self.load_request(model, path, version, partial)
        return UpdateResult.from_proto(self._call(self._stub.LoadWeights, request, timeout))

    def close(self) -> None:
        self._close_push_processes()
        for channel in self._all_channels():
            channel.close()

    def __enter__(self) -> LogprobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLogprobClient(_Client):
    """asyncio client with the same API as ``LogprobClient`` (methods are coroutines)."""

    _aio = True

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One RPC; its failure raised as the typed error of its status."""
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    async def score(self, prompt_ids: Any, completion_ids: Any, **keywords: Unpack[ScoreKeywords]) -> Any:
        """See ``LogprobClient.score``; for overlap, ``asyncio.create_task(client.score(...))``."""
        return await self._score(self.prepare_one(prompt_ids, completion_ids, keywords))

    async def _score(self, scoring: _Scoring) -> Any:
        """A prepared scoring call's RPCs, sent once connected, and its answer."""
        await self._connected.wait(scoring.timeout)
        calls = [
            self._stub.ScoreTokens(request, timeout=scoring.timeout, wait_for_ready=True)
            for request in scoring.requests
        ]
        try:
            responses = await asyncio.gather(*calls)
        except grpc.RpcError as err:
            error = scoring.error(*await _failure(calls, err))
            for call in calls:
                call.cancel()
            raise error from None
        return scoring.result(responses)

    async def score_groups(
        self, prompt_ids: Sequence[Any], completion_ids: Sequence[Sequence[Any]], **keywords: Unpack[ScoreKeywords]
    ) -> Any:
        """See ``LogprobClient.score_groups``."""
        scoring, sizes = self.prepare_groups(prompt_ids, completion_ids, keywords)
        return regroup(await self._score(scoring), sizes)

    async def score_many(self, inputs: Iterable[ScoreInput], **keywords: Unpack[ScoreKeywords]) -> list[Any]:
        """See ``LogprobClient.score_many``."""
        scoring = self.prepare(inputs, **keywords)
        resume = StreamResume(scoring.requests, scoring.timeout, self.max_attempts)
        while (delay := resume.retry_after_s(await self._stream_once(resume))) is not None:
            await asyncio.sleep(delay)
        return scoring.collected(resume.responses)

    async def _stream_once(self, resume: StreamResume) -> grpc.RpcError | None:
        """See ``LogprobClient._stream_once``."""
        await self._connected.wait(resume.remaining_s())
        try:
            async for response in self._stub.ScoreTokensStream(**resume.next_stream()):
                resume.take(response)
        except grpc.RpcError as err:
            return err
        return None

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        response = await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [model_info(m) for m in response.models]

    async def update_weights(
        self, model: str, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], **keywords: Unpack[UpdateKeywords]
    ) -> UpdateResult:
        """See ``LogprobClient.update_weights``."""
        if keywords.get("delta"):
            weights = list(named_tensors(weights))
        while True:
            try:
                listed = await self._listed(keywords.get("timeout") or self.timeout)
            except LogprobError as err:
                raise _unsent(err, model, keywords.get("version", 0)) from None
            ports, live = _ports_and_live(listed, model)
            try:
                update = self.update(model, weights, ports, live=live, **keywords)
                return self._pushed(model, keywords, await self._push(update))
            except LogprobError as err:
                if not self._again_dense(model, keywords, err):
                    raise

    async def _listed(self, timeout: float) -> pb.ListModelsResponse | None:
        """See ``LogprobClient._listed``."""
        if self._receivers_host is None:
            return None
        try:
            return await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        except PermissionDenied:
            return None

    async def _push(self, update: _Update) -> pb.UpdateWeightsResponse:
        """See ``LogprobClient._push`` (here each stream is read on the event loop, or with
        ``push_processes``, on threads of this client's)."""
        if update.targets is not None and self.push_processes:
            # Off the event loop: the first push starts the processes (about 2 s on an H100 host).
            processes = self._push_processes_for(update.chunk_bytes)
            push = await asyncio.to_thread(processes.start, update.targets, update.calls, update.timeout)
            try:
                return pb.UpdateWeightsResponse.FromString(await asyncio.to_thread(push.wait))
            except asyncio.CancelledError:
                push.cancel()
                raise
            except LogprobError as err:
                raise await self._told(update, err, []) from None
        channels = self._stream_channels(len(update.calls), update.targets)
        deadline = time.monotonic() + update.timeout
        calls = [self._pusher(c)(stream, timeout=update.timeout) for c, stream in zip(channels, update.calls)]
        try:
            return (await asyncio.gather(*calls))[0]
        except grpc.RpcError as err:
            for call in calls:
                call.cancel()
            raise await self._told(update, _push_error(err, deadline), channels) from None
        except asyncio.CancelledError:
            for call in calls:
                call.cancel()
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this push's caller cancelled it
            # grpc.aio cancelled a call itself: it does so when the half-close after a call's last
            # message fails, the deadline having just passed, and its awaiter then sees
            # CancelledError in place of the deadline.
            cancelled = Cancelled("a call of the push was cancelled", grpc.StatusCode.CANCELLED)
            raise await self._told(update, _push_error(cancelled, deadline), channels) from None

    async def _told(self, update: _Update, error: LogprobError, channels: list[Any]) -> LogprobError:
        """See ``LogprobClient._told``."""
        if not _interrupted(error):
            return error
        asks = [
            pb_grpc.LogprobServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=self.timeout)
            for channel in self._asked_after(update, channels)
        ]
        answers = await asyncio.gather(*asks, return_exceptions=True)
        return update.interrupted(error, [a for a in answers if isinstance(a, pb.ListModelsResponse)])

    async def update_weights_ipc(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int = 0,
        partial: bool = False,
        timeout: float | None = None,
    ) -> UpdateResult:
        """See ``LogprobClient.update_weights_ipc``."""
        request, kept = ipc_request(model, weights, version=version, partial=partial)
        response = await self._call(self._stub.UpdateWeightsFromIpc, request, timeout)
        del kept
        return UpdateResult.from_proto(response)

    async def load_weights(
        self, model: str, path: str, *, version: int = 0, partial: bool = False, timeout: float | None = None
    ) -> UpdateResult:
        """See ``LogprobClient.load_weights``."""
        request = self.load_request(model, path, version, partial)
        return UpdateResult.from_proto(await self._call(self._stub.LoadWeights, request, timeout))

    async def close(self) -> None:
        await asyncio.to_thread(self._close_push_processes)
        for channel in self._all_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncLogprobClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _failure(calls: Sequence[Any], err: grpc.RpcError) -> tuple[int, grpc.StatusCode, str]:
    """Which of a call's asyncio RPCs failed (the first in part order of those that have, when
    several have), its status and message; ``gather`` raised ``err``, one of theirs."""
    for part, call in enumerate(calls):
        if call.done() and (code := await call.code()) != grpc.StatusCode.OK:
            return part, code, await call.details() or ""
    return len(calls), err.code(), err.details() or ""  # (no part: the error keeps the server's words)


def _described(target: str | Sequence[str]) -> str:
    """A target as errors name it: as given."""
    return repr(target) if isinstance(target, str) else repr(list(target))
