"""``AsyncLogprobClient``: the asyncio client, with ``LogprobClient``'s API (methods are coroutines)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Unpack

import grpc
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from .base import ClientBase, ScoreKeywords, Scoring, check_keywords
from .errors import Cancelled, LogprobError, PermissionDenied
from .inputs import regroup
from .ipc import ipc_request
from .pacing import PacedCall
from .pushes import PreparedPush, UpdateKeywords, ports_and_live, push_error, unsent_error, was_interrupted
from .resume import StreamResume
from .streams import UpdateResult, named_tensors
from .wire import (
    ModelInfo,
    ScoreInput,
    model_info,
)


class AsyncLogprobClient(ClientBase):
    """asyncio client with the same API as ``LogprobClient`` (methods are coroutines)."""

    _aio = True
    _learning: asyncio.Future[None] | None = None  # the ask for the server's queue limits (pacing.py)

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One RPC; its failure raised as the typed error of its status."""
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise self.rpc_error(err) from None

    async def score(self, prompt_ids: Any, completion_ids: Any, **keywords: Unpack[ScoreKeywords]) -> Any:
        """See ``LogprobClient.score``; for overlap, ``asyncio.create_task(client.score(...))``."""
        return await self._score(self.prepare_one(prompt_ids, completion_ids, keywords))

    async def _score(self, scoring: Scoring) -> Any:
        """A prepared scoring call's RPCs, sent once connected as this client's share of the
        server's queue has room (``pacing.py``), and its answer."""
        await self._connected.wait(scoring.timeout)
        paced = scoring.paced()
        parts = [asyncio.ensure_future(self._part(request, paced, i)) for i, request in enumerate(scoring.requests)]
        try:
            responses = await asyncio.gather(*parts)
        except _PartFailed:
            for part in parts:
                part.cancel()
            ended = await asyncio.gather(*parts, return_exceptions=True)
            # The first of the parts that failed, in part order (several may have).
            failed = min((e for e in ended if isinstance(e, _PartFailed)), key=lambda e: e.part)
            if failed.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self.deadline_error(paced, failed.message) from None
            raise scoring.error(failed.part, failed.code, failed.message) from None
        finally:
            for part in parts:
                part.cancel()
        return scoring.result(responses)

    async def _part(self, request: pb.ScoreRequest, paced: PacedCall, part: int) -> pb.ScoreResponse:
        """One part's RPC, sent when the share has room, within the call's deadline; its failure
        (or the deadline passing before it was sent) raised as ``_PartFailed``."""
        cost = paced.costs[part]
        room: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = self._share.ask(cost, lambda: room.done() or room.set_result(None))
        try:
            if waiter is not None:
                await asyncio.wait_for(room, max(0.0, paced.remaining_s()))
        except BaseException as err:  # the deadline passed, or the call was cancelled, while kept back
            if waiter is not None and not self._share.withdraw(waiter):
                self._share.release(cost)  # let go meanwhile: its tokens were counted in flight
            if isinstance(err, TimeoutError):
                raise _PartFailed(part, grpc.StatusCode.DEADLINE_EXCEEDED, "") from None
            raise
        try:
            if (remaining := paced.remaining_s()) <= 0:
                raise _PartFailed(part, grpc.StatusCode.DEADLINE_EXCEEDED, "")
            paced.sent.add(part)
            call = self._stub.ScoreTokens(request, timeout=remaining, wait_for_ready=True)
            try:
                response = await call
            except grpc.RpcError as err:
                raise _PartFailed(part, err.code(), err.details() or "") from None
            except asyncio.CancelledError:
                call.cancel()
                raise
            paced.answered.add(part)
            return response
        finally:
            self._share.release(cost)

    def _learn(self) -> None:
        """See ``ClientBase._learn`` (a task on the event loop)."""
        self._learning = asyncio.ensure_future(self._learn_limits())

    async def _learn_limits(self) -> None:
        try:
            listed = await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout, wait_for_ready=True)
        except grpc.RpcError:
            listed = None
        self._limits_told(listed)

    async def score_groups(
        self, prompt_ids: Sequence[Any], completion_ids: Sequence[Sequence[Any]], **keywords: Unpack[ScoreKeywords]
    ) -> Any:
        """See ``LogprobClient.score_groups``."""
        scoring, sizes = self.prepare_groups(prompt_ids, completion_ids, keywords)
        return regroup(await self._score(scoring), sizes)

    async def score_many(self, inputs: Iterable[ScoreInput], **keywords: Unpack[ScoreKeywords]) -> list[Any]:
        """See ``LogprobClient.score_many``."""
        check_keywords(keywords, "score_many")
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
        """See ``LogprobClient.list_models``."""
        listed = await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        self._limits_told(listed)
        return [model_info(m) for m in listed.models]

    async def update_weights(
        self, model: str, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], **keywords: Unpack[UpdateKeywords]
    ) -> UpdateResult:
        """See ``LogprobClient.update_weights``."""
        if keywords.get("delta"):
            weights = list(named_tensors(weights))
        while True:
            try:
                listed = await self._listing_before_push(keywords.get("timeout") or self.timeout)
            except LogprobError as err:
                raise unsent_error(err, model, keywords.get("version", 0)) from None
            ports, live = ports_and_live(listed, model)
            try:
                update = self.update(model, weights, ports, live=live, **keywords)
                return self._push_result(model, keywords, await self._push(update))
            except LogprobError as err:
                if not self._again_dense(model, keywords, err):
                    raise

    async def _listing_before_push(self, timeout: float) -> pb.ListModelsResponse | None:
        """See ``LogprobClient._listing_before_push``."""
        if self._receivers_host is None:
            return None
        try:
            return await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        except PermissionDenied:
            return None

    async def _push(self, update: PreparedPush) -> pb.UpdateWeightsResponse:
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
                raise await self._failed_push_error(update, err, []) from None
        channels = self._stream_channels(len(update.calls), update.targets)
        deadline = time.monotonic() + update.timeout
        calls = [self._pusher(c)(stream, timeout=update.timeout) for c, stream in zip(channels, update.calls)]
        try:
            return (await asyncio.gather(*calls))[0]
        except grpc.RpcError as err:
            for call in calls:
                call.cancel()
            raise await self._failed_push_error(update, push_error(err, deadline), channels) from None
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
            raise await self._failed_push_error(update, push_error(cancelled, deadline), channels) from None

    async def _failed_push_error(self, update: PreparedPush, error: LogprobError, channels: list[Any]) -> LogprobError:
        """See ``LogprobClient._failed_push_error``."""
        if not was_interrupted(error):
            return error
        asks = [
            pb_grpc.LogprobServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=self.timeout)
            for channel in self._outcome_channels(update, channels)
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


class _PartFailed(Exception):
    """A part of an asyncio scoring call failed: which, its status and the server's message
    (DEADLINE_EXCEEDED with none: the deadline passed before it was sent)."""

    def __init__(self, part: int, code: grpc.StatusCode, message: str) -> None:
        super().__init__(part, code, message)
        self.part, self.code, self.message = part, code, message
