"""Every answered request is accounted for once: counted in ``logprob_requests_total`` and logged.

``record`` is called where a request's outcome becomes final: by the interceptor for each unary
RPC and for a stream that fails as a whole, and by the stream handler for each request answered
on a stream. One log line per request, on the ``logprob_service.requests`` logger: DEBUG when it
succeeded, WARNING when it failed, ERROR with the traceback when the failure is a bug
(INTERNAL). Each line carries the RPC, the client (``identity.py``: token name or peer address),
request id, model, sequences, tokens, timings (the response's metadata when scored, else the
time the handler took) and status as structured fields (see ``logs``).
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import Message
from logprob_proto import logprob_pb2 as pb

from logprob_service.api import wire
from logprob_service.api.security.caller import current_client
from logprob_service.errors import LogprobError
from logprob_service.observability import metrics

log = logging.getLogger("logprob_service.requests")


def _level(code: grpc.StatusCode) -> int:
    if code is grpc.StatusCode.OK:
        return logging.DEBUG
    return logging.ERROR if code is grpc.StatusCode.INTERNAL else logging.WARNING


def _error_text(error: BaseException) -> str:
    return error.message if isinstance(error, LogprobError) else f"{type(error).__name__}: {error}"


def record(
    rpc: str,
    request: Message | None,
    code: grpc.StatusCode,
    *,
    elapsed_ns: int,
    response: Message | None = None,
    error: BaseException | None = None,
    request_id: str = "",
) -> None:
    """Account for one answer: ``request`` is None for a stream's own final status. ``request_id``:
    the id an INTERNAL answer names, where the request carries none of its own."""
    scoring = request if isinstance(request, pb.ScoreRequest) else None
    if isinstance(request, pb.ScoreRequest | pb.LoadWeightsRequest):
        model = wire.model_name(request)
    elif isinstance(request, pb.IpcUpdateRequest | pb.DistributedUpdateRequest):
        model = wire.model_name(request.header)
    elif isinstance(response, pb.UpdateWeightsResponse):
        model = response.model  # a client stream: the model is known from its answer
    else:
        model = ""
    metrics.observe_request(model, rpc, code.name)
    level = _level(code)
    if not log.isEnabledFor(level):
        return
    fields: dict[str, object] = {"rpc": rpc, "status": code.name}
    if client := current_client():
        fields["client"] = client
    if scoring is not None:
        sequences, tokens = wire.request_size(scoring)
        fields |= {"request_id": scoring.request_id, "model": model, "sequences": sequences, "tokens": tokens}
    elif request_id:
        fields["request_id"] = request_id
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
        fields["error"] = _error_text(error)
    log.log(
        level,
        "answered" if error is None else "failed",
        extra={"fields": fields},
        exc_info=error if code is grpc.StatusCode.INTERNAL else None,
    )
