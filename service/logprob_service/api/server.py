"""The gRPC edge: the servicer, health, reflection and interceptors over an engine, as a grpc.aio server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from logprob_service.api import handlers, tls
from logprob_service.api.auth import AuthInterceptor
from logprob_service.api.health import SERVICE_NAME, HealthMirror
from logprob_service.api.interceptors import ExceptionToStatusInterceptor, HeldRefusals, TensorPieceViews
from logprob_service.api.malformed import MalformedMessageInterceptor
from logprob_service.api.receivers import PageLock, WeightReceivers
from logprob_service.api.server_options import listen, server_options
from logprob_service.api.servicer import LogprobServicer
from logprob_service.engine import LogprobEngine
from logprob_service.security.bearer_tokens import TokenTable
from logprob_service.security.exposure import exposure_warnings
from logprob_service.security.refusals import RefusalThrottle
from logprob_service.settings.model import Settings

log = logging.getLogger(__name__)


@dataclass
class GrpcEdge:
    """A started gRPC server over an engine: its port, health and weight receivers."""

    server: grpc.aio.Server
    port: int
    health: HealthMirror
    receivers: WeightReceivers | None = None

    async def close(self) -> None:
        """Stop the weight receivers (the server itself is stopped by the caller's drain)."""
        if self.receivers is not None:
            await self.receivers.close()


async def create_server(
    engine: LogprobEngine,
    settings: Settings,
    address: str,
    *,
    tokens: TokenTable | None,
    page_lock: PageLock | None = None,
    refusals: RefusalThrottle | None = None,
) -> GrpcEdge:
    """Build and start the gRPC server over ``engine`` on ``address`` ("host:port"; port 0 picks
    one), with TLS when the settings name a certificate, ``tokens``' authentication (None: off),
    and the settings' weight receivers (their slots page-locked with ``page_lock`` when given).
    ``refusals``: the throttle of refused calls, shared with the HTTP edge (None: one of the
    settings' own).

    Health mirrors the engine's phase: NOT_SERVING until it serves.
    """
    # Outermost first: a refused call is held once all the others have answered it; credentials
    # are checked before anything else, then undecodable bytes are refused, then the handler's own
    # errors are mapped to statuses; weight pieces are read with their bytes as views. Calls the
    # weight receivers forward go through the same ones.
    interceptors: list[handlers.ServiceInterceptor] = [
        HeldRefusals(refusals or RefusalThrottle.of(settings)),
        AuthInterceptor(tokens),
        MalformedMessageInterceptor(max_sequences=settings.max_sequences_per_request),
        ExceptionToStatusInterceptor(),
        TensorPieceViews(),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=server_options(settings))
    receivers: WeightReceivers | None = None
    servicer = LogprobServicer(
        engine,
        weight_receiver_ports=lambda: receivers.ports if receivers is not None else [],
        max_message_bytes=settings.max_message_bytes,
        max_stream_answer_bytes=settings.max_stream_answer_bytes,
    )
    health = HealthMirror(engine)
    pb_grpc.add_LogprobServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    credentials = tls.server_credentials(settings)
    host, _, port_text = address.rpartition(":")
    port = listen(server, host, int(port_text), credentials, "--port")
    for warning in exposure_warnings(host, tls=credentials is not None, auth=tokens is not None):
        log.warning("%s", warning)
    await health.show(engine.phase)
    await server.start()
    if settings.weight_receivers:
        try:
            receivers = await WeightReceivers.start(settings, _update_handler(servicer, interceptors), page_lock)
        except BaseException:
            await server.stop(0)
            raise
    return GrpcEdge(server, port, health, receivers)


def _update_handler(
    servicer: LogprobServicer, interceptors: list[handlers.ServiceInterceptor]
) -> Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler]:
    """The UpdateWeights handler of a call with ``details``, wrapped by ``interceptors`` as the
    server wraps a call on its own port: for the calls the weight receivers forward."""
    plain = grpc.stream_unary_rpc_method_handler(
        servicer.UpdateWeights,
        request_deserializer=pb.UpdateWeightsRequest.FromString,
        response_serializer=pb.UpdateWeightsResponse.SerializeToString,
    )

    def handler_for(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = plain
        for interceptor in reversed(interceptors):
            handler = interceptor.wrap(handler, "UpdateWeights", details)
        return handler

    return handler_for
