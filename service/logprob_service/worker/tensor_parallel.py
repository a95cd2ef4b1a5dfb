"""Tensor-parallel serving: one process per device, rank 0 the server, the others following it.

``Leader.start`` runs in the server process, which is rank 0: it opens a TCP store on loopback,
spawns ranks 1..N-1 (torchrun-style, one process per device; the spawn start method, as CUDA
needs), and joins them in two process groups: the model's (NCCL on GPUs, gloo on the CPU), whose
collectives run inside the sharded forward (``models.tensor_parallel``), and a gloo group that
carries rank 0's commands. Every rank then calls the same ``build`` (load the configured models,
in the same order: loading runs collectives too).

Only rank 0 serves gRPC and schedules. Each micro-batch it launches is first broadcast to the
followers (``("launch", model, batch, options)``: launch's ``ScoreOptions``), which launch the same
packed batch on their shards, so that every rank issues the same collectives in the same order.
The followers return nothing: the vocab-parallel lm_head leaves the combined scores on every rank.

A group is only as alive as its ranks. A follower that exits, or a launch that fails on rank 0
(an out-of-memory error midway would leave the ranks in different collectives), makes the group
unusable: ``Leader.watch``'s callback is told, and the server stops serving and exits (it does
not wait for work stuck in a collective). Followers exit when rank 0's process is gone.
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from logprob_service.domain import ScoreOptions
from logprob_service.errors import LogprobError
from logprob_service.logs import configure_logging
from logprob_service.models.scorer import CausalLMScorer, Launched, PackedBatch
from logprob_service.models.served import ServedModel
from logprob_service.models.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

# Loads the served models on one rank: the same function, called on every rank of the group.
Build = Callable[[TensorParallel, torch.device], dict[str, ServedModel]]

# How long ranks wait for each other to join, and a collective for its peers, before failing.
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
STOP_TIMEOUT_S = 30.0


def _join(rank: int, devices: list[torch.device], store: dist.TCPStore) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Join the group as ``rank``: the model's process group as a mesh, and the command group."""
    device = devices[rank]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=len(devices), timeout=JOIN_TIMEOUT)
    mesh = DeviceMesh(device.type, list(range(len(devices))))
    commands = dist.new_group(backend="gloo", timeout=JOIN_TIMEOUT)
    return TensorParallel(rank=rank, world=len(devices), mesh=mesh), commands


class GroupLost(RuntimeError):
    """A rank of the group is gone (or out of step): the server cannot serve its models any more."""


@dataclass
class Leader:
    """Rank 0's side of a tensor-parallel group: its processes, and the channel to command them."""

    tp: TensorParallel
    commands: dist.ProcessGroup
    followers: list[multiprocessing.process.BaseProcess]
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False

    @classmethod
    def start(
        cls, devices: list[torch.device], build: Build, log_level: str = "INFO", log_format: str = "text"
    ) -> Leader:
        """Spawn ranks 1..N-1 (``devices[r]`` each) and join them. ``build`` must pickle: a
        module-level function, or a ``functools.partial`` of one."""
        store = dist.TCPStore(
            "127.0.0.1", 0, len(devices), is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
        )
        spawn = multiprocessing.get_context("spawn")
        followers = [
            spawn.Process(
                target=_follow,
                args=(rank, devices, store.port, build, log_level, log_format),
                name=f"logprob-tp-rank{rank}",
                daemon=True,  # never outlives the server
            )
            for rank in range(1, len(devices))
        ]
        for process in followers:
            process.start()
        tp, commands = _join(0, devices, store)
        log.info("tensor parallel over %d ranks: %s", len(devices), ", ".join(map(str, devices)))
        return cls(tp, commands, followers)

    def lead(self, name: str, scorer: CausalLMScorer, on_failure: Callable[[str], None]) -> None:
        """Make ``scorer`` (model ``name``, rank 0's) announce each launch to the followers first.
        A launch that raises leaves the ranks out of step: ``on_failure`` is told, and it raises."""
        launch = scorer.launch

        @functools.wraps(launch)
        def announced(batch: PackedBatch, options: ScoreOptions) -> Launched:
            # The followers launch with the same options, but routed experts are rank 0's to keep:
            # the router is replicated, its choices the same on every rank.
            self._announce(("launch", name, batch, replace(options, return_routed_experts=False)))
            try:
                return launch(batch, options)
            except Exception as err:
                on_failure(f"rank 0 failed in a launch of {name!r}, the ranks are out of step: {err!r}")
                raise

        scorer.launch = announced  # type: ignore[method-assign]

    def _announce(self, command: tuple[Any, ...]) -> None:
        with self._lock:
            dist.broadcast_object_list([command], src=0, group=self.commands)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost`` (from a thread of its own) when a follower's process ends unasked."""

        def wait() -> None:
            sentinels = {p.sentinel: p for p in self.followers}
            ended = multiprocessing.connection.wait(list(sentinels))
            if not self._stopping:
                process = sentinels[ended[0]]
                process.join(1.0)  # reaped, so that its exit code is known
                on_lost(f"tensor-parallel {process.name} (pid {process.pid}) exited with code {process.exitcode}")

        threading.Thread(target=wait, name="logprob-tp-watch", daemon=True).start()

    def stop(self) -> None:
        """Tell the followers to exit and wait for them (then for good: no more launches)."""
        self._stopping = True
        try:
            self._announce(("stop",))
        except RuntimeError as err:  # a follower is gone already (it failed to load, say)
            log.warning("tensor-parallel ranks not told to stop: %s", err)
        for process in self.followers:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
        dist.destroy_process_group()


def _follow(rank: int, devices: list[torch.device], port: int, build: Build, log_level: str, log_format: str) -> None:
    """A follower's process: join, build the models, then launch what rank 0 announces until ``stop``."""
    configure_logging(log_level, log_format)
    _exit_with_parent()
    store = dist.TCPStore("127.0.0.1", port, len(devices), is_master=False, timeout=JOIN_TIMEOUT)
    tp, commands = _join(rank, devices, store)
    scorers = {name: served.scorer for name, served in build(tp, devices[rank]).items()}
    log.info("tensor-parallel rank %d ready on %s: %s", rank, devices[rank], ", ".join(scorers))
    launched: Launched | None = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=commands)
        command = box[0]
        if command[0] == "stop":
            break
        _, name, batch, options = command
        # Two in flight, as on rank 0: the next launch is queued before this one's end is awaited.
        previous = launched
        launched = scorers[name].launch(batch, options)
        if previous is not None:
            _wait(previous)
    if launched is not None:
        _wait(launched)
    dist.destroy_process_group()


def _wait(launched: Launched) -> None:
    """A follower waits for its launch's end; a micro-batch whose scores are not to be trusted
    (``Launched.fetch``'s LogprobError: every rank sees it) is rank 0's to fail, and the rank goes on."""
    try:
        launched.fetch()
    except LogprobError as err:
        log.debug("micro-batch failed (rank 0 reports it): %s", err)


def _exit_with_parent() -> None:
    """End this process when rank 0's ends (a follower alone would wait in a collective forever)."""
    parent = multiprocessing.parent_process()

    def wait() -> None:
        if parent is not None:
            parent.join()
        os._exit(1)

    threading.Thread(target=wait, name="logprob-tp-parent", daemon=True).start()
