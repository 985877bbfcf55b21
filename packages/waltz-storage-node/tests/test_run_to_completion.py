"""Appends run to completion on a partition's worker (the fs engine, real files).

An append of the session the partition's fence holds is handed to the engine by the
callback that received it and answered by the one that resolves it (``post``, no task
in between); the partition's order holds all the same: what is queued behind an append
waits until it is answered, appends queued in one loop iteration merge, a reply that
cannot be posted is sent by the task with the rest in order, and a stalled disk holds
up only the requests queued behind its append, never the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from waltz_api.contracts.transport import Transport
from waltz_api.messages import (
    FailureResponse,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    Message,
    StorageAppendRequest,
    SuccessResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_conformance.records import make_records
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import Files
from waltz_storage_node import StorageClient, StorageNode
from waltz_storage_node.partition import PartitionWorker

pytestmark = pytest.mark.timeout(60)

KEY = uuid.UUID("5e2d8c41-0a7b-4f93-b6e1-c3d94a7f2b05")
DEADLINE = 30.0
"""Seconds to wait for an event (holds on a slow, loaded machine)."""


class GatedFiles(Files):
    """The real file system whose flushes wait while the gate is closed (a stalled disk)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()
        """Set once a flush waits at the closed gate."""

    def fdatasync(self, fd: int) -> None:
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait(DEADLINE)
        super().fdatasync(fd)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[FsStorageEngine, GatedFiles]]:
    files = GatedFiles()
    opened = await FsStorageEngine.open(
        str(tmp_path / "node"), cluster_key=KEY, num_partitions=2, files=files
    )
    try:
        await opened.add_partition(0)
        await opened.add_partition(1)
        yield opened, files
    finally:
        files.gate.set()
        await opened.close()


@dataclass
class Answers:
    """The answers of a worker, in the order they were sent, and how (post or reply)."""

    got: list[tuple[int, Message, str]] = field(default_factory=list)
    refuse_posts: set[int] = field(default_factory=set)
    """seq_nums whose post answers False (no room: the task must send them)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def reply(self, message: Message) -> None:
        self._add(message, "reply")

    def post(self, message: Message) -> bool:
        if getattr(message, "seq_num", -1) in self.refuse_posts:
            return False
        self._add(message, "post")
        return True

    def _add(self, message: Message, how: str) -> None:
        self.got.append((getattr(message, "seq_num", -1), message, how))
        self.changed.set()

    async def until(self, count: int) -> None:
        async def wait() -> None:
            while len(self.got) < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), DEADLINE)

    def seqs(self) -> list[int]:
        return [seq for seq, _, _ in self.got]

    def hows(self) -> list[str]:
        return [how for _, _, how in self.got]


def _append(seq: int, first: int, count: int, session: int = 1) -> StorageAppendRequest:
    return StorageAppendRequest(session, seq, 0, tuple(make_records(first, count, partition_id=0)))


async def _submit(worker: PartitionWorker, answers: Answers, requests: Sequence[Any]) -> None:
    for request in requests:
        await worker.submit(request, answers.reply, 0, answers.post)


async def _started(engine: FsStorageEngine, answers: Answers) -> PartitionWorker:
    """A worker whose fence holds session 1 (its first append, served by the task)."""
    worker = PartitionWorker(engine, 0)
    worker.start()
    await _submit(worker, answers, [_append(0, 0, 5)])
    await answers.until(1)
    assert answers.got[0][2] == "reply", "raising the fence is the task's"
    return worker


async def _wait_thread_event(event: threading.Event) -> None:
    assert await asyncio.wait_for(asyncio.to_thread(event.wait, DEADLINE), DEADLINE + 5)


async def test_a_request_queued_behind_an_append_waits_until_it_is_answered(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    fs, files = engine
    answers = Answers()
    worker = await _started(fs, answers)
    files.gate.clear()
    await _submit(
        worker, answers, [_append(1, 5, 5), MaxTransactionIdRequest(1, 2, 0), _append(3, 10, 5)]
    )
    await _wait_thread_event(files.held)  # the append is on the (stalled) disk
    files.gate.set()
    await answers.until(4)
    await worker.stop()
    assert answers.seqs() == [0, 1, 2, 3], "answered in the order they came"
    max_id = answers.got[2][1]
    assert isinstance(max_id, MaxTransactionIdResponse)
    assert max_id.transaction_id == 9, "served once the append before it was durable"
    assert all(isinstance(answers.got[i][1], SuccessResponse) for i in (0, 1, 3))
    assert answers.hows() == ["reply", "post", "reply", "post"], (
        "the appends of the fenced session are answered by the callback (run to "
        "completion), the read by the task"
    )
    assert worker.stats.engine_appends == 3
    assert worker.stats.records_appended == 15
    assert fs.partition(0).max_transaction_id() == 14


async def test_the_appends_queued_in_one_loop_iteration_merge_into_one_engine_append(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    fs, _ = engine
    answers = Answers()
    worker = await _started(fs, answers)
    await _submit(worker, answers, [_append(1, 5, 2), _append(2, 7, 3), _append(3, 10, 1)])
    await answers.until(4)
    await worker.stop()
    assert answers.seqs() == [0, 1, 2, 3]
    assert answers.hows()[1:] == ["post", "post", "post"]
    assert worker.stats.engine_appends == 2, "the three appends of one iteration: one"
    assert worker.stats.append_requests == 4
    assert fs.partition(0).max_transaction_id() == 10


async def test_a_reply_that_cannot_be_posted_is_sent_by_the_task_with_the_rest_in_order(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    fs, _ = engine
    answers = Answers(refuse_posts={2})
    worker = await _started(fs, answers)
    await _submit(
        worker,
        answers,
        [_append(1, 5, 1), _append(2, 6, 1), _append(3, 7, 1), MaxTransactionIdRequest(1, 4, 0)],
    )
    await answers.until(5)
    await worker.stop()
    assert answers.seqs() == [0, 1, 2, 3, 4]
    assert answers.hows() == ["reply", "post", "reply", "reply", "reply"]
    assert all(isinstance(message, SuccessResponse) for _, message, _ in answers.got[:4])
    last = answers.got[4][1]
    assert isinstance(last, MaxTransactionIdResponse) and last.transaction_id == 7


async def test_a_merged_append_refused_at_once_is_answered_one_by_one(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    fs, _ = engine
    answers = Answers()
    worker = await _started(fs, answers)
    # ids that skip 5..9: the engine refuses the merged batch (nothing stored), then each
    await _submit(worker, answers, [_append(1, 10, 2), _append(2, 12, 2), _append(3, 5, 1)])
    await answers.until(4)
    await worker.stop()
    assert answers.seqs() == [0, 1, 2, 3]
    refused = [message for _, message, _ in answers.got[1:3]]
    assert all(isinstance(message, FailureResponse) for message in refused), refused
    assert isinstance(answers.got[3][1], SuccessResponse), "the partition goes on"
    assert fs.partition(0).max_transaction_id() == 5


async def test_a_merged_append_refused_at_once_is_answered_before_the_request_behind_it(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    """The one-by-one answers of a refused merged append are the task's work: the
    request queued behind waits for them (nothing else starts meanwhile), then is served."""
    fs, _ = engine
    answers = Answers()
    worker = await _started(fs, answers)
    behind = MaxTransactionIdRequest(1, 3, 0)
    await _submit(worker, answers, [_append(1, 10, 2), _append(2, 12, 2), behind])
    await answers.until(4)
    await worker.stop()
    assert answers.seqs() == [0, 1, 2, 3]
    refused = [message for _, message, _ in answers.got[1:3]]
    assert all(isinstance(message, FailureResponse) for message in refused), refused
    assert answers.got[3][1] == MaxTransactionIdResponse(1, 3, 0, 4)


async def test_a_lone_append_refused_is_answered_by_the_callback_not_tried_again(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    """A lone append the engine refuses (ids that skip 5..9) gets its failure from the
    callback, posted; only a merged batch is tried again one by one (by the task)."""
    fs, _ = engine
    answers = Answers()
    worker = await _started(fs, answers)
    await _submit(worker, answers, [_append(1, 10, 2)])
    await answers.until(2)
    await worker.stop()
    assert isinstance(answers.got[1][1], FailureResponse)
    assert answers.hows() == ["reply", "post"]


async def test_stop_during_an_append_on_the_engine_ends_once_it_is_answered(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    """``stop`` while an append that runs to completion is on the (stalled) disk: the
    worker's task ends once the append is answered (its callback wakes the task)."""
    fs, files = engine
    answers = Answers()
    worker = await _started(fs, answers)
    files.gate.clear()
    await _submit(worker, answers, [_append(1, 5, 2)])
    await _wait_thread_event(files.held)
    stopping = asyncio.ensure_future(worker.stop())
    await asyncio.sleep(0)
    files.gate.set()
    await asyncio.wait_for(stopping, DEADLINE)
    assert answers.seqs() == [0, 1] and answers.hows() == ["reply", "post"]


async def test_a_post_that_raises_leaves_the_rest_of_its_batch_answered(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    """A post that raises (the connection went away) is done with, as a reply that
    fails: the other appends merged with it are still answered."""
    fs, _ = engine
    answers = Answers()
    worker = await _started(fs, answers)
    post = answers.post

    def breaking(message: Message) -> bool:
        if getattr(message, "seq_num", -1) == 2:
            raise ConnectionResetError("the connection went away")
        return post(message)

    for request in (_append(1, 5, 1), _append(2, 6, 1), _append(3, 7, 1)):
        await worker.submit(request, answers.reply, 0, breaking)
    await answers.until(3)
    await worker.stop()
    assert answers.seqs() == [0, 1, 3]
    assert fs.partition(0).max_transaction_id() == 7


async def test_requests_queued_before_the_start_are_served_in_order(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    """Queued before ``start`` (the fence already holds the session): the append starts
    at once, and the read behind it waits for its answer."""
    fs, _ = engine
    answers = Answers()
    first = await _started(fs, answers)
    await first.stop()
    worker = PartitionWorker(fs, 0)
    await _submit(worker, answers, [_append(1, 5, 5), MaxTransactionIdRequest(1, 2, 0)])
    worker.start()
    await answers.until(3)
    await worker.stop()
    assert answers.seqs() == [0, 1, 2]
    assert answers.got[2][1] == MaxTransactionIdResponse(1, 2, 0, 9)


async def test_the_appends_of_store_session_0_run_to_completion_too(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    """Session 0 (a cluster's first store session) is a session like any other: once
    the fence holds it, its appends are answered by the callback (posted)."""
    fs, _ = engine
    answers = Answers()
    worker = PartitionWorker(fs, 0)
    worker.start()
    await _submit(worker, answers, [_append(0, 0, 5, session=0)])  # raises the fence
    await answers.until(1)
    await _submit(worker, answers, [_append(1, 5, 2, session=0)])
    await answers.until(2)
    await worker.stop()
    assert answers.got[1][1] == SuccessResponse(0, 1, 0)
    assert answers.hows() == ["reply", "post"]
    assert fs.partition(0).max_transaction_id() == 6


async def test_a_request_that_breaks_the_callback_is_logged_and_the_next_served(
    engine: tuple[FsStorageEngine, GatedFiles], caplog: pytest.LogCaptureFixture
) -> None:
    """A bug taking an append that runs to completion (here a record without an id) is
    logged and the partition serves the requests after it, as the task does."""
    fs, _ = engine
    answers = Answers()
    worker = await _started(fs, answers)
    broken = StorageAppendRequest(1, 1, 0, (None,))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="waltz_storage_node.partition"):
        await _submit(worker, answers, [broken, MaxTransactionIdRequest(1, 2, 0)])
        await answers.until(2)
    await worker.stop()
    assert answers.seqs() == [0, 2]
    assert answers.got[1][1] == MaxTransactionIdResponse(1, 2, 0, 4)
    assert any("request processing failed" in r.getMessage() for r in caplog.records)


async def test_a_stalled_disk_holds_up_its_partition_only_never_the_event_loop(
    engine: tuple[FsStorageEngine, GatedFiles],
) -> None:
    fs, files = engine
    answers = Answers()
    worker = await _started(fs, answers)
    other = PartitionWorker(fs, 1)
    other.start()
    others = Answers()
    await _submit(other, others, [MaxTransactionIdRequest(1, 0, 1)])  # its fence raised
    await others.until(1)
    files.gate.clear()
    await _submit(worker, answers, [_append(1, 5, 5)])
    await _wait_thread_event(files.held)
    # the loop runs on: the other partition is served meanwhile (from memory)
    await _submit(other, others, [MaxTransactionIdRequest(1, 1, 1)])
    await others.until(2)
    assert isinstance(others.got[1][1], MaxTransactionIdResponse)
    assert answers.seqs() == [0], "the append waits for its disk"
    files.gate.set()
    await answers.until(2)
    assert isinstance(answers.got[1][1], SuccessResponse)
    await worker.stop()
    await other.stop()


async def test_the_acknowledgements_of_a_round_leave_in_one_message(tmp_path: Path) -> None:
    """Over ZeroMQ (loopback): the appends of four partitions sent in one message are one
    round, and their four acknowledgements come back in one transport message."""
    transport = get_registry().get("transport", "zmq").factory
    server_transport: Transport = transport({})
    client_transport: Transport = transport({})
    fs = await FsStorageEngine.open(str(tmp_path / "node"), cluster_key=KEY, num_partitions=4)
    for p in range(4):
        await fs.add_partition(p)
    node = StorageNode(fs, server_transport, f"tcp://127.0.0.1:{free_port()}")
    await node.start()
    client = await StorageClient.connect(client_transport, node.endpoint, sender="test")
    try:
        await client.open(KEY, 4)
        for p in range(4):  # each partition's fence raised: its appends run to completion
            await asyncio.wait_for(client.append(1, p, make_records(0, 1, partition_id=p)), 30)
        received = client.conn._seq_in  # type: ignore[attr-defined]
        burst = [client.start_append(1, p, make_records(1, 2, partition_id=p)) for p in range(4)]
        assert await asyncio.wait_for(asyncio.gather(*burst), 30) == [None] * 4
        assert client.conn._seq_in - received == 1  # type: ignore[attr-defined]
    finally:
        await client.close()
        await node.close()
        await server_transport.close()
        await client_transport.close()
