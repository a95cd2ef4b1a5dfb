"""Joins of a trainer's weight group (``worker.collectives.WeightGroup``) that the trainer never
completes, on the CPU: a fake trainer (a socket on 127.0.0.1 that accepts and never answers) held
a join in torch's TCP store client for good, past its ``timeout_s``, with its thread and its
slot, and a stopping server waited for the join's call. Now the join fails within its timeout
naming the trainer, its slot is free again, and a stopping server ends the calls of joins at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from logprob_service.domain import GroupSpec, ModelInfo
from logprob_service.engine.engine import EngineConfig, LogprobEngine
from logprob_service.engine.registry import ModelRegistry
from logprob_service.errors import InvalidArgument, Overloaded, Unavailable
from logprob_service.worker.collectives import WeightGroup

SLACK_S = 3.0  # past its timeout_s, what a join may take to end (a loaded 2-core machine)
CPU = torch.device("cpu")


@contextlib.contextmanager
def silent_trainer() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers; yields the port."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        for conn in accepted:
            conn.close()


def join(port: int, timeout_s: float) -> WeightGroup:
    return WeightGroup(
        CPU,
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        name="g",
        backend="gloo",
        timeout_s=timeout_s,
    )


def test_a_join_to_a_trainer_that_never_answers_fails_within_its_timeout():
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            join(port, timeout_s=1.0)
        except BaseException as err:
            outcome.append(err)

    with silent_trainer() as port:
        start = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)  # a daemon: a join that never ends fails the test only
        thread.start()
        thread.join(1.0 + SLACK_S)
        took = time.monotonic() - start
    assert not thread.is_alive(), "the join outlived its timeout_s"
    (error,) = outcome
    assert isinstance(error, InvalidArgument), error
    assert str(error).startswith(f"master_address: group 'g' with the trainer at 127.0.0.1:{port} was not joined")
    assert "did not complete within timeout_s=1 s" in str(error)
    assert 0.9 <= took <= 1.0 + SLACK_S


@dataclass
class Served:
    info: ModelInfo
    device: torch.device = CPU

    def updatable(self):  # no update reaches it
        raise NotImplementedError


class Lane:  # the engine's scheduler is never given work here
    def shutdown(self) -> None:
        pass


def spec(port: int, timeout_s: float) -> GroupSpec:
    return GroupSpec("127.0.0.1", port, rank=1, world_size=2, name="g", backend="gloo", timeout_s=timeout_s)


async def test_joins_that_time_out_free_their_slots_and_a_stopping_server_abandons_joins():
    registry = ModelRegistry()
    registry.add(Served(ModelInfo("m", "fake", "fake", 50, 16, "float32", "fake", 0, "fp")))
    engine = LogprobEngine(registry, [Lane()], EngineConfig(), staging=object(), join_group=WeightGroup)
    engine.start()
    await engine.serving()
    try:
        with silent_trainer() as port:
            # Four joins take every slot; each fails at its timeout, and its slot is free again.
            joins = [asyncio.create_task(engine.join_group(spec(port, 1.0))) for _ in range(4)]
            await asyncio.sleep(0)
            with pytest.raises(Overloaded, match="4 joins of weight groups are in progress"):
                await engine.join_group(spec(port, 1.0))
            start = time.monotonic()
            done, _ = await asyncio.wait(joins, timeout=1.0 + SLACK_S)
            assert len(done) == 4, "joins outlived their timeout_s"
            assert all(isinstance(j.exception(), InvalidArgument) for j in joins)
            assert time.monotonic() - start <= 1.0 + SLACK_S and engine.updater._joins == 0

            # Joins that would wait 5 s take the slots again; a stopping server ends their calls at once.
            joins = [asyncio.create_task(engine.join_group(spec(port, 5.0))) for _ in range(4)]
            await asyncio.sleep(0.2)
            assert not any(j.done() for j in joins)
            start = time.monotonic()
            await engine.draining()
            done, _ = await asyncio.wait(joins, timeout=SLACK_S)
            assert len(done) == 4 and time.monotonic() - start < 1.0
            for j in joins:
                with pytest.raises(Unavailable, match="the server is stopping; the join of group 'g' was abandoned"):
                    j.result()
    finally:
        await engine.close()
