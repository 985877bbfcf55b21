"""The checkers of the safety invariants (DESIGN.md section 5) on a system harness:
from the owner's committed log, every live replica's storage, and the writers' feeds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from waltz_api.errors import SessionFencedError, StorageError, TransportError
from waltz_api.types import Record
from waltz_conformance.records import make_record
from waltz_conformance.suites.system.clients import read_log
from waltz_conformance.suites.system.harness import TIMEOUT, SystemHarness, wait_for
from waltz_conformance.suites.system.load import Writer


async def check_invariants(harness: SystemHarness, writers: Sequence[Writer]) -> None:
    """Invariants 1, 2, 3 and 6 for the writers' partitions, from the owner's log and
    from every live replica's storage."""
    for writer in writers:
        records = await read_log(harness, writer.partition)
        assert [r.transaction_id for r in records] == list(range(len(records))), "ids not dense"
        log_ids = [r.req_id for r in records]
        # 6: the feed is exactly the committed log, in order
        assert writer.feed == log_ids[writer.first : writer.last + 1]
        # 2: no submission committed twice
        assert len(set(log_ids)) == len(log_ids), "a submission committed twice"
        # 1: every acknowledged transaction is there with its data
        by_id = {r.req_id: r.data for r in records}
        for rid in writer.acknowledged:
            assert by_id.get(rid) == writer.sent[rid], f"acknowledged {rid} lost"
        # nothing of this writer appears that it did not submit
        mine = {r for r in log_ids if r.client_id == writer.client_id}
        assert mine <= set(writer.sent), "a transaction nobody submitted"
        # an append answered NOT_COMMITTED never commits
        assert not mine & writer.not_committed, "an append answered NOT_COMMITTED committed"
        await check_no_fork(harness, writer.partition, committed=writer.last + 1)


async def check_no_fork(harness: SystemHarness, partition: int, committed: int) -> None:
    """3: replicas never fork: every live replica's committed prefix is a prefix of the
    longest replica (lagging replicas catch up later), and the committed prefix is on a
    majority of the assigned replicas.

    A replica's committed prefix is its whole log once it holds the partition's current
    store session (it rejoined: anything above the recovered mark was truncated then). A
    replica still in an older session (it was away when that session was closed and has
    not rejoined yet) may hold a dirty tail above its own low-water mark, records of its
    session that the next recovery did not commit, which its rejoin truncates: only the
    records up to its low-water mark are committed ones there."""
    replicas = await harness.replica_indexes(partition)
    current = await harness.session_id(partition)
    views = [await harness.replica_view(i, partition) for i in replicas if harness.storage[i].alive]
    trusted = [
        (
            info,
            records
            if info.session_id >= current
            else [r for r in records if r.transaction_id <= info.low_water_mark],
        )
        for info, records in views
    ]
    longest = max((records for _, records in trusted), key=len)
    for info, records in trusted:
        assert records == longest[: len(records)], (
            f"replicas forked (a replica of session {info.session_id}, low-water mark "
            f"{info.low_water_mark}; the partition's session {current})"
        )
    assert sum(1 for _, records in trusted if len(records) >= committed) > len(replicas) // 2


async def check_replicas_converge(harness: SystemHarness, partitions: Sequence[int]) -> None:
    """Once writes stopped: every live replica of each partition ends exactly equal to
    the committed log (identical committed prefixes, no dirty record beyond the
    resolved high-water mark on any replica), waiting (bounded) for catch-up."""
    for partition in partitions:
        committed = await read_log(harness, partition)
        replicas = await harness.replica_indexes(partition)
        lengths: dict[int, int] = {}

        async def equal(
            partition: int = partition,
            committed: list[Record] = committed,
            lengths: dict[int, int] = lengths,
            replicas: list[int] = replicas,
        ) -> bool:
            same = True
            for index in replicas:
                if not harness.storage[index].alive:
                    continue
                replica = await harness.replica_log(index, partition)
                lengths[index] = len(replica)
                assert replica[: len(committed)] == committed[: len(replica)], (
                    f"replica {index} of partition {partition} differs from the committed log"
                )
                same = same and replica == committed
            return same

        try:
            await wait_for(equal, TIMEOUT, f"the replicas of partition {partition} to converge")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: committed {len(committed)}, replicas {lengths}") from None


async def fenced_everywhere(harness: SystemHarness, partition: int, old_session: int) -> None:
    """Every storage node refuses a write of store session ``old_session``; waits
    (bounded) for replicas the new session has not reached yet."""
    for index in range(harness.num_storage_nodes):

        async def refuses(index: int = index) -> bool:
            try:
                client = await harness.storage_client(index)
            except (StorageError, TransportError, TimeoutError, OSError):
                return False  # restarting: ask again
            try:
                # a no-op if accepted (nothing lies beyond a huge id): a safe probe
                await client.truncate(old_session, partition, 10**12)
                return False
            except SessionFencedError:
                return True
            except (StorageError, TransportError):
                return False
            finally:
                await client.close()

        await wait_for(refuses, TIMEOUT, f"storage node {index} to fence session {old_session}")
        client = await harness.storage_client(index)
        try:
            with pytest.raises(SessionFencedError):
                await client.append(
                    old_session, partition, [make_record(10**6, partition_id=partition)]
                )
        finally:
            await client.close()
