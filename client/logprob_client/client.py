"""``LogprobClient`` (blocking) and ``AsyncLogprobClient`` (asyncio): the same API.

from logprob_client import LogprobClient

with LogprobClient("localhost:50051") as client:
    logprobs = client.score([[1, 2, 3]], [[4, 5]])   # [array([-8.1, -7.9], dtype=float32)]
    pending = client.score_async([[1, 2, 3]], [[4, 5]])  # returns at once; RPCs in flight
    logprobs = pending.result()

Every scoring call is cut into parts within ``max_sequences_per_rpc`` / ``max_tokens_per_rpc``
(``split.py``), sent as that many ScoreTokens RPCs at once, and reassembled in order.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from .channel import open_channel
from .errors import LogprobError, MixedVersionsError, error_for_status, error_from_rpc
from .future import ScoreFuture
from .inputs import Prepared, assemble, prepare
from .resume import StreamResume
from .security import PathLike
from .split import DEFAULT_MAX_SEQUENCES_PER_RPC, DEFAULT_MAX_TOKENS_PER_RPC, RpcLimits, split
from .weights import DEFAULT_CHUNK_BYTES, UpdateResult, update_requests

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ModelLimits:
    max_sequence_tokens: int
    max_sequences_per_request: int
    max_tokens_per_request: int


@dataclass(frozen=True)
class ModelInfo:
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
    base_model: str = ""  # a LoRA model's base, whose weights it shares


@dataclass(frozen=True)
class ScoreInput:
    """One batch for ``score_many``: the same arguments ``score`` takes."""

    prompt_ids: Any
    completion_ids: Any
    prompt_mask: Any = None
    completion_mask: Any = None


def _model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        name=m.name,
        architecture=m.architecture,
        vocab_size=m.vocab_size,
        max_positions=m.max_positions,
        dtype=m.dtype,
        version=m.version,
        fingerprint=m.fingerprint,
        limits=ModelLimits(
            max_sequence_tokens=m.limits.max_sequence_tokens,
            max_sequences_per_request=m.limits.max_sequences_per_request,
            max_tokens_per_request=m.limits.max_tokens_per_request,
        ),
        source=m.source,
        device=m.device,
        base_model=m.base_model,
    )


@dataclass(frozen=True)
class _Options:
    """Per-call scoring options, as every part of a call sends them."""

    model: str
    temperature: float
    return_entropy: bool
    min_version: int


def _request(sequences: Sequence[tuple[np.ndarray, np.ndarray]], options: _Options) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=str(uuid.uuid4()),
        model=options.model,
        temperature=options.temperature,
        return_entropy=options.return_entropy,
        min_version=options.min_version,
        sequences=[pb.Sequence(prompt_ids=p.tolist(), completion_ids=c.tolist()) for p, c in sequences],
    )


def _result(prepared: Prepared, responses: Sequence[pb.ScoreResponse], return_entropy: bool) -> Any:
    """The caller's layout from the responses of a call's parts, in part order."""
    versions = sorted({response.model_version for response in responses})
    if len(versions) > 1:
        # The model's weights were updated while the call's parts were being scored.
        raise MixedVersionsError(
            f"the parts of this call were scored by versions {versions} of model {responses[0].model!r}; "
            f"retry with min_version={versions[-1]}"
        )
    scores = [s for response in responses for s in response.scores]
    logprobs = assemble(prepared, [np.asarray(s.logprobs, dtype=np.float32) for s in scores])
    if not return_entropy:
        return logprobs
    return logprobs, assemble(prepared, [np.asarray(s.entropies, dtype=np.float32) for s in scores])


class _Calls:
    """What both clients share: defaults, request building and splitting, result unpacking."""

    def __init__(
        self, *, model: str, timeout: float, max_attempts: int, max_sequences_per_rpc: int, max_tokens_per_rpc: int
    ) -> None:
        self.model = model
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.rpc_limits = RpcLimits(max_sequences_per_rpc, max_tokens_per_rpc)

    def options(self, model: str | None, temperature: float, return_entropy: bool, min_version: int) -> _Options:
        if not (temperature > 0 and np.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        if min_version < 0:
            raise ValueError(f"min_version must be >= 0 (0: any version), got {min_version}")
        return _Options(model or self.model, temperature, return_entropy, min_version)

    def prepare_call(self, inp: ScoreInput, options: _Options) -> tuple[Prepared, list[pb.ScoreRequest]]:
        """The prepared input and its requests, one per part (none when every completion is masked
        out: that answer is all zeros, made locally, as the server would refuse an empty request)."""
        prepared = prepare(inp.prompt_ids, inp.completion_ids, inp.prompt_mask, inp.completion_mask)
        if not prepared.sequences and prepared.dense_shape is not None:
            return prepared, []
        seqs = prepared.sequences
        parts = split([len(p) + len(c) for p, c in seqs], self.rpc_limits)
        return prepared, [_request(seqs[part], options) for part in parts]

    def prepare_many(
        self, inputs: Iterable[ScoreInput], options: _Options
    ) -> tuple[list[tuple[Prepared, list[pb.ScoreRequest]]], list[pb.ScoreRequest]]:
        """Every batch's prepared call, and all their requests, to stream."""
        calls = [self.prepare_call(inp, options) for inp in inputs]
        return calls, [request for _, requests in calls for request in requests]


class LogprobClient(_Calls):
    """Blocking client.

    ``target``: a gRPC target ("host:port", "dns:///host:port") or a list of "host:port"
    replicas; calls are spread round-robin over every address it resolves to (``channel.py``).
    ``timeout``: deadline of every call, seconds (overridable per call). ``options``: extra gRPC
    channel options.
    UNAVAILABLE and RESOURCE_EXHAUSTED are retried with exponential backoff (gRPC's retry policy,
    up to ``max_attempts`` tries) within the deadline; other failures raise at once.
    ``max_sequences_per_rpc`` / ``max_tokens_per_rpc``: a scoring call larger than either is
    split into several RPCs in flight together (keep them within the server's per-request limits).
    Security (``security.py``): ``tls`` or any ``tls_*`` option turns TLS on (``tls_ca_file``:
    the CA to trust; ``tls_cert_file`` + ``tls_key_file``: a client certificate for mutual TLS;
    ``tls_server_name``: the name the server's certificate carries, when the target's differs);
    ``token`` or ``token_file``: a bearer token sent on every call. With ``channel=``, these are
    the channel's business: build it with ``channel.open_channel``.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        model: str = "default",
        max_attempts: int = 5,
        max_sequences_per_rpc: int = DEFAULT_MAX_SEQUENCES_PER_RPC,
        max_tokens_per_rpc: int = DEFAULT_MAX_TOKENS_PER_RPC,
        options: Sequence[tuple[str, Any]] | None = None,
        channel: grpc.Channel | None = None,
        tls: bool = False,
        tls_ca_file: PathLike | None = None,
        tls_cert_file: PathLike | None = None,
        tls_key_file: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
    ) -> None:
        super().__init__(
            model=model,
            timeout=timeout,
            max_attempts=max_attempts,
            max_sequences_per_rpc=max_sequences_per_rpc,
            max_tokens_per_rpc=max_tokens_per_rpc,
        )
        self._channel = _channel(
            channel,
            target,
            aio=False,
            max_attempts=max_attempts,
            options=options,
            tls=tls,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            tls_server_name=tls_server_name,
            token=token,
            token_file=token_file,
        )
        self._stub = pb_grpc.LogprobServiceStub(self._channel)

    def score(
        self,
        prompt_ids: Any,
        completion_ids: Any,
        *,
        model: str | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        min_version: int = 0,
        prompt_mask: Any = None,
        completion_mask: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """Log-probs of every completion token (and entropies, as a second value, when asked).

        Lists in -> list of float32 arrays out; 2-D arrays/tensors in -> one (B, C) array/tensor
        out (see ``logprob_client.inputs``).
        """
        return self.score_async(
            prompt_ids,
            completion_ids,
            model=model,
            temperature=temperature,
            return_entropy=return_entropy,
            min_version=min_version,
            prompt_mask=prompt_mask,
            completion_mask=completion_mask,
            timeout=timeout,
        ).result()

    def score_async(
        self,
        prompt_ids: Any,
        completion_ids: Any,
        *,
        model: str | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        min_version: int = 0,
        prompt_mask: Any = None,
        completion_mask: Any = None,
        timeout: float | None = None,
    ) -> ScoreFuture:
        """``score`` without waiting: the RPCs are sent before this returns, and ``.result()``
        gives what ``score`` would have returned. The inputs are read before it returns, so the
        caller may reuse their buffers at once.
        """
        inp = ScoreInput(prompt_ids, completion_ids, prompt_mask, completion_mask)
        prepared, requests = self.prepare_call(inp, self.options(model, temperature, return_entropy, min_version))
        calls = [
            self._stub.ScoreTokens.future(request, timeout=timeout or self.timeout, wait_for_ready=True)
            for request in requests
        ]
        return ScoreFuture(calls, lambda responses: _result(prepared, responses, return_entropy))

    def score_many(
        self,
        inputs: Iterable[ScoreInput],
        *,
        model: str | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        min_version: int = 0,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Score several batches pipelined over one stream; results in input order.

        A batch larger than the RPC limits goes as several requests on the stream. A failed
        batch raises its typed error, or, with ``return_exceptions``, takes its place. A stream
        broken by UNAVAILABLE or RESOURCE_EXHAUSTED (a server restart) is resumed on a new one
        with the requests still unanswered (``resume.py``).
        """
        calls, requests = self.prepare_many(inputs, self.options(model, temperature, return_entropy, min_version))
        resume = StreamResume(requests, timeout or self.timeout, self.max_attempts)
        while True:
            error = None
            try:
                stream = self._stub.ScoreTokensStream(
                    iter(resume.next_stream()), timeout=resume.remaining_s(), wait_for_ready=True
                )
                for response in stream:
                    resume.take(response)
            except grpc.RpcError as err:
                error = err
            delay = resume.retry_after_s(error)
            if delay is None:
                return _collect(calls, resume.responses, return_entropy, return_exceptions)
            time.sleep(delay)

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        try:
            response = self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return [_model_info(m) for m in response.models]

    def update_weights(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int = 0,
        partial: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> UpdateResult:
        """Push new weights for ``model``; they go live at once, as ``version`` (0: live + 1).

        ``weights``: a state dict or ``(name, tensor)`` pairs (torch tensors or numpy arrays, in
        the served dtype; for a LoRA model, its PEFT adapter state dict). ``partial=False`` needs
        every weight; ``True`` replaces only those given. Tensors are streamed one
        ``chunk_bytes`` piece at a time. Needs the admin scope where authentication is on.
        """
        requests = update_requests(model, weights, version=version, partial=partial, chunk_bytes=chunk_bytes)
        try:
            response = self._stub.UpdateWeights(requests, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return UpdateResult.from_proto(response)

    def load_weights(
        self, model: str, path: str, *, version: int = 0, partial: bool = False, timeout: float | None = None
    ) -> UpdateResult:
        """Make the server load ``model``'s weights from ``path`` on its own disk (a .safetensors
        file, an HF checkpoint directory, or for a LoRA model a PEFT adapter directory)."""
        request = pb.LoadWeightsRequest(model=model, path=str(path), version=version, partial=partial)
        try:
            response = self._stub.LoadWeights(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return UpdateResult.from_proto(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> LogprobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLogprobClient(_Calls):
    """asyncio client with the same API as ``LogprobClient`` (methods are coroutines)."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        model: str = "default",
        max_attempts: int = 5,
        max_sequences_per_rpc: int = DEFAULT_MAX_SEQUENCES_PER_RPC,
        max_tokens_per_rpc: int = DEFAULT_MAX_TOKENS_PER_RPC,
        options: Sequence[tuple[str, Any]] | None = None,
        channel: grpc.aio.Channel | None = None,
        tls: bool = False,
        tls_ca_file: PathLike | None = None,
        tls_cert_file: PathLike | None = None,
        tls_key_file: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
    ) -> None:
        super().__init__(
            model=model,
            timeout=timeout,
            max_attempts=max_attempts,
            max_sequences_per_rpc=max_sequences_per_rpc,
            max_tokens_per_rpc=max_tokens_per_rpc,
        )
        self._channel = _channel(
            channel,
            target,
            aio=True,
            max_attempts=max_attempts,
            options=options,
            tls=tls,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            tls_server_name=tls_server_name,
            token=token,
            token_file=token_file,
        )
        self._stub = pb_grpc.LogprobServiceStub(self._channel)

    async def score(
        self,
        prompt_ids: Any,
        completion_ids: Any,
        *,
        model: str | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        min_version: int = 0,
        prompt_mask: Any = None,
        completion_mask: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """See ``LogprobClient.score``; for overlap, ``asyncio.create_task(client.score(...))``."""
        inp = ScoreInput(prompt_ids, completion_ids, prompt_mask, completion_mask)
        prepared, requests = self.prepare_call(inp, self.options(model, temperature, return_entropy, min_version))
        calls = [
            self._stub.ScoreTokens(request, timeout=timeout or self.timeout, wait_for_ready=True)
            for request in requests
        ]
        try:
            responses = await asyncio.gather(*calls)
        except grpc.RpcError as err:
            for call in calls:
                call.cancel()
            raise error_from_rpc(err) from None
        return _result(prepared, responses, return_entropy)

    async def score_many(
        self,
        inputs: Iterable[ScoreInput],
        *,
        model: str | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        min_version: int = 0,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """See ``LogprobClient.score_many``."""
        calls, requests = self.prepare_many(inputs, self.options(model, temperature, return_entropy, min_version))
        resume = StreamResume(requests, timeout or self.timeout, self.max_attempts)
        while True:
            error = None
            try:
                stream = self._stub.ScoreTokensStream(
                    iter(resume.next_stream()), timeout=resume.remaining_s(), wait_for_ready=True
                )
                async for response in stream:
                    resume.take(response)
            except grpc.RpcError as err:
                error = err
            delay = resume.retry_after_s(error)
            if delay is None:
                return _collect(calls, resume.responses, return_entropy, return_exceptions)
            await asyncio.sleep(delay)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        try:
            response = await self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return [_model_info(m) for m in response.models]

    async def update_weights(
        self,
        model: str,
        weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int = 0,
        partial: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> UpdateResult:
        """See ``LogprobClient.update_weights``."""
        requests = update_requests(model, weights, version=version, partial=partial, chunk_bytes=chunk_bytes)
        try:
            response = await self._stub.UpdateWeights(requests, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return UpdateResult.from_proto(response)

    async def load_weights(
        self, model: str, path: str, *, version: int = 0, partial: bool = False, timeout: float | None = None
    ) -> UpdateResult:
        """See ``LogprobClient.load_weights``."""
        request = pb.LoadWeightsRequest(model=model, path=str(path), version=version, partial=partial)
        try:
            response = await self._stub.LoadWeights(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return UpdateResult.from_proto(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncLogprobClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _channel(channel: Any, target: str, **settings: Any) -> Any:
    """``channel`` as given, else one opened with ``settings``; refuses TLS or token settings
    beside a given channel, which would silently not apply."""
    if channel is None:
        return open_channel(target, **settings)
    security = {k: v for k, v in settings.items() if k.startswith(("tls", "token")) and v not in (None, False)}
    if security:
        raise ValueError(
            f"{', '.join(security)} cannot apply to a given channel: pass them to open_channel(...) instead"
        )
    return channel


def _collect(
    calls: list[tuple[Prepared, list[pb.ScoreRequest]]],
    responses: dict[str, pb.ScoreResponse],
    return_entropy: bool,
    return_exceptions: bool,
) -> list[Any]:
    results: list[Any] = []
    for prepared, requests in calls:
        error = next(filter(None, (_stream_error(request, responses) for request in requests)), None)
        if error is None:
            results.append(_result(prepared, [responses[r.request_id] for r in requests], return_entropy))
        elif return_exceptions:
            results.append(error)
        else:
            raise error
    return results


def _stream_error(request: pb.ScoreRequest, responses: dict[str, pb.ScoreResponse]) -> LogprobError | None:
    """The error the stream answered for one request, if any."""
    response = responses.get(request.request_id)
    if response is None:
        return error_for_status(grpc.StatusCode.UNKNOWN, f"no response for {request.request_id}")
    if response.HasField("error"):
        return error_for_status(response.error.code, response.error.message)
    return None
