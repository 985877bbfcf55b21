"""The asyncio client: submissions, flush, reads.

Layout, one event loop, four modules:

- :mod:`waltz_client.config`: :class:`~waltz_client.config.ClientConfig`.
- :mod:`waltz_client.channel`: :class:`~waltz_client.channel.Channel`, the two
  connections to one server (stream and RPC).
- :mod:`waltz_client.partition`: :class:`~waltz_client.partition.Partition`, one
  partition's mounting, feed and appends' outcomes (the I/O shell around the pure
  machines of :mod:`waltz_client.state`); how appends are decided (flush rounds,
  deadlines) is its part in :mod:`waltz_client.decisions`.
- :mod:`waltz_client.runner`: where the application's callbacks run.
- here: :class:`AsyncWaltzClient`: discovery (cluster metadata watches),
  submissions, flush, high-water mark, lazy data fetch with a bounded cache.

The direction is top down: the client makes its partitions and channels and tells them
what they need (:class:`~waltz_client.host.PartitionHost`,
:class:`~waltz_client.channel.ChannelHost`, both implemented by :class:`_Host`, which
the type checker holds to them where it is passed); they never import the client or
reach into it.

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
import itertools
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Executor
from types import TracebackType
from typing import Any, Self, TypeVar

from waltz_api.backoff import Backoff
from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.contracts.coordination import Coordination, SessionState, Watch
from waltz_api.contracts.transport import Transport
from waltz_api.errors import (
    ClientError,
    ServerError,
    TransportError,
    WaltzError,
)
from waltz_api.messages import (
    ErrorCode,
    ErrorResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    Message,
    RangeReadRequest,
    RangeReadResponse,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.types import NO_TRANSACTION, Record, ReqId
from waltz_client.api import (
    SubmissionResult,
    Transaction,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_client.batch import Coalescer, run_many
from waltz_client.channel import Carried, Channel, ChannelLost
from waltz_client.config import POISON_POLICIES, ClientConfig
from waltz_client.decisions import Expired as _Expired
from waltz_client.decisions import before_deadline, call_hook
from waltz_client.errors import TransactionExpiredError, access_denied
from waltz_client.partition import MAX_RETRY_DELAY, MOVED_CODES, Partition
from waltz_client.runner import CALLBACK_THREAD_PREFIX, Built, CallbackRunner
from waltz_client.state import (
    Outcome,
    Resolution,
    TransactionDataCache,
)

__all__ = ["CALLBACK_THREAD_PREFIX", "POISON_POLICIES", "AsyncWaltzClient", "ClientConfig"]

log = logging.getLogger(__name__)

R = TypeVar("R")
M = TypeVar("M", bound=Message)
INT32_MAX = 2**31 - 1
_MAX_COORDINATION_DELAY = 5.0
"""The longest pause between two attempts to renew a lost coordination session."""


_NO_OP_ON_COMPLETION = TransactionContext.on_completion
"""The default hook, which does nothing (not called: a call per submission saved)."""


class AsyncWaltzClient:
    """The Waltz client on an asyncio event loop.

    ::

        async with AsyncWaltzClient(callbacks, ClientConfig("zk://127.0.0.1:2181/waltz")) as c:
            committed = await c.submit(Deposit(account=7, amount=100))
            await c.flush(0)

    Plain (non-async) callbacks and ``execute`` run on one callback thread, in
    order; ``async def`` ones run on the loop.
    """

    def __init__(
        self,
        callbacks: WaltzClientCallbacks,
        config: ClientConfig,
        *,
        rng: random.Random | None = None,
        callback_executor: Executor | None = None,
    ) -> None:
        if not isinstance(callbacks, WaltzClientCallbacks):
            raise ClientError(
                f"callbacks must be a WaltzClientCallbacks, got {type(callbacks).__name__}"
            )
        if not isinstance(config, ClientConfig):
            raise ClientError(f"config must be a ClientConfig, got {type(config).__name__}")
        if (
            config.poison_policy == "skip"
            and type(callbacks).dead_letter is WaltzClientCallbacks.dead_letter
        ):
            raise ClientError(
                f"ClientConfig(poison_policy='skip') needs {type(callbacks).__name__}."
                "dead_letter: it records a skipped transaction and advances the partition's "
                "high-water mark past it (the SQL helpers implement it)"
            )
        self.callbacks = callbacks
        self.config = config
        self._runner = CallbackRunner(callbacks, callback_executor)
        self.hwm_is_async = self._runner.hwm_is_async
        self.apply_is_async = self._runner.apply_is_async
        self._context_types: set[type] = set()
        """The classes of the contexts submitted so far (all TransactionContexts)."""
        self._submit_names: dict[int, str] = {}
        """partition id -> the name of its submission tasks."""
        self.client_id = -1
        self.num_partitions = 0
        self.partitions: dict[int, Partition] = {}
        self.closing = False
        self.transactions_seen = 0
        self.cache: TransactionDataCache[tuple[int, int]] = TransactionDataCache(
            config.data_cache_bytes
        )
        self._transport: Transport | None = None
        self._coordination: Coordination | None = None
        self._owns_coordination = isinstance(config.coordination, str)
        self._metadata: ClusterMetadata | None = None
        self._channels: dict[str, Channel] = {}
        self._channel_locks: dict[str, asyncio.Lock] = {}
        self._network_seq = itertools.count(1)
        self._req_seq = itertools.count(1)
        self._watches: list[Watch] = []
        self._fetching: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._cache_lock = threading.Lock()
        self._started = False
        self.rng = rng or random.Random()
        """The jitter of every retry's back-off (inject a seeded one to replay a run)."""
        self._host = _Host(self)
        self._coalescer = Coalescer(self._host)
        """What the partitions and channels are told of this client."""

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

        self._runner.start()
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
                partition = Partition(self._host, p)
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
        self._runner.shutdown()

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

    def _partition_of(self, context: TransactionContext) -> Partition:
        kind = type(context)
        if kind not in self._context_types:  # (an ABC's isinstance is a Python call)
            if not isinstance(context, TransactionContext):
                raise ClientError(f"submit() takes a TransactionContext, got {kind.__name__}")
            if len(self._context_types) > 1000:  # contexts of ever new classes
                self._context_types.clear()
            self._context_types.add(kind)
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

    async def enqueue(self, context: TransactionContext) -> asyncio.Task[SubmissionResult]:
        """Wait for a free slot in the context's partition (back pressure), then start
        the transaction; the task resolves like :meth:`submit`. Cancelling the task
        gives up the submission and its slot (an append already sent may still commit;
        the feed then delivers it like any other transaction)."""
        partition = await self._slot(context)
        name = self._submit_names.get(partition.id)
        if name is None:
            name = self._submit_names[partition.id] = f"waltz-submit-{partition.id}"
        return asyncio.get_running_loop().create_task(self._run(partition, context), name=name)

    async def submit(self, context: TransactionContext) -> SubmissionResult:
        """Execute ``context`` until its outcome is known: a :class:`SubmissionResult`,
        true when committed (with the transaction id), false when ``execute`` declined.
        Raises :class:`TransactionExpiredError` (not committed by the deadline),
        :class:`TransactionOutcomeUnknownError` (the server could not be asked), what
        ``execute`` raised (after ``on_exception``), ClientAheadError,
        AuthenticationError (the partition's server refuses this client's transport
        credentials; nothing was sent), or ClientError when the client closes. Waits
        for a slot first (back pressure)."""
        partition = await self._slot(context)
        return await self._run(partition, context)

    async def submit_many(
        self, contexts: Iterable[TransactionContext]
    ) -> list[SubmissionResult | BaseException]:
        """Submit many transactions in this task (not a task each): one build hop for
        those ready together, one send per partition (see :mod:`waltz_client.batch`).
        Returns, in the order given, each one's :class:`SubmissionResult` or the error
        :meth:`submit` would have raised for it (each is decided on its own: one lock
        failure or expiry touches no other). Each holds a slot while it runs; a batch
        larger than the free slots runs in turns. Deadlines count from this call."""
        return await run_many(self._host, list(contexts))

    def submit_nowait(self, context: TransactionContext) -> asyncio.Future[SubmissionResult]:
        """Start ``context`` without a task of its own: the future resolves (or
        raises) as :meth:`submit` returns (or raises). The submissions made in one turn of
        the event loop run as one batch (:meth:`submit_many`), in one task. Never waits:
        a submission beyond its partition's free slots waits in its batch. Cancelling
        the future gives it up (when it is not in flight). Raises ClientError at once
        for a context :meth:`submit` refuses (no partition, the client not running)."""
        return self._coalescer.submit(context)

    async def _slot(self, context: TransactionContext) -> Partition:
        partition = self._partition_of(context)
        partition.check_usable()
        if partition.limit.try_acquire_free():
            return partition  # a free slot, taken without waiting: nothing changed meanwhile
        await partition.acquire_slot()
        try:
            partition.check_usable()
        except BaseException:
            partition.release_slot()
            raise
        return partition

    async def _run(self, partition: Partition, context: TransactionContext) -> SubmissionResult:
        """One submission, holding a slot: (re)executed until decided."""
        number = partition.submissions.start()
        timeout = self.config.transaction_timeout
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            p = partition.id
            while True:
                partition.check_usable()
                if not partition.mount.appends_allowed:
                    await self._before_deadline(
                        partition.wait_mounted(), deadline, partition.unwritable
                    )
                elif deadline is not None and loop.time() >= deadline:
                    raise _Expired("the deadline passed as it was about to be executed again")
                builder, go = await self._runner.build(context, p)
                if not go:
                    call_hook(context.on_completion, False)
                    return SubmissionResult(False, p, NO_TRANSACTION, context.attempts)
                size = builder.wire_size  # checked before anything is sent
                if size > self.transport.max_frame_size:
                    builder.check_size(self.transport.max_frame_size)
                channel = partition.channel
                if not partition.mount.appends_allowed or channel is None:
                    continue  # a mount started while executing: build again after it
                if size > channel.max_frame_size:  # below the transport's: the server's
                    builder.check_size(channel.max_frame_size, "the server's")
                outcome = await partition.send_append(channel, context, builder, deadline)
                if outcome is None:
                    continue  # a mount started while it waited for its turn: build again
                resolution = await outcome
                if resolution.outcome is Outcome.COMMITTED:
                    transaction_id = resolution.transaction_id
                    if transaction_id > partition.committed_top:
                        partition.committed_top = transaction_id
                    hook = context.on_completion
                    if getattr(hook, "__func__", None) is not _NO_OP_ON_COMPLETION:
                        call_hook(hook, True)
                    return SubmissionResult(True, p, transaction_id, context.attempts)
                await self._before_retry(partition, context, resolution, deadline)
        except _Expired as expired:
            # true: every attempt was never sent, or was decided by what the server sent
            # back after it took the attempt's frame (sends in the partition's turn)
            call_hook(context.on_expiration)
            raise TransactionExpiredError(
                f"{type(context).__name__} expired: not committed within {timeout} s "
                f"({context.attempts} attempts): {expired}. It will not be committed: "
                "nothing of it is pending"
            ) from None
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                call_hook(context.on_exception, exc)
            raise
        finally:
            partition.finished(number)

    async def _before_retry(
        self,
        partition: Partition,
        context: TransactionContext,
        resolution: Resolution,
        deadline: float | None,
    ) -> None:
        """An attempt was not committed: wait until it may be executed again (after a
        lock failure, until the feed reached the transaction that made it fail)."""
        failed = resolution.reason
        if resolution.outcome is Outcome.LOCK_FAILED:
            call_hook(context.on_lock_failure, resolution.transaction_id)
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise _Expired(f"its last attempt was not committed: {failed}")
        if resolution.outcome is Outcome.LOCK_FAILED:
            failing = resolution.transaction_id

            def lock_wait() -> str:
                return (
                    f"its last attempt was not committed ({failed}), and this client's "
                    f"feed had not reached transaction {failing} to retry on the state "
                    f"it made (at {partition.feed.position}; {partition.unwritable()})"
                )

            await self._before_deadline(partition.wait_retry(failing), deadline, lock_wait)
        else:

            def retry_wait() -> str:
                waiting = partition.unwritable()
                return f"its last attempt was not committed ({failed}), and {waiting}"

            await self._before_deadline(partition.wait_retry(None), deadline, retry_wait)

    _before_deadline = staticmethod(before_deadline)

    # -- flush, high-water mark, data --------------------------------------------------------------

    def _partition(self, partition_id: int) -> Partition:
        partition = self.partitions.get(partition_id)
        if partition is None:
            raise ClientError(f"partition {partition_id} is not mounted by this client")
        partition.check_usable()
        return partition

    async def flush(self, partition_id: int, timeout: float | None = None) -> int:
        """Wait until every submission to the partition started before this call is
        decided (committed, declined, expired...) and the feed has delivered everything
        the partition committed before the call; returns the partition's high-water
        mark (at least that of every submission it covered). Raises ServerError when the
        server does not answer, ClientError when a covered submission is still undecided,
        both after ``timeout`` (default ``request_timeout``). A feed being delivered
        answers: while it advances (a long catch-up before the mount completes, a slow
        apply_transaction) the wait for it goes on."""
        timeout = timeout or self.config.request_timeout
        partition = self._partition(partition_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        mark = partition.submissions.mark
        covered = partition.submissions.running_up_to(mark)
        top = await partition.flush_round(timeout)
        undecided = await partition.wait_submissions(mark, max(deadline - loop.time(), 0))
        if undecided:
            raise ClientError(
                f"flush of partition {partition_id}: {undecided} of the {covered} "
                f"submissions it covers were still undecided after {timeout} s "
                f"({partition.unwritable()}); flush again, or bound them with "
                "ClientConfig.transaction_timeout"
            )
        return max(top, partition.committed_top)

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

    async def _rpc(self, partition: Partition, make: Callable[[ReqId], M], what: str) -> Message:
        loop = asyncio.get_running_loop()
        timeout = self.config.request_timeout
        deadline = loop.time() + timeout
        backoff = self.retry_backoff()
        while True:
            partition.check_usable()
            if partition.mount.endpoint:
                try:
                    channel = await partition.connect(partition.mount.endpoint)
                    req_id = self._next_req_id(partition.id, partition.mount.generation)
                    remaining = deadline - loop.time()
                    response = await channel.call(make(req_id), req_id, max(remaining, 0.001))
                    if (
                        isinstance(response, ErrorResponse)
                        and response.code is ErrorCode.ACCESS_DENIED
                    ):
                        raise access_denied(partition.id, "read", what, response)
                    if not (isinstance(response, ErrorResponse) and response.code in MOVED_CODES):
                        return response
                    log.debug("%s refused (%s), retrying", what, response.message)
                except (ChannelLost, TransportError, TimeoutError) as exc:
                    log.debug("%s failed, retrying: %s", what, exc)
            if loop.time() >= deadline:
                raise ServerError(
                    f"{what}: no answer from partition {partition.id}'s server within {timeout} s"
                )
            await backoff.sleep()

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
            self._cache_put(partition_id, transaction_id, response.data)
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

    async def _channel_for(self, endpoint: str) -> Channel:
        channel = self._channels.get(endpoint)
        if channel is not None and not channel.closed:
            return channel
        lock = self._channel_locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            channel = self._channels.get(endpoint)
            if channel is not None and not channel.closed:
                return channel
            if self.closing:
                raise ChannelLost("the client is closing")
            channel = Channel(self._host, endpoint, next(self._network_seq))
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
        backoff = Backoff(self.config.retry_interval, _MAX_COORDINATION_DELAY, self.rng)
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
            await backoff.sleep()

    def retry_backoff(self) -> Backoff:
        """The pacing of one request's retries: from ``retry_interval`` up to 1 s."""
        interval = self.config.retry_interval
        return Backoff(interval, max(interval, MAX_RETRY_DELAY), self.rng)

    def _cache_put(self, partition_id: int, transaction_id: int, data: bytes) -> None:
        with self._cache_lock:
            self.cache.put((partition_id, transaction_id), data)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _blocking_fetch(self, partition_id: int, transaction_id: int) -> bytes:
        on_loop = self._runner.on_loop_thread()
        if on_loop and self._runner.given_executor is None:
            raise ClientError(
                "Transaction.get_data() blocks, so it cannot run on the client's event loop; "
                "use `await transaction.fetch_data()` in async callbacks"
            )
        with self._cache_lock:  # a cache hit needs no trip to the loop
            cached = self.cache.get((partition_id, transaction_id))
        if cached is not None:
            return cached
        if on_loop:  # the callback executor runs on the loop: waiting would block it
            raise ClientError(f"the data of transaction {transaction_id} is not prefetched")
        assert self._runner.loop is not None
        return asyncio.run_coroutine_threadsafe(
            self._fetch_data(partition_id, transaction_id), self._runner.loop
        ).result(self.config.request_timeout * 2)


class _Host:
    """What this client tells its partitions (:class:`~waltz_client.host.PartitionHost`)
    and its channels (:class:`~waltz_client.channel.ChannelHost`). The services a
    partition uses per transaction are the client's own bound methods (no call in
    between); the rest are read through."""

    __slots__ = (
        "_client",
        "_runner",
        "apply",
        "apply_is_async",
        "blocking_fetch",
        "cache_put",
        "callbacks",
        "config",
        "fetch_data",
        "next_req_id",
        "rng",
    )

    def __init__(self, client: AsyncWaltzClient) -> None:
        self._client = client
        self._runner = runner = client._runner
        self.config = client.config
        self.callbacks = client.callbacks
        self.rng = client.rng
        self.apply_is_async = client.apply_is_async
        self.next_req_id: Callable[[int, int], ReqId] = client._next_req_id
        self.fetch_data: Callable[[int, int], Awaitable[bytes]] = client._fetch_data
        self.blocking_fetch: Callable[[int, int], bytes] = client._blocking_fetch
        self.cache_put: Callable[[int, int, bytes], None] = client._cache_put
        self.apply: Callable[[Transaction], Awaitable[None]] = runner.apply

    @property
    def closing(self) -> bool:
        return self._client.closing

    @property
    def metadata(self) -> ClusterMetadata:
        return self._client.metadata

    @property
    def transport(self) -> Transport:
        return self._client.transport

    @property
    def client_id(self) -> int:
        return self._client.client_id

    @property
    def connect_timeout(self) -> float:
        return self.config.connect_timeout

    async def connect(self, endpoint: str) -> Channel:
        return await self._client._channel_for(endpoint)

    async def call_callback(self, fn: Callable[..., R | Awaitable[R]], *args: Any) -> R:
        return await self._runner.call(fn, *args)

    async def on_callback_thread(self, fn: Callable[..., R], *args: Any) -> R:
        return await self._runner.on_thread(fn, *args)

    def report(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
        try:
            self.callbacks.uncaught_exception(partition_id, transaction_id, exc)
        except Exception:
            log.exception("uncaught_exception callback raised")

    def count_seen(self, count: int) -> None:
        self._client.transactions_seen += count

    def retry_backoff(self) -> Backoff:
        return self._client.retry_backoff()

    def partition(self, partition_id: int) -> Carried | None:
        return self._client.partitions.get(partition_id)

    def channel_lost(self, channel: Channel) -> None:
        channels = self._client._channels
        if channels.get(channel.endpoint) is channel:
            del channels[channel.endpoint]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._client._spawn(coro)

    def partition_of(self, context: TransactionContext) -> Partition:
        return self._client._partition_of(context)

    def build_many(
        self, items: list[tuple[TransactionContext, int]]
    ) -> Awaitable[list[Built | BaseException]]:
        return self._runner.build_many(items)
