"""Bytes that are not a valid message get INVALID_ARGUMENT, not gRPC's UNKNOWN or a failed stream.

gRPC decodes each request with the method's deserializer before the handler sees it; a
``DecodeError`` there (corrupt wire format, bad UTF-8 in a string) would be answered UNKNOWN
("Unexpected DecodeError"), and inside a request stream it would break the whole stream. Here
the deserializer returns a ``Malformed`` marker instead, and the handler's behaviour is wrapped:

- a single request that is malformed is refused with INVALID_ARGUMENT before the handler runs;
- in a request stream, the messages before the malformed one are handled as usual (their
  answers are sent), the stream is treated as ending there, and the call then ends with
  INVALID_ARGUMENT naming the message's index. A client stream with one answer (UpdateWeights)
  is read to its end first (``handlers.read_to_end``): answered while its client still sent, a
  push got INTERNAL instead in a CI run (tests/integration/weights/test_weight_receivers.py).

A ``ScoreTokens`` request of more sequences than ``max_sequences`` (plain ones and groups'
completions) is counted from its bytes before they are parsed (``wire.count_sequences``):
protobuf would otherwise build an object for each of them first, on the event loop every caller
shares. Only its head is parsed (``wire.request_head``: its request id and model), and it is
refused the same way; in a ``ScoreTokensStream``, the message is handed on as ``TooManySequences``,
which the stream answers with its error as it does any request refused by its counts, and goes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from logprob_service.api import handlers
from logprob_service.api.wire import count_sequences, request_head
from logprob_service.errors import InvalidArgument


@dataclass(frozen=True)
class Malformed:
    """Stands for a message that could not be decoded."""

    reason: str


@dataclass(frozen=True)
class TooManySequences:
    """Stands for a ScoreRequest of more sequences than ``limit``, of which only ``head`` was parsed
    (``wire.request_head``: the fields before its sequences, its request id and model among them)."""

    limit: int
    head: Any

    def error(self) -> InvalidArgument:
        return InvalidArgument(
            f"sequences: more than {self.limit} sequences exceed the limit of {self.limit} per request "
            "(counted before the message was read whole)"
        )


def _tolerant(deserializer: Callable[[bytes], Any], max_sequences: int | None) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        if max_sequences is not None and count_sequences(raw, max_sequences) > max_sequences:
            try:
                head = deserializer(request_head(raw))
            except DecodeError:
                head = deserializer(b"")
            return TooManySequences(max_sequences, head)
        try:
            return deserializer(raw)
        except DecodeError as err:
            return Malformed(str(err))

    return deserialize


class MalformedMessageInterceptor(handlers.ServiceInterceptor):
    """``max_sequences``: the most sequences a ScoreTokens or ScoreTokensStream request may hold
    (the ``max_sequences_per_request`` setting); None: counted after the parse only."""

    def __init__(self, max_sequences: int | None = None) -> None:
        self.max_sequences = max_sequences

    def wrap(self, handler: grpc.RpcMethodHandler, rpc: str, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None:
            return handler
        inner = handlers.behaviour_of(handler)
        counted = self.max_sequences if rpc in ("ScoreTokens", "ScoreTokensStream") else None
        deserializer = _tolerant(handler.request_deserializer, counted)

        if not handler.request_streaming:

            async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    return await handlers.reject(
                        context, rpc, InvalidArgument(f"request: not a valid message ({request.reason})")
                    )
                if isinstance(request, TooManySequences):
                    return await handlers.reject(context, rpc, request.error())
                return await handlers.run(inner, request, context)

            return handlers.rebuild(handler, single, deserializer)

        async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            bad: list[tuple[int, Malformed]] = []

            async def well_formed() -> AsyncIterator[Any]:
                index = 0
                async for request in requests:
                    if isinstance(request, Malformed):
                        bad.append((index, request))
                        return
                    yield request
                    index += 1

            answer = await handlers.run(inner, well_formed(), context)
            if bad:
                if not handler.response_streaming:  # (a scoring stream's client may wait for answers)
                    await handlers.read_to_end(requests)
                index, malformed = bad[0]
                return await handlers.reject(
                    context,
                    rpc,
                    InvalidArgument(
                        f"request stream message [{index}]: not a valid message ({malformed.reason}); "
                        f"the stream ended there, after {index} valid messages, which were handled"
                    ),
                )
            return answer

        return handlers.rebuild(handler, stream, deserializer)
