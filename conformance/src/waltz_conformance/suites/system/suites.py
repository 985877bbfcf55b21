"""The system suites: :class:`LockingSuite` (feed and locking, no fault) and
:class:`SystemSuite` (those, plus fencing, faults while appending, recoveries and
replica membership changes). Each test leaves the cluster serving every partition."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from waltz_api.capabilities import PROCESSES, RECOVERY_CASES, VOTER_SWEEP
from waltz_api.errors import SessionFencedError
from waltz_api.messages import ErrorCode
from waltz_api.types import Lock, LockMode
from waltz_conformance.harness import requires, skip_unless_capable
from waltz_conformance.suites.system.checks import (
    check_invariants,
    check_replicas_converge,
    fenced_everywhere,
)
from waltz_conformance.suites.system.clients import PartitionClient, read_log
from waltz_conformance.suites.system.harness import (
    TIMEOUT,
    SystemHarness,
    gather_all,
    start_all,
    wait_for,
)
from waltz_conformance.suites.system.liveness import LivenessSuite
from waltz_conformance.suites.system.load import under_load


class LockingSuite:
    """The feed and locking tests alone (cheap: no fault), e.g. to run them once more
    with another lock table plugin. :class:`SystemSuite` includes them."""

    pytestmark = pytest.mark.asyncio(loop_scope="class")

    @pytest.fixture(autouse=True)
    def _capabilities(self, request: pytest.FixtureRequest, harness: SystemHarness) -> None:
        skip_unless_capable(request, harness)

    # -- 6: the feed ---------------------------------------------------------------

    async def test_feed_delivers_every_committed_transaction_once_in_order(
        self, harness: SystemHarness
    ) -> None:
        writer = await PartitionClient.connect(harness, 0)
        try:
            start = await writer.flush()
            sent = [await writer.append(b"feed-%d" % i, -1) for i in range(30)]
            end = await writer.flush()
            assert end == start + 30
            for from_hwm in (start, start + 10, -1):
                reader = await PartitionClient.connect(harness, 0, client_hwm=from_hwm)
                try:
                    feed = await reader.feed_until(end)
                    ids = [f.transaction_id for f in feed]
                    assert ids == list(range(from_hwm + 1, end + 1)), f"from {from_hwm}"
                    assert [f.req_id for f in feed[-30 + max(0, from_hwm - start) :]] == sent[
                        max(0, from_hwm - start) :
                    ]
                finally:
                    await reader.close()
            log = await read_log(harness, 0)
            assert [r.req_id for r in log[start + 1 : end + 1]] == sent
            assert [r.data for r in log[start + 1 : end + 1]] == [b"feed-%d" % i for i in range(30)]
        finally:
            await writer.close()

    # -- 5: locking ----------------------------------------------------------------

    async def test_overlapping_write_locks_on_the_same_hwm_exactly_one_commits(
        self, harness: SystemHarness
    ) -> None:
        first = await PartitionClient.connect(harness, 0)
        second = await PartitionClient.connect(harness, 0)
        try:
            hwm = await first.flush()
            for round_ in range(5):
                name = f"account-{uuid.uuid4().hex[:6]}"
                a = await first.append(b"a", hwm, [Lock(name, round_), Lock("other-a", round_)])
                b = await second.append(b"b", hwm, [Lock(name, round_), Lock("other-b", round_)])
                new_hwm = max(await first.flush(), await second.flush())
                committed = {rid: await first.committed(rid, new_hwm) for rid in (a, b)}
                winners = [rid for rid, tid in committed.items() if tid is not None]
                assert len(winners) == 1, f"round {round_}: {committed}"
                loser = b if winners[0] == a else a
                failures = (first if loser == a else second).lock_failures()
                assert failures.get(loser) == committed[winners[0]], "LockFailure id"
                hwm = new_hwm
        finally:
            await first.close()
            await second.close()

    async def test_read_lock_fails_after_the_entity_changed(self, harness: SystemHarness) -> None:
        client = await PartitionClient.connect(harness, 1)
        try:
            before = await client.flush()
            entity = Lock(f"item-{uuid.uuid4().hex[:6]}", 7)
            read = Lock(entity.name, entity.id, LockMode.READ)
            changed = await client.append(b"change", before, [entity])
            hwm = await client.flush()
            changed_at = await client.committed(changed, hwm)
            assert changed_at == hwm
            stale = await client.append(b"stale-read", before, [read])
            fresh = await client.append(b"fresh-read", changed_at, [read])
            hwm = await client.flush()
            assert await client.committed(stale, hwm) is None
            assert client.lock_failures().get(stale) == changed_at
            assert await client.committed(fresh, hwm) == changed_at + 1
        finally:
            await client.close()

    async def test_append_locks_never_fail_but_fail_later_read_and_write_checks(
        self, harness: SystemHarness
    ) -> None:
        client = await PartitionClient.connect(harness, 1)
        try:
            before = await client.flush()
            name = f"log-{uuid.uuid4().hex[:6]}"
            appended = [
                await client.append(b"app-%d" % i, before, [Lock(name, 1, LockMode.APPEND)])
                for i in range(3)
            ]
            hwm = await client.flush()
            ids = [await client.committed(rid, hwm) for rid in appended]
            assert ids == [before + 1, before + 2, before + 3]
            last = before + 3
            write = await client.append(b"w", before, [Lock(name, 1)])
            read = await client.append(b"r", last - 1, [Lock(name, 1, LockMode.READ)])
            read_ok = await client.append(b"r-ok", last, [Lock(name, 1, LockMode.READ)])
            hwm = await client.flush()
            failures = client.lock_failures()
            assert failures.get(write) == last and failures.get(read) == last
            assert await client.committed(read_ok, hwm) == last + 1
        finally:
            await client.close()


class SystemSuite(LockingSuite, LivenessSuite):
    """Tests against one cluster (the class-scoped ``harness`` fixture); they run in
    order and each leaves the cluster serving every partition."""

    # -- 4: fencing by generation --------------------------------------------------

    async def test_an_append_with_a_stale_generation_is_refused(
        self, harness: SystemHarness
    ) -> None:
        client = await PartitionClient.connect(harness, 0)
        try:
            before = await client.flush()
            await client.append(b"stale", -1, generation=client.generation - 1)
            assert await client.flush() == before
            errors = client.errors()
            assert [e.code for e in errors] == [ErrorCode.STALE_GENERATION]
            assert not any(r.data == b"stale" for r in await read_log(harness, 0))
        finally:
            await client.close()

    async def test_a_forced_new_store_session_fences_the_running_one(
        self, harness: SystemHarness
    ) -> None:
        """Another writer takes the next store session id (by compare-and-set, as a new
        owner would) and reaches every storage node: the running session's writes fail
        everywhere; its server notices, starts a newer session, and loses nothing."""
        from waltz_server.server.store_metadata import begin_store_session

        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            _, _, generation = await harness.owner(0)
            old_session = await harness.session_id(0)
            assert harness.coordination is not None
            forced = (await begin_store_session(harness.coordination, 0, generation)).value
            assert forced.session_id > old_session
            for index in range(harness.num_storage_nodes):
                client = await harness.storage_client(index)
                # any request of a newer session fences the older ones (fenced itself
                # when the server's next session reached this node first)
                try:
                    with contextlib.suppress(SessionFencedError):
                        await client.max_transaction_id(forced.session_id, 0)
                finally:
                    await client.close()
            await fenced_everywhere(harness, 0, old_session)
            await writers.progress(50, TIMEOUT, "progress after the forced session")
            assert await harness.session_id(0) > forced.session_id
        await check_invariants(harness, writers.writers)

    # -- 1, 3: faults while appending ------------------------------------------------

    async def test_a_storage_node_killed_while_appending_loses_nothing_acknowledged(
        self, harness: SystemHarness
    ) -> None:
        async with under_load(harness) as writers:
            await writers.progress(50, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(harness.num_storage_nodes - 1)
            await writers.progress(100, TIMEOUT, "progress with a minority of storage down")
        await check_invariants(harness, writers.writers)

    @requires(PROCESSES)
    async def test_every_storage_node_killed_at_once_keeps_every_acknowledged_transaction(
        self, harness: SystemHarness
    ) -> None:
        """kill -9 of all storage nodes while appending (a power cut): acknowledged means
        on a majority's disk, so all of it is there after the restart."""
        async with under_load(harness) as writers:
            await writers.progress(50, TIMEOUT, "first acknowledgements")
            for index in range(harness.num_storage_nodes):
                await harness.kill_storage_node(index)
            acknowledged = [set(w.acknowledged) for w in writers.writers]
            await start_all(harness.storage[: harness.num_storage_nodes])
            await writers.progress(50, TIMEOUT, "progress after the restart")
        for writer, before in zip(writers.writers, acknowledged, strict=True):
            assert before <= writer.acknowledged
        await check_invariants(harness, writers.writers)

    async def test_a_server_killed_while_appending_moves_its_partitions_and_is_fenced(
        self, harness: SystemHarness
    ) -> None:
        """A storage node is down when the owner of partition 0 dies: the new owner
        recovers from the remaining majority, and the node rejoins afterwards."""
        down = 1
        async with under_load(harness) as writers:
            await writers.progress(50, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(down)
            await writers.progress(50, TIMEOUT, "progress without a storage node")
            old_session = await harness.session_id(0)
            await harness.kill_owner(0)
            await harness.restart_storage_node(down)
            await writers.progress(100, TIMEOUT, "progress after the server died")
            assert await harness.session_id(0) > old_session
        assert writers.writers[0].reconnects >= 1, "the server kill never reached the writer"
        await check_invariants(harness, writers.writers)
        # 4: the old session can write on no storage node, also after they restart
        await fenced_everywhere(harness, 0, old_session)
        for index in range(harness.num_storage_nodes):
            await harness.kill_storage_node(index)
        await start_all(harness.storage[: harness.num_storage_nodes])
        await fenced_everywhere(harness, 0, old_session)
        # and the cluster serves again, with everything acknowledged still there
        async with under_load(harness) as after:
            await after.progress(20, TIMEOUT, "progress after the storage restarts")
        await check_invariants(harness, [*writers.writers, *after.writers])

    # -- the original's recovery cases, on the harness's storage nodes ---------------
    # (exact vote counts over preloaded logs are covered by waltz-server's fake-node
    # tests)

    @requires(VOTER_SWEEP)
    async def test_one_to_five_voters_recover_without_losing_anything(
        self, harness: SystemHarness
    ) -> None:
        """Clusters of 1, 2, 4 and 5 storage nodes (one server, one partition): voters killed
        while appending force recoveries; with a majority left it resolves at once,
        otherwise it waits for them; nothing acknowledged is lost, replicas converge."""
        # 3: the suite's own cluster, in the tests below. The clusters run
        # concurrently: most of each one's time is waiting (fault detection, retries).
        await gather_all(_voters(harness, count) for count in (1, 2, 4, 5))

    @requires(RECOVERY_CASES)
    async def test_recovery_waits_while_undecidable_then_resolves(
        self, harness: SystemHarness
    ) -> None:
        """A majority of replicas unavailable: the recovery cannot decide the
        high-water mark and waits (nothing commits, and the lone replica may hold
        records nobody acknowledged); each replica back lets it resolve, and the
        dirty records are truncated."""
        down = [1, 2]
        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            for index in down:
                await harness.kill_storage_node(index)
            await asyncio.sleep(1.5)  # commits made before the kill reach the feed
            stalled = [len(w.acknowledged) for w in writers.writers]
            await asyncio.sleep(3.0)
            assert [len(w.acknowledged) for w in writers.writers] == stalled, (
                "a transaction committed without a majority of replicas"
            )
            await harness.restart_storage_node(down[0])
            await writers.progress(30, TIMEOUT, "progress once a majority is back")
            await harness.restart_storage_node(down[1])
            await writers.progress(30, TIMEOUT, "progress with every replica back")
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))

    @requires(RECOVERY_CASES)
    async def test_recovery_after_a_failed_recovery_keeps_every_acknowledged_transaction(
        self, harness: SystemHarness
    ) -> None:
        """The owner's recovery stalls (a majority of replicas down) and the owner dies;
        the next owner's recovery is interrupted by a storage node kill; the one after
        completes with every acknowledged transaction and nothing else. (Node 0, the
        only replica that may hold records nobody acknowledged, stays up: a replica
        with such a tail that misses the recovery is the restored-older-storage case,
        not covered here.)"""
        down = [1, 2]
        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            server_id, _, generation = await harness.owner(0)
            old_session = await harness.session_id(0)
            for index in down:
                await harness.kill_storage_node(index)
            await asyncio.sleep(1.0)  # the owner's new session is recovering, undecided
            await harness.kill_server(harness.server_index(server_id))
            await harness.wait_moved(0, server_id, generation)
            await harness.restart_storage_node(down[0])
            # the new owner's recovery, interrupted by the loss of a voter (one that
            # holds no record beyond the committed log: node 0, which may, votes)
            await harness.kill_storage_node(down[0])
            await asyncio.sleep(0.5)
            await harness.restart_storage_node(down[0])
            await harness.restart_storage_node(down[1])
            await writers.progress(50, TIMEOUT, "progress after the recoveries")
            assert await harness.session_id(0) > old_session
            await writers.stop()
            # checked before the victim's restart moves partitions again
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, range(harness.num_partitions))
        await harness.wait_assigned()

    @requires(RECOVERY_CASES)
    async def test_a_wiped_replica_is_caught_up_from_its_low_water_mark(
        self, harness: SystemHarness
    ) -> None:
        """Inconsistent storage: a replica loses its data (its disk replaced) and comes
        back empty while appends go on; the next sessions catch it up to the committed
        log, and nothing acknowledged is lost."""
        wiped = 1
        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(wiped)
            harness.wipe_storage(wiped)
            await harness.restart_storage_node(wiped)
            await writers.progress(30, TIMEOUT, "progress after the wipe")
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))

    @requires(RECOVERY_CASES)
    async def test_recovery_is_idempotent(self, harness: SystemHarness) -> None:
        """With nothing written, recoveries by two successive owners (and a storage
        node restart) change nothing committed and nothing stored."""
        partitions = range(harness.num_partitions)
        await check_replicas_converge(harness, partitions)
        committed = [await read_log(harness, p) for p in partitions]
        stored = [
            [await harness.replica_log(i, p) for i in range(harness.num_storage_nodes)]
            for p in partitions
        ]
        for round_ in range(2):
            old_session = await harness.session_id(0)

            # the owner notices the storage nodes left (at its next idle probe): wait
            async def new_session(old_session: int = old_session) -> bool:
                return await harness.session_id(0) > old_session

            waiting = f"a store session of partition 0 after {old_session}"
            if round_ == 0:  # a new owner's recovery
                try:
                    await harness.kill_owner(0)
                    assert [await read_log(harness, p) for p in partitions] == committed
                finally:
                    await harness.heal()
                await harness.wait_assigned()
            else:  # the same owner's recovery, forced by the quorum of storage leaving
                await harness.kill_storage_node(1)
                await harness.kill_storage_node(2)
                # both stay down until the owner has seen the quorum go (its session ends and
                # it begins the next): a replica that came back first would rejoin the running
                # session, which a minority fault never ends
                await wait_for(new_session, TIMEOUT, waiting)
                await start_all([harness.storage[1], harness.storage[2]])
            assert [await read_log(harness, p) for p in partitions] == committed
            await wait_for(new_session, TIMEOUT, waiting)
            for p in partitions:
                assert [
                    await harness.replica_log(i, p) for i in range(harness.num_storage_nodes)
                ] == stored[p], f"recovery changed the stored log of partition {p}"
        await check_replicas_converge(harness, partitions)
        # every replica's last session started at the unchanged high-water mark
        session = await harness.session_id(0)
        for index in range(harness.num_storage_nodes):
            client = await harness.storage_client(index)
            try:
                info = await client.last_session_info(session, 0)
            finally:
                await client.close()
            assert info.low_water_mark == len(committed[0]) - 1, f"replica {index}: {info}"

    @requires(RECOVERY_CASES)
    async def test_a_voter_killed_during_the_new_owners_recovery_loses_nothing(
        self, harness: SystemHarness
    ) -> None:
        """The owner of partition 0 dies while appending, and storage node 0 (a voter
        that may hold records nobody acknowledged) dies as soon as the partition moved
        (while the new owner recovers, or just after): recovery completes with the
        remaining majority; node 0 comes back, is
        truncated to the resolved mark and caught up; nothing acknowledged is lost."""
        voter = 0
        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            await harness.kill_owner(0)
            await harness.kill_storage_node(voter)
            await writers.progress(30, TIMEOUT, "progress without the voter")
            await harness.restart_storage_node(voter)
            await writers.progress(30, TIMEOUT, "progress with the voter back")
            await writers.stop()
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, range(harness.num_partitions))
        await harness.wait_assigned()

    @requires(PROCESSES, RECOVERY_CASES)
    async def test_a_replica_restored_from_an_older_backup_is_truncated_and_caught_up(
        self, harness: SystemHarness
    ) -> None:
        """Inconsistent storage: a storage node's data is restored from an older backup
        (taken while it was down, so it may hold records the cluster never committed,
        and lacks everything since). The storage is older than the metadata says: it
        is truncated to its own low-water mark before anything reads it, and caught
        up; every read returns the committed records."""
        restored = 0
        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(restored)
            backup = harness.backup_storage(restored)
            await harness.restart_storage_node(restored)
            await writers.progress(50, TIMEOUT, "progress after the backup")
            await harness.kill_storage_node(restored)
            harness.restore_storage(restored, backup)
            await harness.restart_storage_node(restored)
            await writers.progress(50, TIMEOUT, "progress after the restore")
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))

    # -- replicas added, removed, replaced (membership changes) -------------------------

    @requires(RECOVERY_CASES)
    async def test_a_replica_added_under_load_converges_to_the_committed_log(
        self, harness: SystemHarness
    ) -> None:
        """A new storage node gets a replica of every partition while appends go on: a new
        store session takes it in, it is caught up in the background, and it ends equal
        to the committed log; nothing acknowledged is lost, nothing duplicated."""
        partitions = range(harness.num_partitions)
        added = -1
        try:
            async with under_load(harness) as writers:
                await writers.progress(30, TIMEOUT, "first acknowledgements")
                added = await harness.add_storage_node()
                for partition in partitions:
                    await harness.add_replica(partition, added)
                await writers.progress(30, TIMEOUT, "progress while the replica is added")
                for partition in partitions:
                    await harness.wait_replica_set(partition)
                await writers.progress(30, TIMEOUT, "progress with the added replica")
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, partitions)
            for partition in partitions:
                assert added in await harness.replica_indexes(partition)
        finally:
            if added < 0:
                await harness.wait_assigned()
            await _retire_added(harness, added)

    @requires(RECOVERY_CASES)
    async def test_a_removed_replica_is_no_longer_written(self, harness: SystemHarness) -> None:
        """A replica of every partition is removed while appends go on: writes continue
        on the others and never reach it again (its data stays); added back, it is
        caught up to the committed log."""
        partitions = range(harness.num_partitions)
        removed = harness.num_storage_nodes - 1
        try:
            async with under_load(harness) as writers:
                await writers.progress(30, TIMEOUT, "first acknowledgements")
                for partition in partitions:
                    await harness.remove_replica(partition, removed)
                for partition in partitions:
                    await harness.wait_replica_set(partition)
                left = [len(await harness.replica_log(removed, p)) for p in partitions]
                await writers.progress(50, TIMEOUT, "progress without the removed replica")
            assert [len(await harness.replica_log(removed, p)) for p in partitions] == left, (
                "a removed replica was written"
            )
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, partitions)
        finally:
            await _restore_replica(harness, removed)
        await check_replicas_converge(harness, partitions)

    @requires(RECOVERY_CASES)
    async def test_a_replaced_replica_is_caught_up_and_the_old_one_no_longer_written(
        self, harness: SystemHarness
    ) -> None:
        """Replace a replica under load: add one on a new storage node, then remove the
        old; the new one converges to the committed log, the old one is not written."""
        partitions = range(harness.num_partitions)
        old = 1
        added = -1
        try:
            async with under_load(harness) as writers:
                await writers.progress(30, TIMEOUT, "first acknowledgements")
                added = await harness.add_storage_node()
                for partition in partitions:
                    await harness.add_replica(partition, added)
                    await harness.remove_replica(partition, old)
                for partition in partitions:
                    await harness.wait_replica_set(partition)
                left = [len(await harness.replica_log(old, p)) for p in partitions]
                await writers.progress(50, TIMEOUT, "progress on the new replica set")
            assert [len(await harness.replica_log(old, p)) for p in partitions] == left, (
                "the replaced replica was written"
            )
            await check_invariants(harness, writers.writers)
            await check_replicas_converge(harness, partitions)
        finally:
            await _restore_replica(harness, old)
            await _retire_added(harness, added)
        await check_replicas_converge(harness, partitions)


async def _voters(harness: SystemHarness, count: int) -> None:
    """One cluster of ``count`` storage nodes (one server, one partition): voters killed
    while appending, then back; nothing acknowledged lost, the replicas converge."""
    cluster = harness.sibling(
        f"voters{count}", num_storage_nodes=count, num_servers=1, num_partitions=1
    )
    await cluster.start()
    try:
        killed = list(range(max(1, (count - 1) // 2)))
        async with under_load(cluster) as writers:
            await writers.progress(20, TIMEOUT, f"{count} voters: acknowledgements")
            for index in killed:
                await cluster.kill_storage_node(index)
            if len(killed) <= (count - 1) // 2:
                await writers.progress(20, TIMEOUT, f"{count} voters: with a minority down")
            await start_all([cluster.storage[index] for index in killed])
            await writers.progress(20, TIMEOUT, f"{count} voters: every voter back")
        await check_invariants(cluster, writers.writers)
        await check_replicas_converge(cluster, [0])
    finally:
        await cluster.close()


async def _restore_replica(harness: SystemHarness, index: int) -> None:
    """Give storage node ``index`` its replica of every partition back (idempotent)."""
    for partition in range(harness.num_partitions):
        await harness.add_replica(partition, index)
    for partition in range(harness.num_partitions):
        await harness.wait_replica_set(partition)


async def _retire_added(harness: SystemHarness, index: int) -> None:
    """Remove an added storage node's replicas and the node (the suite's cluster goes
    back to its original replicas for the next tests)."""
    if index < 0:
        return
    assert harness.metadata is not None
    name = harness.storage_nodes[index]
    held = (await harness.metadata.replica_assignments()).partitions_of(name)
    for partition in held:
        await harness.remove_replica(partition, index)
    for partition in range(harness.num_partitions):
        await harness.wait_replica_set(partition)
    await harness.remove_storage_node(index)
