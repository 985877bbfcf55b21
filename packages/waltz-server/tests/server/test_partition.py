"""The partition: append path, locking, feeds, mount, flush, reads (in-process storage nodes)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import pytest
from fakes import FakeReplicaConnection, FakeStorageNode

from waltz_api import wire
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
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
from waltz_api.types import Lock, LockMode, LockRequest, Record, ReqId
from waltz_conformance.reference.coordination import (
    MemoryCoordination,
    MemoryCoordinationService,
)
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.caches import DATA_ENTRY_OVERHEAD, FRAME_COST, DataCache, FeedCache
from waltz_server.server.partition import Partition, PartitionConfig
from waltz_server.server.store import StoreConfig, StorePartition
from waltz_server.server.store_session import StoreSession

P = 0
GEN = 1
TIMEOUT = 20.0
NODES = ("a:1", "b:1", "c:1")
M = TypeVar("M", bound=Message)


class Stream:
    """A client connection as the partition sees it; records what it was sent."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.closed = False
        self.take_feed_now = True
        """``post_feed`` takes the frames (False: as a full outbox, it never does)."""
        self.feed_posts = 0
        self._event = asyncio.Event()

    async def send(self, message: Message) -> None:
        self.post(message)

    async def send_feed(
        self, frames: Sequence[bytes], partition_id: int, last_transaction_id: int
    ) -> None:
        feed = [wire.decode(frame) for frame in frames]
        assert all(isinstance(m, FeedData) for m in feed)
        assert feed[-1].transaction_id == last_transaction_id  # type: ignore[attr-defined]
        assert {m.req_id.partition_id for m in feed} == {partition_id}  # type: ignore[attr-defined]
        for message in feed:
            self.post(message)

    def post_feed(
        self, frames: Sequence[bytes], partition_id: int, last_transaction_id: int
    ) -> bool:
        if not self.take_feed_now:
            return False
        self.feed_posts += 1
        feed = [wire.decode(frame) for frame in frames]
        assert feed[-1].transaction_id == last_transaction_id  # type: ignore[attr-defined]
        for message in feed:
            self.post(message)
        return True

    def post(self, message: Message) -> None:
        self.messages.append(message)
        self._event.set()
        self._event = asyncio.Event()

    def of(self, kind: type[M]) -> list[M]:
        return [m for m in self.messages if isinstance(m, kind)]

    async def wait_for(self, done: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        async def loop() -> None:
            while not done():
                await self._event.wait()

        await asyncio.wait_for(loop(), timeout)

    def feed_ids(self) -> list[int]:
        return [m.transaction_id for m in self.of(FeedData)]


@pytest.fixture
async def env() -> AsyncIterator[tuple[Partition, dict[str, FakeStorageNode]]]:
    async with serving() as served:
        yield served


@contextlib.asynccontextmanager
async def serving(
    store_config: StoreConfig | None = None, append_queue_size: int = 2000
) -> AsyncIterator[tuple[Partition, dict[str, FakeStorageNode]]]:
    """A recovered partition on three in-process storage nodes."""
    coordination = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await coordination.start()
    await ClusterAdmin(coordination).create_cluster(
        num_partitions=1, num_replicas=3, storage_nodes=list(NODES)
    )
    nodes = {n: FakeStorageNode(n) for n in NODES}

    async def connector(node: str, partition_id: int, session_id: int) -> FakeReplicaConnection:
        return await nodes[node].connect(partition_id, session_id)

    store = StorePartition(
        partition_id=P,
        generation=GEN,
        coordination=coordination,
        replica_nodes=list(NODES),
        connector=connector,
        config=store_config or StoreConfig(retry_initial=0.001, retry_max=0.02),
        rng=random.Random(0),
    )
    partition = Partition(
        store=store,
        config=PartitionConfig(
            lock_table="exact",
            feed_cache_bytes=FRAME_COST * 50,
            data_cache_bytes=4096,
            append_queue_size=append_queue_size,
        ),
    )
    await partition.start()
    await store.wait_ready(TIMEOUT)
    try:
        yield partition, nodes
    finally:
        await partition.close()
        await coordination.close()


_seq = iter(range(1, 1_000_000))


def rid(client: int = 1, generation: int = GEN) -> ReqId:
    return ReqId(client, generation, P, next(_seq))


def append(
    client: int = 1,
    data: bytes = b"d",
    hwm: int = -1,
    locks: tuple[Lock, ...] = (),
    generation: int = GEN,
) -> AppendRequest:
    return AppendRequest(
        rid(client, generation), hwm, LockRequest.from_locks(locks), 7, data, wire.checksum(data)
    )


async def settle(partition: Partition, stream: Stream) -> int:
    await partition.submit(FlushRequest(rid()), stream)
    await stream.wait_for(lambda: bool(stream.of(FlushResponse)))
    response = stream.of(FlushResponse)[-1]
    stream.messages.remove(response)
    return response.transaction_id


async def test_feed_delivers_every_commit_in_order_exactly_once(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, _ = env
    writer, reader = Stream(), Stream()
    await partition.submit(FeedRequest(rid(2), -1), reader)
    sent = []
    for i in range(120):
        request = append(client=1 + i % 3, data=b"x%d" % i)
        sent.append(request)
        await partition.submit(request, writer)
    hwm = await settle(partition, writer)
    assert hwm == 119
    await reader.wait_for(lambda: len(reader.of(FeedData)) >= 120)
    await asyncio.sleep(0.01)
    feed = reader.of(FeedData)
    assert [f.transaction_id for f in feed] == list(range(120))
    assert [f.req_id for f in feed] == [r.req_id for r in sent]
    # a late feed from the middle reads from storage (the feed cache holds only 50)
    late = Stream()
    await partition.submit(FeedRequest(rid(3), 9), late)
    await late.wait_for(lambda: len(late.of(FeedData)) >= 110)
    assert late.feed_ids() == list(range(10, 120))
    assert partition.feed_cache.misses > 0 and len(partition.feed_cache) <= 50


async def test_write_locks_on_the_same_high_water_mark_exactly_one_commits(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, _ = env
    stream = Stream()
    account = Lock("account", 42)
    await partition.submit(append(data=b"base"), stream)
    base = await settle(partition, stream)
    first = append(client=1, data=b"one", hwm=base, locks=(account,))
    second = append(client=2, data=b"two", hwm=base, locks=(account,))
    other = append(client=3, data=b"other", hwm=base, locks=(Lock("account", 43),))
    for request in (first, second, other):
        await partition.submit(request, stream)
    hwm = await settle(partition, stream)
    assert hwm == base + 2  # first and other committed
    failures = stream.of(LockFailure)
    assert [f.req_id for f in failures] == [second.req_id]
    assert failures[0].transaction_id == base + 1
    # READ fails once the entity changed after the client's mark, passes when up to date
    stale_read = append(client=4, hwm=base, locks=(Lock("account", 42, LockMode.READ),))
    fresh_read = append(client=4, hwm=hwm, locks=(Lock("account", 42, LockMode.READ),))
    await partition.submit(stale_read, stream)
    await partition.submit(fresh_read, stream)
    hwm2 = await settle(partition, stream)
    assert hwm2 == hwm + 1
    assert [f.req_id for f in stream.of(LockFailure)][-1] == stale_read.req_id
    # APPEND never fails, but makes a later READ/WRITE built before it fail
    owner = Lock("owner", 1, LockMode.APPEND)
    await partition.submit(append(client=5, hwm=-1, locks=(owner,)), stream)
    await partition.submit(append(client=5, hwm=-1, locks=(owner,)), stream)
    hwm3 = await settle(partition, stream)
    assert hwm3 == hwm2 + 2
    child = append(client=6, hwm=hwm2, locks=(Lock("owner", 1, LockMode.READ),))
    await partition.submit(child, stream)
    assert await settle(partition, stream) == hwm3
    assert stream.of(LockFailure)[-1].req_id == child.req_id
    assert partition.stats.lock_failures == 3


async def test_stale_generation_is_refused_and_nothing_written(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, nodes = env
    stream = Stream()
    request = append(generation=GEN - 1, data=b"stale")
    await partition.submit(request, stream)
    hwm = await settle(partition, stream)
    assert hwm == -1
    errors = stream.of(ErrorResponse)
    assert errors and errors[0].code is ErrorCode.STALE_GENERATION
    assert all(not n.log(P) for n in nodes.values())


async def test_mount_ready_after_feed_client_ahead_and_stale_connections(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, _ = env
    old, new = Stream(), Stream()
    await partition.submit(MountRequest(rid(9), -1, 1), old)
    await old.wait_for(lambda: bool(old.of(MountResponse)))
    for i in range(10):
        await partition.submit(append(client=9, data=b"m%d" % i), old)
    # the client reconnects: a new network client with a higher sequence number
    await partition.submit(MountRequest(rid(9), 3, 2), new)
    await new.wait_for(lambda: bool(new.of(MountResponse)))
    response = new.of(MountResponse)[0]
    assert response.status is MountStatus.READY
    # every append sent before the mount was decided, and fed before the response
    assert response.high_water_mark == 9
    assert new.feed_ids() == list(range(4, 10))
    assert new.messages.index(response) == len(new.of(FeedData))
    # the old connection's appends are now ignored
    await partition.submit(append(client=9, data=b"ghost"), old)
    await partition.submit(append(client=9, data=b"live"), new)
    assert await settle(partition, new) == 10
    assert partition.stats.stale_connection == 1
    # a mount from an even older network client is ignored too
    older = Stream()
    await partition.submit(MountRequest(rid(9), -1, 1), older)
    await asyncio.sleep(0.05)
    assert not older.of(MountResponse)
    # a client ahead of the partition is told so
    ahead = Stream()
    await partition.submit(MountRequest(rid(11), 500, 1), ahead)
    await ahead.wait_for(lambda: bool(ahead.of(MountResponse)))
    assert ahead.of(MountResponse)[0].status is MountStatus.CLIENT_AHEAD


async def test_reads_high_water_mark_data_and_ranges(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, _ = env
    stream = Stream()
    payloads = [bytes([i]) * 300 for i in range(40)]
    for data in payloads:
        await partition.submit(append(data=data), stream)
    assert await settle(partition, stream) == 39
    await partition.submit(HighWaterMarkRequest(rid()), stream)
    await stream.wait_for(lambda: bool(stream.of(HighWaterMarkResponse)))
    assert stream.of(HighWaterMarkResponse)[0].transaction_id == 39
    # the data cache holds 4096 bytes: recent ids hit, old ones come from storage
    assert partition.data_cache.bytes <= 4096
    for transaction_id in (39, 0, 41):
        await partition.submit(TransactionDataRequest(rid(), transaction_id), stream)
    await stream.wait_for(lambda: len(stream.of(TransactionDataResponse)) == 3)
    by_id = {r.transaction_id: r for r in stream.of(TransactionDataResponse)}
    assert by_id[39].success and by_id[39].data == payloads[39]
    assert by_id[0].success and by_id[0].data == payloads[0]
    assert by_id[0].checksum == wire.checksum(payloads[0])
    assert not by_id[41].success and "not committed" in by_id[41].error
    await partition.submit(RangeReadRequest(rid(), 5, 10, 1 << 20), stream)
    await partition.submit(RangeReadRequest(rid(), 35, 100, 1 << 20), stream)
    await partition.submit(RangeReadRequest(rid(), 0, 100, 700), stream)
    await stream.wait_for(lambda: len(stream.of(RangeReadResponse)) == 3)
    ranges = {r.req_id.seq_num: r for r in stream.of(RangeReadResponse)}
    first, second, third = (ranges[k] for k in sorted(ranges))
    assert [r.transaction_id for r in first.records] == list(range(5, 15))
    assert [r.data for r in first.records] == payloads[5:15]
    assert [r.transaction_id for r in second.records] == list(range(35, 40))
    assert len(third.records) == 2  # bounded by bytes
    assert first.high_water_mark == 39


async def test_recovery_resets_the_lock_table_conservatively(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, nodes = env
    stream = Stream()
    await partition.submit(append(data=b"a", locks=(Lock("x", 1),)), stream)
    base = await settle(partition, stream)
    # two storage nodes fail: the quorum is lost, the session ends, a new one recovers
    nodes["a:1"].crash()
    nodes["b:1"].crash()
    await partition.submit(append(data=b"b"), stream)
    await partition.submit(append(data=b"c"), stream)
    nodes["a:1"].restart()
    nodes["b:1"].restart()
    hwm = await settle(partition, stream)
    assert hwm >= base
    assert partition.stats.recoveries >= 2
    # a lock never written, checked by a client behind the recovered mark: rejected
    # (every lock looks changed at the recovered mark), with that mark as the conflict
    session = partition.store.session
    assert session is not None
    recovered = session.low_water_mark
    assert recovered >= base
    behind = append(hwm=recovered - 1, locks=(Lock("never", 1),))
    await partition.submit(behind, stream)
    await settle(partition, stream)
    failure = stream.of(LockFailure)[-1]
    assert failure.req_id == behind.req_id
    assert failure.transaction_id == recovered


def test_caches_are_bounded_in_bytes() -> None:
    from waltz_api.types import RecordHeader

    def ids(frames: list[bytes]) -> list[int]:
        return [wire.decode(f).transaction_id for f in frames]  # type: ignore[attr-defined]

    feed = FeedCache(FRAME_COST * 10)
    feed.add([RecordHeader(i, ReqId(1, 1, 0, i), 0) for i in range(25)])
    assert len(feed) == 10 and feed.first_id == 15 and feed.last_id == 24
    assert ids(feed.frames(20, 3)) == [20, 21, 22]
    assert ids(feed.frames(16, 3)) == [16, 17, 18]  # from the left end
    assert ids(feed.frames(22, 100)) == [22, 23, 24]
    assert feed.frames(3, 3) == [] and feed.frames(25, 3) == []
    assert feed.frames(15, 1) == [
        wire.encode(FeedData(ReqId(1, 1, 0, 15), 15, 0))
    ]  # the frame every client is sent
    feed.add([RecordHeader(40, ReqId(1, 1, 0, 40), 0)])  # a gap: restart the range
    assert feed.first_id == 40 and feed.last_id == 40
    data = DataCache(3 * (300 + DATA_ENTRY_OVERHEAD) + 10)
    for i in range(10):
        data.put(i, bytes(300), 0)
    assert data.bytes <= data.max_bytes and len(data) == 3
    assert data.get(9) is not None and data.get(0) is None
    data.put(99, bytes(5000), 0)  # larger than the whole cache: not kept
    assert data.get(99) is None


async def test_flush_is_answered_busy_when_storage_cannot_recover(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    partition, nodes = env
    partition.config = dataclasses.replace(partition.config, mount_timeout=0.3)
    stream = Stream()
    await partition.submit(append(data=b"kept"), stream)
    assert await settle(partition, stream) == 0
    # a majority of the storage nodes is gone: no session can recover
    nodes["a:1"].crash()
    nodes["b:1"].crash()
    await partition.submit(append(data=b"stuck"), stream)
    await partition.submit(FlushRequest(rid()), stream)
    await stream.wait_for(lambda: bool(stream.of(ErrorResponse)))
    busy = stream.of(ErrorResponse)[0]
    assert busy.code is ErrorCode.SERVER_BUSY
    assert not stream.of(FlushResponse)
    # storage comes back: the partition recovers and the next flush is answered
    nodes["a:1"].restart()
    nodes["b:1"].restart()
    partition.config = dataclasses.replace(partition.config, mount_timeout=20.0)
    assert await settle(partition, stream) >= 0
    assert partition.high_water_mark in (0, 1)


async def test_an_append_its_session_dropped_is_answered_not_committed(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """Every append is answered: one in flight when every storage node crashes is
    decided by the next session's recovery, here not committed (it never reached a
    disk), and the flush that covers it answers only after that answer."""
    partition, nodes = env
    stream = Stream()
    kept = append(data=b"kept")
    await partition.submit(kept, stream)
    assert await settle(partition, stream) == 0
    for node in nodes.values():
        node.append_delay = 0.2  # the next append stays in flight
    lost = append(data=b"lost")
    await partition.submit(lost, stream)
    await partition.submit(FlushRequest(rid()), stream)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while partition.store.session is None or partition.store.session.next_transaction_id < 2:
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    for node in nodes.values():
        node.crash()
        node.append_delay = 0.0
    for node in nodes.values():
        node.restart()
    await stream.wait_for(lambda: bool(stream.of(FlushResponse)))
    answers = [m for m in stream.messages if isinstance(m, ErrorResponse | FlushResponse)]
    assert len(answers) == 2 and isinstance(answers[0], ErrorResponse)
    assert answers[0].req_id == lost.req_id and answers[0].code is ErrorCode.NOT_COMMITTED
    assert "re-execute" in answers[0].message
    assert isinstance(answers[1], FlushResponse) and answers[1].transaction_id == 0
    assert partition.stats.not_committed == 1
    stream.messages.clear()
    # the id goes to the next append, and nothing of the lost one was ever stored
    after = append(data=b"after")
    await partition.submit(after, stream)
    assert await settle(partition, stream) == 1
    assert all(r.data != b"lost" for n in nodes.values() for r in n.log(P))


async def test_a_data_fetch_during_recovery_waits_and_succeeds(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """A new owner's partition knows no high-water mark until its first recovery: a
    fetch of a committed transaction then waits for it instead of answering that the
    transaction is not committed."""
    partition, nodes = env
    stream = Stream()
    await partition.submit(append(data=b"fetch me"), stream)
    assert await settle(partition, stream) == 0
    coordination = partition.store._coordination
    await partition.close()
    nodes["a:1"].crash()
    nodes["b:1"].crash()

    async def connector(node: str, partition_id: int, session_id: int) -> FakeReplicaConnection:
        return await nodes[node].connect(partition_id, session_id)

    moved = Partition(
        store=StorePartition(
            partition_id=P,
            generation=GEN + 1,
            coordination=coordination,
            replica_nodes=list(NODES),
            connector=connector,
            config=StoreConfig(retry_initial=0.001, retry_max=0.02),
            rng=random.Random(1),
        ),
        config=PartitionConfig(lock_table="exact"),
    )
    await moved.start()
    try:
        request = TransactionDataRequest(rid(generation=GEN + 1), 0)
        await moved.submit(request, stream)
        await asyncio.sleep(0.05)
        assert not moved.ready
        assert not stream.of(TransactionDataResponse) and not stream.of(ErrorResponse)
        nodes["a:1"].restart()
        nodes["b:1"].restart()
        await stream.wait_for(lambda: bool(stream.of(TransactionDataResponse)))
        response = stream.of(TransactionDataResponse)[0]
        assert response.success and response.data == b"fetch me", response.error
    finally:
        await moved.close()


async def test_an_append_pending_when_the_partition_stops_here_is_not_refused(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """The partition stops here (moved, or a graceful stop) with an append in flight:
    the next owner's recovery may still commit it, so it is not refused by its request
    id (a client would re-execute it: a duplicate); the client is told only that the
    partition left (a partition-level STALE_GENERATION), and its mount at the new owner
    decides the append."""
    partition, nodes = env
    stream = Stream()
    assert await settle(partition, stream) == -1
    for node in nodes.values():
        node.append_delay = 0.2  # the append stays in flight
    pending = append(data=b"pending")
    await partition.submit(pending, stream)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while partition.store.session is None or partition.store.session.next_transaction_id < 1:
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    await partition.close()
    assert all(m.req_id != pending.req_id for m in stream.of(ErrorResponse))
    assert all(m.req_id.client_id == -1 for m in stream.of(ErrorResponse))


async def test_requests_in_flight_when_the_partition_stops_here_are_answered(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """The partition stops here (moved, or the server stops) under requests it took: a
    data fetch, a high-water mark, a range read, flushes and mounts, some being served,
    some still queued behind an append. Each is answered "not here" (a mount NOT_READY),
    so that the client asks the next owner at once: an RPC (a data fetch of a feed
    being applied) was otherwise left to its 60 s timeout, and the feed behind it with
    it. The append is not refused by its request id: the next owner's mount decides it."""
    partition, nodes = env
    stream = Stream()
    await partition.submit(append(data=b"committed"), stream)
    assert await settle(partition, stream) == 0
    coordination = partition.store._coordination
    await partition.close()
    nodes["a:1"].crash()  # the next owner cannot recover: everything it takes waits
    nodes["b:1"].crash()

    async def connector(node: str, partition_id: int, session_id: int) -> FakeReplicaConnection:
        return await nodes[node].connect(partition_id, session_id)

    moved = Partition(
        store=StorePartition(
            partition_id=P,
            generation=GEN + 1,
            coordination=coordination,
            replica_nodes=list(NODES),
            connector=connector,
            config=StoreConfig(retry_initial=0.001, retry_max=0.02),
            rng=random.Random(1),
        ),
        config=PartitionConfig(lock_table="exact"),
    )
    await moved.start()
    stream = Stream()
    gen = GEN + 1
    served: list[Message] = [
        TransactionDataRequest(rid(generation=gen), 0),
        HighWaterMarkRequest(rid(generation=gen)),
        RangeReadRequest(rid(generation=gen), 0, 10, 1 << 20),
        FlushRequest(rid(generation=gen)),
        MountRequest(rid(client=2, generation=gen), -1, 1),
    ]
    blocking = append(generation=gen)  # waits for the recovery: the ones after it queue
    queued: list[Message] = [
        FlushRequest(rid(generation=gen)),
        MountRequest(rid(client=3, generation=gen), -1, 1),
    ]
    try:
        for message in [*served, blocking, *queued]:
            await moved.submit(message, stream)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT
        while moved._queue.qsize() > len(queued):  # the append loop took the rest
            assert loop.time() < deadline, "the append loop did not take its requests"
            await asyncio.sleep(0.001)
        assert not moved.ready and stream.messages == []
    finally:
        await moved.close()
    answered = {getattr(m, "req_id", None): m for m in stream.messages}
    for request in [*served, *queued]:
        answer = answered.get(request.req_id)  # type: ignore[attr-defined]
        if isinstance(request, MountRequest):
            assert isinstance(answer, MountResponse), (request, answer)
            assert answer.status is MountStatus.NOT_READY
        else:
            assert isinstance(answer, ErrorResponse), (request, answer)
            assert answer.code is ErrorCode.STALE_GENERATION
            assert "no longer served here" in answer.message
    assert blocking.req_id not in answered


async def test_a_mount_whose_catch_up_feed_is_cut_by_the_partition_stopping_is_answered(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """A mount is answered READY after its catch-up feed; the partition stops here while
    that feed is being sent: the mount is answered NOT_READY (the client mounts again,
    at the next owner), not left to the client's timeout."""
    partition, _ = env
    stream = Stream()
    for i in range(3):
        await partition.submit(append(data=b"%d" % i), stream)
    assert await settle(partition, stream) == 2

    class Stuck(Stream):
        """A client that reads nothing: its feed waits."""

        def __init__(self) -> None:
            super().__init__()
            self.feeding = asyncio.Event()

        async def send_feed(
            self, frames: Sequence[bytes], partition_id: int, last_transaction_id: int
        ) -> None:
            self.feeding.set()
            await asyncio.Event().wait()

    stuck = Stuck()
    mount = MountRequest(rid(client=2), -1, 1)
    await partition.submit(mount, stuck)
    await asyncio.wait_for(stuck.feeding.wait(), TIMEOUT)
    await partition.close()
    (answer,) = stuck.of(MountResponse)
    assert answer.req_id == mount.req_id and answer.status is MountStatus.NOT_READY


# -- run to completion: an append taken in the reader's callback, in order --------------


async def wait_until(done: Callable[[], bool], what: str) -> None:
    """Until ``done()`` (the event loop turns meanwhile), within TIMEOUT."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while not done():
        assert loop.time() < deadline, f"not within {TIMEOUT}s: {what}"
        await asyncio.sleep(0.001)


async def committed_ids(
    partition: Partition, stream: Stream, requests: list[AppendRequest]
) -> list[int]:
    """The transaction id each of ``requests`` committed at (their feed), once all did."""
    reader = Stream()
    await partition.submit(FeedRequest(rid(99), -1), reader)
    wanted = {r.req_id for r in requests}
    await reader.wait_for(lambda: wanted <= {f.req_id for f in reader.of(FeedData)})
    at = {f.req_id: f.transaction_id for f in reader.of(FeedData)}
    return [at[r.req_id] for r in requests]


def store_room(partition: Partition, room: list[bool]) -> None:
    """The store says it has room (the open session) only while ``room[0]``."""
    real = partition.store.session_with_room

    def session_with_room() -> StoreSession | None:
        return real() if room[0] else None

    partition.store.session_with_room = session_with_room  # type: ignore[method-assign]


async def test_an_append_is_taken_in_the_readers_call_when_nothing_is_ahead(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """Run to completion: with room and nothing queued, ``submit`` assigns the id before
    it returns (no hand-off to the append task)."""
    partition, _ = env
    stream = Stream()
    session = partition.store.session
    assert session is not None
    before = session.next_transaction_id
    await partition.submit(append(data=b"now"), stream)
    assert session.next_transaction_id == before + 1
    assert partition.stats.appends == 1


async def test_an_append_arriving_while_others_are_queued_goes_after_them(
    env: tuple[Partition, dict[str, FakeStorageNode]],
) -> None:
    """An append that finds the queue not empty queues behind it, even when the store
    has room by the time it arrives (the append task has not run yet)."""
    partition, _ = env
    stream = Stream()
    room = [True]
    store_room(partition, room)
    first = append(data=b"first")
    await partition.submit(first, stream)  # taken now
    room[0] = False
    queued = append(data=b"queued")
    await partition.submit(queued, stream)  # no room: queued (the task has not run)
    room[0] = True
    behind = append(data=b"behind")
    await partition.submit(behind, stream)  # room, but something is queued: behind it
    assert partition.stats.appends == 1
    requests = [first, queued, behind]
    assert await committed_ids(partition, stream, requests) == [0, 1, 2]


async def test_an_append_arriving_while_the_append_task_waits_for_room_goes_after() -> None:
    """The append task took a request and waits for room (a full window): an append that
    arrives when room appears, before that task runs again, goes after the one it holds;
    and a full window with a full queue stops the reader (back pressure)."""
    async with serving(
        StoreConfig(retry_initial=0.001, retry_max=0.02, max_pending_records=2),
        append_queue_size=2,
    ) as (partition, nodes):
        stream = Stream()
        hold = asyncio.Event()
        for node in nodes.values():
            node.hold = hold  # nothing is acknowledged: the window fills
        requests = [append(data=b"%d" % i) for i in range(7)]
        for request in requests[:2]:
            await partition.submit(request, stream)  # taken now: the window is full
        assert partition.stats.appends == 2
        await partition.submit(requests[2], stream)  # queued, then held by the task
        await wait_until(lambda: partition._taking, "the append task waits for room")
        room = [True]
        session = partition.store.session
        assert session is not None
        # room appears (as when an acknowledgement comes) before the task runs again
        partition.store.session_with_room = lambda: session  # type: ignore[method-assign]
        await partition.submit(requests[3], stream)
        assert partition.stats.appends == 2, "taken ahead of the one the task holds"
        del partition.store.session_with_room  # the store's own again
        store_room(partition, room)
        room[0] = False
        await partition.submit(requests[4], stream)  # the queue (2) is full now
        blocked = asyncio.ensure_future(partition.submit(requests[5], stream))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not blocked.done(), "a full window and a full queue must stop the reader"
        room[0] = True
        hold.set()
        for node in nodes.values():
            node.hold = None
        await asyncio.wait_for(blocked, TIMEOUT)
        await partition.submit(requests[6], stream)
        assert await committed_ids(partition, stream, requests) == list(range(7))


async def test_a_quorum_of_replies_commits_and_feeds_in_the_replies_callbacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run to completion: the replies of a quorum are counted, the commit announced and
    a live feed sent it, in the replies' own callbacks (one loop turn after they came),
    not by the write loops' and the feed's tasks turns later. A feed whose outbox has
    no room now is sent it by its task (it waits for room)."""
    replies: list[tuple[FakeReplicaConnection, Sequence[Record], asyncio.Future[None]]] = []
    manual = [False]
    original = FakeReplicaConnection.start_append

    def start_append(
        self: FakeReplicaConnection, records: Sequence[Record]
    ) -> asyncio.Future[None]:
        if not manual[0]:
            return original(self, records)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        replies.append((self, records, future))
        return future

    monkeypatch.setattr(FakeReplicaConnection, "start_append", start_append)
    async with serving() as (partition, _):
        reader, slow = Stream(), Stream()
        slow.take_feed_now = False  # an outbox without room: its feed task sends
        for client, feed in ((7, reader), (8, slow)):
            await partition.submit(FeedRequest(rid(client), -1), feed)
        await wait_until(lambda: len(partition._feed_waiters) == 2, "both feeds wait")
        manual[0] = True  # the test answers the appends from now on
        stream = Stream()
        await partition.submit(append(data=b"one"), stream)
        await wait_until(lambda: len(replies) == 3, "the append posted to the 3 replicas")
        assert partition.high_water_mark == -1
        for connection, records, future in replies[:2]:
            connection.node.partition(P).log.extend(records)
            future.set_result(None)
        await asyncio.sleep(0)  # one loop turn: the replies' callbacks run
        assert partition.high_water_mark == 0
        assert partition.feed_cache.frames(0, 1), "the commit reached the feed cache"
        # the live feed was sent the commit in the same call (its task still asleep)
        assert reader.feed_ids() == [0] and reader.feed_posts == 1
        assert slow.feed_ids() == []
        await slow.wait_for(lambda: slow.feed_ids() == [0])
        assert slow.feed_posts == 0
        connection, records, future = replies[2]
        connection.node.partition(P).log.extend(records)
        future.set_result(None)
        manual[0] = False
        await partition.submit(append(data=b"two"), stream)
        assert await settle(partition, stream) == 1
        await reader.wait_for(lambda: reader.feed_ids() == [0, 1])
        await slow.wait_for(lambda: slow.feed_ids() == [0, 1])
