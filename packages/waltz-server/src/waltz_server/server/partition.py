"""A partition served by this server (../shared/spec/waltz-server.txt, "Partition Object").

One :class:`Partition` per assigned partition and generation. Its append
task takes appends, flushes and mounts from one bounded queue, in arrival
order: the generation check, the stale-connection check, the lock check with
the configured LockTable, and the dense transaction id come from here. The
replicated write is the :class:`~waltz_server.server.store.StorePartition`'s.
Committed records fill a feed cache and a transaction data cache, both
bounded in bytes; each client stream's feed is its own task that reads from
the cache, or from storage when it is behind.

Replies go to a :class:`ClientStream`. Feeds ``await send_feed`` (a slow client
slows only its own feed); the append task never waits for a client, it
``post``s (a stream whose bounded outbox is full is closed as too slow).
A committed transaction's FeedData frame is encoded once, into the feed cache,
and every feed sends that frame, as many at once as it has (``feed_batch``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from waltz_api.contracts.locktable import LockTable
from waltz_api.errors import (
    StaleGenerationError,
    StorageError,
    StoreSessionClosedError,
    WaltzError,
)
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedRequest,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    Message,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.types import NO_TRANSACTION, Record, RecordHeader, ReqId
from waltz_api.wire import RecordBlock, encode_feed_data
from waltz_server.observability import ServerMetrics
from waltz_server.server.caches import DataCache, FeedCache
from waltz_server.server.store import StorePartition
from waltz_server.server.store_session import StoreSession

log = logging.getLogger(__name__)


class ClientStream(Protocol):
    """One client connection, as a partition sees it."""

    @property
    def closed(self) -> bool: ...

    async def send(self, message: Message) -> None:
        """Send, waiting while the client is slow (back pressure)."""

    def post(self, message: Message) -> None:
        """Queue without waiting; a stream whose bounded outbox is full is closed."""

    async def send_feed(
        self, frames: Sequence[bytes], partition_id: int, last_transaction_id: int
    ) -> None:
        """Send encoded FeedData frames (of ``partition_id``, the last one announcing
        ``last_transaction_id``), waiting while the client is slow."""

    def post_feed(self, frames: Sequence[bytes], partition_id: int, last: int) -> bool:
        """:meth:`send_feed` without waiting (False: no room now, nothing was sent)."""


@dataclass(frozen=True)
class PartitionConfig:
    """Tuning of a partition (``[server.partition]``)."""

    lock_table: str = "hwm-array"
    lock_table_options: Mapping[str, Any] = field(default_factory=dict)
    append_queue_size: int = 2000
    feed_cache_bytes: int = 8 * 1024 * 1024
    data_cache_bytes: int = 64 * 1024 * 1024
    feed_batch: int = 512
    max_range_records: int = 10_000
    max_range_bytes: int = 16 * 1024 * 1024
    read_concurrency: int = 16
    mount_timeout: float = 60.0
    """How long a mount or a flush waits for the partition's pending appends to settle."""


def make_lock_table(name: str, high_water_mark: int, options: Mapping[str, Any]) -> LockTable:
    """The LockTable plugin ``name`` (``hwm-array``, ``exact``, ``memory``...)."""
    table = get_registry().get("lock_table", name).factory(high_water_mark, dict(options))
    if not isinstance(table, LockTable):
        raise WaltzError(f"lock table plugin {name!r} made a {type(table).__name__}")
    return table


@dataclass(frozen=True, slots=True)
class _Pending:
    """An append taken by the partition, until it is decided."""

    stream: ClientStream
    req_id: ReqId
    transaction_id: int
    session_id: int
    decided: asyncio.Future[None]


class _Feed:
    """A client stream's feed: the next transaction id it is due, and, while its task
    waits for the next commit, the future that wakes it."""

    __slots__ = ("live", "next_id", "stream", "waiter")

    def __init__(self, stream: ClientStream, next_id: int, live: bool) -> None:
        self.stream = stream
        self.next_id = next_id
        self.live = live
        """No mount response is owed: a commit may be sent to it in the commit's call."""
        self.waiter: asyncio.Future[None] | None = None


@dataclass
class PartitionStats:
    appends: int = 0
    lock_failures: int = 0
    stale_generation: int = 0
    stale_connection: int = 0
    recoveries: int = 0
    not_committed: int = 0


class Partition:
    """The append path, feeds and reads of one partition at one generation."""

    def __init__(
        self,
        *,
        store: StorePartition,
        config: PartitionConfig | None = None,
        lock_table: LockTable | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.config = config or PartitionConfig()
        self.metrics = metrics
        self.store = store
        self.partition_id = store.partition_id
        if metrics is not None:
            metrics.serve_partition(self.partition_id)  # its counters at zero from now
        self.generation = store.generation
        self.lock_table = lock_table or make_lock_table(
            self.config.lock_table, NO_TRANSACTION, self.config.lock_table_options
        )
        self.feed_cache = FeedCache(self.config.feed_cache_bytes)
        self.data_cache = DataCache(self.config.data_cache_bytes)
        self.stats = PartitionStats()
        self._queue: asyncio.Queue[tuple[Message, ClientStream]] = asyncio.Queue(
            self.config.append_queue_size
        )
        self._inflight: collections.deque[asyncio.Future[None]] = collections.deque()
        """One future per append in the order they were taken, done once the append is
        decided: committed, or answered NOT_COMMITTED (or the partition moved)."""
        self._received_at: collections.deque[tuple[int, float]] = collections.deque()
        self._lag_updated = 0.0
        self._client_seq: dict[int, int] = {}
        self._stream_seq: weakref.WeakKeyDictionary[ClientStream, dict[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._feeds: weakref.WeakKeyDictionary[ClientStream, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._owed: dict[asyncio.Task[None], tuple[ClientStream, Message]] = {}
        """Tasks serving a client's request, with the request: it is answered if the
        partition stops under them (see :meth:`close`)."""
        self._reads = asyncio.Semaphore(self.config.read_concurrency)
        self._feed_waiters: list[_Feed] = []
        """Feeds waiting for the next commit (or recovery, or close)."""
        self._append_task: asyncio.Task[None] | None = None
        self._taking = False
        """The append task holds a request (waiting for room, perhaps): appends queue."""
        self._closed = False
        store.set_listeners(on_commit=self._on_commit, on_recovered=self._on_recovered)

    # -- life cycle ------------------------------------------------------------------------

    @property
    def high_water_mark(self) -> int:
        return self.store.high_water_mark

    @property
    def ready(self) -> bool:
        return self.store.ready

    async def start(self) -> None:
        await self.store.start()
        self._append_task = asyncio.create_task(
            self._append_loop(), name=f"append-{self.partition_id}"
        )

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._append_task, *self._tasks, *self._feeds.values()) if t]
        owed = dict(self._owed)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The requests it took and stopped serving (moved, or the server stops) are
        # answered "not here" now: a client waits for its answer, and an RPC's wait (a
        # data fetch of a feed being applied) is woken by nothing else than its timeout.
        # Appends excepted: the next owner's recovery may commit one; its mount decides.
        for task, (stream, request) in owed.items():
            if task.cancelled():
                stream.post(self._stopped(request))
        while not self._queue.empty():
            message, stream = self._queue.get_nowait()
            if isinstance(message, FlushRequest | MountRequest):
                stream.post(self._stopped(message))
        self._wake_feeds()
        await self.store.close()
        if self.metrics is not None:
            self.metrics.forget_partition(self.partition_id, tuple(self.store.replica_nodes))

    def detach(self, stream: ClientStream) -> None:
        """Forget a closed client stream (stops its feed)."""
        feed = self._feeds.pop(stream, None)
        if feed is not None:
            feed.cancel()
        self._stream_seq.pop(stream, None)

    def _spawn(
        self, coro: Any, name: str, serving: tuple[Message, ClientStream] | None = None
    ) -> None:
        """Run ``coro``; ``serving``: the request it answers (answered if it is cancelled
        by :meth:`close`)."""
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if serving is not None:
            self._owe(task, serving[1], serving[0])

    def _owe(self, task: asyncio.Task[None], stream: ClientStream, request: Message) -> None:
        self._owed[task] = (stream, request)
        task.add_done_callback(self._paid)

    def _paid(self, task: asyncio.Task[None]) -> None:
        self._owed.pop(task, None)

    def _stopped(self, message: Message) -> Message:
        """The answer to a request this partition took and stops serving."""
        req_id: ReqId = getattr(message, "req_id", ReqId(-1, -1, self.partition_id, -1))
        if isinstance(message, MountRequest):
            return MountResponse(req_id, MountStatus.NOT_READY, self.high_water_mark)
        return self._moved_error(req_id, StoreSessionClosedError("it stopped being served here"))

    # -- commits and recovery -------------------------------------------------------------

    def _on_commit(self, high_water_mark: int, records: Sequence[Record]) -> None:
        self.feed_cache.add(records)
        for record in records:
            self.data_cache.put(record.transaction_id, record.data, record.checksum)
        self._feed_commit(high_water_mark)
        metrics = self.metrics
        if metrics is not None:
            now = asyncio.get_running_loop().time()
            received = self._received_at
            while received and received[0][0] <= high_water_mark:
                _, at = received.popleft()
                metrics.observe_commit_latency(self.partition_id, now - at)
            metrics.committed(self.partition_id, len(records))
            metrics.set_high_water_mark(self.partition_id, high_water_mark)
            if now - self._lag_updated >= 1.0:
                self._lag_updated = now
                self._report_lag(high_water_mark)

    def _report_lag(self, high_water_mark: int) -> None:
        session = self.store.session
        if self.metrics is None or session is None:
            return
        acked = session.acknowledged_marks()
        for replica in self.store.replica_nodes:
            lag = high_water_mark - acked.get(replica, session.low_water_mark)
            self.metrics.set_replica_lag(self.partition_id, replica, max(lag, 0))

    def _on_recovered(self, high_water_mark: int) -> None:
        # in-flight transactions of the old session may or may not have committed:
        # every lock now looks changed at the recovered mark (conservative, never unsafe)
        self.lock_table.reset(high_water_mark)
        self.stats.recoveries += 1
        self._received_at.clear()
        if self.metrics is not None:
            self.metrics.recovered(self.partition_id)
            self.metrics.set_high_water_mark(self.partition_id, high_water_mark)
        self._wake_feeds()

    def _wake_feeds(self) -> None:
        waiters = self._feed_waiters
        if waiters:
            self._feed_waiters = []
            for feed in waiters:
                waiter = feed.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    def _feed_commit(self, high_water_mark: int) -> None:
        """Run to completion: a live feed waiting for this commit is sent its frames here,
        in the commit's call (its task stays asleep; the frames of every partition
        committed in one loop iteration leave to a client in one transport message); one
        the outbox cannot take them now, or that is owed a mount response, is woken."""
        waiters = self._feed_waiters
        if not waiters:
            return
        self._feed_waiters = []
        batch = self.config.feed_batch
        for feed in waiters:
            waiter = feed.waiter
            if waiter is None or waiter.done():
                continue
            if feed.live and not feed.stream.closed and feed.next_id <= high_water_mark:
                frames = self.feed_cache.frames(feed.next_id, batch)
                last = feed.next_id + len(frames) - 1
                if (
                    frames
                    and last == high_water_mark
                    and feed.stream.post_feed(frames, self.partition_id, last)
                ):
                    feed.next_id = last + 1
                    self._feed_waiters.append(feed)  # it waits on, up to date
                    continue
            waiter.set_result(None)

    # -- requests --------------------------------------------------------------------------

    async def submit(self, message: Message, stream: ClientStream) -> None:
        """Take a client request for this partition (waits while the append queue is
        full: the caller stops reading its connection, which is the back pressure)."""
        if type(message) is AppendRequest and self._append_now(message, stream):
            return
        if isinstance(message, AppendRequest | FlushRequest | MountRequest):
            await self._queue.put((message, stream))
        elif isinstance(message, FeedRequest):
            self._start_feed(stream, message.req_id, message.client_high_water_mark, None)
        elif isinstance(message, HighWaterMarkRequest):
            if self.ready:
                stream.post(HighWaterMarkResponse(message.req_id, self.high_water_mark))
            else:
                self._spawn(self._answer_high_water_mark(message, stream), "hwm", (message, stream))
        elif isinstance(message, TransactionDataRequest | RangeReadRequest):
            await self._reads.acquire()
            self._spawn(self._read(message, stream), f"read-{self.partition_id}", (message, stream))
        else:
            stream.post(
                ErrorResponse(
                    getattr(message, "req_id", ReqId(-1, -1, self.partition_id, -1)),
                    ErrorCode.BAD_REQUEST,
                    f"{type(message).__name__} is not a partition request",
                )
            )

    def _is_stale(self, stream: ClientStream, client_id: int) -> bool:
        latest = self._client_seq.get(client_id)
        if latest is None:
            return False
        mounted = self._stream_seq.get(stream, {}).get(client_id, -1)
        return mounted < latest

    def _append_now(self, message: AppendRequest, stream: ClientStream) -> bool:
        """Take an append in the caller's callback (the connection's reader), run to
        completion: when nothing is queued or being taken ahead of it (the order of a
        partition's appends never changes) and the open session has room now (else it
        queues: back pressure as before). False: queue it."""
        if self._taking or not self._queue.empty() or self._closed:
            return False
        session = self.store.session_with_room()
        if session is None:
            return False
        try:
            if self._admit(message, stream):
                self._take(message, stream, session)
        except Exception as exc:
            self._failed(message, stream, exc)
        self._forget_decided()
        return True

    async def _append_loop(self) -> None:
        while True:
            message, stream = await self._queue.get()
            self._taking = True
            try:
                if isinstance(message, AppendRequest):
                    await self._append(message, stream)
                elif isinstance(message, FlushRequest):
                    self._spawn(
                        self._flush(message, stream, list(self._inflight)),
                        f"flush-{self.partition_id}",
                        (message, stream),
                    )
                elif isinstance(message, MountRequest):
                    self._mount(message, stream)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(message, stream, exc)
            finally:
                self._taking = False
            self._forget_decided()

    def _failed(self, message: Message, stream: ClientStream, exc: Exception) -> None:
        if isinstance(exc, StaleGenerationError | StoreSessionClosedError):
            log.info("partition %d: %s", self.partition_id, exc)
            if self.store.stale is not None or self._closed:
                stream.post(self._moved(message, exc))
            return
        # one bad request must not stop the partition's append path
        log.error(
            "partition %d: %s failed", self.partition_id, type(message).__name__, exc_info=exc
        )

    def _forget_decided(self) -> None:
        inflight = self._inflight
        while inflight and inflight[0].done():
            inflight.popleft()

    def _moved(self, message: Message, exc: BaseException) -> ErrorResponse:
        req_id: ReqId = getattr(message, "req_id", ReqId(-1, -1, self.partition_id, -1))
        return self._moved_error(req_id, exc)

    def _moved_error(self, req_id: ReqId, exc: BaseException) -> ErrorResponse:
        return ErrorResponse(
            req_id,
            ErrorCode.STALE_GENERATION,
            f"partition {self.partition_id} is no longer served here at generation "
            f"{self.generation} ({exc}); re-read the partition assignment",
        )

    async def _append(self, message: AppendRequest, stream: ClientStream) -> None:
        if self._admit(message, stream):
            session = await self.store.reserve()
            # no await from here to the id assignment: check and record are atomic
            self._take(message, stream, session)

    def _admit(self, message: AppendRequest, stream: ClientStream) -> bool:
        """The checks before an append waits for room: its generation, its connection."""
        req_id = message.req_id
        if req_id.generation != self.generation:
            # the client's view of the assignment is out of date: this is not ours to write
            self.stats.stale_generation += 1
            if self.metrics is not None:
                self.metrics.append_failed(self.partition_id, "generation")
            stream.post(
                ErrorResponse(
                    req_id,
                    ErrorCode.STALE_GENERATION,
                    f"partition {self.partition_id} is at generation {self.generation}, "
                    f"the request carries {req_id.generation}: refresh the assignment",
                )
            )
            return False
        if self._is_stale(stream, req_id.client_id):
            # a connection the client has replaced (it mounted again since): ignore
            self.stats.stale_connection += 1
            return False
        return True

    def _take(self, message: AppendRequest, stream: ClientStream, session: StoreSession) -> None:
        """Check the locks, assign the id, record the locks: synchronous, so atomic."""
        req_id = message.req_id
        conflict = self.lock_table.check(message.locks, message.client_high_water_mark)
        if conflict is not None:
            self.stats.lock_failures += 1
            if self.metrics is not None:
                self.metrics.lock_failed(self.partition_id)
            stream.post(LockFailure(req_id, conflict))
            return
        transaction_id, future = session.append(
            req_id, message.header, message.data, message.checksum
        )
        self.lock_table.record(message.locks, transaction_id)
        loop = asyncio.get_running_loop()
        if self.metrics is not None:
            self._received_at.append((transaction_id, loop.time()))
        pending = _Pending(stream, req_id, transaction_id, session.session_id, loop.create_future())
        future.add_done_callback(functools.partial(self._stored, pending))
        self._inflight.append(pending.decided)
        self.stats.appends += 1

    def _stored(self, pending: _Pending, future: asyncio.Future[int]) -> None:
        """An append's store future is done: committed (the feed tells the client), or
        its store session ended first, and the next session's recovery decides it."""
        if future.cancelled() or future.exception() is None:
            if not pending.decided.done():
                pending.decided.set_result(None)
            return
        self._spawn(self._decide(pending), f"decide-{self.partition_id}")

    async def _decide(self, pending: _Pending) -> None:
        """Answer an append whose store session ended before it was acknowledged: at or
        below the session's closing high-water mark it is committed (the feed delivers
        it); above it, it never will be, and the client is told so (NOT_COMMITTED)."""
        try:
            closing = await self.store.closing_mark(pending.session_id)
            if pending.transaction_id > closing:
                self.stats.not_committed += 1
                pending.stream.post(
                    ErrorResponse(
                        pending.req_id,
                        ErrorCode.NOT_COMMITTED,
                        f"transaction {pending.transaction_id} of partition "
                        f"{self.partition_id} was not committed: its store session "
                        f"{pending.session_id} ended before a quorum of replicas acknowledged "
                        f"it, and recovery closed that session at {closing}; it never will "
                        "be: re-execute it",
                    )
                )
        except (StaleGenerationError, StoreSessionClosedError) as exc:
            # The partition moved or stopped here: this server cannot decide the append
            # (the new owner's recovery does; it may well be committed). Refusing it by
            # its request id would make the client re-execute it - a duplicate if it was
            # committed - so the client is only told to mount the new owner, whose mount
            # decides every pending append.
            pending.stream.post(
                self._moved_error(ReqId(-1, self.generation, self.partition_id, -1), exc)
            )
        finally:
            # answered before a flush or mount waiting on it answers
            if not pending.decided.done():
                pending.decided.set_result(None)

    async def _settled(self, pending: Sequence[asyncio.Future[None]]) -> int:
        """Wait until ``pending`` appends are decided (committed, or answered), then
        until a session is open; returns the high-water mark that includes every one
        that committed."""
        if pending:
            await asyncio.wait(pending)  # (gather would cancel them if this is cancelled)
        await self.store.wait_ready()
        return self.high_water_mark

    async def _flush(
        self, message: FlushRequest, stream: ClientStream, pending: list[asyncio.Future[None]]
    ) -> None:
        try:
            high_water_mark = await asyncio.wait_for(
                self._settled(pending), self.config.mount_timeout
            )
        except (StaleGenerationError, StoreSessionClosedError) as exc:
            stream.post(self._moved(message, exc))
            return
        except TimeoutError:
            stream.post(
                ErrorResponse(
                    message.req_id,
                    ErrorCode.SERVER_BUSY,
                    f"partition {self.partition_id} did not settle its pending appends within "
                    f"{self.config.mount_timeout}s (its storage is recovering); retry the flush",
                )
            )
            return
        stream.post(FlushResponse(message.req_id, high_water_mark))

    def _mount(self, message: MountRequest, stream: ClientStream) -> None:
        client_id = message.req_id.client_id
        if message.req_id.generation != self.generation:
            stream.post(MountResponse(message.req_id, MountStatus.NOT_READY, self.high_water_mark))
            return
        # from now on, messages from the client's older connections are ignored
        latest = self._client_seq.get(client_id, -1)
        if message.seq_num < latest:
            self.stats.stale_connection += 1
            return
        self._client_seq[client_id] = message.seq_num
        self._stream_seq.setdefault(stream, {})[client_id] = message.seq_num
        pending = list(self._inflight)
        self._spawn(
            self._finish_mount(message, stream, pending),
            f"mount-{self.partition_id}",
            (message, stream),
        )

    async def _finish_mount(
        self, message: MountRequest, stream: ClientStream, pending: list[asyncio.Future[None]]
    ) -> None:
        try:
            high_water_mark = await asyncio.wait_for(
                self._settled(pending), self.config.mount_timeout
            )
        except (TimeoutError, StaleGenerationError, StoreSessionClosedError):
            stream.post(MountResponse(message.req_id, MountStatus.NOT_READY, self.high_water_mark))
            return
        if message.client_high_water_mark > high_water_mark:
            stream.post(MountResponse(message.req_id, MountStatus.CLIENT_AHEAD, high_water_mark))
            return
        # the feed answers the mount once it has delivered everything up to the mark
        self._start_feed(
            stream,
            message.req_id,
            message.client_high_water_mark,
            MountResponse(message.req_id, MountStatus.READY, high_water_mark),
        )

    # -- feeds ---------------------------------------------------------------------------------

    def _start_feed(
        self,
        stream: ClientStream,
        req_id: ReqId,
        client_high_water_mark: int,
        mount_response: MountResponse | None,
    ) -> None:
        previous = self._feeds.pop(stream, None)
        if previous is not None:
            previous.cancel()
        task = asyncio.create_task(
            self._feed(stream, client_high_water_mark + 1, mount_response),
            name=f"feed-{self.partition_id}-{req_id.client_id}",
        )
        self._feeds[stream] = task
        if mount_response is not None:  # owed until READY is sent
            self._owe(task, stream, MountRequest(req_id, client_high_water_mark, -1))

    async def _feed(
        self, stream: ClientStream, next_id: int, mount_response: MountResponse | None
    ) -> None:
        batch = self.config.feed_batch
        feed = _Feed(stream, next_id, live=mount_response is None)
        try:
            while not stream.closed and not self._closed:
                if mount_response is not None and feed.next_id > mount_response.high_water_mark:
                    await stream.send(mount_response)
                    mount_response = None
                    feed.live = True
                    task = asyncio.current_task()
                    if task is not None:
                        self._paid(task)
                if feed.next_id > self.high_water_mark:
                    waiter = asyncio.get_running_loop().create_future()
                    feed.waiter = waiter
                    self._feed_waiters.append(feed)
                    try:
                        await waiter  # (commits may be sent meanwhile: _feed_commit)
                    except asyncio.CancelledError:  # the feed stops: not left behind
                        with contextlib.suppress(ValueError):
                            self._feed_waiters.remove(feed)
                        raise
                    finally:
                        feed.waiter = None
                    continue
                next_id = feed.next_id
                frames = self.feed_cache.frames(next_id, batch)
                if not frames:
                    try:
                        frames = encode_feed_data(await self._read_headers(next_id, batch))
                    except StoreSessionClosedError:
                        # the session ended under the read: the next one serves it
                        await asyncio.sleep(0.05)
                        continue
                if frames:
                    feed.next_id = next_id + len(frames)
                    await stream.send_feed(frames, self.partition_id, feed.next_id - 1)
        except StaleGenerationError as exc:
            # the partition moved: tell the client, which re-reads the assignment
            stream.post(
                ErrorResponse(
                    ReqId(-1, self.generation, self.partition_id, -1),
                    ErrorCode.STALE_GENERATION,
                    f"partition {self.partition_id} is no longer served here: {exc}",
                )
            )
        except (WaltzError, ConnectionError) as exc:
            log.debug("partition %d: feed ends: %s", self.partition_id, exc)

    async def _read_headers(self, start: int, count: int) -> list[RecordHeader]:
        records = await self.store.read_committed(start, count, self.config.max_range_bytes)
        return [record.record_header for record in records]

    # -- reads -------------------------------------------------------------------------------

    async def _read(
        self, message: TransactionDataRequest | RangeReadRequest, stream: ClientStream
    ) -> None:
        try:
            if isinstance(message, TransactionDataRequest):
                stream.post(await self._transaction_data(message))
            else:
                count = max(0, min(message.max_records, self.config.max_range_records))
                size = max(1, min(message.max_bytes, self.config.max_range_bytes))
                high_water_mark = await self._recovered_high_water_mark()
                start = message.start_transaction_id
                records: Sequence[Record] = ()
                if start <= high_water_mark and count:
                    # from a replica: its storage node's block, forwarded as it came (the
                    # reader checks the checksums); never past the high-water mark
                    records = await self.store.read_committed_block(
                        start, min(count, high_water_mark - start + 1), size
                    )
                    first, last = _id_range(records)
                    if first is not None and (first != start or last != start + len(records) - 1):
                        raise StorageError(
                            f"partition {self.partition_id}: a replica answered a read of "
                            f"{len(records)} records from {start} with transactions "
                            f"{first}..{last}"
                        )
                if not isinstance(records, RecordBlock):
                    records = tuple(records)
                stream.post(RangeReadResponse(message.req_id, high_water_mark, records))
        except TimeoutError:
            stream.post(
                ErrorResponse(
                    message.req_id,
                    ErrorCode.SERVER_BUSY,
                    f"partition {self.partition_id} did not recover within "
                    f"{self.config.mount_timeout}s; retry the read",
                )
            )
        except WaltzError as exc:
            stream.post(ErrorResponse(message.req_id, ErrorCode.GENERIC, str(exc)))
        finally:
            self._reads.release()

    async def _recovered_high_water_mark(self) -> int:
        """The high-water mark once the partition is recovered: before its first
        recovery it is unknown (-1 would tell a reader the partition is empty)."""
        if not self.ready:
            await self.store.wait_ready(self.config.mount_timeout)
        return self.high_water_mark

    async def _answer_high_water_mark(
        self, message: HighWaterMarkRequest, stream: ClientStream
    ) -> None:
        try:
            high_water_mark = await self._recovered_high_water_mark()
        except TimeoutError:
            stream.post(
                ErrorResponse(
                    message.req_id,
                    ErrorCode.SERVER_BUSY,
                    f"partition {self.partition_id} did not recover within "
                    f"{self.config.mount_timeout}s; retry",
                )
            )
            return
        except WaltzError as exc:
            stream.post(ErrorResponse(message.req_id, ErrorCode.GENERIC, str(exc)))
            return
        stream.post(HighWaterMarkResponse(message.req_id, high_water_mark))

    async def _transaction_data(self, message: TransactionDataRequest) -> TransactionDataResponse:
        transaction_id = message.transaction_id
        high_water_mark = self.high_water_mark
        if transaction_id > high_water_mark:
            # not known committed yet: before a (new owner's) first recovery the mark
            # is unknown, so wait for it rather than answer "not committed"
            high_water_mark = await self._recovered_high_water_mark()
        if not 0 <= transaction_id <= high_water_mark:
            return TransactionDataResponse(
                message.req_id,
                transaction_id,
                False,
                error=f"transaction {transaction_id} is not committed in partition "
                f"{self.partition_id} (high-water mark {high_water_mark})",
            )
        cached = self.data_cache.get(transaction_id)
        if cached is None:
            records = await self.store.read_committed(
                transaction_id, 1, self.config.max_range_bytes
            )
            if not records or records[0].transaction_id != transaction_id:
                return TransactionDataResponse(
                    message.req_id, transaction_id, False, error="not found in storage"
                )
            cached = (records[0].data, records[0].checksum)
            self.data_cache.put(transaction_id, *cached)
        data, checksum = cached
        return TransactionDataResponse(message.req_id, transaction_id, True, data, checksum)


def _id_range(records: Sequence[Record]) -> tuple[int | None, int | None]:
    """The first and last transaction ids of ``records`` (a block is not decoded)."""
    if isinstance(records, RecordBlock):
        return records.first_transaction_id, records.last_transaction_id
    if not records:
        return None, None
    return records[0].transaction_id, records[-1].transaction_id
