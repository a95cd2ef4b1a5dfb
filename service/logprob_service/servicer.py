"""Thin RPC handlers: protobuf -> domain job -> scheduler -> domain result -> protobuf."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from logprob_client._proto import logprob_pb2 as pb
from logprob_client._proto import logprob_pb2_grpc as pb_grpc

from . import convert
from .errors import LogprobError
from .models.registry import ModelRegistry
from .scheduler import Scheduler
from .state import ServingState
from .validation import RequestLimits, validate_job

log = logging.getLogger(__name__)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class LogprobServicer(pb_grpc.LogprobServiceServicer):
    def __init__(
        self, registry: ModelRegistry, scheduler: Scheduler, state: ServingState, limits: RequestLimits
    ) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._state = state
        self._limits = limits

    async def _score(self, request: pb.ScoreRequest, deadline: float | None) -> pb.ScoreResponse:
        self._state.check_accepting()
        job = convert.job_from_request(request, deadline)
        validate_job(job, self._registry.get(job.model).info, self._limits)
        result = await self._scheduler.submit(job)
        log.debug(
            "scored request_id=%s model=%s tokens=%d timings=%s",
            job.request_id,
            job.model,
            result.tokens,
            result.timings,
        )
        return convert.response_from_result(result)

    async def ScoreTokens(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        return await self._score(request, _deadline(context))

    async def ScoreTokensStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        """Each request is scored concurrently and answered as soon as it is done; a failed
        request is answered with ``error`` set and does not end the stream."""
        self._state.check_accepting()
        deadline = _deadline(context)
        responses: asyncio.Queue[pb.ScoreResponse | None] = asyncio.Queue()

        async def answer(request: pb.ScoreRequest) -> None:
            try:
                response = await self._score(request, deadline)
            except LogprobError as err:
                response = convert.error_response(request, err)
            except Exception as err:
                log.exception("ScoreTokensStream request_id=%s failed with an internal error", request.request_id)
                response = convert.error_response(request, LogprobError(f"internal error ({type(err).__name__})"))
            await responses.put(response)

        async def read_all() -> None:
            try:
                async with asyncio.TaskGroup() as tasks:
                    async for request in request_iterator:
                        request.request_id = request.request_id or str(uuid.uuid4())
                        tasks.create_task(answer(request))
            finally:
                responses.put_nowait(None)  # every request answered, or the request stream broke

        reader = asyncio.create_task(read_all())
        try:
            while (response := await responses.get()) is not None:
                yield response
            await reader  # surfaces a broken request stream
        finally:
            reader.cancel()

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[convert.model_info_to_proto(served.info, self._limits) for served in self._registry]
        )
