"""The weight updates of a server's models: the model's one update slot, the streams of an update
(one, or several in a session), LoadWeights, trainers' groups and their broadcasts, IPC updates,
and the swap that makes an update live."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from logprob_service.domain import (
    Commit,
    GroupSpec,
    SharedTensor,
    SparsePiece,
    TensorPiece,
    TensorSpec,
    UpdateChecked,
    UpdateHeader,
    UpdateMessage,
    UpdateOutcome,
    tensor_nbytes,
)
from logprob_service.engine.interfaces import JoinGroup, Staging, WeightGroup
from logprob_service.engine.registry import ModelRegistry
from logprob_service.engine.scheduler import Scheduler
from logprob_service.engine.weights.files import no_tensors, safetensors_files, served_checkpoint_dirs
from logprob_service.engine.weights.session import Session, StreamIdle
from logprob_service.engine.weights.update import Stream, Update, one_digest_per_weight
from logprob_service.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    LogprobError,
    Overloaded,
    Unavailable,
)
from logprob_service.settings.weight_updates import DEFAULT_MAX_GROUP_TIMEOUT_S, DEFAULT_UPDATE_IDLE_TIMEOUT_S
from logprob_service.stats import NO_STATS, StatsSink, WeightsUpdated

log = logging.getLogger(__name__)
T = TypeVar("T")

# InitWeightsUpdateGroup's timeout_s when the request gives none (the server's max_group_timeout_s
# if lower).
DEFAULT_GROUP_TIMEOUT_S = 120.0
# Joins of trainers' groups in progress at once, at most; more are refused (RESOURCE_EXHAUSTED).
# Each holds a thread until it ends, within its timeout_s whatever the trainer does
# (``worker.collectives``), which is when its slot is free again.
MAX_PENDING_JOINS = 4
# A join's call ends this long after its timeout_s at the latest, even if its thread has not.
JOIN_SLACK_S = 5.0
# Updates over several streams remembered once ended, so that a stream coming late gets its answer.
ENDED_SESSIONS_KEPT = 64
# An update stream yielding to micro-batch launches (``yield_to_launches``) reads its next message
# after at most this long, so that it goes on, slowly, even when launches follow each other.
LAUNCH_YIELD_MAX_S = 0.1


async def _on_daemon_thread(
    fn: Callable[[], T], *, ended: Callable[[], None] = lambda: None, orphaned: Callable[[T], None] = lambda _: None
) -> T:
    """``fn()``, run on a daemon thread of its own: a call blocked where nothing can interrupt it
    (a join's connect to a trainer's TCP store, up to its timeout) then holds neither a thread of
    the event loop's default executor, which the server's other work needs, nor the process's exit,
    which waits for that executor's threads. Cancelled, this returns at once; ``fn`` runs on, and
    ``orphaned`` takes what it returns, which no caller will. ``ended``: called once ``fn`` has
    returned or raised. Both are called on the event loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        ended()
        if done.cancelled():
            if error is None:
                orphaned(result)
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as err:
            error = err
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="logprob-group", daemon=True).start()
    return await done


class WeightUpdater:
    """Runs the weight updates of a server's models (asyncio side; the swap runs on the device thread)."""

    def __init__(
        self,
        registry: ModelRegistry,
        scheduler: Scheduler,
        staging: Staging,
        *,
        join_group: JoinGroup | None = None,
        yield_to_launches: bool = False,
        load_roots: Sequence[Path] = (),
        idle_timeout_s: float = DEFAULT_UPDATE_IDLE_TIMEOUT_S,
        max_group_timeout_s: float = DEFAULT_MAX_GROUP_TIMEOUT_S,
        stats: StatsSink = NO_STATS,
    ) -> None:
        """``load_roots``: the directories (resolved) LoadWeights may read under, with the served
        checkpoints' own; empty: anywhere outside /proc, /sys and /dev."""
        self._registry = registry
        self._load_roots = tuple(load_roots)
        self._scheduler = scheduler
        self._staging = staging
        self._join_group = join_group
        self._stats = stats
        self._updating: set[str] = set()
        self._sessions: dict[str, Session] = {}  # updates over several streams, by model
        self._ended: collections.OrderedDict[str, LogprobError | None] = collections.OrderedDict()  # by update_id
        self._yield_to_launches = yield_to_launches
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="logprob-stage")
        # Received pieces are written where they are staged on these, without the GIL, while the
        # event loop receives the next ones.
        self._writers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="logprob-receive")
        self._groups: dict[str, WeightGroup] = {}  # joined trainers' groups, by name
        self._joins = 0  # joins in progress (their threads, whose calls may have ended)
        self._joining: set[asyncio.Future[WeightGroup]] = set()  # the calls of joins in progress
        self._abandoning = False  # the server is stopping: joins are abandoned
        self._idle_timeout_s = idle_timeout_s
        self._max_group_timeout_s = max_group_timeout_s
        self._past_commit: set[asyncio.Task[UpdateOutcome]] = set()  # updates past their commit (``settled``)

    def updating(self, model: str) -> bool:
        """Whether an update of ``model`` is in progress (its header came; its swap is not done)."""
        return model in self._updating

    async def update(self, messages: AsyncIterator[UpdateMessage]) -> UpdateOutcome:
        """An UpdateWeights stream: a header, tensor pieces, a commit; or one of the streams of an
        update that comes over several."""
        start = time.perf_counter_ns()
        first = await self._next_message(messages, "before its header")
        if not isinstance(first, UpdateHeader):
            raise InvalidArgument("header: the first message of an update stream must be its header")
        if first.streams > 1:
            return await self._update_in_session(first, messages, start)
        with self._updating_model(first) as update:
            await self._receive(update, messages)
            return await self._commit(update, start)

    async def _receive(
        self, update: Update, messages: AsyncIterator[UpdateMessage], session: Session | None = None
    ) -> None:
        """One stream's tensors, up to its commit (checked)."""
        stream = Stream()
        while True:
            if self._yield_to_launches:
                await self._scheduler.between_launches(LAUNCH_YIELD_MAX_S)
            message = await self._next_message(messages, f"in an update of model {update.served.info.name!r}")
            if message is None:
                break
            if session is not None:
                session.check()
            if isinstance(message, TensorPiece | SparsePiece):
                update.add_piece(message, stream)
                await update.room()
            elif isinstance(message, Commit):
                update.check_commit(stream, message)
                return
            else:
                raise InvalidArgument("header: a second header in one update stream")
        raise update.ended_early(stream)

    async def _next_message(self, messages: AsyncIterator[UpdateMessage], where: str) -> UpdateMessage | None:
        """The stream's next message (None at its end), if it comes within the idle limit: a client
        that holds a stream open without sending would otherwise hold the model's update slot (and
        the other streams of its update) for as long as it likes."""
        try:
            async with asyncio.timeout(self._idle_timeout_s) as idle:
                return await anext(messages, None)
        except TimeoutError:
            if not idle.expired():
                raise
            raise StreamIdle(
                f"update stream: no message came for {self._idle_timeout_s:g} s {where} (the server's "
                "update_idle_timeout_s); nothing applied"
            ) from None

    async def _update_in_session(
        self, header: UpdateHeader, messages: AsyncIterator[UpdateMessage], start: int
    ) -> UpdateOutcome:
        """One of the streams of an update: it starts the session or joins it, brings its tensors,
        commits; the last to commit swaps the update in; every stream answers with its outcome."""
        if not header.update_id:
            raise InvalidArgument(f"header.update_id: empty; an update over {header.streams} streams needs an id")
        name = self._registry.replicas(header.model)[0].info.name
        session = self._sessions.get(name)
        if header.update_id in self._ended:
            # A stream that comes after its update ended gets the update's failure, if it failed.
            raise self._ended[header.update_id] or InvalidArgument(
                f"header.update_id: update {header.update_id!r} already went live"
            )
        if session is not None and session.header.update_id == header.update_id:
            session.join(header)
        else:
            update = self._start_update(header)
            session = self._sessions[name] = Session(update, header, start)
            session.on_end = functools.partial(self._end_session, name, session)
        try:
            await self._receive(session.update, messages, session)
            session.committed += 1
            if session.committed == header.streams:
                # The update is whole, and goes live even if this stream's call is cancelled
                # meanwhile (every stream is then answered with the outcome).
                session.commit = self._go_live(session.update, session.start_ns)
                session.commit.add_done_callback(session.settle)
        except BaseException as err:
            session.fail(err)  # the other streams' answer; this one's is its own error
            raise
        return await asyncio.shield(session.outcome)

    def _end_session(self, name: str, session: Session) -> None:
        # Only the failure is kept: the session holds the update's staged tensors.
        failed = session.outcome.done() and session.outcome.exception()
        self._ended[session.header.update_id] = failed if isinstance(failed, LogprobError) else None
        while len(self._ended) > ENDED_SESSIONS_KEPT:
            self._ended.popitem(last=False)
        if self._sessions.get(name) is session:
            del self._sessions[name]
            self._end_update(name)

    async def load(self, header: UpdateHeader, path: str) -> UpdateOutcome:
        """A LoadWeights request: the tensors of the safetensors files at ``path``."""
        start = time.perf_counter_ns()
        # On a thread: a path's lookups may wait on a slow filesystem.
        files = await asyncio.to_thread(self._checkpoint_files, path)
        with self._updating_model(header) as update:
            added = 0
            for file in files:  # one file in host memory at a time (checkpoint shards are a few GB)
                for name, dtype, shape, tensor in await asyncio.to_thread(self._staging.read_file, file):
                    update.add_tensor(name, dtype, shape, tensor)
                    added += 1
            if not added:
                raise no_tensors(path)
            return await self._commit(update, start)

    def _checkpoint_files(self, path: str) -> list[Path]:
        roots = self._load_roots
        if roots:  # confined: the served checkpoints may always be read again
            roots = (*roots, *served_checkpoint_dirs(served.info.source for served in self._registry))
        return safetensors_files(path, roots)

    async def join_group(self, spec: GroupSpec) -> WeightGroup:
        """Join a trainer's group (replacing one of the same name); returns once every rank is in."""
        if self._join_group is None:
            raise FailedPrecondition("InitWeightsUpdateGroup: this server takes no weights by broadcast")
        if not 0 < spec.rank < spec.world_size:
            raise InvalidArgument(
                f"rank_offset: {spec.rank} must be in [1, world_size={spec.world_size}) (0 is the trainer)"
            )
        limit = self._max_group_timeout_s
        if not 0 <= spec.timeout_s <= limit:  # NaN too
            raise InvalidArgument(
                f"timeout_s: {spec.timeout_s} is not in [0, {limit:g}] seconds (the server's max_group_timeout_s; "
                f"0: {min(DEFAULT_GROUP_TIMEOUT_S, limit):g})"
            )
        if self._joins >= MAX_PENDING_JOINS:
            raise Overloaded(
                f"InitWeightsUpdateGroup: {self._joins} joins of weight groups are in progress, the most at once",
                retry_after_s=1.0,
            )
        device = next(iter(self._registry)).device
        timeout_s = spec.timeout_s or min(DEFAULT_GROUP_TIMEOUT_S, limit)
        join = functools.partial(
            self._join_group,
            device,
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=spec.rank,
            world_size=spec.world_size,
            name=spec.name,
            backend=spec.backend,
            timeout_s=timeout_s,
        )
        self._joins += 1  # until its thread ends, which may be after its call did
        # A join whose call ends first (cancelled, past its deadline, abandoned) leaves the group it joins.
        joining = asyncio.ensure_future(
            _on_daemon_thread(join, ended=self._join_ended, orphaned=lambda group: group.close())
        )
        self._joining.add(joining)
        try:
            group = await asyncio.wait_for(joining, timeout_s + JOIN_SLACK_S)
        except TimeoutError:
            raise InvalidArgument(
                f"master_address: group {spec.name!r} with the trainer at {spec.master_address}:{spec.master_port} "
                f"was not joined within timeout_s={timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if joining.cancelled() and self._abandoning and not (current and current.cancelling()):
                raise Unavailable(
                    f"InitWeightsUpdateGroup: the server is stopping; the join of group {spec.name!r} was abandoned"
                ) from None
            raise
        finally:
            self._joining.discard(joining)
        # Joined: only now does it replace a group of that name (one that failed to join leaves
        # the trainer's working group in place).
        if (old := self._groups.pop(spec.name, None)) is not None:
            old.close()
        self._groups[spec.name] = group
        log.info("joined weight group %r as rank %d of %d (%s)", spec.name, spec.rank, spec.world_size, group.backend)
        return group

    def _join_ended(self) -> None:
        self._joins -= 1

    def abandon_joins(self) -> None:
        """The server is stopping: the calls of joins in progress end at once (UNAVAILABLE), and
        each join's thread, a daemon, leaves what it joins within its timeout."""
        self._abandoning = True
        for joining in self._joining:
            joining.cancel()

    async def leave_group(self, name: str) -> None:
        """Leave the group ``name`` together with its rank 0 (returns once both have left)."""
        group = self._groups.pop(name, None)
        if group is None:
            raise FailedPrecondition(f"group_name: no weight group {name!r} joined ({self._joined()})")
        # Waits for the trainer (NCCL's shutdown): not on a thread the process's exit would wait for.
        await _on_daemon_thread(functools.partial(group.close, graceful=True))
        log.info("left weight group %r", name)

    def _joined(self) -> str:
        return ", ".join(map(repr, self._groups)) or "none"

    async def update_from_group(
        self, header: UpdateHeader, group_name: str, tensors: list[TensorSpec]
    ) -> AsyncIterator[UpdateChecked | UpdateOutcome]:
        """An update whose tensors rank 0 of ``group_name`` broadcasts: yields ``UpdateChecked`` once every
        tensor is checked, then the outcome once they are live. A broadcast that fails (the trainer
        went away, the group's timeout passed) aborts the update and closes the group."""
        start = time.perf_counter_ns()
        group = self._groups.get(group_name)
        if group is None:
            raise FailedPrecondition(
                f"group_name: no weight group {group_name!r} joined ({self._joined()}); "
                "call InitWeightsUpdateGroup first"
            )
        with self._updating_model(header) as update:
            update.check_all(tensors)
            yield UpdateChecked()
            for i, spec in enumerate(tensors):
                try:
                    received = await asyncio.to_thread(group.receive, spec.dtype, spec.shape)
                except BaseException as err:
                    # A dead trainer, a timeout, or this call cancelled midway: the two sides no longer
                    # agree on what comes next through the group, so it is closed (which also ends a
                    # receive still waiting in its thread).
                    self._groups.pop(group_name, None)
                    group.close()
                    if not isinstance(err, Exception):
                        raise
                    raise Aborted(
                        f"tensor {spec.name!r}: its broadcast from rank 0 of group {group_name!r} failed after "
                        f"{i} of {len(tensors)} tensors ({err}); nothing applied, the group is closed"
                    ) from None
                update.stage(spec.name, tensor_nbytes(spec.dtype, spec.shape), lambda t=received: t)
            yield await self._commit(update, start)

    async def update_from_ipc(self, header: UpdateHeader, boot_id: str, tensors: list[SharedTensor]) -> UpdateOutcome:
        """An update whose tensors lie in a caller's GPU memory on this host (UpdateWeightsFromIpc):
        every tensor is checked, and the caller's host and GPUs too, before any is opened; each is
        then copied device to device into staging, and they are swapped in as UpdateWeights'."""
        start = time.perf_counter_ns()
        with self._updating_model(header) as update:
            update.check_all(tensors)
            self._staging.check_shared(boot_id, update.served.device, tensors)
            for t in tensors:
                update.stage(
                    t.name, tensor_nbytes(t.dtype, t.shape), lambda t=t: self._staging.open_shared(t), copy=True
                )
            return await self._commit(update, start)

    @contextlib.contextmanager
    def _updating_model(self, header: UpdateHeader) -> Iterator[Update]:
        """The model's one update slot, and the update started in it; released on any exit."""
        update = self._start_update(header)
        try:
            yield update
        finally:
            self._end_update(update.served.info.name)

    def _start_update(self, header: UpdateHeader) -> Update:
        """The update, started in the model's one update slot (``_end_update`` releases it)."""
        replicas = self._registry.replicas(header.model)
        served = replicas[0]
        name, live = served.info.name, served.info.version
        if name in self._updating:
            raise Aborted(f"model: another update of {name!r} is in progress; retry when it is done")
        dependents = self._registry.lora_models_of(name)
        if dependents:
            raise FailedPrecondition(
                f"model: {name!r} is the shared base of the LoRA models {', '.join(map(repr, dependents))}; "
                "update their adapters instead"
            )
        version = header.version or live + 1
        if version <= live:
            raise FailedPrecondition(f"version: {version} is not above model {name!r}'s live version {live}")
        update = Update(
            replicas,
            UpdateHeader(name, version, header.partial, header.base_version),
            self._staging,
            self._pool,
            self._writers,
        )
        self._updating.add(name)
        return update

    def _end_update(self, name: str) -> None:
        self._updating.discard(name)

    async def _commit(self, update: Update, start_ns: int) -> UpdateOutcome:
        """The update goes live (``_go_live``). Cancelling this call does not stop it: the
        cancellation waits for its end, so that the model's update slot is held until then."""
        going = self._go_live(update, start_ns)
        try:
            return await asyncio.shield(going)
        except asyncio.CancelledError:
            await asyncio.wait([going])  # a second cancellation (the server stopping) ends this wait
            raise

    def _go_live(self, update: Update, start_ns: int) -> asyncio.Task[UpdateOutcome]:
        """An update whose commit came, checked, swapped in and logged by a task of its own: it
        goes live or fails whatever becomes of the calls that brought it (a caller may cancel
        right after sending its commit), and ``settled`` waits for it."""
        task = asyncio.ensure_future(self._swap_in(update, start_ns))
        self._past_commit.add(task)
        task.add_done_callback(self._gone_live)
        return task

    def _gone_live(self, task: asyncio.Task[UpdateOutcome]) -> None:
        self._past_commit.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the call that brought it may be gone

    async def settled(self) -> None:
        """Returns once every update whose commit came before has gone live or failed: ListModels
        answers after them, so a caller whose push was cancelled or timed out after its commit
        learns from it whether the push went live."""
        if self._past_commit:
            await asyncio.wait(set(self._past_commit))

    async def _swap_in(self, update: Update, start_ns: int) -> UpdateOutcome:
        update.check_complete()
        staged = await update.staged_tensors()
        served, version = update.served, update.header.version
        digests = one_digest_per_weight(update.target, {name: digest for name, (_, digest) in staged.items()})
        swap_ns = [0] * len(update.replicas)

        def apply(lane: int) -> None:
            """On ``lane``'s device thread: its replica takes its copies and the new version."""
            t0 = time.perf_counter_ns()
            served_as = update.targets[lane].apply({name: copies[lane] for name, (copies, _) in staged.items()})
            update.replicas[lane].updated(version, {**digests, **served_as})
            swap_ns[lane] = time.perf_counter_ns() - t0

        await self._scheduler.swap(served.info.name, apply)
        outcome = UpdateOutcome(
            model=served.info.name,
            version=served.info.version,
            fingerprint=served.info.fingerprint,
            tensors=len(staged),
            bytes=update.bytes,
            staged_on="+".join(sorted(set().union(*(stager.places for stager in update.stagers)))) or "none",
            total_ns=time.perf_counter_ns() - start_ns,
            swap_ns=max(swap_ns),
        )
        self._stats.record(WeightsUpdated(outcome.model, outcome.bytes, outcome.total_ns, outcome.swap_ns))
        log.info("model %r: version %d live (%s)", outcome.model, outcome.version, outcome)
        return outcome

    def close(self) -> None:
        self.abandon_joins()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._writers.shutdown(wait=False, cancel_futures=True)
        for group in self._groups.values():
            group.close()
        self._groups.clear()
