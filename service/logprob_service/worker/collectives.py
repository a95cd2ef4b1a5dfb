"""A torch.distributed group shared with a trainer, to receive weights by broadcast.

RL frameworks sync a policy's weights into their inference servers this way (vLLM's and SGLang's
``init_weights_update_group`` / ``update_weights_from_distributed``): the trainer, rank 0, hosts a
TCP store; each server joins as a further rank; every tensor is broadcast from rank 0 in an order
both sides agreed on. The group is a process group of its own, built on that store (not
torch.distributed's default group, which a server may need for itself), so it can be joined,
dropped and joined again while the server runs. ``logprob_client.collective`` is the trainer's side.

A join ends within its ``timeout_s`` whatever the trainer does. torch's store client does not
bound every wait on the store by its timeout (a peer that accepts the connection and never
answers held a join, its thread and its slot for good), so the server reaches the store through a
``StoreRelay`` of its own, which a watchdog closes when the time is up: every wait on the store
then fails at once. The group's own waits are given the time left (gloo's set-up and the first
broadcast), and the watchdog aborts an NCCL group still setting up.

``engine.weights`` runs the update's protocol and holds the group as an opaque object
(``engine.interfaces.WeightGroup``): the engine touches no tensor.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from logprob_service.errors import InvalidArgument
from logprob_service.models.loading import DTYPES
from logprob_service.worker.store_relay import StoreRelay

STORE_PREFIX = "logprob-weights"  # the trainer's side uses the same: both see one key space per group
BACKENDS = ("nccl", "gloo")


class WeightGroup:
    """This server's rank in a group with a trainer: joined at construction (within ``timeout_s``,
    else ``InvalidArgument``), tensors received by ``receive`` in broadcast order. Not
    thread-safe: one update receives at a time."""

    def __init__(
        self,
        device: torch.device,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        self.device, self.rank, self.world_size = device, rank, world_size
        self.backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if self.backend not in BACKENDS:
            raise InvalidArgument(f"backend: {backend!r} is not one of {', '.join(BACKENDS)} (empty: by device)")
        if self.backend == "nccl" and device.type != "cuda":
            raise InvalidArgument(f"backend: nccl needs a CUDA device; this server runs on {device}")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        deadline = time.monotonic() + timeout_s
        trainer = f"{master_address}:{master_port}"
        try:
            self._relay = StoreRelay(master_address, master_port, connect_timeout_s=timeout_s)
        except OSError as err:
            raise InvalidArgument(f"master_address: no TCP store of a trainer at {trainer} ({err})") from None
        self.group: dist.ProcessGroup | None = None
        self._lock = threading.Lock()  # the watchdog's abandon against the group's making
        self._abandoned = self._joined = False
        watchdog = threading.Timer(timeout_s, self._abandon)
        watchdog.daemon = True
        watchdog.start()
        try:
            store = dist.TCPStore("127.0.0.1", self._relay.port, world_size, is_master=False, timeout=self.timeout)
            self._join(dist.PrefixStore(f"{STORE_PREFIX}/{name}", store), deadline)
            with self._lock:
                if self._abandoned:  # joined as the time ran out: the watchdog closed the store
                    raise RuntimeError("the join's time ran out")
                self._joined = True
        except (RuntimeError, OSError) as err:  # DistNetworkError is a RuntimeError
            self.close()
            if not self._relay.connected:
                raise InvalidArgument(
                    f"master_address: no TCP store of a trainer at {trainer} within {timeout_s:g} s "
                    f"({self._relay.error or err})"
                ) from None
            why = f"it did not complete within timeout_s={timeout_s:g} s" if self._abandoned else str(err)
            raise InvalidArgument(
                f"master_address: group {name!r} with the trainer at {trainer} was not joined: {why}"
            ) from None
        finally:
            watchdog.cancel()

    def _join(self, store: dist.Store, deadline: float) -> None:
        """Make the group on ``store`` and take the trainer's first broadcast, by ``deadline``."""
        if self.backend == "gloo":
            group = dist.ProcessGroupGloo(store, self.rank, self.world_size, _left(deadline))
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            torch.cuda.set_device(self.device)
            group = dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        with self._lock:
            self.group = group
            if self._abandoned:
                raise RuntimeError("the join's time ran out")
        self._broadcast(torch.zeros(1, device=self.device), _left(deadline))  # every rank is in

    def _abandon(self) -> None:
        """The join's time is up: every wait on the store fails at once, and an NCCL group still
        setting up is aborted (gloo's waits end by themselves: they were given the time left)."""
        with self._lock:
            if self._joined:
                return
            self._abandoned = True
            group = self.group
        self._relay.close()
        if group is not None and self.backend == "nccl":
            try:
                group.abort()
            except RuntimeError:
                pass  # already broken

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
        assert self.group is not None
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = timeout
        self.group.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()  # received, before anyone reads it

    def receive(self, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The next tensor rank 0 broadcasts, on this server's device; raises once the group's
        timeout passes without it."""
        tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
        self._broadcast(tensor, self.timeout)
        return tensor

    def close(self, *, graceful: bool = False) -> None:
        """Leave the group (a broken one included). ``graceful``: rank 0 leaves at the same time
        (NCCL's shutdown waits for every rank); otherwise it is aborted here alone (the trainer
        is gone, or broke the protocol)."""
        try:
            if self.group is None:
                pass  # not made: only the store's connection to end
            elif graceful:
                self.group.shutdown()
            else:
                self.group.abort()
        except RuntimeError:
            pass  # already broken or shut down: nothing left to release
        finally:
            self._relay.close()


def _left(deadline: float) -> datetime.timedelta:
    """The time from now to ``deadline`` (``time.monotonic``), at least a millisecond."""
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
