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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from .channel import Connection
from .errors import error_from_rpc
from .future import ScoreFuture
from .inputs import Prepared, prepare
from .resume import StreamResume
from .split import DEFAULT_MAX_SEQUENCES_PER_RPC, DEFAULT_MAX_TOKENS_PER_RPC, RpcLimits, split
from .weights import DEFAULT_CHUNK_BYTES, UpdateResult, update_requests
from .wire import ModelInfo, Options, ScoreInput, collect, model_info, result, score_request

DEFAULT_TIMEOUT_S = 120.0


class _Client:
    """What both clients share: the connection, defaults, request building and splitting.

    ``target``: a gRPC target ("host:port", "dns:///host:port") or a list of "host:port"
    replicas; calls are spread round-robin over every address it resolves to (``channel.py``).
    ``timeout``: deadline of every call, seconds (overridable per call). ``model``: the model of
    calls that name none. ``max_sequences_per_rpc`` / ``max_tokens_per_rpc``: a scoring call larger
    than either is split into several RPCs in flight together (keep them within the server's
    per-request limits). ``connection``: the fields of ``channel.Connection`` (``max_attempts``:
    UNAVAILABLE and RESOURCE_EXHAUSTED are retried with exponential backoff up to that many tries,
    within the deadline; other failures raise at once; ``options``; TLS: ``tls``, ``tls_ca_file``,
    ``tls_cert_file``, ``tls_key_file``, ``tls_server_name``; a bearer token: ``token`` or
    ``token_file``). With ``channel=`` (a channel of the client's kind), those are the channel's
    business: build it with ``channel.open_channel``.
    """

    _aio: bool

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        model: str = "default",
        max_sequences_per_rpc: int = DEFAULT_MAX_SEQUENCES_PER_RPC,
        max_tokens_per_rpc: int = DEFAULT_MAX_TOKENS_PER_RPC,
        channel: Any = None,
        **connection: Any,
    ) -> None:
        self.model = model
        self.timeout = timeout
        self.rpc_limits = RpcLimits(max_sequences_per_rpc, max_tokens_per_rpc)
        self.connection = Connection(**connection)
        if channel is not None and self.connection.security():
            raise ValueError(
                f"{', '.join(self.connection.security())} cannot apply to a given channel: "
                "pass them to open_channel(...) instead"
            )
        self._channel = channel if channel is not None else self.connection.open(target, aio=self._aio)
        self._stub = pb_grpc.LogprobServiceStub(self._channel)

    @property
    def max_attempts(self) -> int:
        return self.connection.max_attempts

    def options(self, model: str | None, temperature: float, return_entropy: bool, min_version: int) -> Options:
        if not (temperature > 0 and np.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        if min_version < 0:
            raise ValueError(f"min_version must be >= 0 (0: any version), got {min_version}")
        return Options(model or self.model, temperature, return_entropy, min_version)

    def prepare_call(self, inp: ScoreInput, options: Options) -> tuple[Prepared, list[pb.ScoreRequest]]:
        """The prepared input and its requests, one per part (none when every completion is masked
        out: that answer is all zeros, made locally, as the server would refuse an empty request)."""
        prepared = prepare(inp.prompt_ids, inp.completion_ids, inp.prompt_mask, inp.completion_mask)
        if not prepared.sequences and prepared.dense_shape is not None:
            return prepared, []
        seqs = prepared.sequences
        parts = split([len(p) + len(c) for p, c in seqs], self.rpc_limits)
        return prepared, [score_request(seqs[part], options) for part in parts]

    def prepare_many(
        self, inputs: Iterable[ScoreInput], options: Options
    ) -> tuple[list[tuple[Prepared, list[pb.ScoreRequest]]], list[pb.ScoreRequest]]:
        """Every batch's prepared call, and all their requests, to stream."""
        calls = [self.prepare_call(inp, options) for inp in inputs]
        return calls, [request for _, requests in calls for request in requests]

    @staticmethod
    def load_request(model: str, path: str, version: int, partial: bool) -> pb.LoadWeightsRequest:
        return pb.LoadWeightsRequest(model=model, path=str(path), version=version, partial=partial)


class LogprobClient(_Client):
    """Blocking client (arguments: see ``_Client``)."""

    _aio = False

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One RPC; its failure raised as the typed error of its status."""
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

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
        return ScoreFuture(calls, lambda responses: result(prepared, responses, return_entropy))

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
                return collect(calls, resume.responses, return_entropy, return_exceptions)
            time.sleep(delay)

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return [model_info(m) for m in self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout).models]

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
        return UpdateResult.from_proto(self._call(self._stub.UpdateWeights, requests, timeout))

    def load_weights(
        self, model: str, path: str, *, version: int = 0, partial: bool = False, timeout: float | None = None
    ) -> UpdateResult:
        """Make the server load ``model``'s weights from ``path`` on its own disk (a .safetensors
        file, an HF checkpoint directory, or for a LoRA model a PEFT adapter directory)."""
        request = self.load_request(model, path, version, partial)
        return UpdateResult.from_proto(self._call(self._stub.LoadWeights, request, timeout))

    def close(self) -> None:
        self._channel.close()

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
        return result(prepared, responses, return_entropy)

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
                return collect(calls, resume.responses, return_entropy, return_exceptions)
            await asyncio.sleep(delay)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        response = await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [model_info(m) for m in response.models]

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
        return UpdateResult.from_proto(await self._call(self._stub.UpdateWeights, requests, timeout))

    async def load_weights(
        self, model: str, path: str, *, version: int = 0, partial: bool = False, timeout: float | None = None
    ) -> UpdateResult:
        """See ``LogprobClient.load_weights``."""
        request = self.load_request(model, path, version, partial)
        return UpdateResult.from_proto(await self._call(self._stub.LoadWeights, request, timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncLogprobClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
