"""Many submissions in one task: :meth:`AsyncWaltzClient.submit_many` and
:meth:`AsyncWaltzClient.submit_nowait`.

:func:`run_batch` carries a batch of transactions in rounds, in the task that calls it:
each round waits for what the batch's partitions need before they take appends (a
mount, the feed reaching the transaction a lock failure named), builds every
transaction of the round in one hop to the callback thread, sends each partition's
appends in one ``send_many`` (one transport frame where the transport coalesces, the
ZeroMQ one does), then takes their outcomes. A transaction that was not committed
(a lock failure, a lost append) joins the next round, which executes it again; each
is answered on its own (``done(index, result)``) as soon as it is decided.

The rules of :meth:`AsyncWaltzClient.submit` hold for each transaction of a batch:
it holds a slot of its partition's ``max_concurrent_transactions`` while it runs (a
batch larger than the free slots runs in several rounds, never waiting for its own
slots), a flush covers it from the round it started in, its deadline is
``transaction_timeout`` from the start of the batch, and an expired transaction never
had an append that may still be sent: the appends of a round are registered and sent
in the partition's turn, and a transaction expires only when nothing of it is in
flight (never sent, or its attempt decided by what the server sent back).

:class:`Coalescer` is :meth:`AsyncWaltzClient.submit_nowait`: the submissions made in
one turn of the event loop become one batch, run by one task, each answered through
its own future (no task per transaction).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from waltz_api.contracts.transport import Transport
from waltz_api.errors import ClientError
from waltz_api.types import NO_TRANSACTION
from waltz_client.api import SubmissionResult, TransactionBuilder, TransactionContext
from waltz_client.config import ClientConfig
from waltz_client.decisions import Expired, before_deadline, call_hook
from waltz_client.errors import TransactionExpiredError
from waltz_client.partition import Partition
from waltz_client.runner import Built
from waltz_client.state import Outcome, Resolution

log = logging.getLogger(__name__)

Answer = SubmissionResult | BaseException
"""What a transaction of a batch came to: its result, or the error that ended it."""

Done = Callable[[int, Answer], None]
"""``done(index, answer)``: the transaction at ``index`` of the batch is decided."""


class BatchHost(Protocol):
    """What a batch is told of its client."""

    @property
    def config(self) -> ClientConfig: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def closing(self) -> bool: ...

    def partition_of(self, context: TransactionContext) -> Partition:
        """The mounted partition ``context`` goes to (ClientError: none, or not running)."""
        ...

    def build_many(
        self, items: list[tuple[TransactionContext, int]]
    ) -> Awaitable[list[Built | BaseException]]:
        """Each (context, partition) built, the plain ones in one hop to the callback thread."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task the client cancels when it closes."""
        ...


@dataclass(slots=True, eq=False)
class _Entry:
    """One transaction of a batch."""

    index: int
    context: TransactionContext
    partition: Partition
    number: int = 0
    """Its number among the partition's running submissions (0: no slot yet)."""
    retry: bool = False
    """An attempt of it was not committed: it waits for the partition to take it again."""
    wait_for: int | None = None
    """After a lock failure: the transaction the feed must reach before it runs again."""
    failed: str = ""
    """Why its last attempt was not committed (for an expiry's message)."""
    builder: TransactionBuilder | None = None
    outcome: asyncio.Future[Resolution] | None = None


class _Batch:
    """The state of one :func:`run_batch` call."""

    def __init__(
        self,
        client: BatchHost,
        done: Done,
        given_up: Callable[[int], bool],
    ) -> None:
        self.client = client
        self.done = done
        self.given_up = given_up
        self.loop = asyncio.get_running_loop()
        self.timeout = client.config.transaction_timeout
        self.deadline = None if self.timeout is None else self.loop.time() + self.timeout
        self.active: dict[int, _Entry] = {}
        """The running transactions (holding a slot), by index, in the order admitted."""
        self.stopped = False
        """The batch ended (cancelled): outcomes still to come are not answered here."""
        self._undecided = 0
        self._round_over: asyncio.Future[None] = self.loop.create_future()

    # -- answers ---------------------------------------------------------------------------------

    def _finish(self, entry: _Entry, answer: Answer) -> None:
        if entry.number:
            entry.partition.finished(entry.number)  # (gives its slot back)
            entry.number = 0
        self.active.pop(entry.index, None)
        self.done(entry.index, answer)

    def _fail(self, entry: _Entry, exc: BaseException) -> None:
        call_hook(entry.context.on_exception, exc)
        self._finish(entry, exc)

    def _expire(self, entry: _Entry, why: str) -> None:
        # true: nothing of it is in flight (see the module)
        context = entry.context
        call_hook(context.on_expiration)
        self._finish(
            entry,
            TransactionExpiredError(
                f"{type(context).__name__} expired: not committed within {self.timeout} s "
                f"({context.attempts} attempts): {why}. It will not be committed: "
                "nothing of it is pending"
            ),
        )

    def _overdue(self) -> bool:
        return self.deadline is not None and self.loop.time() >= self.deadline

    # -- admission ---------------------------------------------------------------------------------

    def _admit(self, waiting: deque[_Entry]) -> None:
        """Give a slot to each waiting transaction whose partition has one free, in order."""
        full: set[int] = set()
        kept: list[_Entry] = []
        for entry in waiting:
            partition = entry.partition
            if partition.id in full:
                kept.append(entry)
            elif self.given_up(entry.index):
                self._finish(entry, asyncio.CancelledError())
            elif partition.limit.try_acquire_free():
                self._start(entry)
            else:
                full.add(partition.id)
                kept.append(entry)
        if len(kept) != len(waiting):
            waiting.clear()
            waiting.extend(kept)

    def _start(self, entry: _Entry) -> None:
        entry.number = entry.partition.submissions.start()
        self.active[entry.index] = entry

    async def run(self, entries: list[_Entry]) -> None:
        waiting = deque(entries)
        try:
            while waiting or self.active:
                self._admit(waiting)
                if not self.active:  # every slot is taken by others: wait for one
                    entry = waiting.popleft()
                    try:
                        await entry.partition.acquire_slot()
                    except ClientError as exc:  # the client closed
                        self.done(entry.index, exc)
                        continue
                    try:
                        entry.partition.check_usable()
                    except ClientError as exc:
                        entry.partition.release_slot()
                        self.done(entry.index, exc)
                        continue
                    self._start(entry)
                    continue
                await self._round()
        finally:
            self.stopped = True
            for entry in self.active.values():  # cancelled: admitted ones give their slot back
                if entry.number:
                    entry.partition.finished(entry.number)
                    entry.number = 0

    # -- one round ---------------------------------------------------------------------------------

    async def _round(self) -> None:
        groups: dict[Partition, list[_Entry]] = {}
        for entry in list(self.active.values()):
            if self.given_up(entry.index):  # (nothing of it is in flight between rounds)
                self._finish(entry, asyncio.CancelledError())
                continue
            groups.setdefault(entry.partition, []).append(entry)
        ready: list[_Entry] = []
        for partition, group in groups.items():
            if await self._writable(partition, group):
                ready.extend(group)
        if not ready:
            return
        built = await self.client.build_many(
            [(entry.context, entry.partition.id) for entry in ready]
        )
        max_frame = self.client.transport.max_frame_size
        sending: dict[Partition, list[_Entry]] = {}
        for entry, outcome in zip(ready, built, strict=True):
            if isinstance(outcome, BaseException):
                self._fail(entry, outcome)
                continue
            builder, go = outcome
            if not go:
                call_hook(entry.context.on_completion, False)
                self._finish(
                    entry,
                    SubmissionResult(
                        False, entry.partition.id, NO_TRANSACTION, entry.context.attempts
                    ),
                )
                continue
            try:
                if builder.wire_size > max_frame:
                    builder.check_size(max_frame)
            except ClientError as exc:
                self._fail(entry, exc)
                continue
            entry.builder = builder
            sending.setdefault(entry.partition, []).append(entry)
        for partition, group in sending.items():
            await self._send(partition, group)
        sent = [entry for entry in self.active.values() if entry.outcome is not None]
        if not sent:
            return
        # each is answered as soon as it is decided (a callback, not an await each);
        # the task wakes once, when the round is over
        self._undecided = len(sent)
        self._round_over = self.loop.create_future()
        for entry in sent:
            assert entry.outcome is not None
            entry.outcome.add_done_callback(functools.partial(self._decided, entry))
        await self._round_over

    async def _writable(self, partition: Partition, group: list[_Entry]) -> bool:
        """Wait until the partition takes appends again, and the feed reached what the
        group's lock failures name; False when the group ended meanwhile (expired)."""
        retrying = [entry for entry in group if entry.retry]
        try:
            partition.check_usable()
            if retrying:
                failing = [e.wait_for for e in retrying if e.wait_for is not None]
                wait_for = max(failing) if failing else None

                def why() -> str:
                    if wait_for is None:
                        return partition.unwritable()
                    return (
                        f"this client's feed had not reached transaction {wait_for} to retry "
                        f"on the state it made (at {partition.feed.position}; "
                        f"{partition.unwritable()})"
                    )

                if self._overdue():
                    raise Expired("")
                await before_deadline(partition.wait_retry(wait_for), self.deadline, why)
            if not partition.mount.appends_allowed:
                await before_deadline(partition.wait_mounted(), self.deadline, partition.unwritable)
            elif self._overdue():
                raise Expired("the deadline passed as it was about to be executed again")
        except Expired as expired:
            waited = str(expired)
            for entry in group:
                if not entry.retry:
                    self._expire(entry, waited)
                elif waited:
                    self._expire(
                        entry, f"its last attempt was not committed ({entry.failed}), and {waited}"
                    )
                else:
                    self._expire(entry, f"its last attempt was not committed: {entry.failed}")
            return False
        except Exception as exc:  # the partition failed, or refuses us; the client closed
            for entry in group:
                self._fail(entry, exc)
            return False
        for entry in retrying:
            entry.retry = False
        return True

    async def _send(self, partition: Partition, group: list[_Entry]) -> None:
        channel = partition.channel
        if not partition.mount.appends_allowed or channel is None:
            return  # a mount started while they executed: built again after it
        server_max = channel.max_frame_size
        items: list[tuple[_Entry, TransactionBuilder]] = []
        for entry in group:
            builder = entry.builder
            assert builder is not None
            entry.builder = None
            if builder.wire_size > server_max:
                try:
                    builder.check_size(server_max, "the server's")
                except ClientError as exc:
                    self._fail(entry, exc)
                    continue
            items.append((entry, builder))
        if not items:
            return
        try:
            outcomes = await partition.send_appends(
                channel, [(entry.context, builder) for entry, builder in items], self.deadline
            )
        except Expired as expired:  # nothing of them was sent
            for entry, _ in items:
                self._expire(entry, str(expired))
            return
        if outcomes is None:
            return  # a mount started while they waited for their turn: built again after it
        for (entry, _), outcome in zip(items, outcomes, strict=True):
            entry.outcome = outcome

    def _decided(self, entry: _Entry, outcome: asyncio.Future[Resolution]) -> None:
        """The outcome of an append of the round (a done callback)."""
        if self.stopped:
            return  # the batch was cancelled: nobody waits
        entry.outcome = None
        try:
            self._answer(entry, outcome)
        finally:
            self._undecided -= 1
            if self._undecided <= 0 and not self._round_over.done():
                self._round_over.set_result(None)

    def _answer(self, entry: _Entry, outcome: asyncio.Future[Resolution]) -> None:
        if outcome.cancelled():
            self._fail(entry, ClientError("the Waltz client is closed"))
            return
        exc = outcome.exception()
        if exc is not None:  # unknown outcome, the client closed, access denied
            self._fail(entry, exc)
            return
        resolution = outcome.result()
        partition = entry.partition
        if resolution.outcome is Outcome.COMMITTED:
            transaction_id = resolution.transaction_id
            if transaction_id > partition.committed_top:
                partition.committed_top = transaction_id
            call_hook(entry.context.on_completion, True)
            self._finish(
                entry,
                SubmissionResult(True, partition.id, transaction_id, entry.context.attempts),
            )
            return
        entry.retry = True
        entry.failed = resolution.reason
        if resolution.outcome is Outcome.LOCK_FAILED:
            call_hook(entry.context.on_lock_failure, resolution.transaction_id)
            entry.wait_for = resolution.transaction_id
        else:
            entry.wait_for = None


async def run_batch(
    client: BatchHost,
    contexts: Sequence[TransactionContext],
    done: Done,
    given_up: Callable[[int], bool] = lambda index: False,
    partitions: Sequence[Partition] | None = None,
) -> None:
    """Run ``contexts`` to their outcomes in this task, ``done(index, answer)`` for each
    as it is decided (see the module). ``given_up(index)``: the application gave that
    one up (it is dropped before it runs again). ``partitions``: each context's, when
    the caller looked them up already."""
    batch = _Batch(client, done, given_up)
    entries: list[_Entry] = []
    for index, context in enumerate(contexts):
        try:
            known = None if partitions is None else partitions[index]
            partition = client.partition_of(context) if known is None else known
            partition.check_usable()
        except ClientError as exc:  # refused like submit() refuses it: nothing ran
            done(index, exc)
            continue
        entries.append(_Entry(index, context, partition))
    await batch.run(entries)


async def run_many(host: BatchHost, contexts: list[TransactionContext]) -> list[Answer]:
    """:func:`run_batch`, its answers collected in the order of ``contexts``."""
    answers: list[Answer] = [ClientError("not decided")] * len(contexts)

    def done(index: int, answer: Answer) -> None:
        answers[index] = answer

    await run_batch(host, contexts, done)
    return answers


class Coalescer:
    """:meth:`AsyncWaltzClient.submit_nowait`: the submissions of one loop turn run as
    one batch, in one task."""

    def __init__(self, client: BatchHost) -> None:
        self.client = client
        self._queued: list[
            tuple[TransactionContext, Partition, asyncio.Future[SubmissionResult]]
        ] = []

    def submit(self, context: TransactionContext) -> asyncio.Future[SubmissionResult]:
        client = self.client
        partition = client.partition_of(context)
        partition.check_usable()  # refused here, as submit() refuses
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SubmissionResult] = loop.create_future()
        if not self._queued:
            loop.call_soon(self._start)  # once this turn's submissions have joined
        self._queued.append((context, partition, future))
        return future

    def _start(self) -> None:
        queued, self._queued = self._queued, []
        if self.client.closing:
            for _, _, future in queued:
                if not future.done():
                    future.set_exception(ClientError("the Waltz client is closed"))
            return
        futures = [future for _, _, future in queued]

        def done(index: int, answer: Answer) -> None:
            future = futures[index]
            if future.done():
                return
            if isinstance(answer, asyncio.CancelledError):
                future.cancel()
            elif isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)

        async def run() -> None:
            try:
                await run_batch(
                    self.client,
                    [context for context, _, _ in queued],
                    done,
                    lambda index: futures[index].cancelled(),
                    [partition for _, partition, _ in queued],
                )
            finally:
                for future in futures:
                    if not future.done():
                        future.set_exception(ClientError("the Waltz client is closed"))

        self.client.spawn(run())
