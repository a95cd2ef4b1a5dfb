"""Thin RPC handlers: protobuf -> domain objects -> the engine facade -> domain results -> protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import grpc
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from logprob_service.api import accounting, handlers, wire
from logprob_service.api.malformed import TooManySequences
from logprob_service.api.status import status_of
from logprob_service.engine import UNLIMITED, LogprobEngine, RequestCounts, StreamIdle
from logprob_service.errors import LogprobError
from logprob_service.security.caller import current_client


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class PendingAnswers:
    """The answers of one ScoreTokensStream being computed or waiting to be sent, by their
    estimated bytes: a request is taken on while they stay within ``limit`` (or none are pending,
    so any request within max_answer_bytes goes through), and its bytes are given back once its
    answer has gone to the transport."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._changed = asyncio.Condition()

    async def take(self, size: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.bytes or self.bytes + size <= self.limit)
            self.bytes += size

    async def give_back(self, size: int) -> None:
        async with self._changed:
            self.bytes -= size
            self._changed.notify_all()


class LogprobServicer(pb_grpc.LogprobServiceServicer):
    def __init__(
        self,
        engine: LogprobEngine,
        weight_receiver_ports: Callable[[], list[int]] = list,
        *,
        max_message_bytes: int = UNLIMITED,
        max_stream_answer_bytes: int = UNLIMITED,
    ) -> None:
        """``max_message_bytes``: the largest message gRPC sends, so an answer past it is refused
        before its work; ``max_stream_answer_bytes``: ``PendingAnswers``' limit of each stream."""
        self._engine = engine
        self._weight_receiver_ports = weight_receiver_ports
        limits = engine.limits
        if max_message_bytes < limits.max_answer_bytes:
            limits = dataclasses.replace(limits, max_answer_bytes=max_message_bytes, answer_limit="max_message_bytes")
        self._limits = limits
        self._max_stream_answer_bytes = max_stream_answer_bytes

    def _counts(self, request: pb.ScoreRequest) -> RequestCounts:
        """The request's counts, refused past a limit (``InvalidArgument``) or the queue's room
        (``Overloaded``) before any of it is built."""
        counts = wire.request_counts(request, self._limits.max_sequences_per_request)
        self._engine.check_counts(counts, self._limits, client=current_client())
        return counts

    async def _score(self, request: pb.ScoreRequest, deadline: float | None, counts: RequestCounts) -> pb.ScoreResponse:
        job = await wire.job_from_request(request, deadline, current_client(), self._limits, counts.answer_bytes)
        return await wire.response_from_result(await self._engine.score(job), request.scores_f32)

    async def ScoreTokens(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        wire.ensure_request_id(request)
        return await self._score(request, _deadline(context), self._counts(request))

    async def _answer_in_stream(
        self, request: pb.ScoreRequest, deadline: float | None, counts: RequestCounts | LogprobError
    ) -> pb.ScoreResponse:
        """One request of a stream: its response, or one with ``error`` set (``counts`` may be the
        refusal of its counts); accounted for here, since the stream's own status says nothing about it."""
        start, scored, error = time.perf_counter_ns(), None, None
        try:
            if isinstance(counts, LogprobError):
                raise counts
            scored = await self._score(request, deadline, counts)
        except Exception as err:
            error = err
        code = grpc.StatusCode.OK if error is None else status_of(error)
        elapsed_ns = time.perf_counter_ns() - start
        accounting.record("ScoreTokensStream", request, code, elapsed_ns=elapsed_ns, response=scored, error=error)
        if scored is not None:
            return scored
        if not isinstance(error, LogprobError):
            error = LogprobError(f"internal error ({type(error).__name__})")
        return wire.error_response(request, error)

    async def ScoreTokensStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest | TooManySequences], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        """Each request is scored concurrently and answered as soon as it is done; a failed
        request is answered with ``error`` set and does not end the stream. The next request is
        read only while the answers pending stay within ``max_stream_answer_bytes``
        (``PendingAnswers``): a client that stops reading stops the stream's reading too, and
        HTTP/2's flow control then holds back its sends."""
        self._engine.check_accepting()
        deadline = _deadline(context)
        responses: asyncio.Queue[tuple[pb.ScoreResponse, int] | None] = asyncio.Queue()
        pending = PendingAnswers(self._max_stream_answer_bytes)

        async def answer(request: pb.ScoreRequest, counts: RequestCounts | LogprobError, size: int) -> None:
            await responses.put((await self._answer_in_stream(request, deadline, counts), size))

        async def read_all() -> None:
            try:
                async with asyncio.TaskGroup() as tasks:
                    async for message in request_iterator:
                        # A message of too many sequences was counted from its bytes, its head alone parsed.
                        request = message.head if isinstance(message, TooManySequences) else message
                        wire.ensure_request_id(request)
                        try:
                            if isinstance(message, TooManySequences):
                                raise message.error()
                            counts: RequestCounts | LogprobError = self._counts(request)
                            size = counts.answer_bytes
                        except LogprobError as err:
                            counts, size = err, wire.error_response(request, err).ByteSize()
                        await pending.take(size)
                        tasks.create_task(answer(request, counts, size))
            finally:
                responses.put_nowait(None)  # every request answered, or the request stream broke

        reader = asyncio.create_task(read_all())
        try:
            while (item := await responses.get()) is not None:
                response, size = item
                yield response  # back here once gRPC has handed it to the transport
                await pending.give_back(size)
            await reader  # surfaces a broken request stream
        finally:
            reader.cancel()

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        models = await self._engine.list_models()  # the fate of every push whose commit came before is in it
        return pb.ListModelsResponse(
            models=[wire.model_info_to_proto(info, self._engine.limits) for info in models],
            weight_receiver_ports=self._weight_receiver_ports(),
        )

    async def UpdateWeights(
        self, request_iterator: AsyncIterator[pb.UpdateWeightsRequest], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        try:
            # Closed at once when the update ends, whatever still refers to it: what it holds of
            # the stream goes then (a weight receiver's slot of shared memory).
            async with contextlib.aclosing(wire.update_messages(request_iterator)) as messages:
                return wire.update_response(await self._engine.update(messages))
        except StreamIdle:
            raise  # the client sends nothing: answered at once, not read to an end that may never come
        except LogprobError:
            await handlers.read_to_end(request_iterator)
            raise

    async def LoadWeights(
        self, request: pb.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        return wire.update_response(await self._engine.load(*wire.load_request(request)))

    async def InitWeightsUpdateGroup(
        self, request: pb.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitWeightsUpdateGroupResponse:
        return wire.group_response(await self._engine.join_group(wire.group_spec(request)))

    async def DestroyWeightsUpdateGroup(
        self, request: pb.DestroyWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.DestroyWeightsUpdateGroupResponse:
        await self._engine.leave_group(request.group_name)
        return pb.DestroyWeightsUpdateGroupResponse()

    async def UpdateWeightsFromDistributed(
        self, request: pb.DistributedUpdateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DistributedUpdateResponse]:
        async for event in self._engine.update_from_group(*wire.distributed_update(request)):
            yield wire.distributed_response(event)

    async def UpdateWeightsFromIpc(
        self, request: pb.IpcUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        return wire.update_response(await self._engine.update_from_ipc(*wire.ipc_update(request)))
