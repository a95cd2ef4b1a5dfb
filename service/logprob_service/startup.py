"""Start-up: the one module that wires the edges over the engine, and runs them until a signal.

``Service`` is a server's whole: its device side (``builder.DeviceSide``: the engine and the
models loaded into it, one replica per device or a tensor-parallel group's rank 0), the gRPC edge
(``api.server.create_server``) and its weight receivers, and the HTTP edge (``http.server``) when
``http_port`` is set. ``serve`` binds, loads, warms up and serves until SIGTERM/SIGINT, then drains
both edges within the grace period.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from dataclasses import dataclass

import grpc

from logprob_service.api.receivers import WeightReceivers
from logprob_service.api.server import GrpcEdge, create_server
from logprob_service.builder import Build, DeviceSide, GroupLost, cuda_version
from logprob_service.engine import LogprobEngine, ModelRegistry
from logprob_service.http.connections import raise_open_file_limit
from logprob_service.http.server import HttpEdge, start_http
from logprob_service.observability import metrics
from logprob_service.security.bearer_tokens import TokenTable, load_token_table
from logprob_service.security.refusals import RefusalThrottle
from logprob_service.settings.model import Settings

log = logging.getLogger(__name__)


@dataclass
class Service:
    """Everything a server runs; owned by one event loop."""

    settings: Settings
    device_side: DeviceSide  # the engine and its models (also what tests and benchmarks reach)
    tokens: TokenTable | None  # None: authentication off
    refusals: RefusalThrottle  # the hold of refused calls, one for both edges: a client is one client on either
    edge: GrpcEdge | None = None  # once the gRPC server started
    http: HttpEdge | None = None  # once the HTTP edge started

    @classmethod
    def create(cls, settings: Settings, registry: ModelRegistry | None = None, build: Build | None = None) -> Service:
        """Raises ``TokenConfigError`` for a bad token document and ``ModelLoadError`` for devices
        this host lacks, before anything starts. ``registry`` and ``build``: ``DeviceSide.create``'s."""
        tokens = load_token_table(settings)
        stats = metrics.PrometheusStats()
        device_side = DeviceSide.create(settings, registry=registry, build=build, stats=stats)
        metrics.track(device_side.engine)  # for as long as the engine lives
        metrics.describe_runtime(cuda=cuda_version())
        return cls(settings, device_side, tokens, RefusalThrottle.of(settings, stats))

    @property
    def engine(self) -> LogprobEngine:
        return self.device_side.engine

    @property
    def receivers(self) -> WeightReceivers | None:  # what tests reach through a running service
        return self.edge.receivers if self.edge is not None else None

    async def start_grpc(self, address: str) -> tuple[grpc.aio.Server, int]:
        """Bind and start the gRPC edge (health NOT_SERVING until ``warm_up``) and its weight
        receivers; the engine's scheduler starts with it."""
        self.engine.start()
        try:
            self.edge = await create_server(
                self.engine,
                self.settings,
                address,
                tokens=self.tokens,
                page_lock=self.device_side.page_lock,
                refusals=self.refusals,
            )
        except BaseException:
            await self.engine.close()
            raise
        return self.edge.server, self.edge.port

    async def start_http(self, host: str, port: int) -> int:
        """Bind and start the HTTP edge over the engine (after ``start_grpc``, which starts the
        engine); its port (``port`` 0 picks one). /health answers 503 until ``warm_up``."""
        self.http = await start_http(self.engine, self.settings, host, port, tokens=self.tokens, refusals=self.refusals)
        return self.http.port

    async def load_models(self) -> None:
        """Load every configured model (``DeviceSide.load_models``), the loop answering health checks meanwhile."""
        await self.device_side.load_models()

    async def warm_up(self) -> None:
        """Score a short random sequence with every model through the real path, then SERVE."""
        await self.engine.warm_up()
        if self.settings.gc_freeze:
            _freeze_heap()
        await self.engine.serving()

    async def drain(self, server: grpc.aio.Server, grace_s: float) -> None:
        """Health NOT_SERVING and new RPCs UNAVAILABLE at once, held refusals answered at once;
        in-flight RPCs get ``grace_s`` to finish.

        The server stops taking calls only after the settings' ``drain_notice_s`` (within
        ``grace_s``): gRPC cancels a call that reached a stopping server before a handler took it
        (the client sees CANCELLED, which it must not retry: grpc/grpc#41785), so clients are
        given the notice first. Through it, calls get UNAVAILABLE from the handler, which clients
        retry elsewhere, and clients watching health stop sending any.
        """
        await self.engine.draining()
        self.refusals.release()
        notice_s = min(self.settings.drain_notice_s, grace_s)
        await asyncio.sleep(notice_s)
        stopping = [server.stop(grace_s - notice_s)]
        if self.http is not None:
            stopping.append(self.http.close(grace_s - notice_s))
        await asyncio.gather(*stopping)
        await self.close()

    async def close(self) -> None:
        if self.settings.gc_freeze:
            # What warm-up froze goes back to the collector, so the interpreter's last collection
            # frees it (nanobind, under triton, reports objects left at exit as leaks).
            gc.unfreeze()
        if self.http is not None:
            await self.http.close()
        if self.edge is not None:
            await self.edge.close()
        await self.device_side.close()


def _freeze_heap() -> None:
    """Collect, then move every object alive into the garbage collector's permanent generation:
    a full collection then walks only what was made since, not the ~400,000 objects of torch,
    transformers and the models. Unfrozen, one took 0.2-0.4 s on the 2-core CPU machine and came
    during weight pushes (``benchmarks/bench_gc.py``), holding the interpreter lock meanwhile: the
    push and every scoring launch waited."""
    gc.collect()
    gc.freeze()
    log.info("%d objects alive after start-up frozen out of the garbage collector's reach", gc.get_freeze_count())


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT: bind, load, warm up, serve; then drain within the grace period."""
    before, limit = raise_open_file_limit()
    # Every connection, checkpoint file and weight receiver's socket takes a descriptor; the HTTP
    # edge's connection cap is derived from this limit.
    log.info("open-file limit: %d%s", limit, f" (raised from {before})" if limit != before else "")
    service = Service.create(settings)
    metrics_server = (
        metrics.start_metrics_server(settings.host, settings.metrics_port) if settings.metrics_port else None
    )
    try:
        await _serve(service, settings)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


async def _serve(service: Service, settings: Settings) -> None:
    server, port = await service.start_grpc(f"{settings.host}:{settings.port}")
    log.info(
        "gRPC listening on %s:%d (%s, %s; health NOT_SERVING until models are warm)",
        settings.host,
        port,
        "plaintext" if settings.tls_cert_file is None else ("mutual TLS" if settings.tls_client_ca_file else "TLS"),
        f"{len(service.tokens)} tokens" if service.tokens is not None else "no authentication",
    )
    if settings.http_port:
        try:
            http_port = await service.start_http(settings.host, settings.http_port)
        except BaseException:
            await server.stop(0)
            await service.close()
            raise
        log.info("HTTP listening on %s:%d (/health 503 until models are warm; docs/http.md)", settings.host, http_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    lost = service.device_side.lost()
    startup = asyncio.create_task(_start_models(service))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({startup, stopper, lost}, return_when=asyncio.FIRST_COMPLETED)
    if not lost.done() and startup.done() and startup.exception() is not None:
        stopper.cancel()
        await server.stop(0)
        await service.close()
        raise startup.exception()  # type: ignore[misc]
    await asyncio.wait({stopper, lost}, return_when=asyncio.FIRST_COMPLETED)
    if lost.done():
        # Work may be stuck in a collective with the lost rank: nothing is waited for.
        reason = lost.result()
        log.error("tensor-parallel group lost: %s; not serving, exiting", reason)
        await service.engine.draining()
        await server.stop(0)
        raise GroupLost(reason)
    log.info("shutting down: draining for up to %.0f s", settings.grace_period_s)
    startup.cancel()
    await service.drain(server, settings.grace_period_s)
    log.info("stopped")


async def _start_models(service: Service) -> None:
    await service.load_models()
    await service.warm_up()
    log.info("SERVING models: %s", ", ".join(served.info.name for served in service.device_side.registry))
