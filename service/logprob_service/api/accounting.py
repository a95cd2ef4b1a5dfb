"""Every answered request is accounted for once: counted in ``logprob_requests_total`` and logged.

``record`` is called where a request's outcome becomes final: by the interceptor for each unary
RPC and for a stream that fails as a whole, and by the stream handler for each request answered
on a stream. One log line per request, on the ``logprob_service.requests`` logger: DEBUG when it
succeeded, INFO when its client cancelled it (or hung up), WARNING when it failed, ERROR with the
traceback when the failure is a bug (INTERNAL). Each line carries the RPC, the client
(``security/caller.py``: token name or peer address), request id (cut to ``logs.SHOWN_ID_CHARS``),
model, sequences, tokens, timings (the response's metadata when scored, else the time the handler
took) and status as structured fields (see ``logs``).

A weight push over several UpdateWeights calls (``UpdateWeightsHeader.streams``, one
``update_id``) is one request: each call is logged, but the push is counted once, by the first of
its calls to end (all end alike: the update's response, or its failure). ``UpdateStream`` reads
the ``update_id`` from a call's header as the handler reads it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import Message
from logprob_proto import logprob_pb2 as pb

from logprob_service.api import wire
from logprob_service.errors import LogprobError
from logprob_service.logs import shown_id
from logprob_service.observability import metrics
from logprob_service.security.caller import current_client

log = logging.getLogger("logprob_service.requests")

# The pushes counted lately, by update_id: the calls of one push end within moments of each other
# (or within the 30 s in which all must arrive), so a few thousand ids remembered is plenty.
_COUNTED_UPDATES: collections.OrderedDict[str, None] = collections.OrderedDict()
COUNTED_UPDATES_KEPT = 4096


class UpdateStream:
    """An UpdateWeights call's messages, passed on as the handler reads them; ``model`` and
    ``update_id``: those its header (the first message) names, if any. Holds no message between
    reads (a message from a weight receiver holds the receiver's shared memory)."""

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = requests
        self._first = True
        self.model = self.update_id = ""

    def __aiter__(self) -> UpdateStream:
        return self

    async def __anext__(self) -> Any:
        request = await anext(self._requests)
        if self._first:
            self._first = False
            if isinstance(request, pb.UpdateWeightsRequest) and request.HasField("header"):
                self.model, self.update_id = wire.model_name(request.header), request.header.update_id
        return request


def _counts(update_id: str) -> bool:
    """Whether an answer counts as a request: one per push, whatever the calls it came over."""
    if not update_id:
        return True
    if update_id in _COUNTED_UPDATES:
        return False
    _COUNTED_UPDATES[update_id] = None
    while len(_COUNTED_UPDATES) > COUNTED_UPDATES_KEPT:
        _COUNTED_UPDATES.popitem(last=False)
    return True


_LEVELS = {
    grpc.StatusCode.OK: logging.DEBUG,
    grpc.StatusCode.CANCELLED: logging.INFO,
    grpc.StatusCode.INTERNAL: logging.ERROR,
}


def _level(code: grpc.StatusCode) -> int:
    return _LEVELS.get(code, logging.WARNING)


def _error_text(error: BaseException, code: grpc.StatusCode) -> str:
    if isinstance(error, LogprobError):
        return error.message
    if code is grpc.StatusCode.CANCELLED:  # why, where the edge could tell (interceptors.cancellation_reason)
        return str(error) or "the client cancelled the call"
    return f"{type(error).__name__}: {error}"


def record(
    rpc: str,
    request: Message | None,
    code: grpc.StatusCode,
    *,
    elapsed_ns: int,
    response: Message | None = None,
    error: BaseException | None = None,
    update: UpdateStream | None = None,
    request_id: str = "",
) -> None:
    """Account for one answer: ``request`` is None for a stream's own final status; ``update``: an
    UpdateWeights call's messages, which name its model and the push it is one of (counted once).
    ``request_id``: the id an INTERNAL answer names, where the request carries none of its own."""
    scoring = request if isinstance(request, pb.ScoreRequest) else None
    if isinstance(request, pb.ScoreRequest | pb.LoadWeightsRequest):
        model = wire.model_name(request)
    elif isinstance(request, pb.IpcUpdateRequest | pb.DistributedUpdateRequest):
        model = wire.model_name(request.header)
    elif isinstance(response, pb.UpdateWeightsResponse):
        model = response.model  # a client stream: the model is known from its answer
    elif update is not None:
        model = update.model  # or from its header, if one came
    else:
        model = ""
    update_id = update.update_id if update is not None else ""
    if _counts(update_id):
        metrics.observe_request(model, rpc, code.name)
    level = _level(code)
    if not log.isEnabledFor(level):
        return
    fields: dict[str, object] = {"rpc": rpc, "status": code.name}
    if client := current_client():
        fields["client"] = client
    if scoring is not None:
        sequences, tokens = wire.request_size(scoring)
        fields |= {"request_id": shown_id(scoring.request_id), "model": model, "sequences": sequences}
        if tokens is not None:
            fields["tokens"] = tokens
    elif request_id:
        fields["request_id"] = shown_id(request_id)
    if update_id:
        fields["update_id"] = update_id
    if isinstance(response, pb.UpdateWeightsResponse):
        fields |= {"model": model, "version": response.version, "tensors": response.tensors, "bytes": response.bytes}
    if isinstance(response, pb.ScoreResponse) and response.HasField("metadata"):
        meta = response.metadata
        fields |= {
            "queue_ms": round(meta.queue_ns / 1e6, 3),
            "compute_ms": round(meta.compute_ns / 1e6, 3),
            "total_ms": round(meta.total_ns / 1e6, 3),
        }
    else:
        fields["total_ms"] = round(elapsed_ns / 1e6, 3)
    if error is not None:
        fields["error"] = _error_text(error, code)
    log.log(
        level,
        "answered" if error is None else "failed",
        extra={"fields": fields},
        exc_info=error if code is grpc.StatusCode.INTERNAL else None,
    )
