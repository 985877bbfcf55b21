"""Store sessions: quorum writes of one partition to its replicas.

A :class:`StorePartition` owns a partition's replicas for one generation. It
runs store sessions one after another; each takes a new session id by CAS in
coordination, recovers (:mod:`waltz_server.server.recovery`), then writes:
appended records go to an in-memory window, and one writer task per replica
appends batches from it, in order, to its storage node. A record is committed
when a quorum of replicas has acknowledged it. A replica that falls behind the
window catches up from a healthy replica's storage. A replica that fails
ends the session (by design it cannot rejoin; the next session's recovery
brings it back); a fenced session (a newer one exists) ends too.

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
from dataclasses import dataclass
from typing import TypeVar

from waltz_api.cluster import ClusterMetadata, ReplicaAssignments
from waltz_api.contracts.coordination import Coordination, Watch
from waltz_api.errors import (
    ClusterNotFoundError,
    CoordinationError,
    SessionFencedError,
    StaleGenerationError,
    StorageError,
    StoreSessionClosedError,
    TransportError,
    WaltzError,
)
from waltz_api.types import NO_TRANSACTION, Record, ReqId
from waltz_server.server.recovery import RecoveryManager
from waltz_server.server.replica import ReplicaConnection, ReplicaConnector
from waltz_server.server.store_metadata import VersionedMetadata, begin_store_session
from waltz_server.server.voting import quorum_of

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass(frozen=True)
class StoreConfig:
    """Tuning of the store layer (``[server.store]``)."""

    max_batch_records: int = 512
    max_batch_bytes: int = 4 * 1024 * 1024
    max_pending_records: int = 8192
    """Appends not yet committed before ``append`` waits (back pressure)."""
    max_window_bytes: int = 32 * 1024 * 1024
    """Bytes of recent records kept in memory for lagging replicas; older ones are read
    back from a healthy replica's storage."""
    catch_up_batch: int = 256
    checkpoint_interval: int = 250_000
    """A new session (so a short recovery) once this many transactions were written."""
    idle_probe_interval: float = 2.0
    """An idle replica is asked its max transaction id this often: a storage node that
    died (or a session that was fenced) while nothing was written ends the session."""
    retry_initial: float = 0.05
    retry_max: float = 2.0
    drain_timeout: float = 10.0


CommitListener = Callable[[int, Sequence[Record]], None]
"""``listener(high_water_mark, records)``: ``records`` are the newly committed ones, in order."""
RecoveryListener = Callable[[int], None]


class StoreSession:
    """One store session: recovery, then quorum writes until it ends."""

    def __init__(
        self,
        *,
        coordination: Coordination,
        metadata: VersionedMetadata,
        replica_nodes: Sequence[str],
        connector: ReplicaConnector,
        config: StoreConfig,
        rng: random.Random,
        on_commit: CommitListener | None = None,
    ) -> None:
        self.partition_id = metadata.value.partition_id
        self.session_id = metadata.value.session_id
        self._replica_nodes = list(replica_nodes)
        self._connector = connector
        self._config = config
        self._rng = rng
        self._on_commit = on_commit
        self.quorum = quorum_of(len(self._replica_nodes))
        self.recovery = RecoveryManager(
            coordination=coordination,
            metadata=metadata,
            replica_nodes=self._replica_nodes,
            catch_up_batch=config.catch_up_batch,
            catch_up_bytes=config.max_batch_bytes,
        )
        self._connections: dict[str, ReplicaConnection] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._acked: dict[str, int] = {}
        self._window: collections.deque[Record] = collections.deque()
        self._window_start = 0
        self._window_bytes = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()
        self.low_water_mark = NO_TRANSACTION
        self.high_water_mark = NO_TRANSACTION
        self._ready = False
        self._accepting = False
        self._error: BaseException | None = None
        self._done = asyncio.Event()
        self._appended = asyncio.Event()
        self._progress = asyncio.Event()
        self.checkpoint_reached = False

    # -- life cycle ------------------------------------------------------------------

    @property
    def next_transaction_id(self) -> int:
        return self._window_start + len(self._window)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def writable_replicas(self) -> list[str]:
        return sorted(self._acked)

    def acknowledged_marks(self) -> dict[str, int]:
        """The highest transaction id each writing replica acknowledged."""
        return dict(self._acked)

    async def open(self) -> int:
        """Start the replica sessions and wait for recovery; returns the high-water mark."""
        for node in self._replica_nodes:
            self._tasks.append(
                asyncio.create_task(
                    self._run_replica(node), name=f"replica-{self.partition_id}-{node}"
                )
            )
        waiter = asyncio.ensure_future(self.recovery.wait_complete())
        done_waiter = asyncio.ensure_future(self._done.wait())
        try:
            await asyncio.wait({waiter, done_waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done_waiter.cancel()
        if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError, WaltzError):
                await waiter
            raise self._closed_error("recovery did not complete")
        resolved = waiter.result()
        self.low_water_mark = resolved
        self.high_water_mark = resolved
        self._window_start = resolved + 1
        self._ready = True
        self._accepting = True
        self._wake()
        log.info(
            "partition %d: store session %d open at high-water mark %d",
            self.partition_id,
            self.session_id,
            resolved,
        )
        return resolved

    async def wait_done(self) -> None:
        await self._done.wait()

    def fail(self, cause: BaseException) -> None:
        """End the session: pending appends fail (outcome unknown), tasks stop."""
        if self._done.is_set():
            return
        self._error = cause
        self._accepting = False
        log.warning(
            "partition %d: store session %d ends: %s: %s",
            self.partition_id,
            self.session_id,
            type(cause).__name__,
            cause,
        )
        self.recovery.abort(cause)
        error = self._closed_error(str(cause))
        while self._waiters:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(error)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._done.set()
        self._wake()

    async def close(self) -> None:
        self.fail(StoreSessionClosedError(f"store session {self.session_id} closed"))
        current = asyncio.current_task()
        others = [t for t in self._tasks if t is not current]
        if others:
            await asyncio.gather(*others, return_exceptions=True)
        for connection in list(self._connections.values()):
            with contextlib.suppress(Exception):
                await connection.close()
        self._connections.clear()

    async def drain(self, timeout: float) -> None:
        """Stop taking appends and wait (bounded) until every pending one committed."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (
            not self._done.is_set()
            and self.high_water_mark < self.next_transaction_id - 1
            and loop.time() < deadline
        ):
            await self._wait_progress(deadline - loop.time())

    def _closed_error(self, why: str) -> StoreSessionClosedError:
        error = StoreSessionClosedError(
            f"store session {self.session_id} of partition {self.partition_id} ended: {why}"
        )
        error.__cause__ = self._error
        return error

    def _wake(self) -> None:
        self._appended.set()
        self._appended = asyncio.Event()
        self._progress.set()
        self._progress = asyncio.Event()

    async def _wait_progress(self, timeout: float | None = None) -> None:
        event = self._progress
        if timeout is None:
            await event.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(timeout, 0.0))

    # -- appends ------------------------------------------------------------------------

    def has_room(self) -> bool:
        pending = self.next_transaction_id - 1 - self.high_water_mark
        return pending < self._config.max_pending_records and (
            self._window_bytes < self._config.max_window_bytes or pending == 0
        )

    async def wait_for_room(self) -> None:
        while not self.has_room():
            if not self._accepting:
                raise self._closed_error("not accepting appends")
            await self._wait_progress()
        if not self._accepting:
            raise self._closed_error("not accepting appends")

    def append(
        self, req_id: ReqId, header: int, data: bytes, checksum: int
    ) -> tuple[int, asyncio.Future[int]]:
        """Assign the next transaction id and queue the record; the future resolves to
        the id when a quorum acknowledged it. Call :meth:`wait_for_room` first."""
        if not self._accepting:
            raise self._closed_error("not accepting appends")
        transaction_id = self.next_transaction_id
        record = Record(transaction_id, req_id, header, data, checksum)
        self._window.append(record)
        self._window_bytes += len(data)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((transaction_id, future))
        self._appended.set()
        self._appended = asyncio.Event()
        return transaction_id, future

    # -- reads --------------------------------------------------------------------------

    async def read_committed(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        """Committed records from ``start`` (at most up to the high-water mark)."""
        end = self.high_water_mark
        if start > end or max_records <= 0:
            return []
        count = min(max_records, end - start + 1)
        if start >= self._window_start:
            records: list[Record] = []
            size = 0
            for offset in range(start - self._window_start, start - self._window_start + count):
                record = self._window[offset]
                if records and size + len(record.data) > max_bytes:
                    break
                records.append(record)
                size += len(record.data)
            return records
        source = await self._read_source(start)
        records = await self._connections[source].read_records(start, count, max_bytes)
        return [r for r in records if r.transaction_id <= end]

    async def read_committed_block(
        self, start: int, max_records: int, max_bytes: int
    ) -> Sequence[Record]:
        """:meth:`read_committed` for a range read: records read from a replica come as
        its storage node sent them (a RecordBlock, nothing decoded) when the connection
        can (``read_block``); the block never goes past the high-water mark."""
        end = self.high_water_mark
        if start > end or max_records <= 0:
            return []
        count = min(max_records, end - start + 1)
        if start >= self._window_start:
            return await self.read_committed(start, count, max_bytes)
        connection = self._connections[await self._read_source(start)]
        read_block = getattr(connection, "read_block", None)
        if read_block is None:
            return await self.read_committed(start, count, max_bytes)
        block: Sequence[Record] = await read_block(start, count, max_bytes)
        if len(block) > count:
            cut = getattr(block, "cut", None)
            block = cut(count) if cut is not None else block[:count]
        return block

    async def _read_source(self, start: int) -> str:
        """A writing replica holding ``start``; right after recovery the replicas are
        still joining the writers, so wait for one (up to the drain timeout)."""
        source = self._healthy_replica(start)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.drain_timeout
        while source is None:
            if self._done.is_set() or loop.time() > deadline:
                raise self._closed_error(f"no replica holds transaction {start}")
            await self._wait_progress(0.1)
            source = self._healthy_replica(start)
        return source

    def _healthy_replica(self, transaction_id: int, exclude: str | None = None) -> str | None:
        candidates = [
            node
            for node, acked in self._acked.items()
            if node != exclude and acked >= transaction_id and node in self._connections
        ]
        return self._rng.choice(sorted(candidates)) if candidates else None

    # -- replica sessions ------------------------------------------------------------

    async def _connect(self, node: str) -> ReplicaConnection:
        delay = self._config.retry_initial
        while True:
            try:
                return await self._connector(node, self.partition_id, self.session_id)
            except (TransportError, StorageError, OSError) as exc:
                if isinstance(exc, SessionFencedError):
                    raise
                log.debug("partition %d: replica %s unreachable: %s", self.partition_id, node, exc)
            jitter = self._rng.uniform(0.5, 1.0)
            await asyncio.sleep(delay * jitter)
            delay = min(delay * 2, self._config.retry_max)

    async def _run_replica(self, node: str) -> None:
        try:
            joined = await self._join(node)
            if joined is None:
                return
            connection, resolved = joined
            # join the writers; anything appended since recovery is caught up below
            self._acked[node] = resolved
            self._advance_commit()
            self._wake()
            await self._write_loop(node, connection, resolved + 1)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(exc)

    async def _join(self, node: str) -> tuple[ReplicaConnection, int] | None:
        """Connect to ``node`` and recover its replica; ``None`` if the session ended.

        A replica that refuses to join (its partition unavailable or not hosted, a
        storage error, a broken connection) is left out of this session and tried
        again with back-off: the others commit as long as they are a quorum, and
        ending the session would only meet the same replica in the next one. A
        fenced replica (a newer session exists) ends the session. Once a replica
        has joined the writers, losing it ends the session (a new one is forced
        whenever a storage node leaves)."""
        delay = self._config.retry_initial
        while not self._done.is_set():
            connection = await self._connect(node)
            if self._done.is_set():
                await connection.close()
                return None
            self._connections[node] = connection
            try:
                return connection, await self.recovery.recover(node, connection)
            except (StorageError, TransportError, OSError) as exc:
                if isinstance(exc, SessionFencedError) or self._done.is_set():
                    raise
                log.warning(
                    "partition %d session %d: replica %s left out, retrying: %s: %s",
                    self.partition_id,
                    self.session_id,
                    node,
                    type(exc).__name__,
                    exc,
                )
            self.recovery.forget(node, connection)
            if self._connections.get(node) is connection:
                del self._connections[node]
            with contextlib.suppress(WaltzError, OSError):
                await connection.close()
            await asyncio.sleep(delay * self._rng.uniform(0.5, 1.0))
            delay = min(delay * 2, self._config.retry_max)
        return None

    async def _write_loop(self, node: str, connection: ReplicaConnection, next_id: int) -> None:
        config = self._config
        while not self._done.is_set():
            if next_id >= self.next_transaction_id:
                event = self._appended
                try:
                    await asyncio.wait_for(event.wait(), config.idle_probe_interval)
                except TimeoutError:
                    await self._probe(node, connection, next_id - 1)
                continue
            if next_id < self._window_start:
                source = self._healthy_replica(next_id, exclude=node)
                if source is None:
                    await self._wait_progress()
                    continue
                limit = min(config.catch_up_batch, self._window_start - next_id)
                records = await self._connections[source].read_records(
                    next_id, limit, config.max_batch_bytes
                )
                if not records or records[0].transaction_id != next_id:
                    raise StorageError(
                        f"catch-up of replica {node} from {source}: asked for records from "
                        f"{next_id}, got {records[0].transaction_id if records else 'none'}"
                    )
            else:
                offset = next_id - self._window_start
                records = []
                size = 0
                for index in range(offset, len(self._window)):
                    record = self._window[index]
                    if records and (
                        len(records) >= config.max_batch_records
                        or size + len(record.data) > config.max_batch_bytes
                    ):
                        break
                    records.append(record)
                    size += len(record.data)
            await connection.append(records)
            next_id += len(records)
            self._acked[node] = next_id - 1
            self._advance_commit()

    async def _probe(self, node: str, connection: ReplicaConnection, expected: int) -> None:
        """Check an idle replica: it must answer, and hold exactly what it acknowledged."""
        found = await connection.max_transaction_id()
        if found != expected:
            raise StorageError(
                f"replica {node} of partition {self.partition_id} holds up to {found}, "
                f"but acknowledged {expected} in store session {self.session_id}: "
                "its storage changed under the session"
            )

    def _advance_commit(self) -> None:
        if len(self._acked) < self.quorum or not self._ready:
            return
        marks = sorted(self._acked.values(), reverse=True)
        committed = min(marks[self.quorum - 1], self.next_transaction_id - 1)
        if committed > self.high_water_mark:
            first = self.high_water_mark + 1 - self._window_start
            newly = [self._window[i] for i in range(first, committed + 1 - self._window_start)]
            self.high_water_mark = committed
            while self._waiters and self._waiters[0][0] <= committed:
                transaction_id, future = self._waiters.popleft()
                if not future.done():
                    future.set_result(transaction_id)
            if committed - self.low_water_mark >= self._config.checkpoint_interval:
                self.checkpoint_reached = True
            if self._on_commit is not None:
                self._on_commit(committed, newly)
        self._trim()
        self._wake()

    def _trim(self) -> None:
        slowest = min(self._acked.values())
        while self._window:
            first = self._window[0]
            if first.transaction_id > self.high_water_mark:
                break
            if (
                first.transaction_id > slowest
                and self._window_bytes <= self._config.max_window_bytes
            ):
                break
            self._window.popleft()
            self._window_start += 1
            self._window_bytes -= len(first.data)


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
    ) -> None:
        if not replica_nodes:
            raise WaltzError(f"partition {partition_id} has no replicas assigned")
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
        """Committed records from ``start`` (from memory or a healthy replica); a replica
        failing during the read ends the session, and the read is retried on the next."""
        return await self._read_retrying(
            lambda session: session.read_committed(start, max_records, max_bytes)
        )

    async def read_committed_block(
        self, start: int, max_records: int, max_bytes: int
    ) -> Sequence[Record]:
        """:meth:`read_committed` for a range read (see StoreSession.read_committed_block)."""
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
            except (TransportError, StorageError) as exc:
                session.fail(exc)

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

    async def _manage(self) -> None:
        delay = self._config.retry_initial
        while not self._closed:
            try:
                await self._follow_replicas()
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
                await asyncio.sleep(delay * self._rng.uniform(0.5, 1.0))
                delay = min(delay * 2, self._config.retry_max)
                continue
            session = StoreSession(
                coordination=self._coordination,
                metadata=metadata,
                replica_nodes=self._replica_nodes,
                connector=self._connector,
                config=self._config,
                rng=self._rng,
                on_commit=self._commit,
            )
            self._session = session
            self.sessions_started += 1
            self._notify()
            try:
                high_water_mark = await session.open()
            except (WaltzError, OSError) as exc:
                log.info(
                    "partition %d: session %d failed to open: %s",
                    self.partition_id,
                    session.session_id,
                    exc,
                )
                await session.close()
                await asyncio.sleep(delay * self._rng.uniform(0.5, 1.0))
                delay = min(delay * 2, self._config.retry_max)
                continue
            delay = self._config.retry_initial
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
