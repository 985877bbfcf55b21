"""Store sessions and recovery on in-process storage nodes and the memory coordination."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from fakes import FakeReplicaConnection, FakeStorageNode

from waltz_api import wire
from waltz_api.cluster import PartitionStoreMetadata
from waltz_api.errors import StaleGenerationError, StorageError, StoreSessionClosedError
from waltz_api.types import (
    LOST_SESSION,
    UNRESOLVED,
    Record,
    ReplicaId,
    ReplicaState,
    ReqId,
    SessionInfo,
)
from waltz_conformance.reference.coordination import (
    MemoryCoordination,
    MemoryCoordinationService,
)
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.store import StoreConfig, StorePartition

P = 0
TIMEOUT = 20.0
NODES = ("a:1", "b:1", "c:1")
A, B, C = NODES


@dataclass
class Cluster:
    coordination: MemoryCoordination
    nodes: dict[str, FakeStorageNode]

    async def connector(
        self, node: str, partition_id: int, session_id: int
    ) -> FakeReplicaConnection:
        return await self.nodes[node].connect(partition_id, session_id)

    def store(self, generation: int = 1, seed: int = 0, **config: Any) -> StorePartition:
        return StorePartition(
            partition_id=P,
            generation=generation,
            coordination=self.coordination,
            replica_nodes=sorted(self.nodes),
            connector=self.connector,
            config=StoreConfig(retry_initial=0.001, retry_max=0.02, **config),
            rng=random.Random(seed),
        )


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    coordination = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await coordination.start()
    nodes = {name: FakeStorageNode(name) for name in NODES}
    await ClusterAdmin(coordination).create_cluster(
        num_partitions=1, num_replicas=3, storage_nodes=sorted(nodes)
    )
    yield Cluster(coordination, nodes)
    await coordination.close()


def rec(transaction_id: int, payload: bytes = b"x") -> Record:
    data = payload + str(transaction_id).encode()
    return Record(transaction_id, ReqId(1, 1, P, transaction_id), 0, data, wire.checksum(data))


async def append_many(store: StorePartition, count: int, tag: bytes) -> list[asyncio.Future[int]]:
    futures = []
    for i in range(count):
        data = tag + b"-" + str(i).encode()
        _, future = await store.append(ReqId(7, 1, P, i), 0, data, wire.checksum(data))
        futures.append(future)
    return futures


def assert_no_fork(nodes: Sequence[FakeStorageNode]) -> None:
    """Every replica's log is a prefix of the longest one (replicas never fork)."""
    logs = sorted((n.log(P) for n in nodes), key=len)
    longest = logs[-1]
    for log in logs:
        assert log == longest[: len(log)]
    for index, record in enumerate(longest):
        assert record.transaction_id == index  # dense


def on_majority(nodes: Sequence[FakeStorageNode], record: Record) -> bool:
    holders = sum(
        1
        for n in nodes
        if len(n.log(P)) > record.transaction_id and n.log(P)[record.transaction_id] == record
    )
    return holders >= len(nodes) // 2 + 1


async def test_fresh_partition_commits_dense_ids_on_every_replica(cluster: Cluster) -> None:
    store = cluster.store()
    await store.start()
    try:
        futures = await append_many(store, 300, b"t")
        ids = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT)
        assert ids == list(range(300))
        assert store.high_water_mark == 299
        # the slowest replica finishes shortly after the quorum
        for _ in range(100):
            if all(len(n.log(P)) == 300 for n in cluster.nodes.values()):
                break
            await asyncio.sleep(0.01)
        assert_no_fork(list(cluster.nodes.values()))
        assert all(len(n.log(P)) == 300 for n in cluster.nodes.values())
        meta = (await ClusterAdmin(cluster.coordination).store_metadata(P)).value
        assert meta.generation == 1 and meta.session_id == 0
        assert {s.session_id for s in meta.replicas} == {0}
        # batching: far fewer storage appends than transactions
        assert cluster.nodes[A].appends < 300
        records = await store.read_committed(0, 1000, 1 << 20)
        assert [r.transaction_id for r in records] == list(range(300))
    finally:
        await store.close()


async def test_commits_with_one_replica_down_and_it_joins_when_it_returns(cluster: Cluster) -> None:
    cluster.nodes[C].crash()
    store = cluster.store()
    await store.start()
    try:
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 50, b"x")), TIMEOUT)
        assert ids == list(range(50))
        assert len(cluster.nodes[C].log(P)) == 0
        session = store.session
        assert session is not None and sorted(session.writable_replicas) == [A, B]
        # c comes back: it is recovered into the running session (never a voter of an
        # older one) and caught up
        cluster.nodes[C].restart()
        await wait_until(lambda: C in session.writable_replicas, "c joined the writers")
        await wait_until(lambda: len(cluster.nodes[C].log(P)) == 50, "c was caught up")
        # then a fails: b and c are a quorum, the session goes on
        cluster.nodes[A].crash()
        more = await append_many(store, 20, b"y")
        done = await asyncio.wait_for(asyncio.gather(*more), TIMEOUT)
        assert done == list(range(50, 70))
        cluster.nodes[A].restart()
        assert store.sessions_started == 1 and store.session is session
        assert_no_fork(list(cluster.nodes.values()))
        # every acknowledged transaction is on a majority
        log_b = cluster.nodes[B].log(P)
        for transaction_id in [*ids, *done]:
            assert on_majority(list(cluster.nodes.values()), log_b[transaction_id])
    finally:
        await store.close()


async def write_metadata(
    cluster: Cluster, session_id: int, states: dict[str, tuple[int, int]]
) -> None:
    meta = PartitionStoreMetadata(
        P,
        0,
        session_id,
        tuple(ReplicaState(ReplicaId(P, n), s, c) for n, (s, c) in sorted(states.items())),
    )
    await ClusterAdmin(cluster.coordination).update_store_metadata(P, lambda _: meta)


def preload(
    node: FakeStorageNode, count: int, session_id: int, low_water_mark: int, tag: bytes = b"x"
) -> None:
    part = node.partition(P)
    part.log = [rec(i, tag) for i in range(count)]
    part.session_info = SessionInfo(session_id, low_water_mark, low_water_mark)
    part.highest_session_id = session_id


async def test_recovery_truncates_dirty_tail_and_catches_up(cluster: Cluster) -> None:
    # last session 3 started at 4 on every replica: a wrote to 9, b to 7, c to 5
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    for name, count in ((A, 10), (B, 8), (C, 6)):
        preload(cluster.nodes[name], count, 3, 4)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        # 7 is the highest mark a majority (a, b) holds
        assert session.low_water_mark == 7 == store.high_water_mark
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"n")), TIMEOUT)
        assert ids == [8, 9, 10, 11, 12]
        for _ in range(200):
            if all(len(n.log(P)) == 13 for n in cluster.nodes.values()):
                break
            await asyncio.sleep(0.01)
        assert_no_fork(list(cluster.nodes.values()))
        # a's dirty 8 and 9 were replaced by the new session's records
        assert cluster.nodes[A].log(P)[8].data.startswith(b"n-")
        assert cluster.nodes[C].log(P)[6] == rec(6)
        for node in cluster.nodes.values():
            info = node.partition(P).session_info
            assert info.session_id == 4 and info.low_water_mark == 7
    finally:
        await store.close()


async def test_undecidable_waits_for_the_missing_replica(cluster: Cluster) -> None:
    # a holds 0..9, c holds 0..5; b (offline) could hold up to 9: undecidable
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 10, 3, 4)
    preload(cluster.nodes[B], 10, 3, 4)
    preload(cluster.nodes[C], 6, 3, 4)
    cluster.nodes[B].crash()
    # c is slow to append, so it cannot catch up with a and make 9 decidable meanwhile
    cluster.nodes[C].append_delay = 1000.0
    store = cluster.store()
    await store.start()
    try:
        with pytest.raises(TimeoutError):
            await store.wait_ready(0.3)
        assert not store.ready
        assert len(cluster.nodes[A].log(P)) == 10  # nothing truncated while undecidable
        cluster.nodes[C].append_delay = 0.0
        cluster.nodes[B].restart()
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 9
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await store.close()


async def test_an_usher_that_dies_during_recovery_is_retried_not_its_readers(
    cluster: Cluster,
) -> None:
    """a holds the highest log and voted; c catches up from it to make 9 decidable; a
    dies meanwhile. The failed read is a's fault: a is dropped from the recovery (and
    its own task, which has nothing in flight, is told to retry), not c; when a and b
    come back, recovery completes."""
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 10, 3, 4)
    preload(cluster.nodes[B], 10, 3, 4)
    preload(cluster.nodes[C], 6, 3, 4)
    cluster.nodes[B].crash()
    cluster.nodes[C].append_delay = 0.05
    store = cluster.store(catch_up_batch=1)
    await store.start()
    try:
        await wait_until(lambda: len(cluster.nodes[C].log(P)) >= 7, "c catching up from a")
        cluster.nodes[A].crash()
        await wait_until(
            lambda: store.session is not None and A not in store.session.recovery._states,
            "a dropped from the recovery",
        )
        cluster.nodes[A].restart()
        cluster.nodes[B].restart()
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 9
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await store.close()


async def test_lagging_replica_catch_up_makes_it_decidable(cluster: Cluster) -> None:
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 10, 3, 4)
    preload(cluster.nodes[C], 6, 3, 4)
    cluster.nodes[B].crash()
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        # c copied 6..9 from a: a majority holds 9 now
        assert session.low_water_mark == 9
        assert cluster.nodes[C].log(P) == cluster.nodes[A].log(P)
        meta = (await ClusterAdmin(cluster.coordination).store_metadata(P)).value
        assert meta.replica(A).session_id == meta.replica(C).session_id == session.session_id
        # b missed the session: valid up to the closing mark, its session id unchanged
        assert meta.replica(B) == ReplicaState(ReplicaId(P, B), 3, 9)
    finally:
        await store.close()


async def test_replica_missing_a_session_is_truncated_to_its_closing_mark(cluster: Cluster) -> None:
    # b missed session 3's end: closing mark 4; it holds a dirty 5..8 of an older session
    await write_metadata(cluster, 3, {A: (3, UNRESOLVED), B: (2, 4), C: (3, UNRESOLVED)})
    preload(cluster.nodes[A], 8, 3, 4)
    preload(cluster.nodes[B], 9, 2, 2)
    cluster.nodes[B].partition(P).log[5:] = [rec(i, b"old") for i in range(5, 9)]
    preload(cluster.nodes[C], 8, 3, 4)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 7
        for _ in range(200):
            if cluster.nodes[B].log(P) == cluster.nodes[A].log(P):
                break
            await asyncio.sleep(0.01)
        assert cluster.nodes[B].log(P) == cluster.nodes[A].log(P)
        assert not any(r.data.startswith(b"old") for r in cluster.nodes[B].log(P))
    finally:
        await store.close()


async def test_new_generation_fences_the_old_session(cluster: Cluster) -> None:
    old = cluster.store(generation=1)
    await old.start()
    new: StorePartition | None = None
    try:
        first = await asyncio.wait_for(asyncio.gather(*await append_many(old, 10, b"old")), TIMEOUT)
        assert first == list(range(10))
        new = cluster.store(generation=2, seed=1)
        await new.start()
        new_session = await new.wait_ready(TIMEOUT)
        # the old server keeps trying: every append of its session is refused, it stops
        outcome = await asyncio.gather(*await append_many(old, 5, b"late"), return_exceptions=True)
        assert all(isinstance(o, StoreSessionClosedError) for o in outcome)
        for _ in range(200):
            if old.stale is not None:
                break
            await asyncio.sleep(0.01)
        assert isinstance(old.stale, StaleGenerationError)
        with pytest.raises(StaleGenerationError):
            await old.append(ReqId(1, 1, P, 99), 0, b"z", wire.checksum(b"z"))
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(new, 5, b"new")), TIMEOUT)
        assert ids == list(range(new_session.low_water_mark + 1, new_session.low_water_mark + 6))
        for node in cluster.nodes.values():
            assert not any(r.data.startswith(b"late") for r in node.log(P))
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await old.close()
        if new is not None:
            await new.close()


async def test_checkpoint_interval_starts_a_new_session(cluster: Cluster) -> None:
    store = cluster.store(checkpoint_interval=20)
    await store.start()
    try:
        ids: list[int] = []
        for chunk in range(7):
            futures = await append_many(store, 10, b"c%d" % chunk)
            ids.extend(await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT))
        assert ids == list(range(70))
        assert store.sessions_started >= 3
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await store.close()


@pytest.mark.parametrize("seed", range(6))
async def test_random_storage_crashes_never_lose_acknowledged(
    cluster: Cluster, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(seed)
    for node in cluster.nodes.values():
        node.append_delay = 0.001  # a disk that takes time, so crashes land mid-append
    store = cluster.store(seed=seed, max_pending_records=64)
    await store.start()
    acknowledged: dict[int, bytes] = {}
    names = sorted(cluster.nodes)

    async def writer() -> None:
        for i in range(400):
            data = f"s{seed}-{i}".encode()
            try:
                _, future = await store.append(ReqId(3, 1, P, i), 0, data, wire.checksum(data))
            except StoreSessionClosedError:
                continue

            def done(f: asyncio.Future[int], data: bytes = data) -> None:
                if not f.cancelled() and f.exception() is None:
                    acknowledged[f.result()] = data

            future.add_done_callback(done)
            if rng.random() < 0.1:
                await asyncio.sleep(0)

    async def chaos() -> None:
        for _ in range(8):
            await asyncio.sleep(rng.uniform(0.001, 0.01))
            victim = cluster.nodes[rng.choice(names)]
            victim.crash()  # at most one down at a time: a majority always survives
            await asyncio.sleep(rng.uniform(0.001, 0.01))
            victim.restart()

    try:
        await asyncio.wait_for(asyncio.gather(writer(), chaos()), TIMEOUT * 3)
        await store.wait_ready(TIMEOUT)
        # settle: a final session has recovered everything the previous ones committed
        hwm = store.high_water_mark
        records = []
        start = 0
        while start <= hwm:
            batch = await store.read_committed(start, 200, 1 << 20)
            assert batch
            records.extend(batch)
            start += len(batch)
        assert [r.transaction_id for r in records] == list(range(hwm + 1))
        for transaction_id, data in acknowledged.items():
            assert transaction_id <= hwm
            assert records[transaction_id].data == data, "an acknowledged transaction was lost"
        # no submission committed twice
        datas = [r.data for r in records]
        assert len(datas) == len(set(datas))
        assert_no_fork(list(cluster.nodes.values()))
        assert acknowledged, "nothing was acknowledged: the test proved nothing"
        departures = [r for r in caplog.records if " left, retrying" in r.getMessage()]
        assert departures, "no crash hit a session: the test proved nothing"
    finally:
        await store.close()


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while not condition():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


async def test_a_storage_node_dying_while_idle_leaves_and_rejoins_the_same_session(
    cluster: Cluster,
) -> None:
    store = cluster.store(idle_probe_interval=0.05)
    await store.start()
    try:
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"i")), TIMEOUT)
        assert ids == list(range(5))
        first = store.session
        assert first is not None
        cluster.nodes[B].crash()  # nothing is being written: the idle probe notices
        await wait_until(lambda: B not in first.writable_replicas, "b left the writers")
        more = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"j")), TIMEOUT)
        assert more == list(range(5, 10)) and store.session is first
        cluster.nodes[B].restart()
        await wait_until(lambda: len(cluster.nodes[B].log(P)) == 10, "b was caught up")
        assert B in first.writable_replicas and store.sessions_started == 1
        assert_no_fork(list(cluster.nodes.values()))
        # a second node dying leaves one connected replica: the quorum is lost, the
        # session ends, and the next one recovers at the committed mark
        cluster.nodes[A].crash()
        cluster.nodes[C].crash()
        await asyncio.wait_for(first.wait_done(), TIMEOUT)
        assert first.error is not None and "quorum" in str(first.error)
        cluster.nodes[A].restart()
        cluster.nodes[C].restart()
        second = await store.wait_ready(TIMEOUT)
        assert second is not first and second.low_water_mark == 9
        assert await store.closing_mark(first.session_id) == 9
    finally:
        await store.close()


async def test_replicas_failing_one_at_a_time_never_stop_the_session(cluster: Cluster) -> None:
    """A minority fault stops nothing: while one replica at a time crashes and comes
    back (losing what it had in flight), every append commits in the one session, and
    each returning replica is caught up to an identical copy."""
    rng = random.Random(5)
    for node in cluster.nodes.values():
        node.append_delay = 0.001
    store = cluster.store(idle_probe_interval=0.05)
    await store.start()
    try:
        await store.wait_ready(TIMEOUT)
        session = store.session
        pending: list[asyncio.Future[int]] = []

        async def writer() -> None:
            for chunk in range(20):
                pending.extend(await append_many(store, 25, b"w%d" % chunk))
                await asyncio.sleep(rng.uniform(0.001, 0.01))

        async def chaos() -> None:
            for _ in range(6):
                name = rng.choice(NODES)
                victim = cluster.nodes[name]
                victim.crash()
                await asyncio.sleep(rng.uniform(0.005, 0.02))
                victim.restart()
                # one at a time: the next crash waits for this replica to be writing again
                # on a connection made after the restart (on a loaded machine its
                # reconnection can take longer than the pause; and until the session
                # next writes to it, a crashed replica still counts as a writer on its
                # broken connection: crashing the next one then would take two at once)
                await wait_until(
                    lambda name=name, victim=victim: (
                        bool(victim.connections) and name in session.writable_replicas
                    ),
                    f"replica {name} writes again on a new connection",
                )
                await asyncio.sleep(rng.uniform(0.005, 0.02))

        await asyncio.wait_for(asyncio.gather(writer(), chaos()), TIMEOUT)
        ids = await asyncio.wait_for(asyncio.gather(*pending), TIMEOUT)
        assert ids == list(range(500))
        assert store.sessions_started == 1 and store.session is session
        await wait_until(
            lambda: all(len(n.log(P)) == 500 for n in cluster.nodes.values()),
            "every replica holds every record",
        )
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await store.close()


async def test_a_replica_whose_storage_was_wiped_rejoins_from_its_proven_prefix(
    cluster: Cluster,
) -> None:
    store = cluster.store(idle_probe_interval=0.05)
    await store.start()
    try:
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 40, b"k")), TIMEOUT)
        assert ids == list(range(40))
        session = store.session
        # c's disk is replaced while it is down: it comes back empty
        cluster.nodes[C].crash()
        cluster.nodes[C].partitions.clear()
        cluster.nodes[C].restart()
        more = await asyncio.wait_for(asyncio.gather(*await append_many(store, 10, b"m")), TIMEOUT)
        assert more == list(range(40, 50))
        await wait_until(lambda: len(cluster.nodes[C].log(P)) == 50, "c was caught up")
        assert store.session is session and store.sessions_started == 1
        assert_no_fork(list(cluster.nodes.values()))
        info = cluster.nodes[C].partition(P).session_info
        assert (info.session_id, info.low_water_mark) == (session.session_id, -1)
    finally:
        await store.close()


@pytest.mark.parametrize("seed", range(4))
async def test_random_moves_between_generations_fence_the_old_owner(
    cluster: Cluster, seed: int
) -> None:
    """The partition moves to a new owner (a new generation) at random moments while
    both the current and the old owner keep appending, and storage nodes crash."""
    rng = random.Random(1000 + seed)
    for node in cluster.nodes.values():
        node.append_delay = 0.0005
    owners = [cluster.store(generation=1, seed=seed, idle_probe_interval=0.02)]
    await owners[0].start()
    acknowledged: dict[int, bytes] = {}
    appended: list[tuple[StorePartition, asyncio.Future[int]]] = []
    opened_at: dict[int, int] = {}  # generation -> low-water mark of its first session

    moved = asyncio.Event()

    async def writer(name: str) -> None:
        for i in range(3000):
            if moved.is_set() and i > 200:
                break
            if i % 10 == 0:
                await asyncio.sleep(rng.uniform(0.0005, 0.003))  # spread over the moves
            store = owners[-1] if name == "current" or len(owners) < 2 else owners[-2]
            data = f"g{store.generation}-{name}-{i}".encode()
            try:
                _, future = await asyncio.wait_for(
                    store.append(ReqId(9, store.generation, P, i), 0, data, wire.checksum(data)),
                    0.5,
                )
            except (StoreSessionClosedError, StaleGenerationError, TimeoutError):
                await asyncio.sleep(0.001)
                continue

            def done(f: asyncio.Future[int], data: bytes = data) -> None:
                if not f.cancelled() and f.exception() is None:
                    acknowledged[f.result()] = data

            future.add_done_callback(done)
            appended.append((store, future))

    async def mover() -> None:
        for generation in range(2, 6):
            await asyncio.sleep(rng.uniform(0.01, 0.05))
            store = cluster.store(
                generation=generation, seed=seed * 10 + generation, idle_probe_interval=0.02
            )
            owners.append(store)
            await store.start()
            session = await store.wait_ready(TIMEOUT)
            opened_at.setdefault(generation, session.low_water_mark)
            if rng.random() < 0.5:
                victim = cluster.nodes[rng.choice(NODES)]
                victim.crash()
                await asyncio.sleep(rng.uniform(0.001, 0.01))
                victim.restart()
        moved.set()

    try:
        await asyncio.wait_for(
            asyncio.gather(writer("current"), writer("old"), mover()), TIMEOUT * 3
        )
        final = owners[-1]
        await final.wait_ready(TIMEOUT)
        # The writers do not wait for their appends' commits: wait for the final
        # owner's to be decided, so its high-water mark covers every commit (a loaded
        # CI run read one record past a mark taken while one was still in flight).
        in_flight = [f for store, f in appended if store is final and not f.done()]
        if in_flight:
            await asyncio.wait(in_flight, timeout=TIMEOUT)
        assert all(f.done() for f in in_flight), "an append to the final owner stayed undecided"
        hwm = final.high_water_mark
        records: list[Record] = []
        while len(records) <= hwm:
            batch = await final.read_committed(len(records), 500, 1 << 20)
            assert batch
            records.extend(batch)
        assert [r.transaction_id for r in records] == list(range(hwm + 1))
        for transaction_id, data in acknowledged.items():
            assert records[transaction_id].data == data, "an acknowledged transaction was lost"
        # fencing: once generation g opened at mark L, nothing of an older generation
        # was committed above L
        for generation, mark in opened_at.items():
            for record in records[mark + 1 :]:
                written_by = int(record.data.split(b"-")[0][1:])
                assert written_by >= generation, (generation, mark, record)
        datas = [r.data for r in records]
        assert len(datas) == len(set(datas))
        assert_no_fork(list(cluster.nodes.values()))
        # every old owner learns it was fenced (by a refused append or an idle probe)
        for _ in range(200):
            if all(o.stale is not None for o in owners[:-1]):
                break
            await asyncio.sleep(0.01)
        assert all(isinstance(o.stale, StaleGenerationError) for o in owners[:-1])
        assert final.stale is None
        generations = {int(r.data.split(b"-")[0][1:]) for r in records}
        assert len(generations) >= 3, f"too few owners wrote: {generations}"
    finally:
        for owner in owners:
            await owner.close()


async def test_a_replica_failing_a_read_is_replaced_by_another_without_ending_the_session(
    cluster: Cluster,
) -> None:
    store = cluster.store(max_window_bytes=1024)
    await store.start()
    try:
        ids = await asyncio.wait_for(
            asyncio.gather(*await append_many(store, 200, b"r" * 20)), TIMEOUT
        )
        assert ids == list(range(200))
        session = store.session
        assert session is not None and session.low_water_mark == -1
        # the window no longer holds the start: reads go to a replica's storage, and
        # every read from a fails (its storage refuses them)
        failing = cluster.nodes[A]
        original = FakeReplicaConnection.read_records

        async def refuse(
            self: FakeReplicaConnection, start: int, max_records: int, max_bytes: int
        ) -> list[Record]:
            if self.node is failing:
                raise StorageError("test: a replica that cannot read")
            return await original(self, start, max_records, max_bytes)

        FakeReplicaConnection.read_records = refuse  # type: ignore[method-assign]
        try:
            for _ in range(10):
                records = await store.read_committed(0, 50, 1 << 20)
                assert [r.transaction_id for r in records] == list(range(50))
        finally:
            FakeReplicaConnection.read_records = original  # type: ignore[method-assign]
        assert store.session is session and store.sessions_started == 1
    finally:
        await store.close()


async def test_a_replica_that_lost_acknowledged_records_never_votes_them_away(
    cluster: Cluster,
) -> None:
    """Issue 27: C lags, A and B acknowledge a burst, A's storage comes back having lost
    it (its engine reports LOST_SESSION) and rejoins, and the owner dies before A caught
    up, while B is down. A is suspect on its storage, so the next recovery counts it as
    a replica that may have held anything: it waits for B instead of closing the session
    at what A and C hold, and nothing acknowledged is lost."""
    old = cluster.store(generation=1)
    await old.start()
    new: StorePartition | None = None
    try:
        session = await old.wait_ready(TIMEOUT)
        cluster.nodes[C].append_delay = 1000.0  # connected, but lagging
        acked = await asyncio.wait_for(
            asyncio.gather(*await append_many(old, 50, b"acked")), TIMEOUT
        )
        assert acked == list(range(50))
        records = cluster.nodes[B].log(P)[:50]
        # A's storage node restarts with a damaged tail its engine moved aside
        cluster.nodes[A].crash()
        lost = cluster.nodes[A].partition(P)
        del lost.log[10:]
        lost.session_info = dataclasses.replace(
            lost.session_info, low_water_mark_session_id=LOST_SESSION
        )
        cluster.nodes[A].append_delay = 1000.0  # it will not catch up in time
        cluster.nodes[A].restart()
        replication = session._replication
        assert replication is not None
        await wait_until(lambda: replication.suspects == [A], "a rejoined as a suspect")
        assert A in session.writable_replicas
        assert lost.session_info.low_water_mark_session_id == LOST_SESSION
        # the owner dies (a new generation takes over) while B is down; it is stopped
        # before A may catch up, or it would catch A up and mark it clean first
        cluster.nodes[B].crash()
        await old.close()
        cluster.nodes[A].append_delay = cluster.nodes[C].append_delay = 0.0
        new = cluster.store(generation=2, seed=1)
        await new.start()
        with pytest.raises(TimeoutError):
            await new.wait_ready(0.5)  # undecidable: B may hold acknowledged records
        at_risk = new.session.recovery.at_risk if new.session is not None else None
        assert at_risk is not None and A in at_risk and B in at_risk, at_risk
        cluster.nodes[B].restart()
        new_session = await new.wait_ready(TIMEOUT)
        assert new_session.low_water_mark >= 49
        for node in cluster.nodes.values():
            await wait_until(lambda n=node: len(n.log(P)) >= 50, f"{node.name} caught up")
            assert node.log(P)[:50] == records
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await old.close()
        if new is not None:
            await new.close()


async def test_a_suspect_replica_is_marked_clean_once_it_holds_the_committed_prefix(
    cluster: Cluster,
) -> None:
    """The suspect mark is temporary: once the rejoined replica caught up to what was
    committed when it rejoined, its storage records it clean in the session (a voter
    again)."""
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        await asyncio.wait_for(asyncio.gather(*await append_many(store, 30, b"a")), TIMEOUT)
        cluster.nodes[A].crash()
        part = cluster.nodes[A].partition(P)
        part.log.clear()  # a wiped disk
        part.session_info = SessionInfo(session.session_id, -1, -1, LOST_SESSION)
        cluster.nodes[A].restart()
        await wait_until(lambda: len(part.log) >= 30, "a caught up")
        await wait_until(
            lambda: part.session_info.low_water_mark_session_id == session.session_id,
            "a marked clean",
        )
        assert session._replication is not None and session._replication.suspects == []
        assert part.log[:30] == cluster.nodes[B].log(P)[:30]
    finally:
        await store.close()


async def test_a_replica_recovering_late_catches_up_from_writers_that_left_and_rejoined(
    cluster: Cluster,
) -> None:
    """c connects but answers nothing while a and b recover and open the session at 9;
    a and b then each leave and rejoin the session (one at a time: c's connection keeps
    the quorum). When c answers, it is behind the closing mark and needs a replica to
    catch up from: the writers that rejoined must serve it (recovery had dropped them
    when they left). Else c waits forever while it counts as connected, and once a
    fails, b alone cannot commit: appends hang."""
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 10, 3, 4)
    preload(cluster.nodes[B], 10, 3, 4)
    preload(cluster.nodes[C], 6, 3, 4)
    cluster.nodes[C].hold = asyncio.Event()
    store = cluster.store(idle_probe_interval=0.05)
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 9  # a and b hold 9: decided without c
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"n")), TIMEOUT)
        assert ids == list(range(10, 15))
        for name in (A, B):
            node = cluster.nodes[name]
            node.crash()  # the idle probe notices; c's connection keeps the quorum
            await wait_until(lambda n=name: n not in session.writable_replicas, f"{name} left")
            node.restart()
            await wait_until(
                lambda n=name, node=node: bool(node.connections) and n in session.writable_replicas,
                f"{name} writes again on a new connection",
            )
        assert store.sessions_started == 1 and store.session is session
        hold, cluster.nodes[C].hold = cluster.nodes[C].hold, None
        hold.set()  # c answers: it recovers into the running session, behind 9
        await wait_until(lambda: C in session.writable_replicas, "c joined the writers")
        # a fails for good: b and c commit
        cluster.nodes[A].crash()
        more = await append_many(store, 5, b"m")
        assert await asyncio.wait_for(asyncio.gather(*more), TIMEOUT) == list(range(15, 20))
        assert store.sessions_started == 1 and store.session is session
        assert_no_fork(list(cluster.nodes.values()))
        assert len(cluster.nodes[C].log(P)) == 20
    finally:
        await store.close()


async def test_a_suspect_replica_gets_the_sessions_marks_only_once_caught_up(
    cluster: Cluster,
) -> None:
    """A recovery catching up a suspect replica (its storage lost what it acknowledged)
    writes the session's marks on it only once it holds the closing mark's prefix:
    written first, they clear its LOST_SESSION while it still lacks the records, and an
    owner dying during the catch-up leaves a replica the next recovery takes for a clean
    one that is merely behind (storage seed 101)."""
    old = cluster.store(generation=1)
    await old.start()
    new: StorePartition | None = None
    try:
        await old.wait_ready(TIMEOUT)
        acked = await asyncio.wait_for(
            asyncio.gather(*await append_many(old, 50, b"acked")), TIMEOUT
        )
        assert acked == list(range(50))
        await wait_until(lambda: len(cluster.nodes[C].log(P)) == 50, "c holds them too")
        await old.close()
        # C's storage node restarts having lost the end of its log (LOST_SESSION)
        cluster.nodes[C].crash()
        lost = cluster.nodes[C].partition(P)
        del lost.log[10:]
        lost.session_info = dataclasses.replace(
            lost.session_info, low_water_mark_session_id=LOST_SESSION
        )
        cluster.nodes[C].append_delay = 1000.0  # its catch-up hangs
        cluster.nodes[C].restart()
        new = cluster.store(generation=2, seed=1)
        await new.start()
        session = await new.wait_ready(TIMEOUT)  # a and b are a quorum
        appends = cluster.nodes[C].appends
        await wait_until(
            lambda: (
                any(c.session_id == session.session_id for c in cluster.nodes[C].connections)
                and lost.highest_session_id == session.session_id
            ),
            "c's recovery reached its storage",
        )
        await asyncio.sleep(0.2)  # (time for a wrong mark to be written: none may come)
        assert len(lost.log) < 50 and cluster.nodes[C].appends == appends
        assert lost.session_info.low_water_mark_session_id == LOST_SESSION, lost.session_info
    finally:
        await old.close()
        if new is not None:
            await new.close()
