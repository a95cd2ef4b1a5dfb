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
RPCs at once (a call larger than the client's share of the server's queue paced to it,
``pacing.py``), and reassembled in order. Consecutive sequences with one prompt travel as one
``SequenceGroup``, the prompt sent once, and ids and scores as little-endian bytes (``wire.py``).
An error the server answers about one of the caller's sequences names it as the caller did
(``completion_ids[3][1]``, ``wire.caller_error``).

This module holds the blocking client and names the asyncio one (``aio.py``); what both share is
``base.py``, a weight push's calls and outcome checks ``pushes.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Unpack

import grpc
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from .aio import AsyncLogprobClient
from .base import ClientBase, ScoreKeywords, Scoring, check_keywords
from .errors import LogprobError, PermissionDenied
from .future import ScoreFuture
from .inputs import regroup
from .ipc import ipc_request
from .pushes import PreparedPush, UpdateKeywords, ports_and_live, push_error, unsent_error, was_interrupted
from .resume import StreamResume
from .streams import UpdateResult, named_tensors
from .wire import ModelInfo, ScoreInput, model_info

__all__ = ["AsyncLogprobClient", "LogprobClient"]


class LogprobClient(ClientBase):
    """Blocking client (arguments: see ``ClientBase``)."""

    _aio = False

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One RPC; its failure raised as the typed error of its status."""
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise self.rpc_error(err) from None

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

    def _send(self, scoring: Scoring) -> ScoreFuture:
        """A prepared scoring call's RPCs, sent as this client's share of the server's queue has
        room (``pacing.py``); they fail as ``Unavailable`` when no connection comes within
        ``connect_timeout_s`` (``channel.ConnectionWatch``)."""
        requests = scoring.requests

        def send(part: int, timeout: float) -> grpc.Future:
            call = self._stub.ScoreTokens.future(requests[part], timeout=timeout, wait_for_ready=True)
            call.add_done_callback(self._connected.answered)
            return call

        future = ScoreFuture(scoring.paced(), self._share, send, scoring.result, scoring.error, self.deadline_error)
        future.start(self._connected.watch(scoring.timeout, future.cancel))
        return future

    def _learn(self) -> None:
        """See ``ClientBase._learn`` (the answer is told on one of gRPC's threads)."""
        listed = self._stub.ListModels.future(pb.ListModelsRequest(), timeout=self.timeout, wait_for_ready=True)
        listed.add_done_callback(
            lambda call: self._limits_told(None if call.cancelled() or call.exception() else call.result())
        )

    def score_many(self, inputs: Iterable[ScoreInput], **keywords: Unpack[ScoreKeywords]) -> list[Any]:
        """Score several batches pipelined over one stream; results in input order.

        A batch larger than the RPC limits goes as several requests on the stream. A failed
        batch raises its typed error, or, with ``return_exceptions``, takes its place. A stream
        broken by UNAVAILABLE or RESOURCE_EXHAUSTED (a server restart) is resumed on a new one
        with the requests still unanswered (``resume.py``).
        """
        check_keywords(keywords, "score_many")
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
        """The served models; their limits also tell this client its share of the queue (``pacing.py``)."""
        listed = self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        self._limits_told(listed)
        return [model_info(m) for m in listed.models]

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
                listed = self._listing_before_push(keywords.get("timeout") or self.timeout)
            except LogprobError as err:
                raise unsent_error(err, model, keywords.get("version", 0)) from None
            ports, live = ports_and_live(listed, model)
            try:
                update = self.update(model, weights, ports, live=live, **keywords)
                return self._push_result(model, keywords, self._push(update))
            except LogprobError as err:
                if not self._again_dense(model, keywords, err):
                    raise

    def _listing_before_push(self, timeout: float) -> pb.ListModelsResponse | None:
        """ListModels before a push, for the ports of the server's weight receivers, where a push
        can use them; None when it cannot (a given channel, replicas), or this client's token may
        not list models (the score scope): it pushes to the target."""
        if self._receivers_host is None:
            return None
        try:
            return self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        except PermissionDenied:
            return None

    def _push(self, update: PreparedPush) -> pb.UpdateWeightsResponse:
        """The UpdateWeights calls of one push, made together (each stream is read on a thread of
        gRPC's, or with ``push_processes``, of this client's); all answer alike, so the first is
        returned, or the first error raised."""
        if update.targets is not None and self.push_processes:
            push = self._push_processes_for(update.chunk_bytes).start(update.targets, update.calls, update.timeout)
            try:
                return pb.UpdateWeightsResponse.FromString(push.wait())
            except LogprobError as err:
                raise self._failed_push_error(update, err, []) from None
        channels = self._stream_channels(len(update.calls), update.targets)
        deadline = time.monotonic() + update.timeout
        calls = [self._pusher(c).future(stream, timeout=update.timeout) for c, stream in zip(channels, update.calls)]
        try:
            responses = [call.result() for call in calls]  # every call, not just the first
            return responses[0]
        except grpc.RpcError as err:
            for call in calls:
                call.cancel()
            raise self._failed_push_error(update, push_error(err, deadline), channels) from None

    def _failed_push_error(self, update: PreparedPush, error: LogprobError, channels: list[Any]) -> LogprobError:
        """A failed push's error; of one cancelled or past its deadline, saying whether it went live
        all the same (ListModels, asked as ``_outcome_channels`` says, with the client's timeout: the
        push's may have passed, and the answer waits for a commit the server had in progress)."""
        if not was_interrupted(error):
            return error
        listed = []
        for channel in self._outcome_channels(update, channels):
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
