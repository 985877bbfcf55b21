"""How a partition's appends are decided: the client side of "every submission gets a
true answer".

An append sent is registered with the partition's transaction monitor
(:class:`~waltz_client.state.TransactionMonitor`); the feed resolves it (ours, seen
committed), a lock failure or an error resolves it (not committed), and a flush round
decides the rest: the server answers a flush once every append it received before it
is decided, with the high-water mark including the committed ones, so once the feed
reaches that mark, those of ours not seen in it were not committed. A submission's
deadline passing with its append in flight starts such a round (one timer per
partition, at the earliest deadline); only when the server cannot be asked is the
outcome unknown (:class:`~waltz_client.errors.TransactionOutcomeUnknownError`).

:class:`AppendDecisions` is a part of :class:`~waltz_client.partition.Partition`
(a mixin: it shares the partition's state), kept here so each reads on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from waltz_api.errors import ServerError, WaltzError
from waltz_api.faultpoints import point
from waltz_api.messages import AppendRequest, FlushRequest, FlushResponse, Message
from waltz_api.types import ReqId
from waltz_api.wire import checksum
from waltz_client.api import TransactionBuilder, TransactionContext
from waltz_client.channel import Channel, ChannelLost
from waltz_client.errors import TransactionOutcomeUnknownError
from waltz_client.host import PartitionHost
from waltz_client.state import (
    FeedTracker,
    MountSequencer,
    MountState,
    Outcome,
    Resolution,
    RunningSubmissions,
    TransactionMonitor,
)

log = logging.getLogger(__name__)

_NO_OP_ON_APPLICATION = TransactionContext.on_application
"""The default hook, which does nothing (not called: a call per transaction saved)."""


class Expired(WaltzError):
    """Internal: the deadline passed; the message says what the submission was doing."""


async def before_deadline(
    waiting: Awaitable[object],
    deadline: float | None,
    why: Callable[[], str] = lambda: "its partition was not writable",
) -> None:
    """Wait, but never past the context's deadline (only where nothing is in flight);
    ``why`` says what was awaited if the deadline passes (:class:`Expired`)."""
    if deadline is None:
        await waiting
        return
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        # not wait_for: on Python 3.11 it loses a cancellation that arrives as
        # ``waiting`` completes, and the submission then runs on after it was cancelled
        async with asyncio.timeout(max(remaining, 0.0)):
            await waiting
    except TimeoutError:
        raise Expired(why()) from None


@dataclass(slots=True)
class SentAppend:
    """An append of ours sent to the partition and not yet decided."""

    outcome: asyncio.Future[Resolution]
    context: TransactionContext
    data: bytes
    deadline: float | None = None
    """The submission's deadline (loop time): then, still in flight, it is overdue."""
    overdue: bool = False
    """Its deadline passed: the server is being asked to decide it."""


class AppendDecisions:
    """Registering, resolving and deciding a partition's appends (see the module)."""

    # the partition's state this part uses (set by Partition.__init__)
    host: PartitionHost
    id: int
    mount: MountSequencer
    channel: Channel | None
    monitor: TransactionMonitor
    appends: dict[ReqId, SentAppend]
    submissions: RunningSubmissions
    _flush_waiters: list[tuple[int, asyncio.Future[None]]]
    _decision: asyncio.Task[None] | None
    _deadline_timer: asyncio.TimerHandle | None
    _deadline_at: float
    _decision_covers: int
    _background: set[asyncio.Task[None]]
    requests: dict[ReqId, asyncio.Future[Message]]
    feed: FeedTracker
    _position_waiters: list[tuple[int, int, asyncio.Future[None]]]
    _waiter_order: Iterator[int]
    _progress: int
    # and the partition's methods it calls
    release_slot: Callable[[], None]
    check_usable: Callable[[], None]
    wait_mounted: Callable[[], Awaitable[None]]
    unwritable: Callable[[], str]

    def _decided(self, resolutions: list[Resolution]) -> list[Resolution]:
        """The feed carried appends of ours: their data goes into the client's cache
        (an application reading it is not sent to the server for what it just sent)."""
        for resolution in resolutions:
            if resolution.outcome is Outcome.COMMITTED:
                append = self.appends.get(resolution.req_id)
                if append is not None:
                    self.host.cache_put(self.id, resolution.transaction_id, append.data)
        return resolutions

    def _resolve(self, resolutions: list[Resolution], *, applied: bool = False) -> None:
        for resolution in resolutions:
            append = self.appends.pop(resolution.req_id, None)
            if append is None:
                continue
            if append.outcome.done():
                continue
            if resolution.outcome is Outcome.COMMITTED and applied:
                hook = append.context.on_application
                if getattr(hook, "__func__", None) is not _NO_OP_ON_APPLICATION:
                    call_hook(hook, resolution.transaction_id)
            append.outcome.set_result(resolution)

    def register(
        self,
        req_id: ReqId,
        context: TransactionContext,
        data: bytes,
        deadline: float | None = None,
    ) -> asyncio.Future[Resolution]:
        """Record an append about to be sent; its resolution comes through the future
        (an exception when it cannot be decided after ``deadline``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Resolution] = loop.create_future()
        self.monitor.register(req_id)
        self.appends[req_id] = SentAppend(future, context, data, deadline)
        if deadline is not None and (self._deadline_timer is None or deadline < self._deadline_at):
            self._arm_deadline_timer(deadline)
        return future

    async def send_append(
        self,
        channel: Channel,
        context: TransactionContext,
        builder: TransactionBuilder,
        deadline: float | None,
    ) -> asyncio.Future[Resolution] | None:
        """Register the append and send it on ``channel``, in the partition's turn (see
        :meth:`Channel.turn`): nothing that decides it (a flush, a later append, a mount)
        passes it on the wire. Returns its resolution's future; None when the partition
        stopped taking appends while it waited for its turn (build it again after the
        mount). Raises :class:`Expired` when the deadline passes first (nothing sent)."""
        turn = channel.turn(self.id)
        if turn.locked():  # an earlier send of the partition waits for room
            await before_deadline(turn.acquire(), deadline, lambda: self._behind(channel))
        else:
            await turn.acquire()  # (free: returns at once)
        try:
            if not self.mount.appends_allowed or self.channel is not channel:
                return None
            req_id = self.host.next_req_id(self.id, self.mount.generation)
            data = builder.data
            outcome = self.register(req_id, context, data, deadline)
            try:  # noqa: SIM105 (no context manager object per submission)
                await channel.send_stream(
                    AppendRequest(
                        req_id,
                        builder.client_high_water_mark,
                        builder.lock_request(),
                        builder.header,
                        data,
                        checksum(data),
                    )
                )
            except ChannelLost:
                pass  # the next mount fails it; then a retry
            return outcome
        finally:
            turn.release()

    async def send_appends(
        self,
        channel: Channel,
        items: list[tuple[TransactionContext, TransactionBuilder]],
        deadline: float | None,
    ) -> list[asyncio.Future[Resolution]] | None:
        """:meth:`send_append` of several transactions in one send (in order, one turn):
        their resolutions' futures; None, or :class:`Expired`, as there (for all)."""
        turn = channel.turn(self.id)
        if turn.locked():
            await before_deadline(turn.acquire(), deadline, lambda: self._behind(channel))
        else:
            await turn.acquire()
        try:
            if not self.mount.appends_allowed or self.channel is not channel:
                return None
            outcomes: list[asyncio.Future[Resolution]] = []
            messages: list[Message] = []
            generation = self.mount.generation
            for context, builder in items:
                req_id = self.host.next_req_id(self.id, generation)
                data = builder.data
                outcomes.append(self.register(req_id, context, data, deadline))
                messages.append(
                    AppendRequest(
                        req_id,
                        builder.client_high_water_mark,
                        builder.lock_request(),
                        builder.header,
                        data,
                        checksum(data),
                    )
                )
            with contextlib.suppress(ChannelLost):  # the next mount fails them; then retries
                await channel.send_stream_many(messages)
            return outcomes
        finally:
            turn.release()

    async def send_in_turn(
        self, channel: Channel, make: Callable[[], Message], until: float | None = None
    ) -> None:
        """Send the message ``make`` builds (a flush, taking its mark; a mount) on
        ``channel`` in the partition's turn (see :meth:`Channel.turn`): after every
        append registered before it. TimeoutError when the turn has not come by loop
        time ``until``."""
        turn = channel.turn(self.id)
        if until is None:
            await turn.acquire()
        else:
            async with asyncio.timeout_at(until):
                await turn.acquire()
        try:
            await channel.send_stream(make())
        finally:
            turn.release()

    def _behind(self, channel: Channel) -> str:
        return (
            f"it was never sent: it waited behind earlier messages of partition {self.id} "
            f"that the connection to {channel.endpoint} had no room for (the server is slow "
            "to read, or the connection is broken)"
        )

    def _arm_deadline_timer(self, when: float) -> None:
        """One timer per partition, at the earliest deadline of its appends in flight
        (not one per append: that is a timer handle per transaction)."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_at = when
        self._deadline_timer = asyncio.get_running_loop().call_at(when, self._deadlines_due)

    def _deadlines_due(self) -> None:
        self._deadline_timer = None
        now = asyncio.get_running_loop().time()
        earliest: float | None = None
        for req_id, append in list(self.appends.items()):
            deadline = append.deadline
            if deadline is None or append.overdue or append.outcome.done():
                continue
            if deadline <= now:
                self._overdue(req_id)
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self._arm_deadline_timer(earliest)

    def finished(self, number: int) -> None:
        """Submission ``number`` is decided (and its slot given back)."""
        self.release_slot()
        self.submissions.finish(number)
        waiters = self._flush_waiters
        if waiters:
            still = []
            for mark, future in waiters:
                if future.done():
                    continue
                if self.submissions.running_up_to(mark):
                    still.append((mark, future))
                else:
                    future.set_result(None)
            self._flush_waiters = still

    async def wait_submissions(self, mark: int, timeout: float) -> int:
        """Wait until no submission numbered up to ``mark`` runs; returns how many still
        run after ``timeout`` (0: all decided)."""
        if not self.submissions.running_up_to(mark):
            return 0
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((mark, future))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await future
        return self.submissions.running_up_to(mark)

    # -- deciding appends ------------------------------------------------------------------------

    async def flush_round(self, timeout: float) -> int:
        """Flush: the server answers once every append it received before the request
        is decided, with the high-water mark that includes the committed ones; once the
        feed has reached it, those of ours not seen in it are decided not committed.
        Returns that high-water mark."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        mark = 0

        def flush_request(req_id: ReqId) -> FlushRequest:
            nonlocal mark
            mark = self.monitor.flush_mark()  # taken as it is sent (again on a retry)
            point("client.flush_mark_taken", partition=self.id, mark=mark)
            return FlushRequest(req_id)

        response = await self.request(flush_request, timeout)
        if not isinstance(response, FlushResponse):
            raise ServerError(f"partition {self.id}: unexpected answer to a flush: {response}")
        high_water_mark = response.transaction_id
        await self.wait_position(high_water_mark, max(deadline - loop.time(), 0.0))
        self._resolve(self.monitor.on_flushed(mark, high_water_mark))
        return high_water_mark

    def _overdue(self, req_id: ReqId) -> None:
        """A submission's deadline passed with its append in flight: ask the server to
        decide it (one flush covers every append sent before it)."""
        append = self.appends.get(req_id)
        order = self.monitor.order_of(req_id)
        if append is None or order is None or append.outcome.done():
            return  # decided, or abandoned by the application
        append.overdue = True
        if self._decision is not None and self._decision_covers >= order:
            return  # a decision under way covers it
        self._decision_covers = self.monitor.flush_mark()
        self._decision = asyncio.get_running_loop().create_task(
            self._decide(self._decision_covers), name=f"waltz-client-decide-{self.id}"
        )
        self._background.add(self._decision)
        self._decision.add_done_callback(self._background.discard)

    async def _decide(self, covers: int) -> None:
        grace = self.host.config.request_timeout
        try:
            await self.flush_round(grace)
        except asyncio.CancelledError:
            raise
        except WaltzError as exc:
            self._undecided(covers, grace, exc)
        finally:
            if self._decision is asyncio.current_task():
                self._decision = None

    def _undecided(self, covers: int, grace: float, exc: WaltzError) -> None:
        """The server could not be asked: the overdue appends the decision covered and
        that are still pending end with an unknown outcome (they stay in the monitor, so
        that a late feed item is still recognized as ours)."""
        for req_id, append in list(self.appends.items()):
            order = self.monitor.order_of(req_id)
            if not append.overdue or order is None or order > covers:
                continue
            del self.appends[req_id]
            if append.outcome.done():
                continue
            append.outcome.set_exception(
                TransactionOutcomeUnknownError(
                    f"the outcome of {type(append.context).__name__} is unknown: its deadline "
                    f"passed with its append {req_id} in flight, and partition {self.id}'s "
                    f"server could not be asked to decide it within {grace} s: {exc}. It may "
                    "be committed: if so, the feed delivers it like any transaction; it is "
                    "not re-executed",
                    req_id,
                )
            )

    # -- stream requests ------------------------------------------------------------------------

    async def request(self, make: Callable[[ReqId], Message], timeout: float) -> Message:
        """A stream request answered by one message (flush, high-water mark); retried
        (on a new connection if need be) until ``timeout`` passed without an answer.
        A mount whose catch-up feed is streaming is answering: while the feed advances,
        the wait for it goes on (as the mount's own timer does)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        backoff = self.host.retry_backoff()
        why = "no answer"
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ServerError(
                    f"partition {self.id}: no answer from the server within {timeout} s "
                    f"({why}); is the partition's server up?"
                )
            try:
                progress = self._progress
                try:
                    await asyncio.wait_for(self.wait_mounted(), remaining)
                except TimeoutError:
                    if self.mount.state is MountState.MOUNTING and self._progress != progress:
                        # answered: the feed before READY is being applied (a long
                        # catch-up, or a slow apply_transaction), not a silent server
                        deadline = loop.time() + timeout
                    why = self.unwritable()
                    continue
                channel = self.channel
                if channel is None:
                    continue
                req_id = self.host.next_req_id(self.id, self.mount.generation)
                future: asyncio.Future[Message] = loop.create_future()
                self.requests[req_id] = future
                try:
                    await self.send_in_turn(channel, lambda: make(req_id), deadline)  # noqa: B023
                    return await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
                finally:
                    self.requests.pop(req_id, None)
            except ChannelLost as exc:
                why = str(exc)
                await backoff.sleep()
            except TimeoutError:
                why = f"no answer from {self.mount.endpoint}"
                continue

    async def wait_position(self, transaction_id: int, timeout: float) -> None:
        """Until the feed reaches ``transaction_id``; ServerError when it did not advance
        for ``timeout`` (a feed that advances, a long catch-up, is waited for)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        position = self.feed.position
        while self.feed.position < transaction_id:
            self.check_usable()
            if self.feed.position != position:
                position = self.feed.position
                deadline = loop.time() + timeout
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ServerError(
                    f"partition {self.id}: the feed did not reach transaction {transaction_id} "
                    f"within {timeout} s (at {self.feed.position}, not advancing)"
                )
            future: asyncio.Future[None] = loop.create_future()
            entry = (transaction_id, next(self._waiter_order), future)
            heapq.heappush(self._position_waiters, entry)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await future


def call_hook(fn: Callable[..., Any], *args: Any) -> None:
    """Call an application hook; its exception is logged, never breaks the client."""
    try:
        fn(*args)
    except Exception:
        log.exception("transaction context hook %s raised", getattr(fn, "__name__", fn))
