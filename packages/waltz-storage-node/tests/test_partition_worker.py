"""One partition's worker driven directly: its limits and rules at their boundaries.

The requests are queued before the worker starts, so the queue holds exactly what a
test put there when the worker first looks at it (which appends merge into one
engine append is then decided, not a race), and ``stop`` returns once every request
is answered. The memory reference engine stores the records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from waltz_api.contracts.storage import StorageEngine
from waltz_api.errors import ConnectionClosedError, PartitionNotFoundError, SessionFencedError
from waltz_api.messages import (
    ErrorCode,
    FailureResponse,
    MarkReplicaRequest,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    Message,
    MissingRangeRequest,
    MissingRangeResponse,
    RecordHeaderListRequest,
    RecordHeaderListResponse,
    RecordListRequest,
    RecordListResponse,
    RepairRequest,
    SetLowWaterMarkRequest,
    StorageAppendRequest,
    SuccessResponse,
    TruncateRequest,
)
from waltz_api.plugins import get_registry
from waltz_api.storage_failures import StorageRequestError
from waltz_api.types import LOST_SESSION, SessionInfo
from waltz_conformance.records import make_records
from waltz_storage_node.partition import PartitionStats, PartitionWorker, failure_for

pytestmark = pytest.mark.timeout(60)

CLUSTER_KEY = uuid.UUID("0c6f1f0e-3c59-4d55-8e0e-5d5a4f1f6a21")


@pytest.fixture
async def engine() -> AsyncIterator[StorageEngine]:
    location = f"memory-storage-{uuid.uuid4()}"
    factory: Any = get_registry().get("storage", "memory").factory
    opened: StorageEngine = await factory.open(location, cluster_key=CLUSTER_KEY, num_partitions=2)
    await opened.add_partition(0)
    try:
        yield opened
    finally:
        await opened.close()
        from waltz_conformance.reference.storage import forget

        forget(location)


async def _answers(worker: PartitionWorker, requests: Sequence[Any]) -> list[Message]:
    """Queue ``requests`` on a worker not started yet, then run it until all are
    answered; the answers in the order the requests were queued."""
    answers: dict[int, Message] = {}
    for index, request in enumerate(requests):

        async def reply(message: Message, index: int = index) -> None:
            answers[index] = message

        await worker.submit(request, reply)
    worker.start()
    await worker.stop()
    assert len(answers) == len(requests), "stop returns once every request is answered"
    return [answers[index] for index in range(len(requests))]


def _appends(session: int, first: int, sizes: Sequence[int]) -> list[StorageAppendRequest]:
    """Appends of ``sizes`` records each, their ids continuing each other from ``first``."""
    requests = []
    for seq, size in enumerate(sizes):
        records = tuple(make_records(first, size, partition_id=0))
        requests.append(StorageAppendRequest(session, seq, 0, records))
        first += size
    return requests


_Answer = MaxTransactionIdResponse | FailureResponse


def _ok(answers: Sequence[Message]) -> bool:
    return all(isinstance(answer, SuccessResponse) for answer in answers)


async def test_a_merged_append_holds_up_to_exactly_the_batch_limit(engine: StorageEngine) -> None:
    """Queued appends merge while the batch stays within ``max_append_batch_records``:
    one record each with a limit of 3 makes batches of 3, 3 and 1 (a batch reaches the
    limit exactly, and never passes it)."""
    worker = PartitionWorker(engine, 0, max_append_batch_records=3)
    answers = await _answers(worker, _appends(1, 0, [1] * 7))
    assert _ok(answers)
    assert worker.stats.engine_appends == 3
    assert worker.stats.records_appended == 7
    assert engine.partition(0).max_transaction_id() == 6
    # two records each: none fits behind another in a batch of 3 (4 would pass it)
    worker = PartitionWorker(engine, 0, max_append_batch_records=3)
    answers = await _answers(worker, _appends(1, 7, [2, 2, 2]))
    assert _ok(answers)
    assert worker.stats.engine_appends == 3
    assert engine.partition(0).max_transaction_id() == 12


async def test_followers_of_several_records_merge_by_their_first_id(
    engine: StorageEngine,
) -> None:
    """A follower continues the batch when its first id is the id after the batch's last
    record, whatever its own length: three appends of two records are one engine append."""
    worker = PartitionWorker(engine, 0)
    assert _ok(await _answers(worker, _appends(1, 0, [2, 2, 2])))
    assert worker.stats.engine_appends == 1
    assert worker.stats.records_appended == 6
    # the same with a gap before the third: two engine appends, the third refused alone
    worker = PartitionWorker(engine, 0)
    requests = _appends(1, 6, [2, 2])
    requests.append(StorageAppendRequest(1, 9, 0, tuple(make_records(11, 2, partition_id=0))))
    answers = await _answers(worker, requests)
    assert _ok(answers[:2]) and isinstance(answers[2], FailureResponse)
    assert answers[2].code == ErrorCode.APPEND_REFUSED
    assert worker.stats.engine_appends == 1
    assert engine.partition(0).max_transaction_id() == 9


async def test_the_stats_count_each_request_once(engine: StorageEngine) -> None:
    """And an empty append behind others is answered on its own (not merged)."""
    worker = PartitionWorker(engine, 0)
    requests: list[Any] = _appends(2, 0, [1, 1])
    requests.append(StorageAppendRequest(2, 2, 0, ()))
    requests += [MaxTransactionIdRequest(2, 5, 0), MaxTransactionIdRequest(1, 6, 0)]
    answers = await _answers(worker, requests)
    assert _ok(answers[:3]) and answers[3] == MaxTransactionIdResponse(2, 5, 0, 1)
    assert isinstance(answers[4], FailureResponse) and answers[4].code == ErrorCode.FENCED
    assert answers[4].highest_session_id == 2
    assert worker.stats == PartitionStats(
        requests=5, append_requests=3, engine_appends=1, records_appended=2, fenced=1
    )
    assert engine.partition(0).max_transaction_id() == 1


async def test_a_reply_that_fails_leaves_the_rest_of_its_batch_answered(
    engine: StorageEngine,
) -> None:
    """A sender gone away (its reply raises) does not cost the appends merged with its
    own their answers: each is answered on its own."""
    worker = PartitionWorker(engine, 0)
    answered: list[int] = []
    for request in _appends(1, 0, [1, 1, 1]):

        async def reply(message: Message, seq: int = request.seq_num) -> None:
            if seq == 0:
                raise ConnectionClosedError("the sender went away")
            answered.append(seq)

        await worker.submit(request, reply)
    worker.start()
    await worker.stop()
    assert answered == [1, 2]
    assert worker.stats.engine_appends == 1


async def test_the_queue_admits_requests_up_to_exactly_its_bytes(engine: StorageEngine) -> None:
    """``queue_bytes`` is inclusive: 40 and 60 bytes fill a 100-byte queue and the next
    byte waits; a request of no declared size (0) is bounded by the count alone."""
    worker = PartitionWorker(engine, 0, queue_bytes=100)

    async def reply(message: Message) -> None:
        pass

    await asyncio.wait_for(worker.submit(MaxTransactionIdRequest(1, 0, 0), reply, 40), 10)
    await asyncio.wait_for(worker.submit(MaxTransactionIdRequest(1, 1, 0), reply, 60), 10)
    for seq in range(2, 5):
        await asyncio.wait_for(worker.submit(MaxTransactionIdRequest(1, seq, 0), reply), 10)
    third = asyncio.create_task(worker.submit(MaxTransactionIdRequest(1, 5, 0), reply, 1))
    await asyncio.sleep(0)
    assert not third.done() and worker.queued == 5
    worker.start()
    await asyncio.wait_for(third, 10)
    await worker.stop()


async def test_a_control_right_behind_an_append_runs_after_it(engine: StorageEngine) -> None:
    """An administrative action queued behind an append ends the batch (it is not an
    append to merge, nor one to skip): it runs after the append, and the append queued
    after it is appended after it."""
    worker = PartitionWorker(engine, 0)
    seen: list[int] = []
    answers: list[Message] = []

    async def reply(message: Message) -> None:
        answers.append(message)

    async def look() -> int:
        seen.append(engine.partition(0).max_transaction_id())
        return seen[-1]

    first, second = _appends(1, 0, [1, 1])
    await worker.submit(first, reply)
    control = asyncio.create_task(worker.run_in_order(look))
    await asyncio.sleep(0)
    await worker.submit(second, reply)
    worker.start()
    assert await asyncio.wait_for(control, 10) == 0
    await asyncio.wait_for(worker.stop(), 10)
    assert _ok(answers) and len(answers) == 2
    assert worker.stats.engine_appends == 2


async def test_the_refusals_say_what_is_wrong(engine: StorageEngine) -> None:
    """The bad arguments the node itself refuses, each at its boundary: a truncation
    to -1 (empty the log) and a read of 0 bytes are fine, -2 and -1 bytes are not."""
    await engine.partition(0).append(make_records(0, 3, partition_id=0))
    worker = PartitionWorker(engine, 0)
    (no_session,) = await _answers(worker, [MaxTransactionIdRequest(-1, 0, 0)])
    assert isinstance(no_session, FailureResponse) and no_session.code == ErrorCode.BAD_REQUEST
    assert "store session id -1 is invalid" in no_session.message
    worker = PartitionWorker(engine, 0)
    answers = await _answers(
        worker,
        [
            TruncateRequest(1, 0, 0, -2),
            RecordListRequest(1, 1, 0, 0, 10, -1),
            RecordListRequest(1, 2, 0, 0, 10, 0),
            RecordListRequest(1, 3, 0, 0, -1),
            RecordHeaderListRequest(1, 4, 0, 0, 0),
            MissingRangeRequest(1, 5, 0),
            TruncateRequest(1, 6, 0, -1),
        ],
    )
    truncate, negative_bytes, no_bytes, negative_count, no_headers, missing, emptied = answers
    assert isinstance(truncate, FailureResponse) and truncate.code == ErrorCode.BAD_REQUEST
    assert "it must be -1 (empty the log) or more" in truncate.message
    assert truncate.highest_session_id == -1
    assert isinstance(negative_bytes, FailureResponse)
    assert "max_bytes must be non-negative, got -1" in negative_bytes.message
    assert isinstance(no_bytes, RecordListResponse)
    assert isinstance(negative_count, FailureResponse)
    assert "max_records must be non-negative, got -1" in negative_count.message
    assert no_headers == RecordHeaderListResponse(1, 4, 0, ())
    assert missing == MissingRangeResponse(1, 5, 0, -1, -1)
    assert isinstance(emptied, SuccessResponse)
    assert engine.partition(0).max_transaction_id() == -1


async def test_a_refusal_is_logged_as_such_and_a_bug_with_its_traceback(
    engine: StorageEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A request refused by the rules (a StorageError) is an INFO line, not an error;
    anything else is an ERROR with its traceback (a bug to look at)."""
    worker = PartitionWorker(engine, 0)
    with caplog.at_level(logging.INFO, logger="waltz_storage_node.partition"):
        answers = await _answers(worker, [TruncateRequest(1, 0, 0, -2), _Broken()])
    refused = [r for r in caplog.records if "TruncateRequest refused" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in refused] == [(logging.INFO, None)]
    failed = [r for r in caplog.records if "_Broken failed unexpectedly" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR and failed[0].exc_info
    assert isinstance(answers[1], FailureResponse)


@dataclasses.dataclass(frozen=True)
class _Broken:
    """A request whose session id is not a number: processing it fails with a TypeError."""

    session_id: Any = "one"
    seq_num: int = 1
    partition_id: int = 0


async def test_only_an_empty_partition_without_marks_is_recorded_lost(
    engine: StorageEngine,
) -> None:
    """Raising the fence of a partition that never had marks records LOST_SESSION as
    its marks' session only when it holds no record (new, or a wiped disk)."""
    await engine.add_partition(1)
    await engine.partition(0).append(make_records(0, 1, partition_id=0))
    await _answers(PartitionWorker(engine, 0), [MaxTransactionIdRequest(1, 0, 0)])
    await _answers(PartitionWorker(engine, 1), [MaxTransactionIdRequest(1, 0, 1)])
    assert engine.partition(0).session_info() == SessionInfo(session_id=1)
    assert engine.partition(1).session_info() == SessionInfo(
        session_id=1, low_water_mark_session_id=LOST_SESSION
    )


class _Metrics:
    """Records the worker's metric calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def fenced_request(self, partition_id: int) -> None:
        self.calls.append(("fenced_request", partition_id))

    def session_fenced(self, partition_id: int) -> None:
        self.calls.append(("session_fenced", partition_id))

    def appended(self, partition_id: int, records: int, data_bytes: int, seconds: float) -> None:
        assert 0 <= seconds < 600, "the append's duration, in seconds"
        self.calls.append(("appended", records))
        self.calls.append(("appended bytes", data_bytes))


async def test_the_metrics_count_superseded_sessions_and_fenced_requests(
    engine: StorageEngine,
) -> None:
    """A session superseding another (session 0 included) counts once; the first
    session on a partition supersedes none; a fenced request counts as such."""
    metrics = _Metrics()
    worker = PartitionWorker(engine, 0, metrics=metrics)  # type: ignore[arg-type]
    requests: list[Any] = [MaxTransactionIdRequest(0, 0, 0), *_appends(1, 0, [1, 1])]
    requests += [MaxTransactionIdRequest(1, 3, 0), MaxTransactionIdRequest(0, 4, 0)]
    requests.append(MaxTransactionIdRequest(2, 5, 0))
    await _answers(worker, requests)
    data_bytes = sum(len(record.data) for record in make_records(0, 2, partition_id=0))
    assert metrics.calls == [
        ("session_fenced", 0),
        ("appended", 2),
        ("appended bytes", data_bytes),
        ("fenced_request", 0),
        ("session_fenced", 0),
    ]


def test_a_failure_names_the_fence_only_when_fenced() -> None:
    request = MaxTransactionIdRequest(4, 9, 1)
    refused = failure_for(request, StorageRequestError("bad"))
    assert refused == FailureResponse(4, 9, 1, ErrorCode.BAD_REQUEST, "bad", -1)
    fenced = failure_for(request, SessionFencedError("stop", 7))
    assert (fenced.code, fenced.message, fenced.highest_session_id) == (ErrorCode.FENCED, "stop", 7)
    # an exception without a message is named by its type
    assert failure_for(request, StorageRequestError()).message == "StorageRequestError"


async def test_a_failed_control_fails_its_caller_and_the_worker_goes_on(
    engine: StorageEngine,
) -> None:
    worker = PartitionWorker(engine, 0)
    worker.start()

    async def fail() -> None:
        raise StorageRequestError("the action failed")

    try:
        with pytest.raises(StorageRequestError, match="the action failed"):
            await asyncio.wait_for(worker.run_in_order(fail), 10)

        async def answer() -> str:
            return "done"

        assert await asyncio.wait_for(worker.run_in_order(answer), 10) == "done"
    finally:
        await worker.stop()


async def test_a_request_that_breaks_the_worker_is_logged_and_the_next_served(
    engine: StorageEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug processing one request (here an append whose record has no id) is logged,
    and the partition serves the requests after it: it does not stall."""
    worker = PartitionWorker(engine, 0)
    answers: list[Message] = []

    async def reply(message: Message) -> None:
        answers.append(message)

    broken = StorageAppendRequest(1, 0, 0, (None,))  # type: ignore[arg-type]
    await worker.submit(broken, reply)
    await worker.submit(MaxTransactionIdRequest(1, 1, 0), reply)
    with caplog.at_level(logging.ERROR, logger="waltz_storage_node.partition"):
        worker.start()
        await asyncio.wait_for(worker.stop(), 10)
    assert answers == [MaxTransactionIdResponse(1, 1, 0, -1)]
    assert any("request processing failed" in r.getMessage() for r in caplog.records)


async def test_a_stopped_worker_refuses_what_comes_after(engine: StorageEngine) -> None:
    """Requests and actions that arrive once the worker stops (the partition moved
    away), and a sender still waiting for room then, are told the partition is gone."""
    worker = PartitionWorker(engine, 0, queue_bytes=10)
    answers: list[Message] = []

    async def reply(message: Message) -> None:
        answers.append(message)

    await worker.submit(MaxTransactionIdRequest(1, 0, 0), reply, 10)
    waiting = asyncio.create_task(worker.submit(MaxTransactionIdRequest(1, 1, 0), reply, 10))
    await asyncio.sleep(0)
    assert not waiting.done()
    worker.start()
    await worker.stop()
    await asyncio.wait_for(waiting, 10)
    await worker.submit(MaxTransactionIdRequest(1, 2, 0), reply)
    by_seq = {answer.seq_num: answer for answer in answers if isinstance(answer, _Answer)}
    assert by_seq[0] == MaxTransactionIdResponse(1, 0, 0, -1)
    refused = [by_seq[1], by_seq[2]]
    assert all(isinstance(a, FailureResponse) for a in refused)
    assert [getattr(a, "code", None) for a in refused] == [ErrorCode.PARTITION_NOT_FOUND] * 2

    async def action() -> None:
        pass

    with pytest.raises(PartitionNotFoundError, match="no longer hosted"):
        await worker.run_in_order(action)


async def test_a_partition_with_holes_names_the_lowest_and_logs_each_repair(
    engine: StorageEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With two missing ranges, the answers and refusals name the lowest one, and a
    repair's log line names the range it filled (its first and last ids)."""
    from waltz_conformance.reference.storage import MemoryStoragePartition

    holes = [(3, 5), (8, 9)]
    repaired: list[list[int]] = []

    async def repair(self: MemoryStoragePartition, records: Sequence[Any]) -> None:
        repaired.append([record.transaction_id for record in records])
        del holes[0]

    monkeypatch.setattr(MemoryStoragePartition, "missing_ranges", lambda self: list(holes))
    monkeypatch.setattr(MemoryStoragePartition, "repair", repair)
    worker = PartitionWorker(engine, 0)
    with caplog.at_level(logging.INFO, logger="waltz_storage_node.partition"):
        answers = await _answers(
            worker,
            [
                MissingRangeRequest(1, 0, 0),
                SetLowWaterMarkRequest(1, 1, 0, 10),
                RepairRequest(1, 2, 0, tuple(make_records(3, 3, partition_id=0))),
                RepairRequest(1, 3, 0, tuple(make_records(8, 1, partition_id=0))),
                MissingRangeRequest(1, 4, 0),
            ],
        )
    assert answers[0] == MissingRangeResponse(1, 0, 0, 3, 5)
    assert isinstance(answers[1], FailureResponse)
    assert "lacks transactions 3..5" in answers[1].message
    assert _ok(answers[2:4]) and repaired == [[3, 4, 5], [8]]
    assert answers[4] == MissingRangeResponse(1, 4, 0, -1, -1)
    logged = [r.getMessage() for r in caplog.records if "repaired transactions" in r.getMessage()]
    assert [line.split(" from ")[0] for line in logged] == [
        "partition 0: repaired transactions 3..5",
        "partition 0: repaired transactions 8..8",
    ]


async def test_the_marks_a_session_records_and_their_boundaries(engine: StorageEngine) -> None:
    """SetLowWaterMark at exactly the log end is fine and one below refused; a suspect
    mark records LOST_SESSION; the clean mark that follows needs the same low-water
    mark and a log reaching exactly ``log_end`` (or more), and keeps the local mark."""
    partition = engine.partition(0)
    await partition.append(make_records(0, 3, partition_id=0))
    answers = await _answers(
        PartitionWorker(engine, 0),
        [
            SetLowWaterMarkRequest(1, 0, 0, 1),
            SetLowWaterMarkRequest(1, 1, 0, 2),
            MarkReplicaRequest(2, 2, 0, 1, clean=False),
            MarkReplicaRequest(2, 3, 0, 2, clean=False),
        ],
    )
    assert isinstance(answers[0], FailureResponse)
    assert "low-water mark 1 is below the max transaction id 2" in answers[0].message
    assert isinstance(answers[2], FailureResponse)
    assert _ok([answers[1], answers[3]])
    assert partition.session_info() == SessionInfo(2, 2, 2, LOST_SESSION)
    await partition.append(make_records(3, 2, partition_id=0))
    answers = await _answers(
        PartitionWorker(engine, 0),
        [
            MarkReplicaRequest(2, 0, 0, 3, clean=True, log_end=4),
            MarkReplicaRequest(2, 1, 0, 2, clean=True, log_end=5),
            MarkReplicaRequest(2, 2, 0, 2, clean=True, log_end=4),
        ],
    )
    assert isinstance(answers[0], FailureResponse) and "its marks are" in answers[0].message
    assert isinstance(answers[1], FailureResponse)
    assert "its log ends at 4, below 5" in answers[1].message
    assert _ok([answers[2]])
    assert partition.session_info() == SessionInfo(2, 2, 2, 2)
    # clean already in this session: marking it clean again is fine; by another session not
    answers = await _answers(
        PartitionWorker(engine, 0),
        [
            MarkReplicaRequest(2, 0, 0, 2, clean=True, log_end=3),
            MarkReplicaRequest(3, 1, 0, 2, clean=True, log_end=3),
        ],
    )
    assert _ok([answers[0]]) and isinstance(answers[1], FailureResponse)


async def test_an_append_of_another_session_is_never_merged(engine: StorageEngine) -> None:
    """Appends merge only within one store session: an older session's append queued
    right behind a newer one's, its ids continuing them, is fenced (nothing of it is
    stored), and a newer one's behind an older one's raises the fence first."""
    newer = StorageAppendRequest(2, 0, 0, tuple(make_records(0, 1, partition_id=0)))
    older = StorageAppendRequest(1, 1, 0, tuple(make_records(1, 1, partition_id=0)))
    answers = await _answers(PartitionWorker(engine, 0), [newer, older])
    assert _ok([answers[0]])
    assert isinstance(answers[1], FailureResponse) and answers[1].code == ErrorCode.FENCED
    assert engine.partition(0).max_transaction_id() == 0
    newest = StorageAppendRequest(3, 1, 0, tuple(make_records(2, 1, partition_id=0)))
    again = StorageAppendRequest(2, 2, 0, tuple(make_records(1, 1, partition_id=0)))
    answers = await _answers(PartitionWorker(engine, 0), [again, newest])
    assert _ok(answers)
    assert engine.partition(0).session_info().session_id == 3
    assert engine.partition(0).max_transaction_id() == 2
