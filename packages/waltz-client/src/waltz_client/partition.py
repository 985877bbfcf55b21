"""One partition as the client sees it: mounting, the feed, appends' outcomes (how
appends are decided, flush rounds and deadlines, is :mod:`waltz_client.decisions`).

:class:`Partition` holds the partition's mount sequencing, transaction monitor,
feed position, retry queue and concurrency limit (the pure machines of
:mod:`waltz_client.state`) and turns their decisions into I/O: a worker task
processes the partition's stream messages strictly in order, a second one
(re)mounts it whenever its assignment or connection changes. What it needs of the
client it is told (:class:`~waltz_client.host.PartitionHost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from typing import Any

from waltz_api.backoff import Backoff
from waltz_api.cluster import NO_SERVER, PartitionAssignment
from waltz_api.errors import (
    AuthenticationError,
    ClientAheadError,
    ClientError,
    ProtocolError,
    TransportError,
    WaltzError,
)
from waltz_api.messages import (
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushResponse,
    HighWaterMarkResponse,
    LockFailure,
    Message,
    MountRequest,
    MountResponse,
)
from waltz_api.types import NO_TRANSACTION, ReqId
from waltz_client.api import Transaction
from waltz_client.channel import Channel, ChannelLost, Inbox
from waltz_client.decisions import AppendDecisions, SentAppend
from waltz_client.errors import PoisonTransactionError, access_denied
from waltz_client.host import PartitionHost
from waltz_client.state import (
    ApplyDecision,
    ApplyFailures,
    ConcurrencyLimit,
    FeedAction,
    FeedTracker,
    MountDecision,
    MountSequencer,
    MountState,
    RetryQueue,
    RunningSubmissions,
    TransactionMonitor,
)

log = logging.getLogger(__name__)

_INBOX_SIZE = 4096
_FEED_BATCH = 512
MOVED_CODES = frozenset(
    {ErrorCode.PARTITION_NOT_ASSIGNED, ErrorCode.STALE_GENERATION, ErrorCode.SERVER_BUSY}
)
"""Refusals that mean "ask again (maybe elsewhere)": the request is retried."""

MAX_RETRY_DELAY = 1.0
"""The longest pause between two attempts of a mount or a request (back-off cap)."""
MAX_APPLY_RETRY_DELAY = 10.0
"""The longest pause before a transaction apply_transaction failed on is offered again."""


class Partition(AppendDecisions):
    def __init__(self, host: PartitionHost, partition_id: int) -> None:
        self.host = host
        self.id = partition_id
        self.mount = MountSequencer()
        self.monitor = TransactionMonitor()
        self.feed = FeedTracker()
        self.retries: RetryQueue[asyncio.Future[None]] = RetryQueue()
        self.limit: ConcurrencyLimit[asyncio.Future[None]] = ConcurrencyLimit(
            host.config.max_concurrent_transactions
        )
        self.appends: dict[ReqId, SentAppend] = {}
        self.requests: dict[ReqId, asyncio.Future[Message]] = {}
        self.submissions = RunningSubmissions()
        """The running submissions (what a flush waits for)."""
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.committed_top = NO_TRANSACTION
        """The highest transaction id a submission of this client committed at."""
        self._decision: asyncio.Task[None] | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = 0.0
        self._decision_covers = 0
        """The monitor's flush mark when the running decision flush started (it covers
        every append registered up to it)."""
        self.channel: Channel | None = None
        self.inbox: Inbox[tuple[Channel, Message]] = Inbox(_INBOX_SIZE)
        self.mounted = asyncio.Event()
        self.need_mount = asyncio.Event()
        self._position_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        """A heap of waits for the feed to reach a transaction id."""
        self._waiter_order = itertools.count()
        self._progress = 0
        """Feed progress so far (what keeps a mount that is streaming a catch-up alive)."""
        self.failure: WaltzError | None = None
        self._unreachable: Exception | None = None  # why the last connect failed
        self.mounts = 0
        """Mounts completed (READY) so far."""
        self._tasks: list[asyncio.Task[None]] = []
        self._delayed: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        interval = host.config.retry_interval
        self._mount_backoff = Backoff(interval, max(interval, MAX_RETRY_DELAY), host.rng)
        """Paces mounts while they keep failing (an unreachable server, NOT_READY...)."""
        self._apply_failures = ApplyFailures(host.config.apply_retries)
        self._apply_backoff = Backoff(interval, max(interval, MAX_APPLY_RETRY_DELAY), host.rng)
        """Paces the offers of a transaction apply_transaction keeps failing on."""
        self._mount_timer: asyncio.TimerHandle | None = None
        self.reassigned = asyncio.Event()
        self._mount_progress = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._maintain(), name=f"waltz-client-mount-{self.id}"),
            loop.create_task(self._work(), name=f"waltz-client-feed-{self.id}"),
        ]

    async def stop(self) -> None:
        for timer in (self._delayed, self._mount_timer, self._deadline_timer):
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
            *(append.outcome for append in self.appends.values()),
            *self.requests.values(),
            *self.retries.drain(),
            *self.limit.drain(),
        ]
        for future in futures:
            if not future.done():
                future.set_exception(closed)
        self.appends.clear()
        self.requests.clear()
        self.mounted.set()  # wake waiters; they see the client closed
        self._wake_position_waiters()

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

    async def connect(self, endpoint: str) -> Channel:
        """The channel to ``endpoint``; gives up (ChannelLost) as soon as the partition is
        reassigned, since a connection attempt to a dead server can take the whole
        connect timeout."""
        changed = self.reassigned
        connecting = asyncio.ensure_future(self.host.connect(endpoint))
        waiting = asyncio.ensure_future(changed.wait())
        try:
            await asyncio.wait({connecting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            moved = not connecting.done()
            if moved:  # reassigned, or this call cancelled (the client closes): it stops too
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
        if moved:
            raise ChannelLost(f"partition {self.id} moved while connecting to {endpoint}")
        return connecting.result()

    def _detach(self, channel: Channel | None) -> None:
        if channel is not None:
            channel.partitions.discard(self)
        self.channel = None
        for future in self.requests.values():
            if not future.done():
                future.set_exception(ChannelLost("the partition moved"))

    def channel_lost(self, channel: Channel) -> None:
        if channel is not self.channel:
            return
        self._detach(channel)
        self.mounted.clear()
        if self.mount.on_disconnect():
            self._remount_later()

    def _remount_later(self, *, refresh: bool = False, delay: float | None = None) -> None:
        """Mount again after ``delay`` (default: the mount back-off), re-reading the
        assignment first when ``refresh``."""
        if self.host.closing or self._delayed is not None:
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

        if delay is None:
            delay = self._mount_backoff.next_delay()
        self._delayed = loop.call_later(delay, fire)

    async def _refresh(self) -> None:
        try:
            stored = await self.host.metadata.partition_assignment(self.id)
        except WaltzError as exc:
            log.warning("cannot read partition %d's assignment: %s", self.id, exc)
            self._remount_later(refresh=True)
            return
        self.on_assignment(stored.value)
        if self.mount.state is MountState.UNMOUNTED:
            self.need_mount.set()

    async def _maintain(self) -> None:
        host = self.host
        while not host.closing:
            await self.need_mount.wait()
            self.need_mount.clear()
            if self.mount.state is not MountState.UNMOUNTED:
                continue
            endpoint = self.mount.endpoint
            generation = self.mount.generation
            try:
                try:
                    channel = await self.connect(endpoint)
                except ChannelLost:
                    if self.mount.endpoint != endpoint or self.mount.generation != generation:
                        continue  # reassigned meanwhile: need_mount is set
                    raise
                self._unreachable = None
                self.mounted.clear()
                app_hwm = await host.call_callback(host.callbacks.client_high_water_mark, self.id)
            except (TransportError, ProtocolError, ChannelLost) as exc:
                log.warning("partition %d: cannot reach %s: %s", self.id, endpoint, exc)
                self._unreachable = exc
                if isinstance(exc, AuthenticationError):
                    self.mounted.set()  # wake waiters: they fail; mounts go on (keys change)
                else:
                    self.mounted.clear()
                self._remount_later(refresh=True)
                continue
            except Exception as exc:
                log.exception("partition %d: client_high_water_mark failed", self.id)
                host.report(self.id, NO_TRANSACTION, exc)
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
                host.report(
                    self.id,
                    NO_TRANSACTION,
                    ClientError(f"client_high_water_mark returned {app_hwm!r}, not an int"),
                )
                self._remount_later()
                continue
            mount_from = self.feed.start_mount(app_hwm)
            req_id = host.next_req_id(self.id, generation)
            self.mount.begin_mount(req_id, channel.seq_num)
            if self.channel is not channel:
                self._detach(self.channel)
            self.channel = channel
            channel.partitions.add(self)
            try:
                mount = MountRequest(req_id, mount_from, channel.seq_num)
                await self.send_in_turn(channel, lambda: mount)  # noqa: B023 (called here)
            except ChannelLost:
                continue  # channel_lost() scheduled the next mount
            if self._mount_timer is not None:
                self._mount_timer.cancel()
            self._mount_progress = self._progress
            self._mount_timer = asyncio.get_running_loop().call_later(
                host.config.request_timeout, self._mount_timed_out, req_id
            )

    def _mount_timed_out(self, req_id: ReqId) -> None:
        self._mount_timer = None
        loop = asyncio.get_running_loop()
        timeout = self.host.config.request_timeout
        if self.mount.state is MountState.MOUNTING and self._progress != self._mount_progress:
            # a long catch-up feed is streaming: the mount is alive, wait on
            self._mount_progress = self._progress
            self._mount_timer = loop.call_later(timeout, self._mount_timed_out, req_id)
            return
        if self.mount.state is MountState.MOUNTING and self.mount.mount_req_id == req_id:
            log.warning(
                "partition %d: no answer to the mount from %s within %s s; mounting again",
                self.id,
                self.mount.endpoint,
                self.host.config.request_timeout,
            )
            self.mount.unmount()
            self._remount_later(refresh=True)

    # -- the stream, in order ----------------------------------------------------------------------

    async def _work(self) -> None:
        inbox = self.inbox
        batchable, prefetch = not self.host.apply_is_async, self.host.config.prefetch_data
        while True:
            channel, message = await inbox.get()
            if channel is not self.channel:
                continue  # a message of a replaced connection or an earlier assignment
            try:
                if isinstance(message, FeedData) and (prefetch or not inbox.empty()):
                    # consecutive feed items go to the callback thread in one hop
                    run = [message]
                    pending: tuple[Channel, Message] | None = None
                    while not inbox.empty() and len(run) < _FEED_BATCH:
                        item = inbox.get_nowait()
                        if item[0] is channel and isinstance(item[1], FeedData):
                            run.append(item[1])
                        else:
                            pending = item
                            break
                    if self.host.config.prefetch_data:
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
        cache, so the callbacks' fetches hit it. Failures are left to the callbacks. An
        append of ours (its request id) is not fetched: the client sent its data, which
        goes into the cache here."""
        position, ours, host = self.feed.position, self.appends, self.host
        fetches = []
        for m in run:
            if m.transaction_id <= position:
                continue
            append = ours.get(m.req_id)
            if append is None:
                fetches.append(host.fetch_data(self.id, m.transaction_id))
            else:
                host.cache_put(self.id, m.transaction_id, append.data)
        if fetches:
            await asyncio.gather(*fetches, return_exceptions=True)

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
        host = self.host
        monitor = self.monitor
        resolutions = [self._decided(monitor.on_feed(m.req_id, m.transaction_id)) for m in items]
        transactions = [
            Transaction(
                self.id,
                m.transaction_id,
                m.header,
                m.req_id,
                fetch=host.fetch_data,
                blocking=host.blocking_fetch,
            )
            for m in items
        ]
        apply = host.callbacks.apply_transaction

        def apply_all(start: int) -> tuple[int, Exception | None]:
            for k in range(start, len(transactions)):
                try:
                    apply(transactions[k])
                except Exception as exc:
                    return k, exc
            return len(transactions), None

        start = 0
        progressed = False
        while start < len(items):
            done, error = await host.on_callback_thread(apply_all, start)
            for k in range(start, done):
                self._resolve(resolutions[k], applied=True)
                self.feed.advance(items[k].transaction_id)
            host.count_seen(done - start)
            if done > start:
                progressed = True
                self._applied(items[done - 1].transaction_id)
            if error is None:
                break
            self._resolve(resolutions[done], applied=False)  # committed, not applied
            if not await self._apply_failed(transactions[done], error):
                for k in range(done + 1, len(items)):
                    self._resolve(resolutions[k], applied=False)
                break
            self.feed.advance(items[done].transaction_id)  # skipped: handed to dead_letter
            host.count_seen(1)
            progressed = True
            start = done + 1
        if progressed:
            self._advance_waiters()

    def _applied(self, transaction_id: int) -> None:
        if self._apply_failures.on_applied(transaction_id):
            self._apply_backoff.reset()

    async def _apply_failed(self, transaction: Transaction, exc: Exception) -> bool:
        """``apply_transaction`` raised on ``transaction``: offer it again later, stop the
        partition, or skip it (True: handed to dead_letter, the feed goes on)."""
        host = self.host
        transaction_id = transaction.transaction_id
        decision = self._apply_failures.on_failure(transaction_id)
        host.report(self.id, transaction_id, exc)
        if decision is ApplyDecision.RETRY:
            delay = self._apply_backoff.next_delay()
            log.warning(
                "partition %d: apply_transaction(%d) failed (%d of %d tries): %r; the feed "
                "restarts from the client high-water mark in %.1f s",
                self.id,
                transaction_id,
                self._apply_failures.failures,
                host.config.apply_retries + 1,
                exc,
                delay,
            )
            self._unmount_and_retry(delay)
            return False
        tries = host.config.apply_retries + 1
        if host.config.poison_policy == "skip":
            try:
                await host.call_callback(host.callbacks.dead_letter, transaction, exc)
            except Exception as hook_exc:
                self._fail_partition(
                    PoisonTransactionError(
                        f"partition {self.id} stopped at transaction {transaction_id}: "
                        f"apply_transaction failed {tries} times ({exc!r}) and dead_letter "
                        f"raised {hook_exc!r}, so it cannot be skipped. Fix dead_letter (it "
                        "must record the transaction and advance the high-water mark past "
                        "it), then restart the client",
                        self.id,
                        transaction_id,
                    ),
                    transaction_id,
                )
                return False
            log.warning(
                "partition %d: transaction %d skipped: apply_transaction failed %d times (%r); "
                "it went to dead_letter (poison_policy='skip')",
                self.id,
                transaction_id,
                tries,
                exc,
            )
            return True
        self._fail_partition(
            PoisonTransactionError(
                f"partition {self.id} stopped at transaction {transaction_id}: "
                f"apply_transaction failed on it {tries} times, last with {exc!r}; nothing "
                "after it is applied and submissions to the partition fail. Fix "
                "apply_transaction (or what it depends on), then restart the client: it "
                "resumes from client_high_water_mark. To skip such transactions instead, "
                "set ClientConfig(poison_policy='skip') and implement "
                "WaltzClientCallbacks.dead_letter",
                self.id,
                transaction_id,
            ),
            transaction_id,
        )
        return False

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
        resolutions = self._decided(self.monitor.on_feed(message.req_id, message.transaction_id))
        if action is FeedAction.APPLY:
            host = self.host
            transaction = Transaction(
                self.id,
                message.transaction_id,
                message.header,
                message.req_id,
                fetch=host.fetch_data,
                blocking=host.blocking_fetch,
            )
            try:
                await host.apply(transaction)
            except Exception as exc:
                self._resolve(resolutions, applied=False)
                if not await self._apply_failed(transaction, exc):
                    return
                action = FeedAction.SKIP  # handed to dead_letter: the feed goes on
            else:
                self._applied(message.transaction_id)
        self._resolve(resolutions, applied=action is FeedAction.APPLY)
        self.feed.advance(message.transaction_id)
        self.host.count_seen(1)
        self._advance_waiters()

    def _unmount_and_retry(self, delay: float | None = None) -> None:
        self.mount.unmount()
        self.mounted.clear()
        self._remount_later(delay=delay)

    def _advance_waiters(self) -> None:
        self._progress += 1
        waiters = self._position_waiters
        if waiters:
            position = self.feed.position
            while waiters and waiters[0][0] <= position:
                future = heapq.heappop(waiters)[2]
                if not future.done():
                    future.set_result(None)
        if self.retries:
            self._release_retries()

    def _wake_position_waiters(self) -> None:
        """Every wait for a feed position looks again (the partition stopped)."""
        waiters, self._position_waiters = self._position_waiters, []
        for _, _, future in waiters:
            if not future.done():
                future.set_result(None)

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
            self._mount_backoff.reset()
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

    def _fail_partition(self, error: WaltzError, transaction_id: int = NO_TRANSACTION) -> None:
        """Stop the partition for good: no more mounts; what waits fails with ``error``."""
        log.error("%s", error)
        self.failure = error
        if self.mount.state is not MountState.FAILED:
            self.mount.fail()
        self._detach(self.channel)
        self.host.report(self.id, transaction_id, error)
        for append in self.appends.values():
            if not append.outcome.done():
                append.outcome.set_exception(error)
        self.appends.clear()
        others: list[asyncio.Future[Any]] = [*self.requests.values(), *self.retries.drain()]
        for future in others:
            if not future.done():
                future.set_exception(error)
        self.requests.clear()
        self.mounted.set()
        self._wake_position_waiters()

    def _on_error(self, message: ErrorResponse) -> None:
        req_id = message.req_id
        if message.code is ErrorCode.ACCESS_DENIED:
            self._on_denied(message)
            return
        if req_id == self.mount.mount_req_id:
            log.warning("partition %d: mount refused: %s", self.id, message.message)
            if self.mount.on_mount_refused(req_id) is MountDecision.RETRY:
                self.mounted.clear()
                self._remount_later(refresh=True)
            return
        future = self.requests.pop(req_id, None)
        if future is not None:
            if not future.done():
                future.set_exception(ChannelLost(f"{message.code.name}: {message.message}"))
            return
        if req_id in self.monitor:
            if message.code in MOVED_CODES:
                # not a decision about the append: the partition left that server, which
                # may have given it an id first; the next mount decides it (its feed holds
                # every committed transaction before READY; what is still pending then
                # failed), so it is never re-executed while it may still commit
                log.info(
                    "partition %d: append %s refused as %s (%s); the next mount decides it",
                    self.id,
                    req_id,
                    message.code.name,
                    message.message,
                )
                self._unmount_and_refresh()
                return
            if message.code is ErrorCode.NOT_COMMITTED:
                reason = (
                    f"the server decided it is not committed (NOT_COMMITTED: {message.message})"
                )
            else:
                reason = f"the server refused it ({message.code.name}: {message.message})"
            self._resolve(self.monitor.on_refused(req_id, reason))
            return
        if message.code in MOVED_CODES and self.mount.state is MountState.MOUNTED:
            # not about a request of ours: the server says the partition left it
            log.info("partition %d: %s; re-reading the assignment", self.id, message.message)
            self._unmount_and_refresh()
            return
        log.warning("partition %d: server error %s: %s", self.id, message.code.name, message)

    def _on_denied(self, message: ErrorResponse) -> None:
        """ACCESS_DENIED: final for what it answers. A refused mount stops the partition
        (nothing can be read: it fails what waits and every later submission); a refused
        append or request fails that one alone."""
        req_id = message.req_id
        if req_id == self.mount.mount_req_id:
            self._fail_partition(access_denied(self.id, "read", "mounting", message))
            return
        future = self.requests.pop(req_id, None)
        if future is not None:
            if not future.done():
                future.set_exception(access_denied(self.id, "read", "a request", message))
            return
        if req_id in self.monitor:
            self.monitor.on_refused(req_id)
            append = self.appends.pop(req_id, None)
            if append is not None and not append.outcome.done():
                append.outcome.set_exception(access_denied(self.id, "write", "an append", message))
            return
        if self.mount.state is MountState.MOUNTED:
            # not about a request of ours: the server stopped this client's reads here
            self._fail_partition(access_denied(self.id, "read", "reading", message))
            return
        log.warning("partition %d: %s", self.id, message.message)

    def _unmount_and_refresh(self) -> None:
        self.mount.unmount()
        self.mounted.clear()
        self._remount_later(refresh=True)

    # -- used by submissions -----------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.host.closing:
            raise ClientError("the Waltz client is closed")

    async def acquire_slot(self) -> None:
        if self.limit.try_acquire_free():
            return
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
        """Until appends may flow; AuthenticationError while the server refuses this
        client's credentials (what waits here has nothing in flight)."""
        while True:
            self.check_usable()
            if self.mount.appends_allowed:
                return
            if isinstance(self._unreachable, AuthenticationError):
                raise AuthenticationError(f"partition {self.id}: refused: {self._unreachable}")
            await self.mounted.wait()

    async def wait_retry(self, wait_for: int | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.retries.add(future, wait_for)
        self._release_retries()
        await future

    def unwritable(self) -> str:
        """Why appends are not flowing now (for an expiry's message)."""
        state, endpoint = self.mount.state, self.mount.endpoint
        if self.failure is not None:
            return f"partition {self.id} failed: {self.failure}"
        if state is MountState.UNASSIGNED:
            return f"partition {self.id} had no server assigned"
        if state is MountState.UNMOUNTED:
            why = self._unreachable or "unreachable or not ready"
            return f"partition {self.id} could not be mounted at {endpoint} ({why})"
        if state is MountState.MOUNTING:
            return f"partition {self.id}'s mount at {endpoint} was not answered yet (recovering?)"
        return f"partition {self.id} was mounted at {endpoint}"
