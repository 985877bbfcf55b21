"""The store with an archive (docs/archive.md), in one event loop: real StorageNode objects
(memory engine: it deletes prefixes exactly), the memory transport and coordination, and
a real archive in a local directory. Reads below the replicas come from the archive;
replicas that end below the archive mark (wiped, or away while the others deleted) start
at the mark, in a new session's recovery and when they rejoin a running one."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from test_store_storage_nodes import TIMEOUT, Cluster, P, cluster, submit

from waltz_api.types import Record
from waltz_archive.archiver import ArchivePolicy, PartitionArchiver
from waltz_archive.objects import WriteOptions
from waltz_archive.store import ArchiveStore
from waltz_conformance.reference.storage import MemoryStorageEngine, forget
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.archiving import PartitionArchiveLink, StoreArchiveSource
from waltz_server.server.storage_client import StorageReplica
from waltz_server.server.store import StoreConfig, StorePartition

pytestmark = pytest.mark.timeout(120)
__all__ = ["cluster"]  # the fixture, re-exported for pytest

POLICY = ArchivePolicy(
    min_range_bytes=1,
    max_range_bytes=600,
    max_local_bytes=0,
    max_local_age=0,
    keep_local_transactions=20,
    interval=0.01,
    timeout=10.0,
    write=WriteOptions(row_group_bytes=200),
)


def archived_store(cluster: Cluster, archive: ArchiveStore, generation: int = 1) -> StorePartition:
    async def connector(node: str, partition_id: int, session_id: int) -> StorageReplica:
        return await cluster.pool.connect(f"memory://{node}", partition_id, session_id)

    link = PartitionArchiveLink(P, cluster.coordination, archive, cache_bytes=1 << 20, timeout=10.0)
    store = StorePartition(
        partition_id=P,
        generation=generation,
        coordination=cluster.coordination,
        replica_nodes=[n.connect for n in cluster.nodes],
        connector=connector,
        config=StoreConfig(retry_initial=0.005, retry_max=0.05, idle_probe_interval=0.05),
        rng=random.Random(generation),
        archive=link,
    )
    cluster.stores.append(store)
    return store


async def archive_all(store: StorePartition, archive: ArchiveStore) -> PartitionArchiver:
    assert store.archive is not None
    link = store.archive
    assert isinstance(link, PartitionArchiveLink)
    archiver = PartitionArchiver(
        partition_id=P,
        coordination=link.coordination,
        store=archive,
        source=StoreArchiveSource(store),
        advance=ClusterAdmin(link.coordination).advance_archive_mark,
        policy=POLICY,
        on_mark=link.update,
        rng=random.Random(3),
    )
    await store.wait_ready(TIMEOUT)
    while await archiver.round() is not None:
        pass
    return archiver


async def read_all(store: StorePartition, start: int, end: int) -> list[Record]:
    records: list[Record] = []
    while start + len(records) <= end:
        chunk = await store.read_committed(start + len(records), 50, 1 << 20)
        assert chunk, f"nothing read at {start + len(records)}"
        records.extend(chunk)
    return records


async def local(cluster: Cluster, index: int) -> tuple[int, int]:
    node = cluster.nodes[index].node
    assert node is not None
    partition = node.engine.partition(P)
    return partition.log_start(), partition.max_transaction_id()


async def wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(TIMEOUT / 0.01)):
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


async def test_reads_cross_the_archive_seam_and_wiped_replicas_start_at_the_mark(
    cluster: Cluster, tmp_path: Path
) -> None:
    archive = ArchiveStore(str(tmp_path / "archive"))
    store = archived_store(cluster, archive)
    await store.start()
    ids = await asyncio.wait_for(asyncio.gather(*await submit(store, "a", 300)), TIMEOUT)
    assert ids == list(range(300))
    await archive_all(store, archive)
    assert store.archive is not None
    mark = store.archive.mark
    assert mark == 279  # keep_local_transactions = 20
    for i in range(3):  # every writer deleted what is archived
        assert await local(cluster, i) == (mark + 1, 299)
    everything = await read_all(store, 0, 299)
    assert [r.transaction_id for r in everything] == list(range(300))
    assert [r.data for r in everything] == [f"a-{i}".encode() for i in range(300)]
    # the seam, read from both sides
    seam = await store.read_committed(mark - 2, 10, 1 << 20)
    assert seam and seam[0].transaction_id == mark - 2
    assert [r.transaction_id for r in await read_all(store, mark - 1, mark + 3)][:5] == list(
        range(mark - 1, mark + 4)
    )
    # a storage node loses its disk: the next session starts it at the archive mark
    await store.close()
    wiped = cluster.nodes[2]
    await wiped.crash()
    forget(wiped.location)
    await wiped.start()
    assert await local(cluster, 2) == (0, -1)
    again = archived_store(cluster, archive, generation=2)
    await again.start()
    await again.wait_ready(TIMEOUT)
    more = await asyncio.wait_for(asyncio.gather(*await submit(again, "b", 10)), TIMEOUT)
    assert more == list(range(300, 310))

    async def caught_up() -> bool:
        return await local(cluster, 2) == (mark + 1, 309)

    await wait_for(caught_up, "the wiped replica holds the mark's successors")
    assert [r.transaction_id for r in await read_all(again, 0, 309)] == list(range(310))


async def test_a_replica_away_while_the_others_archived_rejoins_at_the_mark(
    cluster: Cluster, tmp_path: Path
) -> None:
    archive = ArchiveStore(str(tmp_path / "archive"))
    store = archived_store(cluster, archive)
    await store.start()
    await asyncio.wait_for(asyncio.gather(*await submit(store, "a", 50)), TIMEOUT)
    session = store.session
    away = cluster.nodes[1]
    await away.crash()
    await asyncio.wait_for(asyncio.gather(*await submit(store, "b", 200)), TIMEOUT)
    await archive_all(store, archive)
    assert store.archive is not None
    mark = store.archive.mark
    assert mark == 229
    assert (await local(cluster, 0))[0] == mark + 1  # the writers deleted their prefix
    await away.start()  # it holds 0..49 only: the others no longer have 50..229

    async def rejoined() -> bool:
        return await local(cluster, 1) == (mark + 1, 249)

    await wait_for(rejoined, "the replica that was away starts at the mark, caught up")
    assert store.session is session and store.sessions_started == 1
    extra = await asyncio.wait_for(asyncio.gather(*await submit(store, "c", 5)), TIMEOUT)
    assert extra == list(range(250, 255))
    engine = away.node.engine if away.node is not None else None
    assert isinstance(engine, MemoryStorageEngine)

    async def has_all() -> bool:
        return await local(cluster, 1) == (mark + 1, 254)

    await wait_for(has_all, "it takes the new appends")


class StaleLink(PartitionArchiveLink):
    """A link whose mark was read before another archiver advanced it (the new owner's
    read raced the old owner's last round)."""

    stale = -1

    async def refresh(self) -> int:
        self._set_mark(self.stale)
        return self.stale


async def test_a_replica_behind_ushers_that_deleted_more_than_the_mark_said_starts_after_them(
    cluster: Cluster, tmp_path: Path
) -> None:
    archive = ArchiveStore(str(tmp_path / "archive"))
    store = archived_store(cluster, archive)
    await store.start()
    await asyncio.wait_for(asyncio.gather(*await submit(store, "a", 300)), TIMEOUT)
    await archive_all(store, archive)
    assert store.archive is not None and store.archive.mark == 279
    await store.close()
    wiped = cluster.nodes[2]
    await wiped.crash()
    forget(wiped.location)
    await wiped.start()

    async def connector(node: str, partition_id: int, session_id: int) -> StorageReplica:
        return await cluster.pool.connect(f"memory://{node}", partition_id, session_id)

    link = StaleLink(P, cluster.coordination, archive, cache_bytes=1 << 20, timeout=10.0)
    link.stale = 100  # the others deleted up to 279
    again = StorePartition(
        partition_id=P,
        generation=2,
        coordination=cluster.coordination,
        replica_nodes=[n.connect for n in cluster.nodes],
        connector=connector,
        config=StoreConfig(retry_initial=0.005, retry_max=0.05),
        rng=random.Random(5),
        archive=link,
    )
    cluster.stores.append(again)
    await again.start()
    await again.wait_ready(TIMEOUT)

    async def started_after() -> bool:
        return await local(cluster, 2) == (280, 299)

    await wait_for(started_after, "the wiped replica starts after what the ushers deleted")


async def test_a_whole_cluster_lost_is_restored_from_the_archive(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Every storage node and the coordination service are lost: a new cluster restored
    from the archive alone (`waltz archive restore --url`) holds the log up to the last
    archived range, serves it from the archive, and appends after it."""
    from waltz_conformance.reference.coordination import (
        MemoryCoordination,
        MemoryCoordinationService,
    )
    from waltz_server.cli.archive import _restore_cluster

    archive = ArchiveStore(str(tmp_path / "archive"))
    store = archived_store(cluster, archive)
    await store.start()
    await asyncio.wait_for(asyncio.gather(*await submit(store, "a", 300)), TIMEOUT)
    await archive_all(store, archive)
    assert store.archive is not None
    mark = store.archive.mark
    original = await read_all(store, 0, mark)
    await store.close()
    for node in cluster.nodes:  # the disaster
        await node.crash()
        forget(node.location)
    fresh = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await fresh.start()
    try:
        await ClusterAdmin(fresh).create_cluster(
            num_partitions=1,
            num_replicas=3,
            storage_nodes=[n.connect for n in cluster.nodes],
            cluster_key=cluster.nodes[0].key,
        )
        rows = await _restore_cluster(fresh, "", str(tmp_path / "archive"), "")
        incarnation = rows[0]["incarnation"]
        assert rows == [
            {
                "partition": P,
                "mark": mark,
                "manifest": rows[0]["manifest"],
                "incarnation": incarnation,
                "set_aside": [],
            }
        ]
        assert incarnation and (await ClusterAdmin(fresh).archive_mark(P)).value.incarnation == (
            incarnation
        )
        with pytest.raises(Exception, match="already has a log"):
            await _restore_cluster(fresh, "", str(tmp_path / "archive"), "")
        for node in cluster.nodes:
            await node.start()

        async def connector(node: str, partition_id: int, session_id: int) -> StorageReplica:
            return await cluster.pool.connect(f"memory://{node}", partition_id, session_id)

        restored = StorePartition(
            partition_id=P,
            generation=1,
            coordination=fresh,
            replica_nodes=[n.connect for n in cluster.nodes],
            connector=connector,
            config=StoreConfig(retry_initial=0.005, retry_max=0.05),
            rng=random.Random(9),
            archive=PartitionArchiveLink(P, fresh, archive, cache_bytes=1 << 20, timeout=10.0),
        )
        cluster.stores.append(restored)
        await restored.start()
        await restored.wait_ready(TIMEOUT)
        assert restored.high_water_mark == mark
        assert await read_all(restored, 0, mark) == original
        ids = await asyncio.wait_for(asyncio.gather(*await submit(restored, "b", 5)), TIMEOUT)
        assert ids == list(range(mark + 1, mark + 6))
        for i in range(3):
            assert (await local(cluster, i))[0] == mark + 1
    finally:
        await fresh.close()
