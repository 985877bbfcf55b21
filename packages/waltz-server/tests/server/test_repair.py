"""Recovery with damaged replicas: a hole in a replica's log is repaired from a peer
before the replica votes, and a replica whose storage lost records (restored from a
backup, a damaged tail) counts as offline in the vote. In-process storage nodes that
report damage as the real storage node does (MissingRange, Repair)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from fakes import FakePartition, FakeReplicaConnection, FakeStorageNode
from test_store import (
    NODES,
    TIMEOUT,
    Cluster,
    P,
    append_many,
    assert_no_fork,
    cluster,
    preload,
    write_metadata,
)

from waltz_api.capabilities import REPAIR
from waltz_api.errors import CorruptionError, StorageAppendError, StorageError
from waltz_api.types import LOST_SESSION, NO_SESSION, UNRESOLVED, Record, SessionInfo
from waltz_server.server.voting import plan_replica, storage_older_than_metadata

A, B, C = NODES
__all__ = ["cluster"]  # the fixture, re-exported for pytest


class DamagedNode(FakeStorageNode):
    """A fake storage node whose partition may miss ranges of its log (lost to damage)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.missing: list[tuple[int, int]] = []
        self.repaired: list[tuple[int, int]] = []

    def damage(self, first: int, last: int) -> None:
        self.missing.append((first, last))
        self.missing.sort()

    def holds(self, transaction_id: int) -> bool:
        return not any(f <= transaction_id <= last for f, last in self.missing)

    async def connect(self, partition_id: int, session_id: int) -> FakeReplicaConnection:
        await asyncio.sleep(0)
        if not self.online:
            return await super().connect(partition_id, session_id)
        connection = DamagedConnection(self, partition_id, session_id)
        self.connections.append(connection)
        return connection


class DamagedConnection(FakeReplicaConnection):
    node: DamagedNode
    capabilities = frozenset({REPAIR})

    async def missing_range(self) -> tuple[int, int] | None:
        await self._enter()
        return self.node.missing[0] if self.node.missing else None

    async def repair(self, records: Sequence[Record]) -> None:
        partition = await self._enter()
        first, last = self.node.missing[0]
        ids = [r.transaction_id for r in records]
        if ids != list(range(first, first + len(ids))) or ids[-1] > last:
            raise StorageAppendError(f"repair of {ids} does not fit the missing {first}..{last}")
        partition.log[first : first + len(records)] = list(records)
        self.node.repaired.append((first, ids[-1]))
        self.node.missing[0] = (ids[-1] + 1, last)
        if ids[-1] == last:
            del self.node.missing[0]

    async def truncate(self, transaction_id: int) -> None:
        await super().truncate(transaction_id)
        self.node.missing = [
            (f, min(last, transaction_id)) for f, last in self.node.missing if f <= transaction_id
        ]

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        if self.node.missing:
            raise StorageError(f"missing {self.node.missing[0]}: repair first")
        await super().set_low_water_mark(low_water_mark)

    async def read_records(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        records = await super().read_records(start, max_records, max_bytes)
        for record in records:
            if not self.node.holds(record.transaction_id):
                raise CorruptionError(f"transaction {record.transaction_id} is missing")
        return records


def damaged_cluster(cluster: Cluster) -> dict[str, DamagedNode]:
    nodes = {name: DamagedNode(name) for name in NODES}
    cluster.nodes.clear()
    cluster.nodes.update(nodes)
    return nodes


def scribble(node: FakeStorageNode, first: int, last: int) -> None:
    """What a damaged range holds: nothing readable (here, records that must not survive)."""
    part: FakePartition = node.partition(P)
    for i in range(first, last + 1):
        part.log[i] = dataclasses.replace(part.log[i], data=b"lost")


async def test_a_hole_is_repaired_from_a_peer_before_the_replica_votes(cluster: Cluster) -> None:
    nodes = damaged_cluster(cluster)
    # every replica was clean in session 3 (started at 4); a lost 5..7 below intact 8..9,
    # c is behind at 6: had a voted with its log end unrepaired, c would have caught up
    # from a's hole
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(nodes[A], 10, 3, 4)
    preload(nodes[B], 10, 3, 4)
    preload(nodes[C], 7, 3, 4)
    scribble(nodes[A], 5, 7)
    nodes[A].damage(5, 7)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 9
        assert nodes[A].repaired and nodes[A].missing == []
        assert nodes[A].log(P) == nodes[B].log(P)
        for _ in range(500):
            if len(nodes[C].log(P)) == 10:
                break
            await asyncio.sleep(0.01)
        assert_no_fork(list(nodes.values()))
        assert not any(r.data == b"lost" for node in nodes.values() for r in node.log(P))
    finally:
        await store.close()


async def test_a_hole_nobody_holds_is_the_dirty_tail_and_is_truncated(cluster: Cluster) -> None:
    nodes = damaged_cluster(cluster)
    # a wrote 5..9 alone (never committed: b and c stopped at 4), then lost 5..6
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(nodes[A], 10, 3, 4)
    preload(nodes[B], 5, 3, 4)
    preload(nodes[C], 5, 3, 4)
    nodes[A].damage(5, 6)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 4
        for _ in range(500):
            if not nodes[A].missing and len(nodes[A].log(P)) == 5:
                break
            await asyncio.sleep(0.01)
        assert nodes[A].missing == [] and not nodes[A].repaired
        assert_no_fork(list(nodes.values()))
    finally:
        await store.close()


async def test_a_replica_that_lost_its_tail_counts_as_offline(cluster: Cluster) -> None:
    nodes = damaged_cluster(cluster)
    # all clean in session 3 (started at 4); 0..9 committed on a and b; c is at 6.
    # a's engine found its tail damaged and moved it aside (LOST_SESSION): counted as a
    # known replica at 4 it would let b and c decide 6 and lose the committed 7..9
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(nodes[A], 5, 3, 4)
    nodes[A].partition(P).session_info = SessionInfo(3, 4, 4, LOST_SESSION)
    preload(nodes[B], 10, 3, 4)
    preload(nodes[C], 7, 3, 4)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 9
        for _ in range(500):
            if all(len(n.log(P)) == 10 for n in nodes.values()):
                break
            await asyncio.sleep(0.01)
        assert_no_fork(list(nodes.values()))
        assert all(len(n.log(P)) == 10 for n in nodes.values())
    finally:
        await store.close()


async def test_a_replica_back_with_a_hole_is_repaired_before_it_rejoins(
    cluster: Cluster,
) -> None:
    """The session goes on without a failed replica; when it comes back with a hole in
    what it acknowledged (its storage found damage at restart), the hole is copied
    from the writers before it rejoins the same session."""
    nodes = damaged_cluster(cluster)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 40, b"a")), TIMEOUT)
        assert ids == list(range(40))
        for _ in range(500):
            if len(nodes[A].log(P)) == 40:
                break
            await asyncio.sleep(0.01)
        nodes[A].crash()
        scribble(nodes[A], 10, 19)
        nodes[A].damage(10, 19)
        more = await asyncio.wait_for(asyncio.gather(*await append_many(store, 20, b"b")), TIMEOUT)
        assert more == list(range(40, 60))
        nodes[A].restart()
        for _ in range(1000):
            if not nodes[A].missing and len(nodes[A].log(P)) == 60:
                break
            await asyncio.sleep(0.01)
        assert nodes[A].repaired and nodes[A].missing == []
        assert store.session is session and not session.done  # the same session
        assert_no_fork(list(nodes.values()))
        assert nodes[A].log(P) == nodes[B].log(P)
        assert not any(r.data == b"lost" for r in nodes[A].log(P))
    finally:
        await store.close()


def test_storage_older_than_metadata() -> None:
    # the marks' session decides when the storage keeps it
    assert storage_older_than_metadata(5, 9, 4)  # a later session raised the fence only
    assert not storage_older_than_metadata(5, 9, 5)
    assert not storage_older_than_metadata(5, 5, 6)
    # an engine that found it lost records
    assert storage_older_than_metadata(5, 9, LOST_SESSION)
    # a storage that does not keep it: the fence, as the original
    assert storage_older_than_metadata(5, 4, NO_SESSION)
    assert not storage_older_than_metadata(5, 9, NO_SESSION)


def test_plan_of_a_restored_replica_is_suspect() -> None:
    common = {
        "known": True,
        "metadata_empty": False,
        "state_session_id": 5,
        "state_closing_high_water_mark": UNRESOLVED,
        "storage_session_id": 7,  # a session that died after its first request
        "storage_low_water_mark": 10,
        "max_transaction_id": 20,
    }
    plan = plan_replica(**common, storage_low_water_mark_session_id=3)  # type: ignore[arg-type]
    assert (plan.truncate_to, plan.voting, plan.suspect) == (10, False, True)
    plan = plan_replica(**common, storage_low_water_mark_session_id=5)  # type: ignore[arg-type]
    assert (plan.truncate_to, plan.voting, plan.suspect) == (None, True, False)
    # the original's rule without the marks' session: the restore stays hidden
    plan = plan_replica(**common)  # type: ignore[arg-type]
    assert (plan.voting, plan.suspect) == (True, False)


def test_a_replica_never_recorded_clean_is_not_suspect() -> None:
    """A replica whose metadata state has no session (-1: added to the partition and
    never recorded clean, so it never joined a session's writers) acknowledged nothing:
    storage that reads LOST_SESSION (a new, pristine partition whose fence a session
    raised, then died before its SetLowWaterMark) lost nothing. Counted as a suspect
    it would be offline forever, and with a removed replica also offline the partition
    never recovered (a CI failure: a replica replaced under load)."""
    assert not storage_older_than_metadata(-1, 4, LOST_SESSION)
    assert not storage_older_than_metadata(-1, 4, NO_SESSION)
    assert not storage_older_than_metadata(-1, 4, 3)
    plan = plan_replica(
        known=True,
        metadata_empty=False,
        state_session_id=-1,
        state_closing_high_water_mark=379,
        storage_session_id=4,
        storage_low_water_mark=-1,
        max_transaction_id=-1,
        storage_low_water_mark_session_id=LOST_SESSION,
    )
    # valid up to the closing mark it was recorded with (it holds nothing): caught up,
    # it then votes as a replica of the last session, not as an offline one
    assert (plan.truncate_to, plan.voting, plan.suspect) == (379, False, False)
