"""A store session: one partition's quorum writes to its replicas, from recovery to end.
(Above 800 lines on purpose: the writers, a replica's rejoin and its repair act on one
session's state - its window, its replicas and the replication core - in the order its
safety argument gives; the pure rules are :mod:`~waltz_server.server.replication`.)

:class:`StoreSession` is the I/O shell of the pure :mod:`waltz_server.server.replication`:
it takes a new session id by CAS in coordination, recovers
(:mod:`waltz_server.server.recovery`), then one writer task per replica appends batches
from the in-memory window, in order and several in flight, to its storage node. A record
is committed when a quorum of replicas has acknowledged it. A replica that fails leaves
the writers and is retried with back-off; the others go on while they are a quorum; when
it returns it rejoins the same session and catches up (from the window, or from a healthy
replica's storage). A session ends only when the connected replicas are no longer a
quorum, when it is fenced, at the checkpoint interval, or for a new replica set
(:mod:`waltz_server.server.store` runs sessions one after another). With an
:class:`ArchiveLink` (docs/archive.md) replicas behind the archive mark are fast-forwarded
to it, and :meth:`StoreSession.prune` deletes what is archived (never past what a writer
acknowledged).

Run to completion (issue 31) moves where this happens, not what: while a replica's
writer is idle, the reply's own callback records its acknowledgement
(``Replication.on_appended``), commits what a quorum now holds and posts its next batch
(``_replied``; ``_send_waiting`` posts a loop iteration's records to the idle writers).
The rules are the same calls in the same order on the one event loop (no await between
an acknowledgement and its commit, as in the writer task), so the safety argument and
its fault points (``replica.*``, ``store.session_*``) are unchanged; a writer that must
wait (catch-up, a suspect's mark, a failed batch, an idle probe) runs its task as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from waltz_api.backoff import Backoff
from waltz_api.capabilities import PREFIX, REPAIR
from waltz_api.contracts.coordination import Coordination
from waltz_api.contracts.storage import LocalLog
from waltz_api.errors import (
    SessionFencedError,
    StorageError,
    StoreSessionClosedError,
    TransportError,
    WaltzError,
)
from waltz_api.faultpoints import point
from waltz_api.types import NO_TRANSACTION, Record, ReqId
from waltz_api.wire import RecordBlock
from waltz_server.server.recovery import RecoveryManager
from waltz_server.server.replica import ReplicaConnection, ReplicaConnector
from waltz_server.server.replication import (
    CatchUp,
    Committed,
    Replication,
    ReplicationLimits,
    Send,
    plan_rejoin,
)
from waltz_server.server.store_config import (
    ArchiveLink,
    CommitListener,
    StoreConfig,
)
from waltz_server.server.store_metadata import VersionedMetadata
from waltz_server.server.voting import quorum_of

log = logging.getLogger(__name__)

R = TypeVar("R")


class StoreSession:
    """One store session: recovery, then quorum writes until it ends.

    The I/O shell around :class:`~waltz_server.server.replication.Replication`: one
    task per replica connects, recovers (or rejoins) the replica, then carries out
    what the replication core decides for it (append batches from the window,
    several in flight; catch up from a healthy replica's storage). A replica that
    fails leaves the writers and is retried with back-off; the session ends when
    the replicas still connected can no longer form a quorum, or when it is fenced.
    """

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
        archive: ArchiveLink | None = None,
    ) -> None:
        self.partition_id = metadata.value.partition_id
        self.session_id = metadata.value.session_id
        self._archive = archive
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
            archive_mark=archive.mark if archive is not None else NO_TRANSACTION,
        )
        self._replication: Replication | None = None
        self._connections: dict[str, ReplicaConnection] = {}
        self._joined: set[str] = set()
        self._suspect_rejoins: set[str] = set()
        """Replicas whose last rejoin found storage that lost what they acknowledged: they
        join as suspects (see Replication.join)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._waiters: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()
        self.low_water_mark = NO_TRANSACTION
        self.high_water_mark = NO_TRANSACTION
        self._accepting = False
        self._error: BaseException | None = None
        self._opened = asyncio.Event()
        self._done = asyncio.Event()
        self._sleepers: list[asyncio.Future[bool]] = []
        """Tasks waiting for the session to change: one future each, resolved (False) by
        the next :meth:`_wake`, or (True) by the waiter's own timeout."""
        self.checkpoint_reached = False
        self._writers: dict[str, _Writer] = {}
        """The replicas' write loops' state, shared with their replies' callbacks."""
        self._sends_scheduled = False

    # -- life cycle ------------------------------------------------------------------

    @property
    def next_transaction_id(self) -> int:
        if self._replication is None:
            return self.high_water_mark + 1
        return self._replication.next_transaction_id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def writable_replicas(self) -> list[str]:
        return [] if self._replication is None else self._replication.writers

    def acknowledged_marks(self) -> dict[str, int]:
        """The highest transaction id each writing replica acknowledged."""
        return {} if self._replication is None else self._replication.acknowledged_marks()

    async def open(self) -> int:
        """Start the replica sessions and wait for recovery; returns the high-water mark."""
        for node in self._replica_nodes:
            self._tasks.append(
                asyncio.create_task(
                    self._run_replica(node), name=f"replica-{self.partition_id}-{node}"
                )
            )
        try:  # (the session's end aborts the recovery: fail())
            resolved = await self.recovery.wait_complete()
        except WaltzError as exc:
            raise self._closed_error("recovery did not complete") from (self._error or exc)
        config = self._config
        self._replication = Replication(
            replicas=self._replica_nodes,
            low_water_mark=resolved,
            limits=ReplicationLimits(
                max_batch_records=config.max_batch_records,
                max_batch_bytes=config.max_batch_bytes,
                max_pending_records=config.max_pending_records,
                max_window_bytes=config.max_window_bytes,
                catch_up_batch=config.catch_up_batch,
                max_inflight_batches=config.max_inflight_batches,
            ),
        )
        self.low_water_mark = resolved
        self.high_water_mark = resolved
        self._accepting = True
        self._opened.set()
        self._wake()
        log.info(
            "partition %d: store session %d open at high-water mark %d",
            self.partition_id,
            self.session_id,
            resolved,
        )
        point(
            "store.session_opened",
            partition=self.partition_id,
            session=self.session_id,
            mark=resolved,
        )
        return resolved

    async def wait_done(self) -> None:
        await self._done.wait()

    def fail(self, cause: BaseException) -> None:
        """End the session: pending appends fail (decided by the next session's
        recovery), tasks stop."""
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
        point("store.session_closing", partition=self.partition_id, session=self.session_id)
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
        """Something changed (records appended, committed, a replica joined or left):
        every task waiting on the session looks again."""
        sleepers = self._sleepers
        if sleepers:
            self._sleepers = []
            for sleeper in sleepers:
                if not sleeper.done():
                    sleeper.set_result(False)

    async def _sleep(
        self, timeout: float | None = None, also: asyncio.Future[Any] | None = None
    ) -> bool:
        """Until the next :meth:`_wake` (or ``also`` is done): False; True when
        ``timeout`` seconds passed first. One plain future per wait, no Event, no task."""
        loop = asyncio.get_running_loop()
        sleeper: asyncio.Future[bool] = loop.create_future()
        self._sleepers.append(sleeper)
        timer = None
        if timeout is not None:
            timer = loop.call_later(max(timeout, 0.0), _time_out, sleeper)
        wake = None
        if also is not None:
            wake = functools.partial(_wake_sleeper, sleeper)
            also.add_done_callback(wake)
        try:
            return await sleeper
        finally:
            if timer is not None:
                timer.cancel()
            if also is not None and wake is not None:
                also.remove_done_callback(wake)
            if sleeper.cancelled() or sleeper.result() or (also is not None and also.done()):
                # perhaps not woken by _wake (which takes the list): no longer waiting
                with contextlib.suppress(ValueError):
                    self._sleepers.remove(sleeper)

    async def _wait_progress(self, timeout: float | None = None) -> None:
        await self._sleep(timeout)

    # -- appends ------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """It takes appends (open, not draining, not ended)."""
        return self._accepting

    def has_room(self) -> bool:
        replication = self._replication
        return replication is not None and replication.has_room()

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
        replication = self._replication
        if not self._accepting or replication is None:
            raise self._closed_error("not accepting appends")
        record = replication.append(req_id, header, data, checksum)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        self._waiters.append((record.transaction_id, future))
        if not self._sends_scheduled:
            # the records appended in this loop iteration go to the waiting writers in
            # one batch each, at its end (see _send_waiting)
            self._sends_scheduled = True
            loop.call_soon(self._send_waiting)
        self._wake()
        return record.transaction_id, future

    # -- reads --------------------------------------------------------------------------

    async def read_committed(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        """Committed records from ``start`` (at most up to the high-water mark)."""
        end = self.high_water_mark
        if start > end or max_records <= 0:
            return []
        count = min(max_records, end - start + 1)
        replication = self._replication
        if replication is not None:
            records = replication.read_window(start, count, max_bytes)
            if records is not None:
                return records
        records = await self._read_from_replicas(
            start, lambda connection: connection.read_records(start, count, max_bytes)
        )
        return [r for r in records if r.transaction_id <= end]

    async def read_committed_block(
        self, start: int, max_records: int, max_bytes: int
    ) -> Sequence[Record]:
        """:meth:`read_committed` for a range read: records read from a replica come as
        its storage node sent them (``read_block``: a RecordBlock, nothing decoded, where
        the replica can); the block never goes past the high-water mark."""
        end = self.high_water_mark
        if start > end or max_records <= 0:
            return []
        count = min(max_records, end - start + 1)
        replication = self._replication
        if replication is not None and start >= replication.window_start:
            return await self.read_committed(start, count, max_bytes)

        async def read(connection: ReplicaConnection) -> Sequence[Record]:
            return await connection.read_block(start, count, max_bytes)

        block = await self._read_from_replicas(start, read)
        if len(block) > count:
            block = block.cut(count) if isinstance(block, RecordBlock) else block[:count]
        return block

    async def _read_from_replicas(
        self, start: int, read: Callable[[ReplicaConnection], Awaitable[R]]
    ) -> R:
        """``read`` from a writer holding ``start``. A replica failing the read is that
        replica's problem (its own task notices and rejoins): another one is tried, each
        at most once while any is left, for up to the drain timeout; a fenced read ends
        the session."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.drain_timeout
        failed: set[str] = set()
        while True:
            source = await self._read_source(start, deadline, failed)
            try:
                return await read(self._connections[source])
            except SessionFencedError as exc:
                self.fail(exc)
                raise self._closed_error(str(exc)) from exc
            except (TransportError, StorageError) as exc:
                log.info(
                    "partition %d: a read of %d from replica %s failed, trying another: %s",
                    self.partition_id,
                    start,
                    source,
                    exc,
                )
                failed.add(source)

    async def _read_source(self, start: int, deadline: float, failed: set[str]) -> str:
        """A connected writer holding ``start``, preferably not one in ``failed`` (all of
        them failed: start over after a pause). Right after recovery the replicas are
        still joining the writers: wait for one, up to ``deadline``."""
        loop = asyncio.get_running_loop()
        while True:
            if self._done.is_set() or loop.time() > deadline:
                raise self._closed_error(f"no replica could serve transaction {start}")
            replication = self._replication
            holding = replication.sources(start) if replication is not None else []
            source = self._source(start, [n for n in holding if n not in failed])
            if source is not None:
                return source
            if failed and not any(n in self._connections for n in holding if n not in failed):
                failed.clear()
            await self._wait_progress(0.1)

    def _source(self, transaction_id: int, among: Sequence[str] | None = None) -> str | None:
        """A connected writer that acknowledged ``transaction_id``, chosen at random."""
        replication = self._replication
        if replication is None:
            return None
        candidates = [
            node
            for node in (among if among is not None else replication.sources(transaction_id))
            if node in self._connections
        ]
        return self._rng.choice(candidates) if candidates else None

    # -- replica sessions ------------------------------------------------------------

    async def _connect(self, node: str) -> ReplicaConnection:
        backoff = Backoff(self._config.retry_initial, self._config.retry_max, self._rng)
        while True:
            try:
                return await self._connector(node, self.partition_id, self.session_id)
            except (TransportError, StorageError, OSError) as exc:
                if isinstance(exc, SessionFencedError):
                    raise
                log.debug("partition %d: replica %s unreachable: %s", self.partition_id, node, exc)
            await backoff.sleep()

    async def _run_replica(self, node: str) -> None:
        """Connect, recover or rejoin, write; after a failure, leave and do it again.

        A replica that refuses to join (its partition unavailable or not hosted, a
        storage error, a broken connection) or that fails while writing is left out
        and tried again with back-off: the others commit as long as they are a
        quorum. A fenced replica (a newer session exists) ends the session, and so
        does losing the quorum of connected replicas once the session is open."""
        backoff = Backoff(self._config.retry_initial, self._config.retry_max, self._rng)
        try:
            while not self._done.is_set():
                connection = await self._connect(node)
                if self._done.is_set():
                    await connection.close()
                    return
                self._connections[node] = connection
                try:
                    mark = await self._prepare(node, connection)
                    if mark is None:
                        return
                    self._join(node, mark)
                    backoff.reset()
                    await self._write_loop(node, connection)
                except (StorageError, TransportError, OSError) as exc:
                    if isinstance(exc, SessionFencedError) or self._done.is_set():
                        raise
                    self._leave(node, connection, exc)
                    with contextlib.suppress(WaltzError, OSError):
                        await connection.close()
                await backoff.sleep()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(exc)

    async def _prepare(self, node: str, connection: ReplicaConnection) -> int | None:
        """Bring the replica to a mark it may join the writers at: recovery the first
        time (it may still be deciding the opening mark), a rejoin after that."""
        if node in self._joined:
            return await self._rejoin(node, connection)
        resolved = await self.recovery.recover(node, connection)
        done = asyncio.ensure_future(self._done.wait())
        opened = asyncio.ensure_future(self._opened.wait())
        try:
            await asyncio.wait({done, opened}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            opened.cancel()
        return None if self._done.is_set() else resolved

    async def _rejoin(self, node: str, connection: ReplicaConnection) -> int:
        replication = self._replication
        assert replication is not None
        progress = replication.progress(node)
        acked = progress.acked if progress is not None else self.low_water_mark
        archive_mark = self._archive.mark if self._archive is not None else NO_TRANSACTION
        capabilities = connection.capabilities
        if archive_mark >= 0 and PREFIX in capabilities:
            missing = await connection.missing_range() if REPAIR in capabilities else None
            if missing is not None and missing[0] <= archive_mark:
                # a hole in archived records: dropped, not repaired
                await self._drop_archived(node, connection.prune, archive_mark)
        await self._repair(node, connection, acked)
        info = await connection.last_session_info()
        max_id = await connection.max_transaction_id()
        plan = plan_rejoin(
            session_id=self.session_id,
            low_water_mark=self.low_water_mark,
            acked=acked,
            storage=info,
            max_transaction_id=max_id,
        )
        if plan.truncate_to is not None:
            await connection.truncate(plan.truncate_to)
        if plan.suspect:
            log.warning(
                "partition %d session %d: replica %s came back with storage that lost what "
                "it acknowledged (session info %s, log end %d, acknowledged %d): keeping up "
                "to %d; suspect (not a voter) until it holds the committed prefix (%d)",
                self.partition_id,
                self.session_id,
                node,
                info,
                max_id,
                acked,
                plan.mark,
                self.high_water_mark,
            )
            # durably suspect before it writes: a recovery must not count it as a voter
            await connection.mark_replica(self.low_water_mark, clean=False)
            point("replica.marked_suspect", partition=self.partition_id, replica=node)
        mark = plan.mark
        behind = archive_mark >= 0 and PREFIX in capabilities and mark < archive_mark
        # behind the archive: its log continues after the mark (everything at or below it
        # is committed and archived)
        if behind and await self._drop_archived(node, connection.prune, archive_mark):
            mark = await connection.max_transaction_id()
        log.info(
            "partition %d session %d: replica %s rejoins at %d",
            self.partition_id,
            self.session_id,
            node,
            mark,
        )
        if plan.suspect:
            self._suspect_rejoins.add(node)
        # a writer again (it joins next): a source again for a replica recovering late
        self.recovery.rejoined(node, connection, mark)
        point("replica.rejoined", partition=self.partition_id, replica=node, mark=mark)
        return mark

    async def _repair(self, node: str, connection: ReplicaConnection, upto: int) -> None:
        """A replica coming back with a hole in its log (damage its storage found when it
        restarted, the damaged bytes moved aside): the missing records at or below
        ``upto``, which it acknowledged in this session, are copied from writers that
        acknowledged them before it rejoins (their records there are the same: committed,
        or this session's)."""
        if REPAIR not in connection.capabilities:
            return  # a connection that cannot report damage has none to report
        while (missing := await connection.missing_range()) is not None and missing[0] <= upto:
            first, last = missing[0], min(missing[1], upto)
            log.warning(
                "partition %d session %d: repairing replica %s: transactions %d..%d, lost to "
                "damage, copied from the writers",
                self.partition_id,
                self.session_id,
                node,
                first,
                last,
            )
            next_id = first
            while next_id <= last:
                count = min(self._config.catch_up_batch, last - next_id + 1)
                start = next_id
                try:
                    records = await self._read_from_replicas(
                        start,
                        functools.partial(
                            _read_records,
                            start=start,
                            count=count,
                            max_bytes=self._config.max_batch_bytes,
                        ),
                    )
                except StoreSessionClosedError as exc:
                    if self._done.is_set():
                        raise
                    raise StorageError(f"no writer could serve {start} to repair {node}") from exc
                records = [r for r in records if r.transaction_id <= last]
                if not records or records[0].transaction_id != start:
                    raise StorageError(
                        f"repair of replica {node}: asked for records from {start}, got "
                        f"{records[0].transaction_id if records else 'none'}"
                    )
                await connection.repair(records)
                point("replica.repaired", partition=self.partition_id, replica=node)
                next_id += len(records)

    async def _drop_archived(
        self, node: str, prune: Callable[[int], Awaitable[object]], upto: int
    ) -> bool:
        """``node`` deletes its archived records up to ``upto``; False when it cannot (no
        ``prefix`` capability): it is repaired and caught up from its peers instead."""
        try:
            await prune(upto)
        except StorageError as exc:
            if isinstance(exc, SessionFencedError):
                raise
            log.info(
                "partition %d: replica %s keeps archived records: %s", self.partition_id, node, exc
            )
            return False
        return True

    def _join(self, node: str, mark: int) -> None:
        replication = self._replication
        assert replication is not None
        self._joined.add(node)
        suspect = node in self._suspect_rejoins
        self._suspect_rejoins.discard(node)
        self._committed(replication.join(node, mark, suspect=suspect))
        self._wake()

    def _leave(self, node: str, connection: ReplicaConnection, cause: BaseException) -> None:
        """The replica failed: out of the writers (or of the recovery), connection
        dropped; the session ends when the connected replicas are no longer a quorum."""
        log.warning(
            "partition %d session %d: replica %s left, retrying: %s: %s",
            self.partition_id,
            self.session_id,
            node,
            type(cause).__name__,
            cause,
        )
        self.recovery.forget(node, connection)
        if self._replication is not None:
            self._replication.leave(node)
        if self._connections.get(node) is connection:
            del self._connections[node]
        if self._opened.is_set() and len(self._connections) < self.quorum:
            self.fail(
                StorageError(
                    f"replica {node} left and only {len(self._connections)} of "
                    f"{len(self._replica_nodes)} replicas are connected: the quorum "
                    f"({self.quorum}) is lost"
                )
            )
        self._wake()

    async def _write_loop(self, node: str, connection: ReplicaConnection) -> None:
        """Send the replica what the replication core plans, several batches in flight;
        their acknowledgements come back in order (one ordered connection).

        While it has nothing else to do (no catch-up, no mark to write, within the
        window) the loop *waits* and the hot path runs to completion in callbacks: a
        reply's callback counts the quorum (:meth:`_replied`) and posts the next batch,
        and records appended are posted at the end of their loop iteration
        (:meth:`_send_waiting`); the loop is woken only for what needs it."""
        replication = self._replication
        assert replication is not None
        writer = _Writer(node, connection.start_append, functools.partial(self._replied, node))
        inflight = writer.inflight
        # each append is posted at once and its future kept (no task per batch)
        self._writers[node] = writer
        progress = replication.progress(node)
        suspect = progress is not None and progress.clean_at is not None
        try:
            if suspect and (log_end := replication.clean_due(node)) is not None:
                await self._mark_clean(node, connection, log_end)
                suspect = False
            while not self._done.is_set():
                while inflight and inflight[0][1].done():
                    last, sent = inflight.popleft()
                    sent.result()
                    self._committed(replication.on_appended(node, last))
                    if suspect and (log_end := replication.clean_due(node)) is not None:
                        await self._mark_clean(node, connection, log_end)
                        suspect = False
                action = replication.next_send(node)
                if isinstance(action, CatchUp):
                    records = await self._read_catch_up(node, action)
                    action = replication.caught_up_read(node, records) if records else None
                    if action is None:
                        continue
                if isinstance(action, Send):
                    writer.post(action)
                    continue
                await self._wait_for_work(node, connection, writer)
        finally:
            if self._writers.get(node) is writer:
                del self._writers[node]
            for _, sent in inflight:
                sent.cancel()
                with contextlib.suppress(BaseException):
                    await sent

    async def _mark_clean(self, node: str, connection: ReplicaConnection, log_end: int) -> None:
        """A suspect replica holds the committed prefix again (up to ``log_end``): its
        storage records it clean in this session, so a recovery counts it as a voter."""
        await connection.mark_replica(self.low_water_mark, clean=True, log_end=log_end)
        replication = self._replication
        if replication is not None:
            replication.marked_clean(node)
        point("replica.marked_clean", partition=self.partition_id, replica=node)
        log.info(
            "partition %d session %d: replica %s holds the committed prefix again (up to "
            "%d): clean",
            self.partition_id,
            self.session_id,
            node,
            log_end,
        )

    async def _wait_for_work(
        self, node: str, connection: ReplicaConnection, writer: _Writer
    ) -> None:
        """Nothing to send now: wait for the oldest batch's acknowledgement, or for new
        records (or progress of the others); an idle replica is probed. A writer within
        the window and not suspect waits for its callbacks to need it (:meth:`_replied`,
        :meth:`_send_waiting`) instead."""
        inflight = writer.inflight
        replication = self._replication
        assert replication is not None
        progress = replication.progress(node)
        if (
            progress is not None
            and progress.writing
            and progress.clean_at is None
            and progress.sent + 1 >= replication.window_start
        ):
            posts = writer.posts
            timed_out = await writer.wait(self._config.idle_probe_interval)
            if writer.error is not None:
                raise writer.error
            idle = timed_out and writer.posts == posts and not inflight  # a quiet interval
            if idle and progress.sent + 1 >= self.next_transaction_id:
                await self._probe(node, connection, progress.acked)
            return
        if inflight:
            if not inflight[0][1].done():
                await self._sleep(also=inflight[0][1])
            return
        if await self._sleep(self._config.idle_probe_interval):
            progress = replication.progress(node)
            if progress is not None and progress.sent + 1 >= self.next_transaction_id:
                await self._probe(node, connection, progress.acked)

    def _replied(self, node: str, _: asyncio.Future[None]) -> None:
        """A batch's reply came (a callback of its future): while the writer's loop
        waits, its acknowledgements are counted here, in order, the commit announced,
        and its next batch posted; a failed batch wakes the loop (it raises)."""
        writer = self._writers.get(node)
        replication = self._replication
        if writer is None or not writer.waiting or replication is None or self._done.is_set():
            return  # the loop runs, or will: it takes the replies itself
        inflight = writer.inflight
        try:
            while inflight and inflight[0][1].done():
                last, sent = inflight[0]
                if sent.cancelled() or sent.exception() is not None:
                    writer.wake()
                    return
                inflight.popleft()
                self._committed(replication.on_appended(node, last))
            self._send(writer, replication)
        except Exception as exc:
            writer.fail(exc)

    def _send_waiting(self) -> None:
        """Post the records appended in this loop iteration to every writer whose loop
        waits (one batch each where they fit: the batches to one storage node, of every
        partition, leave in one transport message)."""
        self._sends_scheduled = False
        replication = self._replication
        if replication is None or self._done.is_set():
            return
        for writer in list(self._writers.values()):
            if writer.waiting:
                try:
                    self._send(writer, replication)
                except Exception as exc:
                    writer.fail(exc)

    @staticmethod
    def _send(writer: _Writer, replication: Replication) -> None:
        """Post what the replication core plans for a waiting writer; anything but a
        batch from the window (a catch-up, behind the window) wakes its loop."""
        node = writer.node
        while True:
            action = replication.next_send(node)
            if isinstance(action, Send):
                writer.post(action)
                continue
            progress = replication.progress(node)
            if (
                action is not None
                or progress is None
                or progress.sent + 1 < replication.window_start
            ):
                writer.wake()
            return

    async def _read_catch_up(self, node: str, action: CatchUp) -> list[Record] | None:
        """Records for a lagging replica from one of the writers holding them. A source
        failing is that source's problem (its own task sees it): wait and plan again."""
        source = self._source(action.start, action.sources)
        if source is None:
            await self._wait_progress(0.1)
            return None
        try:
            records = await self._connections[source].read_records(
                action.start, action.count, self._config.max_batch_bytes
            )
        except (TransportError, StorageError) as exc:
            if isinstance(exc, SessionFencedError):
                raise
            log.info(
                "partition %d: catch-up of %s from %s failed: %s",
                self.partition_id,
                node,
                source,
                exc,
            )
            if self._archive is not None and action.start <= self._archive.mark:
                # the sources deleted what it needs (archived): it rejoins at the mark
                raise StorageError(
                    f"replica {node} of partition {self.partition_id} is behind the archive "
                    f"mark {self._archive.mark}: it rejoins there"
                ) from exc
            await self._wait_progress(0.1)
            return None
        if not records or records[0].transaction_id != action.start:
            log.warning(
                "partition %d: catch-up of %s: %s answered records from %s, asked from %d",
                self.partition_id,
                node,
                source,
                records[0].transaction_id if records else "none",
                action.start,
            )
            await self._wait_progress(0.1)
            return None
        return records

    async def prune(self, through: int) -> None:
        """Ask every writer to delete its records up to ``through`` (archived), but never
        past the lowest id a writer acknowledged (a writer catching up reads from the
        others)."""
        replication = self._replication
        if replication is None or self._done.is_set():
            return
        acked = replication.acknowledged_marks()
        if not acked:
            return
        bound = min(through, *acked.values())
        for node in sorted(acked):
            connection = self._connections.get(node)
            if connection is None or PREFIX not in connection.capabilities:
                continue
            try:
                await connection.prune(bound)
            except (TransportError, StorageError) as exc:  # its own task sees a real failure
                log.info(
                    "partition %d: replica %s did not delete its archived records up to %d: %s",
                    self.partition_id,
                    node,
                    bound,
                    exc,
                )

    async def local_log(self) -> LocalLog | None:
        """One writer's local log (start, end, segments), or None."""
        for node in sorted(self.writable_replicas):
            connection = self._connections.get(node)
            if connection is None or PREFIX not in connection.capabilities:
                continue
            try:
                return await connection.local_log()
            except (TransportError, StorageError) as exc:
                log.debug("partition %d: no local log from %s: %s", self.partition_id, node, exc)
        return None

    async def _probe(self, node: str, connection: ReplicaConnection, expected: int) -> None:
        """Check an idle replica: it must answer, and hold exactly what it acknowledged."""
        found = await connection.max_transaction_id()
        if found != expected:
            raise StorageError(
                f"replica {node} of partition {self.partition_id} holds up to {found}, "
                f"but acknowledged {expected} in store session {self.session_id}: "
                "its storage changed under the session"
            )

    def _committed(self, committed: Committed | None) -> None:
        if committed is None:
            return
        high_water_mark = committed.high_water_mark
        self.high_water_mark = high_water_mark
        waiters = self._waiters
        while waiters and waiters[0][0] <= high_water_mark:
            transaction_id, future = waiters.popleft()
            if not future.done():
                future.set_result(transaction_id)
        if high_water_mark - self.low_water_mark >= self._config.checkpoint_interval:
            self.checkpoint_reached = True
        if self._on_commit is not None:
            self._on_commit(high_water_mark, committed.records)
        self._wake()


class _Writer:
    """One replica's write loop's state: its batches in flight (oldest first), and
    whether the loop waits for its callbacks (:meth:`StoreSession._replied`)."""

    __slots__ = ("_replied", "_start_append", "_wanted", "error", "inflight", "node", "posts")

    def __init__(
        self,
        node: str,
        start_append: Callable[[Sequence[Record]], asyncio.Future[None]],
        replied: Callable[[asyncio.Future[None]], None],
    ) -> None:
        self.node = node
        self.inflight: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self.error: BaseException | None = None
        """What failed in a callback, raised by the loop."""
        self.posts = 0
        """Batches posted so far (an idle replica posted none during a wait)."""
        self._start_append = start_append
        self._replied = replied
        self._wanted: asyncio.Future[bool] | None = None

    @property
    def waiting(self) -> bool:
        """The loop waits (the callbacks carry the hot path)."""
        wanted = self._wanted
        return wanted is not None and not wanted.done()

    def post(self, send: Send) -> None:
        future = self._start_append(send.records)
        self.inflight.append((send.last_transaction_id, future))
        future.add_done_callback(self._replied)
        self.posts += 1

    async def wait(self, timeout: float) -> bool:
        """Until :meth:`wake` (False) or ``timeout`` seconds (True)."""
        loop = asyncio.get_running_loop()
        wanted: asyncio.Future[bool] = loop.create_future()
        self._wanted = wanted
        timer = loop.call_later(timeout, _time_out, wanted)
        try:
            return await wanted
        finally:
            timer.cancel()
            self._wanted = None

    def wake(self) -> None:
        wanted = self._wanted
        if wanted is not None and not wanted.done():
            wanted.set_result(False)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake()


def _time_out(sleeper: asyncio.Future[bool]) -> None:
    if not sleeper.done():
        sleeper.set_result(True)


def _wake_sleeper(sleeper: asyncio.Future[bool], _: asyncio.Future[Any]) -> None:
    if not sleeper.done():
        sleeper.set_result(False)


async def _read_records(
    connection: ReplicaConnection, *, start: int, count: int, max_bytes: int
) -> list[Record]:
    return await connection.read_records(start, count, max_bytes)
