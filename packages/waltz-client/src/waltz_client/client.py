"""The asyncio client: connections, partitions, the feed, submissions.

Layout, one event loop:

- :class:`_Channel`: the two connections to one server (stream and RPC), each
  opened with the Hello handshake; its *network sequence number* increases with
  every channel the client creates (a MountRequest carries it, so a server can
  drop messages of an older connection).
- :class:`_Partition`: one partition's mount sequencing, transaction monitor,
  feed position, retry queue and concurrency limit (the pure machines of
  :mod:`waltz_client.state`), and a worker task processing the partition's stream
  messages strictly in order.
- :class:`AsyncWaltzClient`: discovery (cluster metadata watches), submissions,
  flush, high-water mark, lazy data fetch with a bounded cache.

Protocol as this client speaks it (stream connection, per partition):

1. ``MountRequest(req_id, client_hwm, network_seq_num)``; the server streams
   ``FeedData`` for every committed transaction after ``client_hwm``, then
   ``MountResponse(READY)``, and keeps streaming ``FeedData`` as transactions
   commit. ``NOT_READY``: the client re-reads the assignment and mounts again;
   ``CLIENT_AHEAD``: a configuration error, reported, no retry.
2. ``AppendRequest``: the outcome comes from the feed (its ReqId), a
   ``LockFailure`` or an ``ErrorResponse``.
3. ``FlushRequest`` -> ``FlushResponse``, ``HighWaterMarkRequest`` ->
   ``HighWaterMarkResponse``.

RPC connection: ``TransactionDataRequest`` -> ``TransactionDataResponse`` and
``RangeReadRequest`` -> ``RangeReadResponse`` (any order, matched by ReqId).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar

from waltz_api.cluster import NO_SERVER, ClusterMetadata, PartitionAssignment, coordination_from_uri
from waltz_api.contracts.coordination import Coordination, SessionState, Watch
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import (
    ClientAheadError,
    ClientError,
    ConnectionClosedError,
    ProtocolError,
    ServerError,
    TransportError,
    WaltzError,
)
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    Message,
    MountRequest,
    MountResponse,
    RangeReadRequest,
    RangeReadResponse,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.types import NO_TRANSACTION, Record, ReqId
from waltz_api.wire import ProtocolConnection, Role, checksum
from waltz_client.api import (
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_client.state import (
    ConcurrencyLimit,
    FeedAction,
    FeedTracker,
    MountDecision,
    MountSequencer,
    MountState,
    Outcome,
    Resolution,
    RetryQueue,
    TransactionDataCache,
    TransactionMonitor,
)

log = logging.getLogger(__name__)

R = TypeVar("R")
M = TypeVar("M", bound=Message)
INT32_MAX = 2**31 - 1
_INBOX_SIZE = 4096
_FEED_BATCH = 512
CALLBACK_THREAD_PREFIX = "waltz-callbacks"
_MOVED_CODES = frozenset(
    {ErrorCode.PARTITION_NOT_ASSIGNED, ErrorCode.STALE_GENERATION, ErrorCode.SERVER_BUSY}
)
"""Refusals that mean "ask again (maybe elsewhere)": the request is retried."""


@dataclass(frozen=True)
class ClientConfig:
    """How a client finds and talks to a cluster.

    - ``coordination``: a URI (``zk://127.0.0.1:2181/waltz``, ``local:///var/lib/waltz``)
      or a started :class:`~waltz_api.contracts.coordination.Coordination` the caller owns.
    - ``transport``: the transport plugin name (``zmq``) and its options.
    - ``partitions``: the partitions to mount (None: all); submissions to others fail.
    - ``max_concurrent_transactions``: per partition; ``submit`` waits beyond it.
    - ``data_cache_bytes``: the bound of the transaction data cache.
    """

    coordination: str | Coordination
    coordination_options: Mapping[str, Any] = field(default_factory=dict)
    transport: str = "zmq"
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    partitions: Sequence[int] | None = None
    max_concurrent_transactions: int = 100
    data_cache_bytes: int = 64 * 1024 * 1024
    connect_timeout: float = 10.0
    request_timeout: float = 30.0
    retry_interval: float = 0.2
    """Pause before mounting again after NOT_READY, a refusal or a lost connection."""
    transaction_timeout: float | None = None
    """Seconds a submission may wait to be (re)executed (partition unavailable,
    retries) before it expires with :class:`TransactionExpiredError`; None: no limit."""
    prefetch_data: bool = False
    """Fetch the data of feed items that arrive together concurrently, before the
    callbacks ask (for applications that read the data of most transactions)."""

    def __post_init__(self) -> None:
        if self.transaction_timeout is not None and (
            not isinstance(self.transaction_timeout, int | float) or self.transaction_timeout <= 0
        ):
            raise ClientError(
                "ClientConfig.transaction_timeout must be a positive number or None, "
                f"got {self.transaction_timeout!r}"
            )
        for name in ("connect_timeout", "request_timeout", "retry_interval"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ClientError(f"ClientConfig.{name} must be a positive number, got {value!r}")
        ConcurrencyLimit[object](self.max_concurrent_transactions)
        TransactionDataCache[object](self.data_cache_bytes)


class TransactionExpiredError(ClientError):
    """A context was not committed within ``ClientConfig.transaction_timeout`` (it was
    never left in flight: it expires only while waiting to be (re)executed)."""


class _Expired(WaltzError):
    """Internal: the deadline passed while waiting."""


class _Lost(WaltzError):
    """A request's connection broke before its answer came (retried)."""


# -- one server: stream and RPC connections ---------------------------------------------------


class _Channel:
    def __init__(self, client: AsyncWaltzClient, endpoint: str, seq_num: int) -> None:
        self.client = client
        self.endpoint = endpoint
        self.seq_num = seq_num
        self.stream: Connection | None = None
        self.rpc: Connection | None = None
        self._stream_proto: ProtocolConnection | None = None
        self._rpc_proto: ProtocolConnection | None = None
        self.rpc_waiters: dict[ReqId, asyncio.Future[Message]] = {}
        self.partitions: set[_Partition] = set()
        self.closed = False
        self._tasks: list[asyncio.Task[None]] = []

    async def _connect(self, kind: str) -> tuple[Connection, ProtocolConnection]:
        client = self.client
        conn = await client.transport.connect(
            self.endpoint,
            timeout=client.config.connect_timeout,
            replace_key=f"waltz-client-{client.client_id}-{kind}",
        )
        try:
            proto = ProtocolConnection(Role.INITIATOR, sender=f"client:{client.client_id}")
            await conn.send(proto.start_handshake())
            frame = await asyncio.wait_for(conn.recv(), client.config.connect_timeout)
            proto.receive_frame(frame)
        except BaseException:
            await conn.close()
            raise
        return conn, proto

    async def open(self) -> None:
        self.stream, self._stream_proto = await self._connect("stream")
        try:
            self.rpc, self._rpc_proto = await self._connect("rpc")
        except BaseException:
            await self.stream.close()
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_stream(), name=f"waltz-client-stream-{self.endpoint}"),
            loop.create_task(self._read_rpc(), name=f"waltz-client-rpc-{self.endpoint}"),
        ]

    async def send_stream(self, message: Message) -> None:
        if self.closed or self.stream is None or self._stream_proto is None:
            raise _Lost(f"the stream connection to {self.endpoint} is closed")
        try:
            await self.stream.send(self._stream_proto.send(message))
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)
            raise _Lost(f"the stream connection to {self.endpoint} broke: {exc}") from exc

    async def call(self, message: Message, req_id: ReqId, timeout: float) -> Message:
        if self.closed or self.rpc is None or self._rpc_proto is None:
            raise _Lost(f"the RPC connection to {self.endpoint} is closed")
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.rpc_waiters[req_id] = future
        try:
            try:
                await self.rpc.send(self._rpc_proto.send(message))
            except (TransportError, ProtocolError) as exc:
                self.lost(exc)
                raise _Lost(f"the RPC connection to {self.endpoint} broke: {exc}") from exc
            return await asyncio.wait_for(future, timeout)
        finally:
            self.rpc_waiters.pop(req_id, None)

    async def _read_stream(self) -> None:
        assert self.stream is not None and self._stream_proto is not None
        try:
            while True:
                message = self._stream_proto.receive_frame(await self.stream.recv())
                req_id: ReqId | None = getattr(message, "req_id", None)
                partition = (
                    None if req_id is None else self.client.partitions.get(req_id.partition_id)
                )
                if partition is None:
                    log.warning("dropping %s for a partition this client does not mount", message)
                    continue
                await partition.inbox.put((self, message))
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)

    async def _read_rpc(self) -> None:
        assert self.rpc is not None and self._rpc_proto is not None
        try:
            while True:
                message = self._rpc_proto.receive_frame(await self.rpc.recv())
                req_id = getattr(message, "req_id", None)
                future = self.rpc_waiters.get(req_id) if isinstance(req_id, ReqId) else None
                if future is None or future.done():
                    log.debug("dropping unexpected RPC answer %s", type(message).__name__)
                    continue
                future.set_result(message)
        except (TransportError, ProtocolError) as exc:
            self.lost(exc)

    def lost(self, reason: BaseException | str) -> None:
        """Close the channel after a failure; its partitions mount again elsewhere/anew."""
        if self.closed:
            return
        self.closed = True
        if not isinstance(reason, ConnectionClosedError) or not self.client.closing:
            log.warning("connection to server %s lost: %s", self.endpoint, reason)
        for future in self.rpc_waiters.values():
            if not future.done():
                future.set_exception(_Lost(f"the connection to {self.endpoint} broke"))
        self.client._channel_lost(self)
        for partition in list(self.partitions):
            partition.channel_lost(self)
        self.partitions.clear()
        self.client._spawn(self.close())

    async def close(self) -> None:
        self.closed = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for conn in (self.stream, self.rpc):
            if conn is not None:
                with contextlib.suppress(WaltzError, OSError):
                    await conn.close()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


# -- one partition ------------------------------------------------------------------------------


class _Partition:
    def __init__(self, client: AsyncWaltzClient, partition_id: int) -> None:
        self.client = client
        self.id = partition_id
        self.mount = MountSequencer()
        self.monitor = TransactionMonitor()
        self.feed = FeedTracker()
        self.retries: RetryQueue[asyncio.Future[None]] = RetryQueue()
        self.limit: ConcurrencyLimit[asyncio.Future[None]] = ConcurrencyLimit(
            client.config.max_concurrent_transactions
        )
        self.outcomes: dict[ReqId, asyncio.Future[Resolution]] = {}
        self.committed_by: dict[ReqId, TransactionContext] = {}
        self.requests: dict[ReqId, asyncio.Future[Message]] = {}
        self.channel: _Channel | None = None
        self.inbox: asyncio.Queue[tuple[_Channel, Message]] = asyncio.Queue(_INBOX_SIZE)
        self.mounted = asyncio.Event()
        self.need_mount = asyncio.Event()
        self.advanced = asyncio.Event()
        self.failure: WaltzError | None = None
        self.mounts = 0
        """Mounts completed (READY) so far."""
        self._tasks: list[asyncio.Task[None]] = []
        self._delayed: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._failures = 0
        self._mount_timer: asyncio.TimerHandle | None = None
        self.reassigned = asyncio.Event()
        self._last_progress = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._maintain(), name=f"waltz-client-mount-{self.id}"),
            loop.create_task(self._work(), name=f"waltz-client-feed-{self.id}"),
        ]

    async def stop(self) -> None:
        for timer in (self._delayed, self._mount_timer):
            if timer is not None:
                timer.cancel()
        tasks = [*self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        closed = ClientError("the Waltz client is closed")
        futures: list[asyncio.Future[Any]] = [
            *self.outcomes.values(),
            *self.requests.values(),
            *self.retries.drain(),
            *self.limit.drain(),
        ]
        for future in futures:
            if not future.done():
                future.set_exception(closed)
        self.outcomes.clear()
        self.requests.clear()
        self.mounted.set()  # wake waiters; they see the client closed

    # -- assignment and mounting -------------------------------------------------------------------

    def on_assignment(self, assignment: PartitionAssignment | None) -> None:
        if assignment is None:
            return
        endpoint = assignment.endpoint if assignment.server_id != NO_SERVER else ""
        before = self.channel
        if self.mount.on_assignment(endpoint, assignment.generation):
            log.info(
                "partition %d assigned to %s (generation %d): mounting",
                self.id,
                endpoint,
                assignment.generation,
            )
            self._detach(before)
            self.mounted.clear()
            self.reassigned.set()  # wakes connection attempts to the previous server
            self.reassigned = asyncio.Event()
            self.need_mount.set()
        elif self.mount.state is MountState.UNASSIGNED:
            self._detach(before)
            self.mounted.clear()

    async def connect(self, endpoint: str) -> _Channel:
        """The channel to ``endpoint``; gives up (_Lost) as soon as the partition is
        reassigned, since a connection attempt to a dead server can take the whole
        connect timeout."""
        changed = self.reassigned
        connecting = asyncio.ensure_future(self.client._channel_for(endpoint))
        waiting = asyncio.ensure_future(changed.wait())
        try:
            await asyncio.wait({connecting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, WaltzError):
                await connecting
            raise _Lost(f"partition {self.id} moved while connecting to {endpoint}")
        return connecting.result()

    def _detach(self, channel: _Channel | None) -> None:
        if channel is not None:
            channel.partitions.discard(self)
        self.channel = None
        for future in self.requests.values():
            if not future.done():
                future.set_exception(_Lost("the partition moved"))

    def channel_lost(self, channel: _Channel) -> None:
        if channel is not self.channel:
            return
        self._detach(channel)
        self.mounted.clear()
        if self.mount.on_disconnect():
            self._remount_later()

    def _remount_later(self, *, refresh: bool = False) -> None:
        """Mount again after the retry interval (re-reading the assignment first)."""
        if self.client.closing or self._delayed is not None:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._delayed = None
            if refresh:
                task = loop.create_task(self._refresh())
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                self.need_mount.set()

        # back off while mounts keep failing (an unreachable server, NOT_READY...)
        interval = self.client.config.retry_interval
        delay = min(interval * 2 ** min(self._failures, 8), max(interval, 1.0))
        self._failures += 1
        self._delayed = loop.call_later(delay, fire)

    async def _refresh(self) -> None:
        try:
            stored = await self.client.metadata.partition_assignment(self.id)
        except WaltzError as exc:
            log.warning("cannot read partition %d's assignment: %s", self.id, exc)
            self._remount_later(refresh=True)
            return
        self.on_assignment(stored.value)
        if self.mount.state is MountState.UNMOUNTED:
            self.need_mount.set()

    async def _maintain(self) -> None:
        client = self.client
        while not client.closing:
            await self.need_mount.wait()
            self.need_mount.clear()
            if self.mount.state is not MountState.UNMOUNTED:
                continue
            endpoint = self.mount.endpoint
            generation = self.mount.generation
            try:
                try:
                    channel = await self.connect(endpoint)
                except _Lost:
                    if self.mount.endpoint != endpoint or self.mount.generation != generation:
                        continue  # reassigned meanwhile: need_mount is set
                    raise
                app_hwm = await client._call_callback(
                    client.callbacks.client_high_water_mark, self.id
                )
            except (TransportError, ProtocolError, _Lost) as exc:
                log.warning("partition %d: cannot reach %s: %s", self.id, endpoint, exc)
                self._remount_later(refresh=True)
                continue
            except Exception as exc:
                log.exception("partition %d: client_high_water_mark failed", self.id)
                client._report(self.id, NO_TRANSACTION, exc)
                self._remount_later()
                continue
            if (
                self.mount.state is not MountState.UNMOUNTED
                or self.mount.endpoint != endpoint
                or self.mount.generation != generation
            ):
                self.need_mount.set()  # the assignment changed meanwhile
                continue
            if not isinstance(app_hwm, int) or isinstance(app_hwm, bool):
                client._report(
                    self.id,
                    NO_TRANSACTION,
                    ClientError(f"client_high_water_mark returned {app_hwm!r}, not an int"),
                )
                self._remount_later()
                continue
            mount_from = self.feed.start_mount(app_hwm)
            req_id = client._next_req_id(self.id, generation)
            self.mount.begin_mount(req_id, channel.seq_num)
            if self.channel is not channel:
                self._detach(self.channel)
            self.channel = channel
            channel.partitions.add(self)
            try:
                await channel.send_stream(MountRequest(req_id, mount_from, channel.seq_num))
            except _Lost:
                continue  # channel_lost() scheduled the next mount
            if self._mount_timer is not None:
                self._mount_timer.cancel()
            self._mount_timer = asyncio.get_running_loop().call_later(
                client.config.request_timeout, self._mount_timed_out, req_id
            )

    def _mount_timed_out(self, req_id: ReqId) -> None:
        self._mount_timer = None
        loop = asyncio.get_running_loop()
        timeout = self.client.config.request_timeout
        quiet = loop.time() - self._last_progress
        if self.mount.state is MountState.MOUNTING and quiet < timeout:
            # a long catch-up feed is streaming: the mount is alive, wait on
            self._mount_timer = loop.call_later(timeout - quiet, self._mount_timed_out, req_id)
            return
        if self.mount.state is MountState.MOUNTING and self.mount.mount_req_id == req_id:
            log.warning(
                "partition %d: no answer to the mount from %s within %s s; mounting again",
                self.id,
                self.mount.endpoint,
                self.client.config.request_timeout,
            )
            self.mount.unmount()
            self._remount_later(refresh=True)

    # -- the stream, in order ----------------------------------------------------------------------

    async def _work(self) -> None:
        inbox = self.inbox
        batchable = not inspect.iscoroutinefunction(self.client.callbacks.apply_transaction)
        while True:
            channel, message = await inbox.get()
            if channel is not self.channel:
                continue  # a message of a replaced connection or an earlier assignment
            try:
                if isinstance(message, FeedData) and not inbox.empty():
                    # consecutive feed items go to the callback thread in one hop
                    run = [message]
                    pending: tuple[_Channel, Message] | None = None
                    while not inbox.empty() and len(run) < _FEED_BATCH:
                        item = inbox.get_nowait()
                        if item[0] is channel and isinstance(item[1], FeedData):
                            run.append(item[1])
                        else:
                            pending = item
                            break
                    if self.client.config.prefetch_data:
                        await self._prefetch(run)
                    if batchable:
                        await self._on_feed_run(run)
                    else:
                        for item_message in run:
                            await self._on_feed(item_message)
                    if pending is not None and pending[0] is self.channel:
                        await self._handle(pending[1])
                else:
                    await self._handle(message)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("partition %d: failed to handle %s", self.id, message)

    async def _prefetch(self, run: list[FeedData]) -> None:
        """Fetch the data of a run of feed items concurrently (pipelined RPCs) into the
        cache, so the callbacks' fetches hit it. Failures are left to the callbacks."""
        position = self.feed.position
        fetch = self.client._fetch_data
        await asyncio.gather(
            *(fetch(self.id, m.transaction_id) for m in run if m.transaction_id > position),
            return_exceptions=True,
        )

    async def _on_feed_run(self, run: list[FeedData]) -> None:
        """Feed items in order; runs of consecutive APPLY items are applied by plain
        callbacks in one callback-thread hop (same outcome as one by one)."""
        i = 0
        while i < len(run):
            first = run[i]
            if (
                self.mount.state not in (MountState.MOUNTING, MountState.MOUNTED)
                or self.feed.classify(first.transaction_id) is not FeedAction.APPLY
            ):
                await self._on_feed(first)
                i += 1
                continue
            j = i + 1
            while j < len(run) and run[j].transaction_id == first.transaction_id + (j - i):
                j += 1
            await self._apply_run(run[i:j])
            i = j

    async def _apply_run(self, items: list[FeedData]) -> None:
        client = self.client
        resolutions = [self.monitor.on_feed(m.req_id, m.transaction_id) for m in items]
        transactions = [
            Transaction(
                self.id,
                m.transaction_id,
                m.header,
                m.req_id,
                fetch=client._fetch_data,
                blocking=client._blocking_fetch,
            )
            for m in items
        ]
        apply = client.callbacks.apply_transaction

        def apply_all() -> tuple[int, Exception | None]:
            for k, transaction in enumerate(transactions):
                try:
                    apply(transaction)
                except Exception as exc:
                    return k, exc
            return len(transactions), None

        assert client._loop is not None and client._executor is not None
        done, error = await client._loop.run_in_executor(client._executor, apply_all)
        for k in range(done):
            self._resolve(resolutions[k], applied=True)
            self.feed.advance(items[k].transaction_id)
        client.transactions_seen += done
        if error is not None:
            for k in range(done, len(items)):
                self._resolve(resolutions[k], applied=False)  # committed, not applied
            self._apply_failed(items[done].transaction_id, error)
        if done:
            self._advance_waiters()

    def _apply_failed(self, transaction_id: int, exc: Exception) -> None:
        log.warning(
            "partition %d: apply_transaction(%d) failed: %r; the feed restarts from "
            "the client high-water mark",
            self.id,
            transaction_id,
            exc,
        )
        self.client._report(self.id, transaction_id, exc)
        self._unmount_and_retry()

    async def _handle(self, message: Message) -> None:
        if isinstance(message, FeedData):
            await self._on_feed(message)
        elif isinstance(message, MountResponse):
            self._on_mount_response(message)
        elif isinstance(message, LockFailure):
            self._resolve(self.monitor.on_lock_failure(message.req_id, message.transaction_id))
        elif isinstance(message, ErrorResponse):
            self._on_error(message)
        elif isinstance(message, FlushResponse | HighWaterMarkResponse):
            future = self.requests.pop(message.req_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            log.warning("partition %d: unexpected %s on the stream", self.id, message)

    async def _on_feed(self, message: FeedData) -> None:
        if self.mount.state not in (MountState.MOUNTING, MountState.MOUNTED):
            return
        action = self.feed.classify(message.transaction_id)
        if action is FeedAction.DUPLICATE:
            return
        if action is FeedAction.GAP:
            if self.mount.state is MountState.MOUNTING:
                return  # the rest of an earlier feed on this connection: the mount restreams
            log.warning(
                "partition %d: feed jumped from %d to %d; mounting again",
                self.id,
                self.feed.position,
                message.transaction_id,
            )
            self._unmount_and_retry()
            return
        resolutions = self.monitor.on_feed(message.req_id, message.transaction_id)
        if action is FeedAction.APPLY:
            client = self.client
            transaction = Transaction(
                self.id,
                message.transaction_id,
                message.header,
                message.req_id,
                fetch=client._fetch_data,
                blocking=client._blocking_fetch,
            )
            try:
                await client._call_callback(client.callbacks.apply_transaction, transaction)
            except Exception as exc:
                self._resolve(resolutions, applied=False)
                self._apply_failed(message.transaction_id, exc)
                return
        self._resolve(resolutions, applied=action is FeedAction.APPLY)
        self.feed.advance(message.transaction_id)
        self.client.transactions_seen += 1
        self._advance_waiters()

    def _unmount_and_retry(self) -> None:
        self.mount.unmount()
        self.mounted.clear()
        self._remount_later()

    def _advance_waiters(self) -> None:
        self._last_progress = asyncio.get_running_loop().time()
        self.advanced.set()
        self.advanced = asyncio.Event()
        self._release_retries()

    def _release_retries(self) -> None:
        for future in self.retries.release(
            self.feed.position, appends_allowed=self.mount.appends_allowed
        ):
            if not future.done():
                future.set_result(None)

    def _on_mount_response(self, message: MountResponse) -> None:
        decision = self.mount.on_mount_response(message.req_id, message.status)
        if decision is MountDecision.READY:
            self._resolve(self.monitor.fail_all())
            self.mounts += 1
            self._failures = 0
            self.mounted.set()
            self._release_retries()
            log.info(
                "partition %d mounted at %s (server high-water mark %d)",
                self.id,
                self.mount.endpoint,
                message.high_water_mark,
            )
        elif decision is MountDecision.RETRY:
            self._remount_later(refresh=True)
        elif decision is MountDecision.CLIENT_AHEAD:
            error = ClientAheadError(
                f"partition {self.id}: the client high-water mark {self.feed.position} is "
                f"beyond the partition's high-water mark {message.high_water_mark}; the "
                "application's database belongs to another cluster, or the log lost data. "
                "Check the client's database and the cluster it points to"
            )
            self._fail_partition(error)

    def _fail_partition(self, error: WaltzError) -> None:
        log.error("%s", error)
        self.failure = error
        self.client._report(self.id, NO_TRANSACTION, error)
        for future in self.outcomes.values():
            if not future.done():
                future.set_exception(error)
        self.outcomes.clear()
        others: list[asyncio.Future[Any]] = [*self.requests.values(), *self.retries.drain()]
        for future in others:
            if not future.done():
                future.set_exception(error)
        self.requests.clear()
        self.mounted.set()

    def _on_error(self, message: ErrorResponse) -> None:
        req_id = message.req_id
        if req_id == self.mount.mount_req_id:
            log.warning("partition %d: mount refused: %s", self.id, message.message)
            if self.mount.on_mount_refused(req_id) is MountDecision.RETRY:
                self.mounted.clear()
                self._remount_later(refresh=True)
            return
        future = self.requests.pop(req_id, None)
        if future is not None:
            if not future.done():
                future.set_exception(_Lost(f"{message.code.name}: {message.message}"))
            return
        if req_id in self.monitor:
            self._resolve(self.monitor.on_refused(req_id))
            if message.code in _MOVED_CODES:
                self._unmount_and_refresh()
            return
        if message.code in _MOVED_CODES and self.mount.state is MountState.MOUNTED:
            # not about a request of ours: the server says the partition left it
            log.info("partition %d: %s; re-reading the assignment", self.id, message.message)
            self._unmount_and_refresh()
            return
        log.warning("partition %d: server error %s: %s", self.id, message.code.name, message)

    def _unmount_and_refresh(self) -> None:
        self.mount.unmount()
        self.mounted.clear()
        self._remount_later(refresh=True)

    def _resolve(self, resolutions: list[Resolution], *, applied: bool = False) -> None:
        for resolution in resolutions:
            future = self.outcomes.pop(resolution.req_id, None)
            if future is None or future.done():
                continue
            if resolution.outcome is Outcome.COMMITTED and applied:
                context = self.committed_by.get(resolution.req_id)
                if context is not None:
                    _hook(context.on_application, resolution.transaction_id)
            future.set_result(resolution)
        for resolution in resolutions:
            self.committed_by.pop(resolution.req_id, None)

    # -- used by submissions -----------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.client.closing:
            raise ClientError("the Waltz client is closed")

    async def acquire_slot(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.limit.try_acquire(future):
            return
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release_slot()  # the slot was handed over as we were cancelled
            else:
                self.limit.cancel(future)
            raise

    def release_slot(self) -> None:
        waiter = self.limit.release()
        while waiter is not None and waiter.done():  # cancelled while queued
            waiter = self.limit.release()
        if waiter is not None:
            waiter.set_result(None)

    async def wait_mounted(self) -> None:
        while True:
            self.check_usable()
            if self.mount.appends_allowed:
                return
            await self.mounted.wait()

    async def wait_retry(self, wait_for: int | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.retries.add(future, wait_for)
        self._release_retries()
        await future

    def register(self, req_id: ReqId, context: TransactionContext) -> asyncio.Future[Resolution]:
        future: asyncio.Future[Resolution] = asyncio.get_running_loop().create_future()
        self.monitor.register(req_id)
        self.outcomes[req_id] = future
        self.committed_by[req_id] = context
        return future

    async def request(self, make: Callable[[ReqId], Message], timeout: float) -> Message:
        """A stream request answered by one message (flush, high-water mark); retried
        on a new connection until ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ServerError(
                    f"partition {self.id}: no answer from the server within {timeout} s; "
                    "is the partition's server up?"
                )
            try:
                await asyncio.wait_for(self.wait_mounted(), remaining)
                channel = self.channel
                if channel is None:
                    continue
                req_id = self.client._next_req_id(self.id, self.mount.generation)
                future: asyncio.Future[Message] = loop.create_future()
                self.requests[req_id] = future
                try:
                    await channel.send_stream(make(req_id))
                    return await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
                finally:
                    self.requests.pop(req_id, None)
            except _Lost:
                await asyncio.sleep(self.client.config.retry_interval)
            except TimeoutError:
                continue

    async def wait_position(self, transaction_id: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.feed.position < transaction_id:
            self.check_usable()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ServerError(
                    f"partition {self.id}: the feed did not reach transaction {transaction_id} "
                    f"within {timeout} s (at {self.feed.position})"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.advanced.wait(), remaining)


def _hook(fn: Callable[..., Any], *args: Any) -> None:
    """Call an application hook; its exception is logged, never breaks the client."""
    try:
        fn(*args)
    except Exception:
        log.exception("transaction context hook %s raised", getattr(fn, "__name__", fn))


# -- the client -----------------------------------------------------------------------------------


class AsyncWaltzClient:
    """The Waltz client on an asyncio event loop.

    ::

        async with AsyncWaltzClient(callbacks, ClientConfig("zk://127.0.0.1:2181/waltz")) as c:
            committed = await c.submit(Deposit(account=7, amount=100))
            await c.flush(0)

    Plain (non-async) callbacks and ``execute`` run on one callback thread, in
    order; ``async def`` ones run on the loop.
    """

    def __init__(self, callbacks: WaltzClientCallbacks, config: ClientConfig) -> None:
        if not isinstance(callbacks, WaltzClientCallbacks):
            raise ClientError(
                f"callbacks must be a WaltzClientCallbacks, got {type(callbacks).__name__}"
            )
        if not isinstance(config, ClientConfig):
            raise ClientError(f"config must be a ClientConfig, got {type(config).__name__}")
        self.callbacks = callbacks
        self.config = config
        self.client_id = -1
        self.num_partitions = 0
        self.partitions: dict[int, _Partition] = {}
        self.closing = False
        self.transactions_seen = 0
        self.cache: TransactionDataCache[tuple[int, int]] = TransactionDataCache(
            config.data_cache_bytes
        )
        self._transport: Transport | None = None
        self._coordination: Coordination | None = None
        self._owns_coordination = isinstance(config.coordination, str)
        self._metadata: ClusterMetadata | None = None
        self._channels: dict[str, _Channel] = {}
        self._channel_locks: dict[str, asyncio.Lock] = {}
        self._network_seq = itertools.count(1)
        self._req_seq = itertools.count(1)
        self._watches: list[Watch] = []
        self._fetching: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._cache_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1
        self._started = False

    # -- life cycle --------------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise ClientError("the client is not started: use `async with` or await start()")
        return self._transport

    @property
    def metadata(self) -> ClusterMetadata:
        if self._metadata is None:
            raise ClientError("the client is not started: use `async with` or await start()")
        return self._metadata

    async def start(self) -> None:
        """Connect to coordination, allocate a client id, mount the partitions."""
        if self._started:
            raise ClientError("the client was started already")
        self._started = True
        from waltz_api.plugins import get_registry

        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=CALLBACK_THREAD_PREFIX
        )
        try:
            descriptor = get_registry().get("transport", self.config.transport)
            transport = descriptor.factory(dict(self.config.transport_options))
            if not isinstance(transport, Transport):
                raise ClientError(f"transport plugin {self.config.transport!r} is not a Transport")
            self._transport = transport
            if isinstance(self.config.coordination, str):
                coordination = coordination_from_uri(
                    self.config.coordination, self.config.coordination_options
                )
                await coordination.start()
            else:
                coordination = self.config.coordination
            self._coordination = coordination
            self._metadata = ClusterMetadata(coordination)
            cluster = await self._metadata.config()
            self.num_partitions = cluster.num_partitions
            wanted = (
                range(cluster.num_partitions)
                if self.config.partitions is None
                else sorted(set(self.config.partitions))
            )
            for p in wanted:
                if not 0 <= p < cluster.num_partitions:
                    raise ClientError(
                        f"partition {p} does not exist: the cluster has "
                        f"{cluster.num_partitions} partitions (0..{cluster.num_partitions - 1})"
                    )
            self.client_id = await self._metadata.allocate_client_id()
            for p in wanted:
                partition = _Partition(self, p)
                self.partitions[p] = partition
                partition.start()
            await self._watch_assignments()
            coordination.add_session_listener(self._on_session)
        except BaseException:
            await self.close()
            raise
        log.info(
            "Waltz client %d started: %d partitions mounted of %d",
            self.client_id,
            len(self.partitions),
            self.num_partitions,
        )

    async def close(self) -> None:
        """Stop: pending submissions fail with ClientError; connections close."""
        if self.closing:
            return
        self.closing = True
        for watch in self._watches:
            watch.cancel()
        for partition in self.partitions.values():
            await partition.stop()
        for channel in list(self._channels.values()):
            await channel.close()
        self._channels.clear()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for future in self._fetching.values():
            if not future.done():
                future.set_exception(ClientError("the Waltz client is closed"))
        if self._transport is not None:
            with contextlib.suppress(WaltzError, OSError):
                await self._transport.close()
        if self._owns_coordination and self._coordination is not None:
            with contextlib.suppress(WaltzError):
                await self._coordination.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- submissions -------------------------------------------------------------------------------

    def _partition_of(self, context: TransactionContext) -> _Partition:
        if not isinstance(context, TransactionContext):
            raise ClientError(f"submit() takes a TransactionContext, got {type(context).__name__}")
        if not self._started or self.closing:
            raise ClientError("the Waltz client is not running (not started, or closed)")
        p = context.partition_id(self.num_partitions)
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_partitions:
            raise ClientError(
                f"{type(context).__name__}.partition_id({self.num_partitions}) returned {p!r}; "
                f"it must be an int in 0..{self.num_partitions - 1}"
            )
        partition = self.partitions.get(p)
        if partition is None:
            raise ClientError(
                f"partition {p} is not mounted by this client (ClientConfig.partitions="
                f"{list(self.config.partitions or [])}); add it to submit there"
            )
        return partition

    async def enqueue(self, context: TransactionContext) -> asyncio.Task[bool]:
        """Wait for a free slot in the context's partition (back pressure), then start
        the transaction; the task resolves like :meth:`submit`."""
        partition = self._partition_of(context)
        partition.check_usable()
        await partition.acquire_slot()
        try:
            partition.check_usable()
        except BaseException:
            partition.release_slot()
            raise
        return asyncio.get_running_loop().create_task(
            self._run(partition, context), name=f"waltz-submit-{partition.id}"
        )

    async def submit(self, context: TransactionContext) -> bool:
        """Execute ``context`` until its outcome is known: True when committed, False
        when ``execute`` declined. Raises what ``execute`` raised (after
        ``on_exception``), ClientAheadError, or ClientError when the client closes."""
        task = await self.enqueue(context)
        return await task

    async def _run(self, partition: _Partition, context: TransactionContext) -> bool:
        try:
            return await self._attempts(partition, context)
        except _Expired as expired:
            _hook(context.on_expiration)
            raise TransactionExpiredError(
                f"{type(context).__name__} expired: not committed within "
                f"{self.config.transaction_timeout} s ({context.attempts} attempts); "
                f"{expired}. Nothing of it is pending"
            ) from None
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                _hook(context.on_exception, exc)
            raise
        finally:
            partition.release_slot()

    async def _before_deadline(self, waiting: Awaitable[None], deadline: float | None) -> None:
        """Wait, but never past the context's deadline (only where nothing is in flight)."""
        if deadline is None:
            await waiting
            return
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(waiting, max(remaining, 0.0))
        except TimeoutError:
            raise _Expired(
                "its partition was not writable (mounting, or waiting to retry)"
            ) from None

    async def _attempts(self, partition: _Partition, context: TransactionContext) -> bool:
        p = partition.id
        timeout = self.config.transaction_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            await self._before_deadline(partition.wait_mounted(), deadline)
            builder, go = await self._build(context, p)
            hwm = builder.client_high_water_mark
            if not go:
                _hook(context.on_completion, False)
                return False
            if not partition.mount.appends_allowed or partition.channel is None:
                continue  # a mount started while executing: build again after it
            channel = partition.channel
            req_id = self._next_req_id(p, partition.mount.generation)
            outcome = partition.register(req_id, context)
            data = builder.data
            with contextlib.suppress(_Lost):  # the next mount fails it; then a retry
                await channel.send_stream(
                    AppendRequest(
                        req_id, hwm, builder.lock_request(), builder.header, data, checksum(data)
                    )
                )
            resolution = await outcome
            if resolution.outcome is Outcome.COMMITTED:
                _hook(context.on_completion, True)
                return True
            if resolution.outcome is Outcome.LOCK_FAILED:
                _hook(context.on_lock_failure, resolution.transaction_id)
                await self._before_deadline(
                    partition.wait_retry(resolution.transaction_id), deadline
                )
            else:
                await self._before_deadline(partition.wait_retry(None), deadline)

    async def _build(self, context: TransactionContext, p: int) -> tuple[TransactionBuilder, bool]:
        """Read the client high-water mark and execute the context (one callback-thread
        hop when both are plain methods, so an apply never runs in between)."""
        read_hwm = self.callbacks.client_high_water_mark

        def checked(hwm: object) -> TransactionBuilder:
            if isinstance(hwm, bool) or not isinstance(hwm, int):
                raise ClientError(f"client_high_water_mark returned {hwm!r}, not an int")
            context.attempts += 1
            return TransactionBuilder(p, hwm)

        if inspect.iscoroutinefunction(read_hwm) or inspect.iscoroutinefunction(context.execute):
            builder = checked(await self._call_callback(read_hwm, p))
            return builder, bool(await self._call_callback(context.execute, builder))

        def build() -> tuple[TransactionBuilder, bool]:
            builder = checked(read_hwm(p))
            return builder, bool(context.execute(builder))

        assert self._loop is not None and self._executor is not None
        return await self._loop.run_in_executor(self._executor, build)

    # -- flush, high-water mark, data --------------------------------------------------------------

    def _partition(self, partition_id: int) -> _Partition:
        partition = self.partitions.get(partition_id)
        if partition is None:
            raise ClientError(f"partition {partition_id} is not mounted by this client")
        partition.check_usable()
        return partition

    async def flush(self, partition_id: int, timeout: float | None = None) -> int:
        """Wait until every append this client sent to the partition completed and
        the feed delivered them; returns the partition's high-water mark."""
        timeout = timeout or self.config.request_timeout
        partition = self._partition(partition_id)
        response = await partition.request(FlushRequest, timeout)
        assert isinstance(response, FlushResponse)
        await partition.wait_position(response.transaction_id, timeout)
        return response.transaction_id

    async def high_water_mark(self, partition_id: int, timeout: float | None = None) -> int:
        """The partition's high-water mark, as its server knows it now."""
        partition = self._partition(partition_id)
        response = await partition.request(
            HighWaterMarkRequest, timeout or self.config.request_timeout
        )
        assert isinstance(response, HighWaterMarkResponse)
        return response.transaction_id

    def feed_position(self, partition_id: int) -> int:
        """The last transaction of the partition this client processed from the feed."""
        return self._partition(partition_id).feed.position

    async def _rpc(self, partition: _Partition, make: Callable[[ReqId], M], what: str) -> Message:
        loop = asyncio.get_running_loop()
        timeout = self.config.request_timeout
        deadline = loop.time() + timeout
        while True:
            partition.check_usable()
            if partition.mount.endpoint:
                try:
                    channel = await partition.connect(partition.mount.endpoint)
                    req_id = self._next_req_id(partition.id, partition.mount.generation)
                    remaining = deadline - loop.time()
                    response = await channel.call(make(req_id), req_id, max(remaining, 0.001))
                    if not (isinstance(response, ErrorResponse) and response.code in _MOVED_CODES):
                        return response
                    log.debug("%s refused (%s), retrying", what, response.message)
                except (_Lost, TransportError, TimeoutError) as exc:
                    log.debug("%s failed, retrying: %s", what, exc)
            if loop.time() >= deadline:
                raise ServerError(
                    f"{what}: no answer from partition {partition.id}'s server within {timeout} s"
                )
            await asyncio.sleep(self.config.retry_interval)

    async def _fetch_data(self, partition_id: int, transaction_id: int) -> bytes:
        key = (partition_id, transaction_id)
        with self._cache_lock:
            cached = self.cache.get(key)
        if cached is not None:
            return cached
        inflight = self._fetching.get(key)
        if inflight is not None:
            return await asyncio.shield(inflight)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._fetching[key] = future
        try:
            response = await self._rpc(
                self._partition(partition_id),
                lambda req: TransactionDataRequest(req, transaction_id),
                f"fetching transaction {transaction_id}'s data",
            )
            if not isinstance(response, TransactionDataResponse):
                raise ServerError(f"unexpected answer to a data request: {response}")
            if not response.success:
                raise ServerError(
                    f"the server could not read transaction {transaction_id} of partition "
                    f"{partition_id}: {response.error}"
                )
            with self._cache_lock:
                self.cache.put(key, response.data)
            future.set_result(response.data)
            return response.data
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: other waiters re-raise it themselves
            raise
        finally:
            self._fetching.pop(key, None)

    async def range_read(
        self,
        partition_id: int,
        start_transaction_id: int,
        *,
        max_records: int = 1000,
        max_bytes: int = 16 * 1024 * 1024,
    ) -> tuple[int, tuple[Record, ...]]:
        """Committed records with their data from ``start_transaction_id`` (bulk catch-up);
        returns the partition's high-water mark and the records."""
        response = await self._rpc(
            self._partition(partition_id),
            lambda req: RangeReadRequest(req, start_transaction_id, max_records, max_bytes),
            "range read",
        )
        if isinstance(response, ErrorResponse):
            raise ServerError(f"range read refused: {response.code.name}: {response.message}")
        if not isinstance(response, RangeReadResponse):
            raise ServerError(f"unexpected answer to a range read: {response}")
        return response.high_water_mark, tuple(response.records)  # (a tuple: no copy)

    # -- internals ---------------------------------------------------------------------------------

    def _next_req_id(self, partition_id: int, generation: int) -> ReqId:
        seq = next(self._req_seq)
        if seq > INT32_MAX:
            self._req_seq = itertools.count(1)
            seq = next(self._req_seq)
        return ReqId(self.client_id, generation, partition_id, seq)

    async def _channel_for(self, endpoint: str) -> _Channel:
        channel = self._channels.get(endpoint)
        if channel is not None and not channel.closed:
            return channel
        lock = self._channel_locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            channel = self._channels.get(endpoint)
            if channel is not None and not channel.closed:
                return channel
            if self.closing:
                raise _Lost("the client is closing")
            channel = _Channel(self, endpoint, next(self._network_seq))
            await channel.open()
            self._channels[endpoint] = channel
            return channel

    async def _watch_assignments(self) -> None:
        metadata = self.metadata
        for partition in self.partitions.values():
            self._watches.append(
                await metadata.watch_partition_assignment(partition.id, partition.on_assignment)
            )

    def _on_session(self, state: SessionState) -> None:
        if state is not SessionState.LOST or self.closing:
            return
        if not self._owns_coordination:
            log.error(
                "the coordination session of Waltz client %d was lost: partition moves are no "
                "longer followed; the Coordination passed in ClientConfig must be replaced by "
                "its owner (or pass a URI and the client reconnects by itself)",
                self.client_id,
            )
            return
        log.warning("coordination session lost; reconnecting to follow partition assignments")
        self._spawn(self._reconnect_coordination())

    async def _reconnect_coordination(self) -> None:
        assert isinstance(self.config.coordination, str)
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()
        if self._coordination is not None:
            with contextlib.suppress(WaltzError):
                await self._coordination.close()
        delay = self.config.retry_interval
        while not self.closing:
            coordination = coordination_from_uri(
                self.config.coordination, self.config.coordination_options
            )
            try:
                await coordination.start()
                self._coordination = coordination
                self._metadata = ClusterMetadata(coordination)
                await self._watch_assignments()
                coordination.add_session_listener(self._on_session)
                log.info("Waltz client %d: coordination session renewed", self.client_id)
                return
            except WaltzError as exc:
                log.warning("cannot reconnect to coordination yet: %s", exc)
                for watch in self._watches:
                    watch.cancel()
                self._watches.clear()
                with contextlib.suppress(WaltzError):
                    await coordination.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _channel_lost(self, channel: _Channel) -> None:
        if self._channels.get(channel.endpoint) is channel:
            del self._channels[channel.endpoint]

    async def _call_callback(self, fn: Callable[..., R | Awaitable[R]], *args: Any) -> R:
        if inspect.iscoroutinefunction(fn):
            result: R = await fn(*args)
            return result
        assert self._loop is not None and self._executor is not None
        value: Any = await self._loop.run_in_executor(self._executor, fn, *args)
        if inspect.isawaitable(value):
            value = await value
        done: R = value
        return done

    def _blocking_fetch(self, partition_id: int, transaction_id: int) -> bytes:
        if threading.get_ident() == self._loop_thread:
            raise ClientError(
                "Transaction.get_data() blocks, so it cannot run on the client's event loop; "
                "use `await transaction.fetch_data()` in async callbacks"
            )
        with self._cache_lock:  # a cache hit needs no trip to the loop
            cached = self.cache.get((partition_id, transaction_id))
        if cached is not None:
            return cached
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(
            self._fetch_data(partition_id, transaction_id), self._loop
        ).result(self.config.request_timeout * 2)

    def _report(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
        try:
            self.callbacks.uncaught_exception(partition_id, transaction_id, exc)
        except Exception:
            log.exception("uncaught_exception callback raised")
