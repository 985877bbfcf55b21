"""The original's recovery cases (replicas added, removed, replaced; inconsistent
storage; recovery after a failed recovery; idempotency), on in-process storage nodes."""

from __future__ import annotations

import asyncio

from fakes import FakeStorageNode
from test_store import (
    NODES,
    TIMEOUT,
    Cluster,
    P,
    append_many,
    assert_no_fork,
    cluster,
    preload,
    rec,
    write_metadata,
)

from waltz_api.types import UNRESOLVED
from waltz_server.cluster_admin import ClusterAdmin

A, B, C = NODES
__all__ = ["cluster"]  # the fixture, re-exported for pytest


async def settle(cluster: Cluster, length: int, nodes: list[str] | None = None) -> None:
    for _ in range(500):
        if all(len(cluster.nodes[n].log(P)) == length for n in nodes or list(cluster.nodes)):
            return
        await asyncio.sleep(0.01)
    lengths = {n: len(node.log(P)) for n, node in cluster.nodes.items()}
    raise AssertionError(f"replicas did not reach {length} records: {lengths}")


async def test_inconsistent_storage_is_truncated_to_its_own_low_water_mark(
    cluster: Cluster,
) -> None:
    # b was restored from an old backup: its storage knows only session 1, started at 2,
    # and holds a tail from then that the cluster never committed
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 10, 3, 5)
    preload(cluster.nodes[C], 10, 3, 5)
    preload(cluster.nodes[B], 8, 1, 2)
    cluster.nodes[B].partition(P).log[3:] = [rec(i, b"stale") for i in range(3, 8)]
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 9
        await settle(cluster, 10)
        assert_no_fork(list(cluster.nodes.values()))
        assert not any(r.data.startswith(b"stale") for r in cluster.nodes[B].log(P))
    finally:
        await store.close()


async def test_an_added_replica_is_caught_up_and_joins_the_metadata(cluster: Cluster) -> None:
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    for name in NODES:
        preload(cluster.nodes[name], 6, 3, 2)
    cluster.nodes["d:1"] = FakeStorageNode("d:1")  # added: empty, not in the metadata
    cluster_meta = ClusterAdmin(cluster.coordination)
    await cluster_meta.add_storage_node("d:1")
    await cluster_meta.add_replica(P, "d:1")
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 5
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"n")), TIMEOUT)
        assert ids == [6, 7, 8, 9, 10]
        await settle(cluster, 11)
        assert_no_fork(list(cluster.nodes.values()))
        meta = (await ClusterAdmin(cluster.coordination).store_metadata(P)).value
        assert meta.replica("d:1").session_id == session.session_id
        assert session.quorum == 3  # a majority of four
    finally:
        await store.close()


async def test_an_added_replica_holding_records_neither_votes_nor_keeps_them(
    cluster: Cluster,
) -> None:
    """A replica added to a partition with replica history is new whatever its storage
    holds (here a node that was a replica before: the committed records through its
    low-water mark 2, then a longer dirty tail of an old session): it does not vote on
    the closing mark, and its tail is replaced by the committed records (the surviving
    mutant recovery.py:179 planned it as if the partition had no history: it voted)."""
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    for name in NODES:
        preload(cluster.nodes[name], 6, 3, 2)
    cluster.nodes["d:1"] = FakeStorageNode("d:1")
    preload(cluster.nodes["d:1"], 12, 3, 2)
    cluster.nodes["d:1"].partition(P).log[3:] = [rec(i, b"stale") for i in range(3, 12)]
    cluster_meta = ClusterAdmin(cluster.coordination)
    await cluster_meta.add_storage_node("d:1")
    await cluster_meta.add_replica(P, "d:1")
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 5  # the three known replicas' end, not d's 11
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"n")), TIMEOUT)
        assert ids == [6, 7, 8, 9, 10]
        await settle(cluster, 11)
        assert_no_fork(list(cluster.nodes.values()))
        assert not any(r.data.startswith(b"stale") for r in cluster.nodes["d:1"].log(P))
    finally:
        await store.close()


async def test_a_removed_replica_leaves_the_metadata(cluster: Cluster) -> None:
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    for name in NODES:
        preload(cluster.nodes[name], 6, 3, 2)
    removed = cluster.nodes[C]
    await ClusterAdmin(cluster.coordination).remove_replica(P, C)
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        # c cannot vote, but a and b are a majority of the last session's three
        assert session.low_water_mark == 5
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 3, b"n")), TIMEOUT)
        assert ids == [6, 7, 8]
        meta = (await ClusterAdmin(cluster.coordination).store_metadata(P)).value
        assert sorted(r.replica_id.storage_node for r in meta.replicas) == [A, B]
        assert len(removed.log(P)) == 6  # untouched
    finally:
        await store.close()


async def test_a_replaced_replica_starts_empty_and_catches_up(cluster: Cluster) -> None:
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    for name in (A, B):
        preload(cluster.nodes[name], 9, 3, 4)
    # c's disk was replaced: an empty storage, the metadata still lists it in session 3
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        assert session.low_water_mark == 8
        await settle(cluster, 9)
        assert cluster.nodes[C].log(P) == cluster.nodes[A].log(P)
        info = cluster.nodes[C].partition(P).session_info
        assert info.session_id == session.session_id and info.low_water_mark == 8
    finally:
        await store.close()


async def test_recovery_after_a_failed_recovery_and_idempotency(cluster: Cluster) -> None:
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 12, 3, 4)
    preload(cluster.nodes[B], 9, 3, 4)
    preload(cluster.nodes[C], 7, 3, 4)
    # the first recovery dies half-way: c is slow to catch up and the server stops
    cluster.nodes[C].append_delay = 1000.0
    cluster.nodes[B].crash()
    first = cluster.store(seed=1)
    await first.start()
    await asyncio.sleep(0.2)
    assert not first.ready  # a=11, c=6, b offline: undecidable, c catching up (slowly)
    await first.close()
    cluster.nodes[C].append_delay = 0.0
    cluster.nodes[B].restart()
    # the next server's recovery: the same answer as if the first had never run
    second = cluster.store(seed=2)
    await second.start()
    try:
        session = await second.wait_ready(TIMEOUT)
        # a and b hold 0..8: 8 at least. 11 when c caught up with a (then a majority
        # holds 0..11) before b answered: both keep every transaction a majority held
        recovered = session.low_water_mark
        assert recovered in (8, 11)
        await settle(cluster, recovered + 1)
        assert_no_fork(list(cluster.nodes.values()))
    finally:
        await second.close()
    logs = {n: node.log(P) for n, node in cluster.nodes.items()}
    # idempotency: one more recovery with nothing written changes nothing
    third = cluster.store(seed=3)
    await third.start()
    try:
        session = await third.wait_ready(TIMEOUT)
        assert session.low_water_mark == recovered
        await asyncio.sleep(0.05)
        assert {n: node.log(P) for n, node in cluster.nodes.items()} == logs
        for node in cluster.nodes.values():
            assert node.partition(P).session_info.low_water_mark == recovered
    finally:
        await third.close()


async def test_one_to_five_voters_recover_the_majority_mark() -> None:
    """For 1..5 replicas with distinct log ends, the recovered mark is the highest
    end a majority holds, and every replica ends equal."""
    from test_store import Cluster as StoreCluster

    from waltz_conformance.reference.coordination import (
        MemoryCoordination,
        MemoryCoordinationService,
    )

    for count in range(1, 6):
        names = [f"n{i}:1" for i in range(count)]
        coordination = MemoryCoordination(MemoryCoordinationService(), "/waltz")
        await coordination.start()
        nodes = {name: FakeStorageNode(name) for name in names}
        await ClusterAdmin(coordination).create_cluster(
            num_partitions=1, num_replicas=count, storage_nodes=names
        )
        cluster = StoreCluster(coordination, nodes)
        await write_metadata(cluster, 2, {n: (2, UNRESOLVED) for n in names})
        ends = [3 + 2 * i for i in range(count)]  # n0 holds the fewest records
        for name, end in zip(names, ends, strict=True):
            preload(nodes[name], end + 1, 2, 1)
        majority = count // 2 + 1
        expected = sorted(ends, reverse=True)[majority - 1]
        store = cluster.store()
        await store.start()
        try:
            session = await store.wait_ready(TIMEOUT)
            assert session.low_water_mark == expected, (count, ends)
            await settle(cluster, expected + 1)
            assert_no_fork(list(nodes.values()))
            for node in nodes.values():
                info = node.partition(P).session_info
                assert (info.session_id, info.low_water_mark) == (session.session_id, expected)
        finally:
            await store.close()
            await coordination.close()


async def test_a_membership_change_while_writing_starts_a_session_over_the_new_set(
    cluster: Cluster,
) -> None:
    """The running partition follows the replica assignments: a replica added while
    appends go on is caught up and written; a removed one is no longer written."""
    meta = ClusterAdmin(cluster.coordination)
    store = cluster.store()
    await store.start()
    try:
        first = await store.wait_ready(TIMEOUT)
        assert await asyncio.wait_for(
            asyncio.gather(*await append_many(store, 20, b"a")), TIMEOUT
        ) == list(range(20))
        cluster.nodes["d:1"] = FakeStorageNode("d:1")
        await meta.add_storage_node("d:1")
        await meta.add_replica(P, "d:1")
        for _ in range(500):
            if store.ready and store.session is not first and "d:1" in store.replica_nodes:
                break
            await asyncio.sleep(0.01)
        assert store.replica_nodes == [A, B, C, "d:1"]
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"b")), TIMEOUT)
        assert ids == list(range(20, 25))
        await settle(cluster, 25)
        second = await store.wait_ready(TIMEOUT)
        assert second.quorum == 3
        await meta.remove_replica(P, A)
        for _ in range(500):
            if store.ready and store.session is not second and A not in store.replica_nodes:
                break
            await asyncio.sleep(0.01)
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 5, b"c")), TIMEOUT)
        assert ids == list(range(25, 30))
        await settle(cluster, 30, [B, C, "d:1"])
        assert len(cluster.nodes[A].log(P)) == 25  # no longer written
        assert_no_fork(list(cluster.nodes.values()))
        stored = (await meta.store_metadata(P)).value
        assert [r.replica_id.storage_node for r in stored.replicas] == [B, C, "d:1"]
    finally:
        await store.close()


async def test_a_replica_set_change_ends_a_recovery_that_waits_for_a_removed_replica(
    cluster: Cluster,
) -> None:
    """A session over a replica set whose recovery cannot decide (a down and a removed
    replica of the last session, each of which may hold what was committed) is given
    up when the assignment changes: the session over the new set opens. (It waited
    for ever: the partition took the new set only once the old session had opened.)"""
    from waltz_server.server.voting import Outcome

    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    for name in NODES:
        preload(cluster.nodes[name], 6, 3, 2)
    meta = ClusterAdmin(cluster.coordination)
    cluster.nodes[A].crash()
    await meta.remove_replica(P, B)
    store = cluster.store()
    await store.start()
    try:
        for _ in range(2000):
            session = store.session
            if session is not None and session.recovery.outcome is Outcome.UNDECIDABLE:
                break
            await asyncio.sleep(0.01)
        stuck = store.session
        assert stuck is not None and stuck.recovery.outcome is Outcome.UNDECIDABLE
        assert store.replica_nodes == [A, C] and not store.ready
        await meta.add_replica(P, B)  # back: with c a majority of the last session's three
        session = await store.wait_ready(TIMEOUT)
        assert session is not stuck and stuck.done
        assert store.replica_nodes == [A, B, C]
        assert session.low_water_mark == 5
        ids = await asyncio.wait_for(asyncio.gather(*await append_many(store, 2, b"n")), TIMEOUT)
        assert ids == [6, 7]
    finally:
        await store.close()


async def test_a_replica_recovering_after_the_others_left_is_recorded_clean_before_it_writes(
    cluster: Cluster,
) -> None:
    """Storage seed 578: c hangs at its recovery while a and b recover and the session
    opens; a and b then leave and rejoin (recovery forgets them); c recovers at last and
    joins the writers. The replica states must record c clean in this session before it
    writes: recorded as it was (behind the old closing mark), the next recovery truncates
    it to that mark and counts it out, and what it acknowledged is lost."""
    from test_store import wait_until

    hung = asyncio.Event()
    cluster.nodes[C].hold = hung
    store = cluster.store()
    await store.start()
    try:
        session = await store.wait_ready(TIMEOUT)
        written = 0
        for node in (A, B):  # each leaves (crash: its connection breaks) and rejoins
            cluster.nodes[node].crash()
            more = await append_many(store, 10, node.encode())
            cluster.nodes[node].restart()
            await asyncio.wait_for(asyncio.gather(*more), TIMEOUT)
            written += 10
            await wait_until(lambda n=node: n in session.writable_replicas, f"{node} rejoined")
        hung.set()  # c answers: it recovers into the running session
        await wait_until(lambda: C in session.writable_replicas, "c joined the writers")
        meta = (await ClusterAdmin(cluster.coordination).store_metadata(P)).value
        states = {r.replica_id.storage_node: r for r in meta.replicas}
        assert states[C].session_id == session.session_id, states[C]
        assert states[C].closing_high_water_mark == UNRESOLVED, states[C]
        assert store.session is session
    finally:
        await store.close()
