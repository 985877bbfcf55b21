"""An append larger than a round may hold at level 3 (issue 31, the journal's old limit).

A round is one journal entry of at most half the journal's body; an append larger than
that (a transaction larger than the journal itself, up to the transport's frame) is
written straight to its segments once a checkpoint emptied the ring, and made durable
by the checkpoint after it (waltz_storage_fs.journaled, "Appends larger than a round"):
it is stored, acknowledged, readable, survives a restart and a power loss at every step,
and the appends after it in every partition go on.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Awaitable
from pathlib import Path

import pytest
from fsutil import FailingFlush
from test_power_loss import (
    Checked,
    Workload,
    crash_everywhere,
    recorder,
)

from waltz_api.errors import StorageError
from waltz_api.types import Record, SessionInfo
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs.committer import LoopRunner, Runner
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.journal import HEAD_SIZE, HEADER_BLOCK
from waltz_storage_fs.powerloss import PowerLossFiles, Snapshot

pytestmark = pytest.mark.timeout(600)

KEY = uuid.UUID("0b8e6c1d-2f3a-4b5c-9d7e-8f1a2b3c4d5e")
BODY = 64 * 1024
OPTIONS = {"segment_size": 48 * 1024, "index_checkpoint_interval": 3, "journal_size": BODY}
CHUNK_HEAD = 20
"""A journal entry's per-partition head (partition, first id, count, byte length)."""

SIZES = {
    "half-the-body": BODY // 2,
    "just-over-half": BODY // 2 + 512,
    "an-entry-of-the-whole-body": BODY - HEAD_SIZE - CHUNK_HEAD,
    "the-body": BODY,
    "twice-the-body": 2 * BODY + 100,
}
"""The bytes of the large append's records (as the segment files hold them)."""

DEADLINE = 120.0
"""Seconds an append may take on a loaded machine (a stalled partition never ends)."""


def big_records(first: int, partition_id: int, size: int, count: int = 1) -> list[Record]:
    """``count`` records of ``partition_id`` from ``first`` whose stored bytes are ``size``."""
    each, extra = divmod(size, count)
    sizes = [each + (1 if n < extra else 0) - fmt.RECORD_OVERHEAD for n in range(count)]
    return [make_record(first + n, partition_id, size=s) for n, s in enumerate(sizes)]


async def within_deadline(*work: Awaitable[None]) -> None:
    await asyncio.wait_for(asyncio.gather(*work), DEADLINE)


async def read_all(engine: FsStorageEngine, pid: int) -> list[Record]:
    return await engine.partition(pid).read_records(0, 10_000, 1 << 40)


def runner(kind: str) -> Runner | None:
    """The engine's runner: its threads (the default), or the event loop (the simulation's)."""
    return LoopRunner() if kind == "loop" else None


@pytest.mark.parametrize("kind", ["threads", "loop"])
@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
async def test_an_append_larger_than_a_round_is_stored_and_every_partition_goes_on(
    tmp_path: Path, journal_level: int, size: int, kind: str
) -> None:
    location = str(tmp_path / "storage")
    engine = await FsStorageEngine.open(
        location,
        cluster_key=KEY,
        num_partitions=3,
        feature_level=journal_level,
        options=OPTIONS,
        runner=runner(kind),
    )
    expected: dict[int, list[Record]] = {0: [], 1: [], 2: []}

    async def append(pid: int, records: list[Record]) -> None:
        await engine.partition(pid).append(records)
        expected[pid].extend(records)

    async def smalls(pid: int, first: int, count: int) -> None:
        for t in range(first, first + count):
            await append(pid, [make_record(t, pid, size=300 + 50 * t)])

    try:
        assert engine.control.version == 4
        for pid in (0, 1, 2):
            await engine.add_partition(pid)
            await append(pid, [make_record(0, pid)])
        # the ring's next entry at the middle of its body: an entry of half of it or more
        # then fits neither before the body's end nor, wrapping, before that middle
        journal = engine.journal
        assert journal is not None
        entry = HEADER_BLOCK + BODY // 2 - journal.position
        await append(
            2, [make_record(1, 2, size=entry - HEAD_SIZE - CHUNK_HEAD - fmt.RECORD_OVERHEAD)]
        )
        assert journal.position == HEADER_BLOCK + BODY // 2
        # the large appends between the other partitions' rounds (some of them queued
        # before, some after): one record, then a batch of several
        await within_deadline(
            append(0, big_records(1, 0, size)), smalls(1, 1, 12), smalls(2, 2, 12)
        )
        await within_deadline(
            smalls(0, 2, 6), append(1, big_records(13, 1, size, count=5)), smalls(2, 14, 6)
        )
        await within_deadline(*(smalls(pid, len(expected[pid]), 8) for pid in (0, 1, 2)))
        # appends of one partition queued behind each other, a large one between
        n = len(expected[2])
        queued = [[make_record(n, 2)], big_records(n + 1, 2, size, 2), [make_record(n + 3, 2)]]
        await within_deadline(
            *(engine.partition(2).append(records) for records in queued),
            smalls(0, len(expected[0]), 3),
        )
        for records in queued:
            expected[2].extend(records)
        for pid in (0, 1, 2):
            assert await read_all(engine, pid) == expected[pid], pid
    finally:
        await engine.close()
    engine = await FsStorageEngine.open(location, options=OPTIONS, runner=runner(kind))
    try:
        for pid in (0, 1, 2):
            assert await read_all(engine, pid) == expected[pid], pid
            assert engine.partition(pid).missing_ranges() == []
        await within_deadline(append(2, big_records(len(expected[2]), 2, size)))
        await within_deadline(*(smalls(pid, len(expected[pid]), 2) for pid in (0, 1, 2)))
        for pid in (0, 1, 2):
            assert await read_all(engine, pid) == expected[pid], pid
    finally:
        await engine.close()


POWER_BODY = 4096
POWER_OPTIONS = {
    "segment_size": 700,
    "index_checkpoint_interval": 3,
    "journal_size": POWER_BODY,
    "checkpoint_bytes": 1500,
}


class LargeAppends(Workload):
    """Rounds of small appends of three partitions with appends larger than the journal
    and than half of it between them (some starting a segment), a restart, more."""

    async def run(self) -> None:
        engine = await self.open()
        for pid in (0, 1, 2):
            await engine.add_partition(pid)
            self.model.partitions[pid] = self.now()
        ends = {0: 0, 1: 0, 2: 0}

        async def small(pid: int, count: int) -> None:
            for _ in range(count):
                first = ends[pid]
                ends[pid] += 1
                await self.append(engine, pid, [make_record(first, pid, size=30 + first)])

        async def large(pid: int, size: int, count: int = 1) -> None:
            first = ends[pid]
            ends[pid] += count
            await self.append(engine, pid, big_records(first, pid, size, count))

        await asyncio.gather(small(0, 3), small(1, 3), small(2, 3))
        await asyncio.gather(large(0, POWER_BODY + 600), small(1, 4), small(2, 4))
        await asyncio.gather(small(0, 2), large(1, POWER_BODY // 2 + 300, 3), small(2, 2))
        await asyncio.gather(small(0, 2), small(1, 2), large(2, POWER_BODY // 2))
        await engine.close()
        engine = await self.open()  # recovery's own steps are crash points too
        await asyncio.gather(large(0, POWER_BODY), small(1, 2), small(2, 2))
        await engine.close()


async def test_power_loss_at_every_step_around_appends_larger_than_the_journal(
    tmp_path: Path, crash_states: Path, journal_level: int
) -> None:
    """A crash at every step of the direct write (the checkpoint before it, the records
    written, their flush, the acknowledged end, the checkpoint after) and of the rounds
    around it: nothing acknowledged is lost, nothing appended is garbage, no damage."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = PowerLossFiles(base, on_step=recorder(snapshots))
    workload = LargeAppends(files, base / "storage", 1, level=journal_level, options=POWER_OPTIONS)
    await asyncio.wait_for(workload.run(), DEADLINE)
    assert len(snapshots) > 100, "the workload made too few steps to be a test"
    checked = Checked()
    await crash_everywhere(crash_states, snapshots, workload.model, checked, options=POWER_OPTIONS)
    sys.stderr.write(
        f"\n{len(snapshots)} steps, {checked.states} crash states, {checked.distinct} distinct "
        f"opened; quarantined: {checked.quarantined}\n"
    )
    assert not checked.failures, "\n".join(checked.failures)


async def test_a_failed_flush_of_an_append_written_alone_fails_it_and_recovery_goes_on(
    tmp_path: Path, journal_level: int
) -> None:
    """The checkpoint that makes the large append durable fails: the append fails (never
    acknowledged), every partition closes until the restart (as after any failed
    checkpoint), and after it each partition's log is dense and takes appends again."""
    files = FailingFlush()
    location = str(tmp_path / "storage")
    engine = await FsStorageEngine.open(
        location,
        cluster_key=KEY,
        num_partitions=2,
        feature_level=journal_level,
        options=OPTIONS,
        files=files,
    )
    try:
        parts = [await engine.add_partition(pid) for pid in (0, 1)]
        for pid in (0, 1):
            await parts[pid].append([make_record(0, pid)])
        await parts[0].set_session_info(SessionInfo(1, 0, 0, 1))  # a checkpoint: all clean
        files.fail.add(parts[0]._segments[-1].data_fd)
        with pytest.raises(StorageError, match="restart the storage node"):
            await asyncio.wait_for(parts[0].append(big_records(1, 0, BODY + 10)), DEADLINE)
        assert not files.fail  # the failed flush was the large append's
        with pytest.raises(StorageError, match="restart the storage node"):
            await asyncio.wait_for(parts[1].append([make_record(1, 1)]), DEADLINE)
    finally:
        await engine.close()
    engine = await FsStorageEngine.open(location, options=OPTIONS)
    try:
        for pid in (0, 1):
            part = engine.partition(pid)
            assert part.missing_ranges() == []
            first = part.max_transaction_id() + 1
            assert first in ((1, 2) if pid == 0 else (1,))
            await asyncio.wait_for(part.append([make_record(first, pid)]), DEADLINE)
            got = await read_all(engine, pid)
            assert [r.transaction_id for r in got] == list(range(first + 1))
    finally:
        await engine.close()
