"""Assembly: models + scheduler + servicer + health + reflection into a grpc.aio server."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from logprob_proto import logprob_pb2 as pb
from logprob_proto import logprob_pb2_grpc as pb_grpc

from logprob_service import host_malloc
from logprob_service.api import handlers
from logprob_service.api.health import SERVICE_NAME, ServingState
from logprob_service.api.interceptors import ExceptionToStatusInterceptor, TensorPieceViews
from logprob_service.api.malformed import MalformedMessageInterceptor
from logprob_service.api.receivers import WeightReceivers
from logprob_service.api.security import tls
from logprob_service.api.security.auth import AuthInterceptor
from logprob_service.api.security.bearer_tokens import TokenTable, load_token_table
from logprob_service.api.server_options import server_options
from logprob_service.api.servicer import LogprobServicer
from logprob_service.config import Settings
from logprob_service.domain import ScoreJob, TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.validation import RequestLimits
from logprob_service.engine.weight_updates import WeightUpdater
from logprob_service.models.loading import ModelLoadError, resolve_devices, resolve_dtype
from logprob_service.models.lora import split_lora_source
from logprob_service.models.scorer import scoring_options
from logprob_service.models.served import load_served_model, serve_lora_model
from logprob_service.observability import metrics
from logprob_service.ops.dispatch import select_logprob_op
from logprob_service.worker.collectives import WeightGroup
from logprob_service.worker.executor import DeviceExecutor
from logprob_service.worker.staging import Staging, page_lock
from logprob_service.worker.tensor_parallel import Build, GroupLost, Leader, configured_models

log = logging.getLogger(__name__)


@dataclass
class Service:
    """Everything behind the RPC surface; owned by one event loop."""

    settings: Settings
    devices: list[torch.device]  # one replica of each model on each, one executor (lane) each
    registry: ModelRegistry
    executors: list[DeviceExecutor]
    scheduler: Scheduler
    updater: WeightUpdater
    state: ServingState
    tokens: TokenTable | None  # None: authentication off
    # With tensor_parallel > 1: rank 0's side of the group (started by load_models), and a future
    # that gets the reason once the group is lost (a rank gone): the server then exits.
    leader: Leader | None = None
    lost: asyncio.Future[str] | None = None
    build: Build | None = None  # what loads each rank's models (default: those the settings name)
    receivers: WeightReceivers | None = None  # with weight_receivers > 0, once the server started

    @classmethod
    def create(cls, settings: Settings, registry: ModelRegistry | None = None, build: Build | None = None) -> Service:
        """Raises ``tokens.TokenConfigError`` for a bad token document and ``ModelLoadError`` for
        devices this host lacks, before anything starts. A ``registry`` given already filled holds
        one replica per device of ``settings.device``. ``build``: with tensor parallel, what
        ``load_models`` runs on every rank instead of loading the settings' models (benchmarks)."""
        tokens = load_token_table(settings)
        devices = resolve_devices(settings.device, settings.tensor_parallel)
        if settings.tensor_parallel > 1:
            devices = devices[:1]  # one lane: rank 0's; the other ranks follow its launches
        registry = registry if registry is not None else ModelRegistry()
        metrics.track(registry)
        stats = metrics.PrometheusStats()
        executors = [DeviceExecutor(stats, device) for device in devices]
        scheduler = Scheduler(
            registry,
            executors,
            max_queued_tokens=settings.max_queued_tokens,
            max_queued_tokens_per_client=settings.max_queued_tokens_per_client,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_sequences=settings.max_batch_sequences,
            max_wait_ms=settings.max_wait_ms,
            max_wait_quiet_ms=settings.max_wait_quiet_ms,
            max_version_wait_s=settings.max_version_wait_s,
            share_prompts=settings.share_prompts,
            stats=stats,
        )
        staging = Staging(settings.update_staging_reserve_bytes)
        updater = WeightUpdater(
            registry,
            scheduler,
            staging,
            join_group=WeightGroup,
            yield_to_launches=settings.update_yield_to_launches,
            idle_timeout_s=settings.update_idle_timeout_s,
            max_group_timeout_s=settings.max_group_timeout_s,
            stats=stats,
        )
        return cls(settings, devices, registry, executors, scheduler, updater, ServingState(), tokens, build=build)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_sequences_per_request=self.settings.max_sequences_per_request,
            max_tokens_per_request=self.settings.max_tokens_per_request,
        )

    async def load_models(self) -> None:
        """Load every configured model in a worker thread (the loop keeps answering health checks),
        once per device."""
        s = self.settings
        if s.tensor_parallel > 1:
            await self._load_tensor_parallel()
            return
        dtype = resolve_dtype(s.dtype, self.devices[0])
        options = scoring_options(s)
        try:
            ops = [
                select_logprob_op(s.logprob_kernel, device, s.lm_head_chunk_bytes, invariant=s.deterministic)
                for device in self.devices
            ]
        except ValueError as err:  # a forced kernel this host cannot run: fail before loading weights
            raise ModelLoadError(str(err)) from None
        loop = asyncio.get_running_loop()
        lora = {name: split_lora_source(source, set(s.models) - {name}) for name, source in s.models.items()}
        for name, source in s.models.items():
            if lora[name] is not None:
                continue
            load = functools.partial(
                load_served_model, name, source, dtype=dtype, options=options, trust_remote_code=s.trust_remote_code
            )
            replicas = [
                await loop.run_in_executor(None, functools.partial(load, device=device, logprob_op=op))
                for device, op in zip(self.devices, ops, strict=True)
            ]
            self.registry.add(replicas[0], replicas[1:])
        for name, spec in lora.items():
            if spec is not None:
                base, adapter_dir = spec
                if lora[base] is not None:
                    raise ModelLoadError(f"LoRA model {name!r}: its base {base!r} is itself a LoRA model")
                replicas = [
                    await loop.run_in_executor(None, serve_lora_model, name, b, adapter_dir)
                    for b in self.registry.replicas(base)
                ]
                self.registry.add(replicas[0], replicas[1:])

    async def _load_tensor_parallel(self) -> None:
        """Start the group's other ranks and load every model's shards on all of them."""
        s = self.settings
        loop = asyncio.get_running_loop()
        lost = self.lost if self.lost is not None else loop.create_future()
        self.lost = lost

        def on_lost(reason: str) -> None:  # from any thread; the first reason wins
            loop.call_soon_threadsafe(lambda: lost.done() or lost.set_result(reason))

        devices = resolve_devices(s.device, s.tensor_parallel)
        build = self.build or functools.partial(configured_models, s)
        self.leader = await loop.run_in_executor(
            None, functools.partial(Leader.start, devices, build, s.log_level, s.log_format)
        )
        self.leader.watch(on_lost)
        served = await loop.run_in_executor(None, build, self.leader.tp, devices[0])
        for name, model in served.items():
            self.leader.lead(name, model.scorer, on_lost)
            self.registry.add(model)

    async def warm_up(self) -> None:
        """Score one short random sequence with every model through the real path, then SERVE."""
        rng = np.random.default_rng()
        for served in self.registry:
            vocab = served.info.vocab_size
            job = ScoreJob(
                request_id=f"warm-up-{served.info.name}",
                model=served.info.name,
                sequences=[TokenSequence(rng.integers(0, vocab, 8), rng.integers(0, vocab, 8))],
            )
            result = await self.scheduler.submit(job)
            if not np.isfinite(result.scores[0].logprobs).all():
                raise RuntimeError(f"warm-up of model {served.info.name!r} produced non-finite log-probs")
            log.info("model %r warmed up in %.1f ms", served.info.name, result.timings.total_ns / 1e6)
        if self.settings.gc_freeze:
            _freeze_heap()
        await self.state.serving()

    async def drain(self, server: grpc.aio.Server, grace_s: float) -> None:
        """Health NOT_SERVING and new RPCs UNAVAILABLE at once; in-flight RPCs get ``grace_s`` to finish.

        The server stops taking calls only after the settings' ``drain_notice_s`` (within
        ``grace_s``): gRPC cancels a call that reached a stopping server before a handler took it
        (the client sees CANCELLED, which it must not retry: grpc/grpc#41785), so clients are
        given the notice first. Through it, calls get UNAVAILABLE from the handler, which clients
        retry elsewhere, and clients watching health stop sending any.
        """
        await self.state.draining()
        notice_s = min(self.settings.drain_notice_s, grace_s)
        await asyncio.sleep(notice_s)
        await server.stop(grace_s - notice_s)
        await self.close()

    async def close(self) -> None:
        if self.settings.gc_freeze:
            # What warm-up froze goes back to the collector, so the interpreter's last collection
            # frees it (nanobind, under triton, reports objects left at exit as leaks).
            gc.unfreeze()
        if self.receivers is not None:
            await self.receivers.close()
        await self.scheduler.close()
        self.updater.close()
        for executor in self.executors:
            executor.shutdown()
        if self.leader is not None:
            self.leader.stop()


async def create_server(service: Service, address: str) -> tuple[grpc.aio.Server, int]:
    """Build and start the gRPC server on ``address`` ("host:port"; port 0 picks one), with TLS
    when the settings name a certificate.

    Health starts NOT_SERVING; ``service.warm_up()`` flips it to SERVING.
    """
    settings = service.settings
    if settings.keep_freed_host_memory and not host_malloc.keep_freed_blocks():
        log.info("keep_freed_host_memory: this C library has no glibc mallopt; its allocator is left as it is")
    # Outermost first: credentials are checked before anything else, then undecodable bytes are
    # refused, then the handler's own errors are mapped to statuses; weight pieces are read with
    # their bytes as views. Calls the weight receivers forward go through the same ones.
    interceptors: list[handlers.ServiceInterceptor] = [
        AuthInterceptor(service.tokens),
        MalformedMessageInterceptor(),
        ExceptionToStatusInterceptor(),
        TensorPieceViews(),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=server_options(settings))
    servicer = LogprobServicer(
        service.registry,
        service.scheduler,
        service.updater,
        service.state,
        service.limits,
        weight_receiver_ports=lambda: service.receivers.ports if service.receivers is not None else [],
    )
    pb_grpc.add_LogprobServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(service.state.health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    credentials = tls.server_credentials(settings)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    host = address.rpartition(":")[0]
    for warning in tls.exposure_warnings(host, tls=credentials is not None, auth=service.tokens is not None):
        log.warning("%s", warning)
    await service.state.starting()
    service.scheduler.start()
    await server.start()
    if settings.weight_receivers:
        try:
            # On a GPU, the slots are page-locked in place: a dense piece goes from its slot to the device.
            on_gpu = any(device.type == "cuda" for device in service.devices)
            service.receivers = await WeightReceivers.start(
                settings, _update_handler(servicer, interceptors), page_lock if on_gpu else None
            )
        except BaseException:
            await server.stop(0)
            await service.close()
            raise
    return server, port


def _freeze_heap() -> None:
    """Collect, then move every object alive into the garbage collector's permanent generation:
    a full collection then walks only what was made since, not the ~400,000 objects of torch,
    transformers and the models. Unfrozen, one took 0.2-0.4 s on the 2-core CPU machine and came
    during weight pushes (``benchmarks/bench_gc.py``), holding the interpreter lock meanwhile: the
    push and every scoring launch waited."""
    gc.collect()
    gc.freeze()
    log.info("%d objects alive after start-up frozen out of the garbage collector's reach", gc.get_freeze_count())


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


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT: bind, load, warm up, serve; then drain within the grace period."""
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
    server, port = await create_server(service, f"{settings.host}:{settings.port}")
    log.info(
        "gRPC listening on %s:%d (%s, %s; health NOT_SERVING until models are warm)",
        settings.host,
        port,
        "plaintext" if settings.tls_cert_file is None else ("mutual TLS" if settings.tls_client_ca_file else "TLS"),
        f"{len(service.tokens)} tokens" if service.tokens is not None else "no authentication",
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    service.lost = loop.create_future()
    startup = asyncio.create_task(_start_models(service))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({startup, stopper, service.lost}, return_when=asyncio.FIRST_COMPLETED)
    if not service.lost.done() and startup.done() and startup.exception() is not None:
        stopper.cancel()
        await server.stop(0)
        await service.close()
        raise startup.exception()  # type: ignore[misc]
    await asyncio.wait({stopper, service.lost}, return_when=asyncio.FIRST_COMPLETED)
    if service.lost.done():
        # Work may be stuck in a collective with the lost rank: nothing is waited for.
        reason = service.lost.result()
        log.error("tensor-parallel group lost: %s; not serving, exiting", reason)
        await service.state.draining()
        await server.stop(0)
        raise GroupLost(reason)
    log.info("shutting down: draining for up to %.0f s", settings.grace_period_s)
    startup.cancel()
    await service.drain(server, settings.grace_period_s)
    log.info("stopped")


async def _start_models(service: Service) -> None:
    await service.load_models()
    await service.warm_up()
    log.info("SERVING models: %s", ", ".join(served.info.name for served in service.registry))
