"""What both clients share (``ClientBase``): the connection, defaults, building and splitting
scoring requests, and preparing weight pushes (``pushes``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import grpc
import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc
from logprob_proto.framing import join

from .channel import CONNECT_TIMEOUT_S, AioConnectionWatch, Connection, ConnectionWatch, channel_target
from .deltas import WeightDeltas
from .errors import LogprobError, error_for_status
from .inputs import Prepared, flatten_groups, prepare
from .pacing import PacedCall, Share
from .push_processes import FRAMING_BYTES, PushProcesses
from .pushes import STREAMS_PER_RECEIVER, UPDATE_WEIGHTS, PreparedPush, UpdateKeywords
from .split import DEFAULT_MAX_SEQUENCES_PER_RPC, DEFAULT_MAX_TOKENS_PER_RPC, RpcLimits, part_tokens, split
from .streams import DEFAULT_CHUNK_BYTES, DEFAULT_STREAMS, UpdateResult, update_streams
from .wire import (
    Options,
    ScoreInput,
    caller_error,
    collect,
    repeats_prompt,
    result,
    score_request,
)

DEFAULT_TIMEOUT_S = 120.0


class ScoreKeywords(TypedDict, total=False):
    """The keywords of ``score``, ``score_async`` and ``score_many`` (all optional).

    ``model``: the model to score with (default: the client's); ``temperature``: the sampling
    temperature the log-probs are taken at (1.0); ``return_entropy``: also return each token's
    entropy, as a second value (False); ``min_version``: score only with weights of at least this
    version, waiting for it within the deadline (0: any; ``FailedPrecondition`` when it does not
    come, naming it and the live version); ``timeout``: this call's deadline in
    seconds (the client's). ``top_k`` (0-256): also return, at each completion position, the K
    most likely ids and their log-probs; ``candidate_ids``: ids whose log-probs to return at each
    completion position (``inputs.prepare``); ``return_routed_experts``: also return, at each
    completion position, the experts each mixture-of-experts layer routed it to (a model with
    routers only: ``ModelInfo.num_experts``); with any of these, the answer is a
    ``wire.TeacherScores``.
    ``score`` and ``score_async`` also take ``prompt_mask``, ``completion_mask`` (dense inputs,
    ``logprob_client.inputs``) and ``candidate_ids``; ``score_many`` takes ``return_exceptions`` (a
    failed batch's error takes its place instead of being raised), its ``ScoreInput``s their own
    candidates.
    """

    model: str | None
    temperature: float
    return_entropy: bool
    min_version: int
    timeout: float | None
    prompt_mask: Any
    completion_mask: Any
    return_exceptions: bool
    top_k: int
    candidate_ids: Any
    return_routed_experts: bool


@dataclass(frozen=True)
class Scoring:
    """A scoring call, prepared: each batch's layout and requests, and how to answer.
    ``sizes``: each request's tokens (as ``split`` counts them) and sequences, in ``requests``' order."""

    calls: list[tuple[Prepared, list[pb.ScoreRequest]]]
    return_entropy: bool
    timeout: float
    return_exceptions: bool
    top_k: int = 0
    return_routed_experts: bool = False
    sizes: tuple[tuple[int, int], ...] = ()

    @property
    def requests(self) -> list[pb.ScoreRequest]:
        return [request for _, requests in self.calls for request in requests]

    def paced(self) -> PacedCall:
        """The call's parts to pace, its deadline starting now."""
        return PacedCall([tokens for tokens, _ in self.sizes], [n for _, n in self.sizes], self.timeout)

    def result(self, responses: Sequence[pb.ScoreResponse]) -> Any:
        """The one batch's answer from its responses, in part order."""
        ((prepared, _),) = self.calls
        return result(prepared, responses, self.return_entropy, self.top_k, self.return_routed_experts)

    def error(self, part: int, code: grpc.StatusCode, message: str) -> LogprobError:
        """The one batch's error for the failure of its RPC ``part``, in the caller's terms
        (``wire.caller_error``)."""
        ((prepared, requests),) = self.calls
        return caller_error(prepared, requests, part, code, message)

    def collected(self, responses: dict[str, pb.ScoreResponse]) -> list[Any]:
        return collect(
            self.calls, responses, self.return_entropy, self.return_exceptions, self.top_k, self.return_routed_experts
        )


class ClientBase:
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
        self._described = described
        self._connected = (AioConnectionWatch if self._aio else ConnectionWatch)(
            self._channel, described, connect_timeout_s
        )
        self._share = Share(self._learn)  # this client's parts in flight, within its share of the queue
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
            UPDATE_WEIGHTS, request_serializer=join, response_deserializer=pb.UpdateWeightsResponse.FromString
        )

    def _outcome_channels(self, update: PreparedPush, channels: list[Any]) -> list[Any]:
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

    def _learn(self) -> None:
        """Ask the server for its queue's limits, without waiting, and tell ``self._share``
        (each client: ListModels)."""
        raise NotImplementedError

    def _limits_told(self, listed: pb.ListModelsResponse | None) -> None:
        """Tell the share what ListModels answered (None: it failed, so no pacing)."""
        limits = listed.models[0].limits if listed is not None and listed.models else pb.ModelLimits()
        self._share.told(limits.max_queued_tokens, limits.max_queued_tokens_per_client)

    def deadline_error(self, paced: PacedCall, server_message: str = "") -> LogprobError:
        """A scoring call's error when its deadline passed (``PacedCall.deadline_error``)."""
        return paced.deadline_error(self._described, self._share, server_message)

    def rpc_error(self, err: grpc.RpcError) -> LogprobError:
        """The typed error of a failed RPC; one that found no server names the target dialled."""
        details = err.details() or ""
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            details = f"{self._described}: {details}"
        return error_for_status(err.code(), details)

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
        top_k: int = 0,
        return_routed_experts: bool = False,
    ) -> Scoring:
        """Check the options and build every batch's requests, one per part (none when every
        completion is masked out: that answer is all zeros, made locally, as the server would
        refuse an empty request). A batch is a ``ScoreInput``, or one ``inputs.prepare`` made."""
        # 0 is the wire's "unset", which the server takes as 1.0, as its own messages say.
        if not (temperature >= 0 and np.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number > 0 (0: the default, 1.0), got {temperature}")
        if min_version < 0:
            raise ValueError(f"min_version must be >= 0 (0: any version), got {min_version}")
        if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: none; the server allows up to 256), got {top_k!r}")
        routed = bool(return_routed_experts)
        options = Options(model or self.model, temperature, return_entropy, min_version, int(top_k), routed)
        calls, sizes = [], []
        for inp in inputs:
            prepared = (
                inp
                if isinstance(inp, Prepared)
                else prepare(
                    inp.prompt_ids,
                    inp.completion_ids,
                    inp.prompt_mask,
                    inp.completion_mask,
                    candidate_ids=inp.candidate_ids,
                )
            )
            if self.legacy_wire and (top_k or prepared.candidates is not None or routed):
                raise ValueError(
                    "top_k, candidate_ids and return_routed_experts need the current wire: not with legacy_wire=True"
                )
            if not prepared.sequences and prepared.dense_shape is not None:
                calls.append((prepared, []))
                continue
            seqs = prepared.sequences
            repeats = repeats_prompt(seqs) if self.share_prompts else [False] * len(seqs)
            shared = [len(p) if repeat else 0 for (p, _), repeat in zip(seqs, repeats, strict=True)]
            lengths = [len(p) + len(c) for p, c in seqs]
            parts = split(lengths, self.rpc_limits, shared)
            sizes += [(part_tokens(lengths, part, shared), part.stop - part.start) for part in parts]
            requests = [
                score_request(
                    seqs[part],
                    options,
                    repeats=repeats[part] if self.share_prompts else None,
                    legacy=self.legacy_wire,
                    candidates=prepared.candidates[part] if prepared.candidates is not None else None,
                )
                for part in parts
            ]
            calls.append((prepared, requests))
        timeout = timeout or self.timeout
        return Scoring(calls, return_entropy, timeout, return_exceptions, int(top_k), routed, tuple(sizes))

    def prepare_one(
        self, prompt_ids: Any, completion_ids: Any, keywords: ScoreKeywords, group_sizes: Sequence[int] | None = None
    ) -> Scoring:
        """``prepare`` of one batch given as ``score`` takes it (``group_sizes``: the lists are
        ``flatten_groups``' of ``score_groups``' groups, which errors then name)."""
        check_keywords(keywords, "score")
        given = {name: keywords.pop(name, None) for name in ("prompt_mask", "completion_mask", "candidate_ids")}  # type: ignore[misc]
        return self.prepare([prepare(prompt_ids, completion_ids, **given, group_sizes=group_sizes)], **keywords)

    def prepare_groups(
        self, prompt_ids: Any, completion_ids: Any, keywords: ScoreKeywords
    ) -> tuple[Scoring, list[int]]:
        """``prepare`` of ``score_groups``' groups, and their sizes."""
        prompts, completions, sizes = flatten_groups(prompt_ids, completion_ids)
        if keywords.get("candidate_ids") is not None:  # grouped as the completions are
            keywords["candidate_ids"] = [c for group in keywords["candidate_ids"] for c in group]
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
    ) -> PreparedPush:
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
        return PreparedPush(calls, targets, timeout or self.timeout, chunk_bytes, model, version, live)

    def _push_result(self, model: str, keywords: UpdateKeywords, response: pb.UpdateWeightsResponse) -> UpdateResult:
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


def check_keywords(keywords: Mapping[str, Any], method: str) -> None:
    """A keyword ``method`` does not take is a TypeError naming it (not the internal function it
    would reach) and the keyword it most likely meant."""
    known = list(ScoreKeywords.__annotations__)
    for name in keywords:
        if name not in known:
            guess = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else f"; it takes {', '.join(known)}"
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}{hint}")


def _described(target: str | Sequence[str]) -> str:
    """A target as errors name it: as given."""
    return repr(target) if isinstance(target, str) else repr(list(target))
