"""One partition's request processor on a storage node.

Every request for a partition goes through its :class:`PartitionWorker`, which takes
the requests in arrival order, one at a time (the next starts once the one before is
answered), so the requests of one partition are processed strictly in order while
different partitions proceed concurrently (and the engine may group their flushes into
one commit).

Run to completion
-----------------
An append that can start at once (the partition open, the request of the store session
its fence holds, and an engine whose partition starts an append without waiting,
``StoragePartition.start_append``, as the fs engine's) is handed to the engine by the callback that
received it (at the end of the loop iteration, so that the appends of one received
message merge), and answered by the callback that resolves it, which starts the next
request: no task in between. Everything else (a fence to raise, reads, truncations,
marks, repairs, controls, an engine without ``start_append``, a reply that must wait
for room) is run by the worker's task, as before; either way one request at a time.

Fencing by store session id
---------------------------
The partition's durable :class:`~waltz_api.types.SessionInfo` holds the fence:
``session_id`` is the highest store session id this partition ever accepted.
A request with a lower id is refused (``FailureResponse(code=FENCED,
highest_session_id=...)``). A request with a higher id first makes that id
durable (``StoragePartition.set_session_info``, keeping the low-water marks)
and only then is acted on, so after a crash and restart the fence still holds.
Every request type fences, reads included: a newer session's recovery reads the
replica's state and an older session must not append behind its back.

Last session info
-----------------
``LastSessionInfo`` answers the session info as it was when the request
arrived, before the request's own session id was recorded: a new session's
recovery (whose first request to a replica is this one) sees the previous
session's id and marks, as the original storage reported them. The marks
carry the session that wrote them (``low_water_mark_session_id``), kept apart
from the fence (a partition with no marks and no records, new or wiped, gets
LOST_SESSION when its fence is first raised: it holds nothing it acknowledged): a
session that reached this replica and died before its
SetLowWaterMark raises the fence only, so a storage restored from a backup
still shows an older low-water-mark session than the partition's metadata
says it completed, and recovery detects it.

Low-water mark
--------------
``SetLowWaterMark(session, lwm)`` marks the start of a store session (after the
server's recovery truncated the dirty tail). As in the original, the
partition's max transaction id must not exceed ``lwm`` (truncate first: the
request is refused otherwise); the stored info becomes ``(session, lwm,
local_lwm = max transaction id at that moment, lwm session = session)``. The
local low-water mark is below ``lwm`` when this replica is behind and must catch
up.

Damage and repair
-----------------
A partition whose storage lost records to damage below intact ones (found by
the engine's start-up recovery, the damaged files moved aside) answers
``MissingRange`` with the lowest such range; reads there fail (CORRUPTION,
naming the record) until ``Repair`` requests fill it with records copied from
a healthy replica. ``SetLowWaterMark`` is refused while a range is missing: the
local low-water mark would vouch for records this replica does not hold. A
lost tail (the engine could not tell how much it lost) shows as
``low_water_mark_session_id == LOST_SESSION`` in the session info.

Appends are pipelined: consecutive append requests of the same session waiting
in the queue whose ids continue each other are handed to the engine as one
batch (one flush), each still answered on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.errors import (
    PartitionClosedError,
    PartitionNotFoundError,
    SessionFencedError,
    StorageError,
)
from waltz_api.messages import (
    FailureResponse,
    LastSessionInfoRequest,
    LastSessionInfoResponse,
    MarkReplicaRequest,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    Message,
    MissingRangeRequest,
    MissingRangeResponse,
    RecordHeaderListRequest,
    RecordHeaderListResponse,
    RecordHeaderRequest,
    RecordHeaderResponse,
    RecordListRequest,
    RecordListResponse,
    RecordRequest,
    RecordResponse,
    RepairRequest,
    SetLowWaterMarkRequest,
    StorageAppendRequest,
    SuccessResponse,
    TruncateRequest,
)
from waltz_api.storage_failures import StorageRequestError, code_for
from waltz_api.types import LOST_SESSION, SessionInfo

if TYPE_CHECKING:
    from waltz_storage_node.metrics import StorageNodeMetrics

log = logging.getLogger(__name__)

Reply = Callable[[Message], Awaitable[None]]
"""Sends a response back on the connection the request came from."""

Post = Callable[[Message], bool]
"""Sends a response back without waiting; False: it was not sent (no room: the worker's
task then sends it with the :data:`Reply`, waiting for room)."""

PARTITION_REQUESTS: tuple[type[Message], ...] = (
    LastSessionInfoRequest,
    MaxTransactionIdRequest,
    TruncateRequest,
    MarkReplicaRequest,
    SetLowWaterMarkRequest,
    StorageAppendRequest,
    RecordHeaderRequest,
    RecordRequest,
    RecordHeaderListRequest,
    RecordListRequest,
    MissingRangeRequest,
    RepairRequest,
)


@dataclass
class _Job:
    request: Any  # one of PARTITION_REQUESTS
    reply: Reply
    size: int = 0
    """The request's frame size: queued bytes are bounded too."""
    post: Post | None = None


@dataclass
class _Control:
    """An administrative action run in the partition's order (between requests)."""

    action: Callable[[], Awaitable[Any]]
    done: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class PartitionStats:
    """Counters of one partition's worker since the node started (admin ``stats``)."""

    requests: int = 0
    append_requests: int = 0
    engine_appends: int = 0
    """Appends handed to the engine: fewer than append_requests when merged."""
    records_appended: int = 0
    fenced: int = 0
    """Requests refused because a newer store session exists."""


def failure_for(request: Any, exc: BaseException) -> FailureResponse:
    highest = exc.highest_session_id if isinstance(exc, SessionFencedError) else -1
    return FailureResponse(
        session_id=request.session_id,
        seq_num=request.seq_num,
        partition_id=request.partition_id,
        code=code_for(exc),
        message=str(exc) or type(exc).__name__,
        highest_session_id=highest,
    )


class PartitionWorker:
    """Processes one partition's requests in order (see the module docstring)."""

    def __init__(
        self,
        engine: StorageEngine,
        partition_id: int,
        *,
        queue_size: int = 1000,
        queue_bytes: int = 64 * 1024 * 1024,
        max_append_batch_records: int = 10000,
        max_list_records: int = 10000,
        max_response_bytes: int = 16 * 1024 * 1024,
        metrics: StorageNodeMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.partition_id = partition_id
        self.available = True
        self.stats = PartitionStats()
        self.metrics = metrics
        self._max_batch = max_append_batch_records
        self._max_list = max_list_records
        self._max_bytes = max_response_bytes
        self._pending: deque[_Job | _Control] = deque()
        self._space = asyncio.Semaphore(queue_size)
        self._queue_bytes = queue_bytes
        self._queued_bytes = 0
        self._room = asyncio.Event()
        self._wakeup: asyncio.Future[None] | None = None
        """The idle task's: resolved when it is handed work, or by stop."""
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._busy = False
        """A request is under way (in the task, or an append on the engine): no other starts."""
        self._handed = False
        """The task has work: :attr:`_handoff`, or else the request at the queue's head."""
        self._handoff: Callable[[], Awaitable[None]] | None = None
        self._pumping = False
        self._pump_scheduled = False

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(
                self._run(), name=f"storage-partition-{self.partition_id}"
            )
            self._pump()

    async def stop(self) -> None:
        """Stop after the queued requests (they are answered) and wait for the task."""
        self._stopping = True
        self._wake()
        self._room.set()
        if self._task is not None:
            await self._task
            self._task = None

    @property
    def queued(self) -> int:
        return len(self._pending)

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    # -- input ---------------------------------------------------------------------

    async def submit(
        self, request: Any, reply: Reply, size: int = 0, post: Post | None = None
    ) -> None:
        """Queue a request of ``size`` bytes (waits while the queue holds ``queue_size``
        requests or ``queue_bytes`` bytes: back pressure; one request is always admitted).
        ``post``: sends a response without waiting (the run to completion path answers
        with it when it can)."""
        self.stats.requests += 1
        if isinstance(request, StorageAppendRequest):
            self.stats.append_requests += 1
        if self._stopping:
            await reply(failure_for(request, PartitionNotFoundError(self._gone())))
            return
        await self._space.acquire()
        while (
            self._pending and self._queued_bytes + size > self._queue_bytes and not self._stopping
        ):
            self._room.clear()
            await self._room.wait()
        if self._stopping:  # stopped while this sender waited for room
            self._space.release()
            await reply(failure_for(request, PartitionNotFoundError(self._gone())))
            return
        self._queued_bytes += size
        self._pending.append(_Job(request, reply, size, post))
        self._schedule_pump()

    async def run_in_order(self, action: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``action`` after every request queued so far, before any later one."""
        if self._stopping:
            raise PartitionNotFoundError(self._gone())
        await self._space.acquire()
        if self._stopping:
            self._space.release()
            raise PartitionNotFoundError(self._gone())
        control = _Control(action)
        self._pending.append(control)
        self._schedule_pump()
        return await control.done

    async def drop_prefix(self, session_id: int, through: int) -> int:
        """Delete the partition's local records up to ``through`` (archived: the owner
        of store session ``session_id`` verified them), in the partition's order and
        fenced like a request; returns the new log start."""

        async def apply() -> int:
            partition = self._partition()
            await self._fence(partition, session_id)
            return await partition.drop_prefix(through)

        result: int = await self.run_in_order(apply)
        return result

    def _gone(self) -> str:
        return f"partition {self.partition_id} is no longer hosted on this storage node"

    # -- the loop ------------------------------------------------------------------

    def _pop(self) -> _Job | _Control:
        item = self._pending.popleft()
        self._space.release()
        if isinstance(item, _Job) and item.size:
            self._queued_bytes -= item.size
            self._room.set()
        return item

    def _schedule_pump(self) -> None:
        """:meth:`_pump` at the end of this loop iteration (the requests of one received
        message are queued by then: consecutive appends merge)."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_pump)

    def _scheduled_pump(self) -> None:
        self._pump_scheduled = False
        self._pump()

    def _pump(self) -> None:
        """Start the request at the queue's head unless one is under way (or the worker is
        not started): an append that can start at once right here, anything else in
        the task."""
        if self._pumping or self._task is None:
            return  # re-entered from an append refused at once: the loop below goes on
        self._pumping = True
        try:
            while not self._busy and self._pending:
                if not self._start_append():
                    self._hand(None)
            if not self._busy and self._stopping:
                self._wake()  # the task ends
        finally:
            self._pumping = False

    def _hand(self, work: Callable[[], Awaitable[None]] | None) -> None:
        """Give the task ``work`` (None: the request at the queue's head); busy until done."""
        self._busy = self._handed = True
        self._handoff = work
        self._wake()

    async def _run(self) -> None:
        while True:
            if self._handed:
                work, self._handoff = self._handoff, None
                try:
                    if work is not None:
                        await work()
                    else:
                        await self._step(self._pop())
                except Exception:  # a bug must not stall the partition: log, go on
                    log.exception("partition %d: request processing failed", self.partition_id)
                self._handed = self._busy = False
                self._pump()
                continue
            if self._stopping and not self._busy and not self._pending:
                return
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    async def _step(self, item: _Job | _Control) -> None:
        if isinstance(item, _Control):
            await self._run_control(item)
        elif isinstance(item.request, StorageAppendRequest):
            await self._append_batch(item)
        else:
            await self._send(item, await self._process(item.request))

    async def _run_control(self, control: _Control) -> None:
        try:
            result = await control.action()
        except Exception as exc:
            if not control.done.done():
                control.done.set_exception(exc)
        else:
            if not control.done.done():
                control.done.set_result(result)

    async def _send(self, job: _Job, response: Message) -> None:
        try:
            await job.reply(response)
        except Exception as exc:  # the connection went away: the request is done regardless
            log.debug(
                "partition %d: could not send %s: %s",
                self.partition_id,
                type(response).__name__,
                exc,
            )

    # -- per request -----------------------------------------------------------------

    def _partition(self) -> StoragePartition:
        if not self.available:
            raise PartitionClosedError(
                f"partition {self.partition_id} is marked unavailable on this storage node "
                "(by an administrator); mark it available with `waltz storage availability`"
            )
        return self.engine.partition(self.partition_id)

    async def _fence(self, partition: StoragePartition, session_id: int) -> None:
        if session_id < 0:
            raise StorageRequestError(
                f"store session id {session_id} is invalid: storage requests need the "
                "non-negative id of a store session"
            )
        info = partition.session_info()
        if session_id < info.session_id:
            self.stats.fenced += 1
            if self.metrics is not None:
                self.metrics.fenced_request(self.partition_id)
            raise SessionFencedError(
                f"store session {session_id} of partition {self.partition_id} is fenced: "
                f"session {info.session_id} is newer; this writer must stop",
                info.session_id,
            )
        if session_id > info.session_id:
            # Durable before anything of the new session is acted on; the marks, and
            # the session that wrote them, stay as they are. A partition that never had
            # marks and holds nothing (new, or a wiped disk) is recorded as one that holds
            # nothing it may have acknowledged (LOST_SESSION), so once its fence is
            # raised it is never taken for a replica that was clean in that session: a
            # recovery counts it as a suspect, not as a voter with an empty log.
            marks_session = info.low_water_mark_session_id
            if info == SessionInfo() and partition.max_transaction_id() < 0:
                marks_session = LOST_SESSION
            await partition.set_session_info(
                dataclasses.replace(
                    info, session_id=session_id, low_water_mark_session_id=marks_session
                )
            )
            if self.metrics is not None and info.session_id >= 0:
                self.metrics.session_fenced(self.partition_id)
            log.info(
                "partition %d: store session %d supersedes %d",
                self.partition_id,
                session_id,
                info.session_id,
            )

    async def _process(self, request: Any) -> Message:
        try:
            partition = self._partition()
            before = partition.session_info()
            await self._fence(partition, request.session_id)
            if isinstance(request, LastSessionInfoRequest):
                s, q, p = request.session_id, request.seq_num, request.partition_id
                return LastSessionInfoResponse(s, q, p, before)
            return await self._serve(partition, request)
        except Exception as exc:
            return self._failure(request, exc)

    def _failure(self, request: Any, exc: BaseException) -> FailureResponse:
        if isinstance(exc, StorageError):
            log.info("partition %d: %s refused: %s", self.partition_id, type(request).__name__, exc)
        else:
            log.exception(
                "partition %d: %s failed unexpectedly", self.partition_id, type(request).__name__
            )
        return failure_for(request, exc)

    async def _serve(self, partition: StoragePartition, request: Any) -> Message:
        s, q, p = request.session_id, request.seq_num, request.partition_id
        if isinstance(request, LastSessionInfoRequest):
            return LastSessionInfoResponse(s, q, p, partition.session_info())
        if isinstance(request, MaxTransactionIdRequest):
            return MaxTransactionIdResponse(s, q, p, partition.max_transaction_id())
        if isinstance(request, TruncateRequest):
            if request.transaction_id < -1:
                raise StorageRequestError(
                    f"cannot truncate after transaction id {request.transaction_id}: "
                    "it must be -1 (empty the log) or more"
                )
            await partition.truncate(request.transaction_id)
            return SuccessResponse(s, q, p)
        if isinstance(request, SetLowWaterMarkRequest):
            max_id = _check_session_start(partition, request.low_water_mark)
            await partition.set_session_info(SessionInfo(s, request.low_water_mark, max_id, s))
            return SuccessResponse(s, q, p)
        if isinstance(request, MarkReplicaRequest):
            await partition.set_session_info(_marked(partition, request))
            log.info(
                "partition %d: marked %s by store session %d (low-water mark %d)",
                p,
                "clean" if request.clean else "suspect (lost acknowledged records)",
                s,
                request.low_water_mark,
            )
            return SuccessResponse(s, q, p)
        if isinstance(request, StorageAppendRequest):
            if request.records:
                await self._engine_append(partition, list(request.records))
            return SuccessResponse(s, q, p)
        if isinstance(request, MissingRangeRequest):
            missing = partition.missing_ranges()
            first, last = missing[0] if missing else (-1, -1)
            return MissingRangeResponse(s, q, p, first, last)
        if isinstance(request, RepairRequest):
            if request.records:
                await partition.repair(list(request.records))
                log.info(
                    "partition %d: repaired transactions %d..%d from a peer (session %d)",
                    p,
                    request.records[0].transaction_id,
                    request.records[-1].transaction_id,
                    s,
                )
            return SuccessResponse(s, q, p)
        if isinstance(request, RecordHeaderRequest):
            return RecordHeaderResponse(
                s, q, p, await partition.read_header(request.transaction_id)
            )
        if isinstance(request, RecordRequest):
            return RecordResponse(s, q, p, await partition.read_record(request.transaction_id))
        if isinstance(request, RecordHeaderListRequest):
            count = self._list_size(request.max_records)
            headers = await partition.read_headers(request.transaction_id, count) if count else []
            return RecordHeaderListResponse(s, q, p, tuple(headers))
        if isinstance(request, RecordListRequest):
            count = self._list_size(request.max_records)
            if request.max_bytes < 0:
                raise StorageRequestError(
                    f"max_bytes must be non-negative, got {request.max_bytes}"
                )
            max_bytes = min(request.max_bytes, self._max_bytes)
            if not count:
                return RecordListResponse(s, q, p, ())
            # the records as the wire carries them, built from the stored bytes
            block = await partition.read_block(request.transaction_id, count, max_bytes)
            return RecordListResponse(s, q, p, block)
        raise StorageRequestError(f"{type(request).__name__} is not a partition request")

    def _list_size(self, max_records: int) -> int:
        if max_records < 0:
            raise StorageRequestError(f"max_records must be non-negative, got {max_records}")
        return min(max_records, self._max_list)

    # -- appends ---------------------------------------------------------------------

    async def _append_batch(self, first: _Job) -> None:
        """Append ``first`` together with the appends queued right behind it."""
        request: StorageAppendRequest = first.request
        try:
            partition = self._partition()
            await self._fence(partition, request.session_id)
        except Exception as exc:
            await self._send(first, self._failure(request, exc))
            return
        batch = self._with_followers(first)
        if len(batch) == 1:
            await self._send(first, await self._append_one(partition, request))
            return
        records = [record for job in batch for record in job.request.records]
        try:
            await self._engine_append(partition, records)
        except Exception as exc:
            await self._one_by_one(partition, batch, exc)
            return
        for job in batch:
            r = job.request
            await self._send(job, SuccessResponse(r.session_id, r.seq_num, r.partition_id))

    def _with_followers(self, first: _Job) -> list[_Job]:
        """``first`` (taken from the queue) and the appends queued right behind it that
        merge with it into one engine append (taken too): the same store session and
        partition, each continuing the ids of the one before, within the batch limit."""
        request: StorageAppendRequest = first.request
        batch = [first]
        if request.records:
            total = len(request.records)
            next_id = request.records[-1].transaction_id + 1
            while self._pending and total < self._max_batch:
                candidate = self._pending[0]
                if not isinstance(candidate, _Job):
                    break
                follower = candidate.request
                if (
                    not isinstance(follower, StorageAppendRequest)
                    or follower.session_id != request.session_id
                    or follower.partition_id != request.partition_id
                    or not follower.records
                    or follower.records[0].transaction_id != next_id
                    or total + len(follower.records) > self._max_batch
                ):
                    break
                batch.append(self._pop())  # type: ignore[arg-type]
                total += len(follower.records)
                next_id = follower.records[-1].transaction_id + 1
        return batch

    async def _one_by_one(
        self, partition: StoragePartition, batch: list[_Job], exc: BaseException
    ) -> None:
        # Nothing of the batch is stored (the contract): answer each on its own.
        log.debug("partition %d: batched append refused (%s); one by one", self.partition_id, exc)
        for job in batch:
            await self._send(job, await self._append_one(partition, job.request))

    async def _engine_append(self, partition: StoragePartition, records: list[Any]) -> None:
        started = time.perf_counter()
        await partition.append(records)
        self._appended(records, started)

    def _appended(self, records: list[Any], started: float) -> None:
        self.stats.engine_appends += 1
        self.stats.records_appended += len(records)
        if self.metrics is not None:
            data_bytes = sum(len(record.data) for record in records)
            self.metrics.appended(
                self.partition_id, len(records), data_bytes, time.perf_counter() - started
            )

    # -- appends run to completion (no task) -----------------------------------------

    def _start_append(self) -> bool:
        """Hand the append at the queue's head (merged with its followers) to the engine
        here, if it can start at once: the partition open, the request of the session its
        fence holds (nothing to make durable first), an engine that starts an append
        without waiting; False (nothing taken) otherwise: the task serves it."""
        head = self._pending[0]
        if not isinstance(head, _Job) or not isinstance(head.request, StorageAppendRequest):
            return False
        request: StorageAppendRequest = head.request
        if not request.records:
            return False
        try:
            partition = self._partition()
            fence = partition.session_info().session_id
        except Exception:  # the task answers why, in order
            return False
        if not partition.starts_appends or request.session_id < 0 or request.session_id != fence:
            return False
        self._pop()
        try:
            batch = self._with_followers(head)
            records = (
                list(request.records)
                if len(batch) == 1
                else [record for job in batch for record in job.request.records]
            )
        except Exception:  # a bug must not stall the partition: log, go on (as the task)
            log.exception("partition %d: request processing failed", self.partition_id)
            return True
        self._busy = True
        started = time.perf_counter()
        try:
            future = partition.start_append(records)
        except Exception as exc:  # refused at once (nothing stored)
            self._append_ended(partition, batch, records, started, exc)
            return True
        future.add_done_callback(
            lambda done: self._append_ended(partition, batch, records, started, _error(done))
        )
        return True

    def _append_ended(
        self,
        partition: StoragePartition,
        batch: list[_Job],
        records: list[Any],
        started: float,
        exc: BaseException | None,
    ) -> None:
        """An append started here ended: answer it (as the task would) and go on."""
        try:
            handed = self._answer(partition, batch, records, started, exc)
        except Exception:  # a bug must not stall the partition: log, go on (as the task)
            log.exception("partition %d: request processing failed", self.partition_id)
            handed = self._handed
        if not handed:
            self._busy = False
            self._pump()

    def _answer(
        self,
        partition: StoragePartition,
        batch: list[_Job],
        records: list[Any],
        started: float,
        exc: BaseException | None,
    ) -> bool:
        """Answer an append started here; whether the rest was handed to the task."""
        replies: list[tuple[_Job, Message]]
        if exc is None:
            self._appended(records, started)
            replies = [
                (job, SuccessResponse(r.session_id, r.seq_num, r.partition_id))
                for job in batch
                for r in (job.request,)
            ]
        elif len(batch) == 1:
            replies = [(batch[0], self._failure(batch[0].request, exc))]
        else:
            self._hand(functools.partial(self._one_by_one, partition, batch, exc))
            return True
        for index, (job, response) in enumerate(replies):
            if job.post is None or not self._post(job, response):
                # the rest in order, by the task, waiting for room
                self._hand(functools.partial(self._send_all, replies[index:]))
                return True
        return False

    def _post(self, job: _Job, response: Message) -> bool:
        assert job.post is not None
        try:
            return job.post(response)
        except Exception as exc:  # as _send: the request is done regardless
            log.debug(
                "partition %d: could not send %s: %s",
                self.partition_id,
                type(response).__name__,
                exc,
            )
            return True

    async def _send_all(self, replies: list[tuple[_Job, Message]]) -> None:
        for job, response in replies:
            await self._send(job, response)

    async def _append_one(
        self, partition: StoragePartition, request: StorageAppendRequest
    ) -> Message:
        try:
            return await self._serve(partition, request)
        except Exception as exc:
            return self._failure(request, exc)


def _error(future: asyncio.Future[None]) -> BaseException | None:
    if future.cancelled():
        return StorageError("the append was cancelled before it was durable")
    return future.exception()


def _check_session_start(partition: StoragePartition, low_water_mark: int) -> int:
    """A store session may record its start (its low-water mark) on this replica only
    once its dirty tail is truncated and no range is missing; returns the log end."""
    p = partition.partition_id
    max_id = partition.max_transaction_id()
    if max_id > low_water_mark:
        raise StorageRequestError(
            f"low-water mark {low_water_mark} is below the max transaction id "
            f"{max_id} of partition {p}: truncate the dirty transactions first"
        )
    _check_nothing_missing(partition, "before a session starts here")
    return max_id


def _check_nothing_missing(partition: StoragePartition, when: str) -> None:
    missing = partition.missing_ranges()
    if missing:
        # the local low-water mark would vouch for records this replica lacks
        first, last = missing[0]
        raise StorageRequestError(
            f"partition {partition.partition_id} lacks transactions {first}..{last} (lost "
            "to damage found at start-up, the files moved aside): repair them from a peer "
            f"(RepairRequest) or truncate below them {when}"
        )


def _marked(partition: StoragePartition, request: MarkReplicaRequest) -> SessionInfo:
    """The session info a MarkReplicaRequest records (see its docstring)."""
    s, lwm = request.session_id, request.low_water_mark
    if not request.clean:
        max_id = _check_session_start(partition, lwm)
        return SessionInfo(s, lwm, max_id, LOST_SESSION)
    info = partition.session_info()
    if info.low_water_mark != lwm or info.low_water_mark_session_id not in (LOST_SESSION, s):
        raise StorageRequestError(
            f"partition {partition.partition_id} cannot be marked clean by store session {s} "
            f"at low-water mark {lwm}: its marks are {info} (a clean mark follows a suspect "
            "one of the same session; start the replica over with SetLowWaterMark)"
        )
    max_id = partition.max_transaction_id()
    if max_id < request.log_end:
        raise StorageRequestError(
            f"partition {partition.partition_id} cannot be marked clean by store session {s}: "
            f"its log ends at {max_id}, below {request.log_end} (it lost records again: "
            "the session must rejoin it)"
        )
    _check_nothing_missing(partition, "before the replica is marked clean")
    return SessionInfo(s, lwm, info.local_low_water_mark, s)
