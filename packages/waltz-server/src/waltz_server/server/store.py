"""A partition's replicated store: store sessions one after another.

A :class:`StorePartition` (this module) owns a partition's replicas for one generation. It
runs store sessions one after another; each takes a new session id by CAS in
coordination, recovers (:mod:`waltz_server.server.recovery`), then writes:
appended records go to an in-memory window, and one writer task per replica
appends batches from it, in order and several in flight, to its storage node.
A record is committed when a quorum of replicas has acknowledged it. The rules
(window, progress, commit, what a returning replica keeps) are the pure
:mod:`waltz_server.server.replication`; :class:`StoreSession`
(:mod:`waltz_server.server.store_session`) is its I/O shell.

A replica that fails leaves the session's writers and is retried with back-off;
the others go on committing while they are a quorum; when it returns it rejoins
the same session and catches up (from the window, or from a healthy replica's
storage when it is behind the window). A session ends only when the connected
replicas are no longer a quorum, when it is fenced (a newer session or
generation exists), at the checkpoint interval, or for a new replica set.
The appends pending when a session ends are decided by the next session's
recovery: :meth:`StorePartition.closing_mark` tells which committed.

The archive (docs/archive.md): with an :class:`ArchiveLink`, reads of ids at or below
the archive mark come from the archive (the replicas may have deleted them; they are
tried when the archive fails), each session's recovery fast-forwards replicas that end
below the mark, a replica that rejoins behind it is fast-forwarded too, and
:meth:`StorePartition.prune` lets the archiver ask the writers to delete what is
archived (never past what a writer acknowledged, so no writer catching up from
another finds its next record deleted).

Membership: each session runs over the partition's replicas as the replica
assignments in coordination name them when it starts (``waltz_api.cluster``,
``/store/assignment``). The partition watches the assignments; a change of its
replica set drains the running session and starts a new one over the new set.
A new replica is caught up from a healthy one by the new session's recovery,
in the background, and counts toward the quorum only once caught up; a removed
replica is no longer written (its data stays on its node).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from waltz_api.backoff import Backoff
from waltz_api.cluster import ClusterMetadata, ReplicaAssignments
from waltz_api.contracts.coordination import Coordination, Watch
from waltz_api.contracts.storage import LocalLog
from waltz_api.errors import (
    ArchiveError,
    ClusterNotFoundError,
    CoordinationError,
    StaleGenerationError,
    StoreSessionClosedError,
    WaltzError,
)
from waltz_api.types import NO_TRANSACTION, Record, ReqId
from waltz_server.server.replica import ReplicaConnector
from waltz_server.server.store_config import (
    ArchiveLink,
    CommitListener,
    RecoveryListener,
    StoreConfig,
)
from waltz_server.server.store_metadata import begin_store_session
from waltz_server.server.store_session import StoreSession

__all__ = ["ArchiveLink", "StoreConfig", "StorePartition", "StoreSession"]

log = logging.getLogger(__name__)

R = TypeVar("R")


class StorePartition:
    """A partition's replicated store for one generation: sessions one after another."""

    def __init__(
        self,
        *,
        partition_id: int,
        generation: int,
        coordination: Coordination,
        replica_nodes: Sequence[str],
        connector: ReplicaConnector,
        config: StoreConfig | None = None,
        rng: random.Random | None = None,
        on_commit: CommitListener | None = None,
        on_recovered: RecoveryListener | None = None,
        archive: ArchiveLink | None = None,
    ) -> None:
        if not replica_nodes:
            raise WaltzError(f"partition {partition_id} has no replicas assigned")
        self.archive = archive
        self.partition_id = partition_id
        self.generation = generation
        self._coordination = coordination
        self._replica_nodes = list(replica_nodes)
        self._connector = connector
        self._config = config or StoreConfig()
        self._rng = rng or random.Random()
        self._on_commit = on_commit
        self._on_recovered = on_recovered
        self._session: StoreSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._stale: StaleGenerationError | None = None
        self._failure: BaseException | None = None
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._watch: Watch | None = None
        self._membership_changed = False
        self.high_water_mark = NO_TRANSACTION
        self.sessions_started = 0
        self._openings: collections.deque[tuple[int, int]] = collections.deque(maxlen=256)
        """(session id, opening high-water mark) of the sessions that opened, in order."""

    @property
    def session(self) -> StoreSession | None:
        return self._session

    @property
    def replica_nodes(self) -> list[str]:
        return list(self._replica_nodes)

    def set_listeners(
        self,
        *,
        on_commit: CommitListener | None = None,
        on_recovered: RecoveryListener | None = None,
    ) -> None:
        """Who hears of commits and recoveries (the partition); set before ``start``."""
        self._on_commit = on_commit
        self._on_recovered = on_recovered

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def stale(self) -> StaleGenerationError | None:
        return self._stale

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._manage(), name=f"store-{self.partition_id}")
            self._task.add_done_callback(self._managed)

    def _managed(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error(
            "partition %d: the store session manager failed: %r; the partition stops",
            self.partition_id,
            error,
        )
        self._failure = error
        self._notify()

    async def close(self) -> None:
        self._closed = True
        self._ready.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_ready(self, timeout: float | None = None) -> StoreSession:
        """The open session, once recovery completed."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._stale is not None:
                raise self._stale
            if self._failure is not None:
                raise StoreSessionClosedError(
                    f"partition {self.partition_id} stopped: {self._failure!r}"
                ) from self._failure
            if self._closed:
                raise StoreSessionClosedError(f"partition {self.partition_id} is closed")
            session = self._session
            if self._ready.is_set() and session is not None and not session.done:
                return session
            event = self._changed
            if deadline is None:
                await event.wait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"partition {self.partition_id} not ready")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)

    async def closing_mark(self, session_id: int) -> int:
        """The closing high-water mark of store session ``session_id`` of this partition:
        its transactions up to the mark are committed, the ones after it never will be.

        It is the opening mark of the first session after it that opened (that
        session's recovery decided it, and sessions that failed to open wrote
        nothing); waits until one has. Raises StaleGenerationError when the partition
        moved (the new owner's recovery decides, and a client learns it by mounting
        there) and StoreSessionClosedError when the partition stops here."""
        while True:
            for opened, mark in self._openings:
                if opened > session_id:
                    return mark
            if self._stale is not None:
                raise self._stale
            if self._failure is not None or self._closed:
                raise StoreSessionClosedError(
                    f"partition {self.partition_id} stopped before store session {session_id} "
                    "was decided"
                )
            await self._changed.wait()

    def session_with_room(self) -> StoreSession | None:
        """The open session when it takes an append now, without waiting (what
        :meth:`reserve` would return at once); None otherwise (then ``reserve`` waits)."""
        session = self._session
        if (
            session is None
            or not self._ready.is_set()
            or session.done
            or self._stale is not None
            or self._failure is not None
            or self._closed
            or not session.accepting
            or not session.has_room()
        ):
            return None
        return session

    async def reserve(self) -> StoreSession:
        """An open session with room for one more append. Nothing else runs between
        the return and a synchronous ``session.append`` by the caller, so a check
        made in between (the lock check) and the id assignment are atomic."""
        while True:
            session = await self.wait_ready()
            try:
                await session.wait_for_room()
                return session
            except StoreSessionClosedError:
                if session.done:
                    continue
                # draining for a checkpoint: wait for the next session
                await self._wait_session_change(session)

    async def append(
        self, req_id: ReqId, header: int, data: bytes, checksum: int
    ) -> tuple[int, asyncio.Future[int]]:
        """Wait for a session with room, then queue the record (see StoreSession.append)."""
        session = await self.reserve()
        return session.append(req_id, header, data, checksum)

    async def _wait_session_change(self, session: StoreSession) -> None:
        while self._session is session and not self._closed and self._stale is None:
            await self._changed.wait()

    async def read_committed(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        """Committed records from ``start`` (from memory or a healthy replica: one failing
        the read is replaced by another); a read cut by the end of the session is retried
        on the next one."""
        archived = await self._read_archive(start, max_records, max_bytes)
        if archived:
            return archived
        return await self._read_retrying(
            lambda session: session.read_committed(start, max_records, max_bytes)
        )

    async def _read_archive(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        """Archived records from ``start`` when it is at or below the archive mark; empty
        when it is not, or when the archive failed and the replicas may still hold it
        (ArchiveError, naming the range and the object, when they do not)."""
        archive = self.archive
        if archive is None or not 0 <= start <= archive.mark or max_records <= 0:
            return []
        try:
            return await archive.read(start, max_records, max_bytes)
        except ArchiveError as exc:
            local = await self.local_log()
            if local is not None and local.log_start > start:
                log.error("partition %d: %s", self.partition_id, exc)
                raise  # the replicas deleted it too: the reader is told what failed where
            log.warning(
                "partition %d: reading transaction %d from the archive failed, trying the "
                "replicas: %s",
                self.partition_id,
                start,
                exc,
            )
            return []

    async def prune(self, through: int) -> None:
        """Ask the open session's writers to delete their archived records up to
        ``through`` (see StoreSession.prune); nothing without an open session."""
        session = self._session
        if session is not None and self._ready.is_set() and not session.done:
            await session.prune(through)

    async def local_log(self) -> LocalLog | None:
        """One writer's local log, or None (no open session, or no writer can tell)."""
        session = self._session
        if session is None or not self._ready.is_set() or session.done:
            return None
        return await session.local_log()

    async def read_committed_block(
        self, start: int, max_records: int, max_bytes: int
    ) -> Sequence[Record]:
        """:meth:`read_committed` for a range read (see StoreSession.read_committed_block)."""
        archived = await self._read_archive(start, max_records, max_bytes)
        if archived:
            return archived
        return await self._read_retrying(
            lambda session: session.read_committed_block(start, max_records, max_bytes)
        )

    async def _read_retrying(self, read: Callable[[StoreSession], Awaitable[R]]) -> R:
        while True:
            session = await self.wait_ready()
            try:
                return await read(session)
            except StoreSessionClosedError:
                if not session.done:
                    raise

    def _commit(self, high_water_mark: int, records: Sequence[Record]) -> None:
        self.high_water_mark = high_water_mark
        if self._on_commit is not None:
            self._on_commit(high_water_mark, records)
        session = self._session
        if session is not None and session.checkpoint_reached:
            self._notify()

    # -- membership -------------------------------------------------------------------

    def _on_assignments(self, assignments: ReplicaAssignments | None) -> None:
        if assignments is None or self._closed:
            return
        replicas = assignments.replicas_of(self.partition_id)
        if replicas and replicas != self._replica_nodes and not self._membership_changed:
            log.info(
                "partition %d: replica assignment changed (%s -> %s): a new store session follows",
                self.partition_id,
                ",".join(self._replica_nodes),
                ",".join(replicas),
            )
            self._membership_changed = True
            self._notify()

    async def _follow_replicas(self) -> None:
        """Watch the replica assignments (once), and take the current replica set for
        the session about to start. A cluster without assignments (a partition store
        used on its own) keeps the replicas it was given."""
        cluster = ClusterMetadata(self._coordination)
        self._membership_changed = False
        try:
            assignments = await cluster.replica_assignments()
        except ClusterNotFoundError:
            return
        replicas = assignments.replicas_of(self.partition_id)
        if replicas and replicas != self._replica_nodes:
            log.info(
                "partition %d: replicas %s (were %s)",
                self.partition_id,
                ",".join(replicas),
                ",".join(self._replica_nodes),
            )
            self._replica_nodes = replicas
        if self._watch is None:
            self._watch = await cluster.watch_replica_assignments(self._on_assignments)

    async def _open(self, session: StoreSession) -> int:
        """``session.open()``, given up (:class:`_ReplicaSetChanged`) when the replica
        assignment changes first: a recovery over the old set may wait for ever (for a
        removed replica's vote, say) while one over the new set can decide."""
        opening = asyncio.ensure_future(session.open())
        try:
            while not opening.done() and not self._membership_changed:
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({opening, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
            if not opening.done():
                opening.cancel()
                with contextlib.suppress(asyncio.CancelledError, WaltzError, OSError):
                    await opening
                raise _ReplicaSetChanged()
            return opening.result()
        finally:
            if not opening.done():  # (this task was cancelled)
                opening.cancel()

    async def _manage(self) -> None:
        backoff = Backoff(self._config.retry_initial, self._config.retry_max, self._rng)
        while not self._closed:
            try:
                await self._follow_replicas()
                if self.archive is not None:
                    await self.archive.refresh()  # the mark the recovery starts replicas at
                metadata = await begin_store_session(
                    self._coordination, self.partition_id, self.generation
                )
            except StaleGenerationError as exc:
                log.warning("partition %d: %s", self.partition_id, exc)
                self._stale = exc
                self._notify()
                return
            except (CoordinationError, OSError) as exc:
                # OSError includes TimeoutError: the service may come back
                log.warning(
                    "partition %d: cannot start a store session: %s", self.partition_id, exc
                )
                await backoff.sleep()
                continue
            session = StoreSession(
                coordination=self._coordination,
                metadata=metadata,
                replica_nodes=self._replica_nodes,
                connector=self._connector,
                config=self._config,
                rng=self._rng,
                on_commit=self._commit,
                archive=self.archive,
            )
            self._session = session
            self.sessions_started += 1
            self._notify()
            try:
                high_water_mark = await self._open(session)
            except _ReplicaSetChanged:
                log.info(
                    "partition %d: session %d ends before it opened: the replica set changed",
                    self.partition_id,
                    session.session_id,
                )
                await session.close()
                continue
            except (WaltzError, OSError) as exc:
                log.info(
                    "partition %d: session %d failed to open: %s",
                    self.partition_id,
                    session.session_id,
                    exc,
                )
                await session.close()
                await backoff.sleep()
                continue
            backoff.reset()
            self._openings.append((session.session_id, high_water_mark))
            self.high_water_mark = high_water_mark
            if self._on_recovered is not None:
                self._on_recovered(high_water_mark)
            self._ready.set()
            self._notify()
            while (
                not session.done and not session.checkpoint_reached and not self._membership_changed
            ):
                event = self._changed
                done = asyncio.ensure_future(session.wait_done())
                changed = asyncio.ensure_future(event.wait())
                try:
                    await asyncio.wait({done, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    done.cancel()
                    changed.cancel()
            if session.checkpoint_reached and not session.done:
                log.info(
                    "partition %d: checkpoint interval reached in session %d, starting a new one",
                    self.partition_id,
                    session.session_id,
                )
                await session.drain(self._config.drain_timeout)
            elif self._membership_changed and not session.done:
                log.info(
                    "partition %d: ending store session %d for the new replica set",
                    self.partition_id,
                    session.session_id,
                )
                await session.drain(self._config.drain_timeout)
            self._ready.clear()
            await session.close()
            self._notify()


class _ReplicaSetChanged(Exception):
    """The replica assignment changed while a store session was opening."""
