"""The fs engine at feature level 3: the node journal (control file format 4).

A round of appends of any partitions is one journal entry and one flush; checkpoints
flush the segment files; recovery writes back what the journal proves durable and
refuses a damaged journal, cutting nothing (waltz_storage_fs.journaled). The upgrade's
input is ``data/format-v3`` (written by the format-3 engine, test_format_v3.py).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from fsutil import CrashStates, copy_of, open_or_fail, preloaded
from test_format_v3 import FIXTURE, SESSION, expected
from test_format_v3 import KEY as V3_KEY
from test_format_v3 import OPTIONS as V3_OPTIONS

from waltz_api.errors import CorruptionError, PartitionClosedError, StorageError
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.committer import LoopRunner
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import REAL_FILES
from waltz_storage_fs.journal import (
    HEADER_BLOCK,
    JOURNAL_FILE_NAME,
    Chunk,
    Journal,
    decode_header,
    scan,
)
from waltz_storage_fs.powerloss import PowerLossFiles, Snapshot, materialize

pytestmark = pytest.mark.timeout(300)

KEY = uuid.UUID("5a4f3e2d-1c0b-4a9e-8d7c-6b5a4f3e2d1c")
OPTIONS = {"segment_size": 700, "index_checkpoint_interval": 3, "journal_size": 16384}
NO_CHECKPOINT = {**OPTIONS, "checkpoint_bytes": 1 << 30, "segment_size": 1 << 20}
"""Checkpoints only before actions and at the close (so rounds stay in the journal); one
segment per partition (a roll flushes the segment before it)."""


def snapshot_tree(location: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(location)): p.read_bytes() for p in location.rglob("*") if p.is_file()
    }


async def rounds_in_the_journal(location: Path, level: int, rounds: int) -> dict[str, bytes]:
    """A level-3 directory with ``rounds`` rounds of both partitions after the last
    checkpoint, as the disk holds it while the engine runs (never closed)."""
    engine = await FsStorageEngine.open(
        str(location), cluster_key=KEY, num_partitions=2, feature_level=level, options=NO_CHECKPOINT
    )
    try:
        for pid in (0, 1):
            await engine.add_partition(pid)
        for first in range(0, 3 * rounds, 3):
            await asyncio.gather(
                *(
                    engine.partition(pid).append(
                        [make_record(t, pid, size=40 + t) for t in range(first, first + 3)]
                    )
                    for pid in (0, 1)
                )
            )
        return snapshot_tree(location)
    finally:
        await engine.close()


def journal_entries(location: Path) -> list[tuple[int, int]]:
    """(position, sequence) of each entry after the control file's checkpoint."""
    raw = (location / fmt.CONTROL_FILE_NAME).read_bytes()
    at = fmt.checkpoint_offset(2, 0)
    slots = [fmt.decode_checkpoint(raw[at + i * fmt.CHECKPOINT_SLOT_SIZE :]) for i in (0, 1)]
    checkpoint = max((c for c in slots if c is not None), key=lambda c: c.counter)
    path = location / JOURNAL_FILE_NAME
    header = decode_header(path.read_bytes()[:HEADER_BLOCK], path)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = scan(REAL_FILES, fd, header, checkpoint.position, checkpoint.sequence)
    finally:
        os.close(fd)
    return [(e.position, e.sequence) for e in found.entries]


async def test_a_round_of_two_partitions_is_one_journal_flush(
    tmp_path: Path, journal_level: int
) -> None:
    files = PowerLossFiles(tmp_path / "sim")
    engine = await FsStorageEngine.open(
        str(tmp_path / "sim" / "storage"),
        cluster_key=KEY,
        num_partitions=2,
        feature_level=journal_level,
        options=NO_CHECKPOINT,
        files=files,
    )
    try:
        assert engine.feature_level == journal_level and engine.control.version == 4
        for pid in (0, 1):
            await engine.add_partition(pid)
            await engine.partition(pid).append([make_record(0, pid)])  # its first segment
        operations: list[str] = []
        files.on_step = lambda s: operations.append(s.operation)
        await asyncio.gather(
            *(
                engine.partition(pid).append([make_record(1, pid), make_record(2, pid)])
                for pid in (0, 1)
            )
        )
        files.on_step = None
        flushes = [op for op in operations if op.startswith(("fdatasync", "fsync"))]
        assert len(flushes) == 1, operations  # the journal's, nothing else
        for pid in (0, 1):
            assert engine.partition(pid).max_transaction_id() == 2
    finally:
        await engine.close()


async def test_records_the_segments_lost_are_written_back_from_the_journal(
    tmp_path: Path, journal_level: int
) -> None:
    location = tmp_path / "storage"
    tree = await rounds_in_the_journal(location, journal_level, 6)
    # the disk kept the journal's flushed rounds, none of the segments' unflushed writes
    # after their creation (the header only: what the segment's creation flushed)
    crashed = tmp_path / "crashed"
    materialize(
        {
            name: (data[: fmt.HEADER_SIZE] if name.endswith((".seg", ".idx")) else data)
            for name, data in tree.items()
        },
        crashed,
    )
    assert len(journal_entries(crashed)) == 6
    engine = await FsStorageEngine.open(str(crashed), options=NO_CHECKPOINT)
    try:
        for pid in (0, 1):
            part = engine.partition(pid)
            assert part.missing_ranges() == []
            got = await part.read_records(0, 100)
            assert got == [make_record(t, pid, size=40 + t) for t in range(18)]
            assert part.session_info().low_water_mark_session_id != -2  # not marked LOST
    finally:
        await engine.close()
    report = tools.verify(crashed)
    assert report.ok, report.problems
    assert report.notes == []  # the close checkpointed: nothing left to replay
    assert journal_entries(crashed) == []


async def test_a_damaged_journal_does_not_open_and_nothing_is_cut(
    tmp_path: Path, journal_level: int
) -> None:
    """A whole entry lies after one that is not: a round made durable is lost. The node
    refuses to open, every file as it was."""
    location = tmp_path / "storage"
    tree = await rounds_in_the_journal(location, journal_level, 4)
    crashed = tmp_path / "crashed"
    materialize(tree, crashed)
    entries = journal_entries(crashed)
    assert len(entries) == 4
    journal = bytearray(tree[JOURNAL_FILE_NAME])
    position = entries[1][0]
    journal[position : position + 64] = bytes(64)
    tree[JOURNAL_FILE_NAME] = bytes(journal)
    shutil.rmtree(crashed)
    materialize(tree, crashed)
    with pytest.raises(CorruptionError, match="records made durable are lost"):
        await FsStorageEngine.open(str(crashed), options=NO_CHECKPOINT)
    assert snapshot_tree(crashed) == tree
    report = tools.verify(crashed)
    assert any("made durable are lost" in p for p in report.problems), report.problems


async def test_the_last_round_lost_whole_is_not_seen_by_the_node(
    tmp_path: Path, journal_level: int
) -> None:
    """The documented trade-off (docs/performance.md): a disk that lost the write of the
    very last round (its entry and its segment writes) leaves nothing that witnesses it;
    the node opens without it (the server's check marks the replica suspect). A round
    lost before a later durable one is seen (the test above)."""
    location = tmp_path / "storage"
    tree = await rounds_in_the_journal(location, journal_level, 3)
    crashed = tmp_path / "crashed"
    materialize(tree, crashed)
    last = journal_entries(crashed)[-1][0]
    journal = bytearray(tree[JOURNAL_FILE_NAME])
    journal[last:] = bytes(len(journal) - last)
    shutil.rmtree(crashed)
    lost = {
        name: (data[: fmt.HEADER_SIZE] if name.endswith((".seg", ".idx")) else data)
        for name, data in {**tree, JOURNAL_FILE_NAME: bytes(journal)}.items()
    }
    materialize(lost, crashed)
    engine = await FsStorageEngine.open(str(crashed), options=NO_CHECKPOINT)
    try:
        assert [engine.partition(pid).max_transaction_id() for pid in (0, 1)] == [5, 5]
    finally:
        await engine.close()


async def test_the_format_3_directory_is_upgraded_while_appends_run(
    tmp_path: Path, journal_level: int
) -> None:
    location = copy_of(FIXTURE, tmp_path)
    old = (location / fmt.CONTROL_FILE_NAME).read_bytes()
    engine = await FsStorageEngine.open(
        str(location), cluster_key=V3_KEY, num_partitions=3, options=V3_OPTIONS
    )
    ends = {0: 35, 2: 24}
    under_way = asyncio.Event()
    try:
        assert engine.feature_level == 2

        async def writer(pid: int, count: int) -> None:
            for _ in range(count):
                t = ends[pid]
                await engine.partition(pid).append([make_record(t, pid, size=60 + t)])
                ends[pid] = t + 1
                if ends[0] >= 40:
                    under_way.set()

        appending = asyncio.gather(writer(0, 30), writer(2, 30))
        await under_way.wait()  # appends of both partitions under way, and on after it
        await engine.raise_feature_level(journal_level)
        assert engine.feature_level == journal_level
        await appending
        assert (location / JOURNAL_FILE_NAME).is_file()
    finally:
        await engine.close()
    backup = (location / (fmt.CONTROL_FILE_NAME + ".v3")).read_bytes()
    header = fmt.decode_control_header(backup[: fmt.HEADER_SIZE])
    assert header is not None and header.version == 3 and len(backup) == len(old)
    assert tools.read_control_file(location).header.version == 4
    report = tools.verify(location)
    assert report.ok and report.notes == [], (report.problems, report.notes)
    engine = await FsStorageEngine.open(str(location), options=V3_OPTIONS)
    try:
        assert engine.feature_level == journal_level
        for pid in (0, 2):
            got = await engine.partition(pid).read_records(0, 100, 1 << 20)
            assert got == expected(pid) + [
                make_record(t, pid, size=60 + t) for t in range(len(expected(pid)), ends[pid])
            ]
        assert engine.partition(0).session_info() == SESSION
        assert not engine.partition(2).available()
    finally:
        await engine.close()


async def test_power_loss_while_the_level_is_raised_to_3(
    tmp_path: Path, journal_level: int
) -> None:
    """A crash at any step of the raise leaves a directory that opens with every record:
    in format 3 (the raise did not happen; a journal file made before the control file
    is ignored, then replaced by the next raise) or 4."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = preloaded(base, FIXTURE)
    engine = await FsStorageEngine.open(
        str(base / "storage"), options={**V3_OPTIONS, "journal_size": 8192}, files=files
    )
    files.on_step = snapshots.append
    try:
        await engine.raise_feature_level(journal_level)
        await engine.partition(0).append([make_record(35, 0, size=90)])
    finally:
        await engine.close()
    failures: list[str] = []
    versions: set[int] = set()
    for crash in CrashStates(snapshots, tmp_path):
        opened = await open_or_fail(crash, failures)
        if opened is None:
            continue
        try:
            versions.add(opened.control.version)
            for pid in (0, 2):
                got = await opened.partition(pid).read_records(0, 100, 1 << 20)
                if got[: len(expected(pid))] != expected(pid):
                    failures.append(f"{crash.where}: partition {pid} reads back {len(got)} records")
        finally:
            await opened.close()
        shutil.rmtree(crash.directory)
    assert not failures, "\n".join(failures[:5])
    assert versions == {3, 4}


class FailingJournalFlush(PowerLossFiles):
    """The journal's next flush fails with EIO and the page cache drops its unflushed
    writes (as the simulation's failing fsync does half the time)."""

    fail_next = False

    def fdatasync(self, fd: int) -> None:
        if self.fail_next and self._inode(fd) is self._lookup(self.journal_path):
            self.fail_next = False
            self.drop_unflushed(fd)
            raise OSError(errno.EIO, "injected")
        super().fdatasync(fd)

    @property
    def journal_path(self) -> Path:
        return self.base / "storage" / JOURNAL_FILE_NAME


async def test_a_failed_journal_flush_stops_every_partition_until_the_restart(
    tmp_path: Path, journal_level: int
) -> None:
    """The failed round's entry is gone from the page cache: a later round written after
    it would make the journal read as damaged (a durable entry lost) at the restart, so
    no partition writes another round; the restart opens, every acknowledged record kept."""
    files = FailingJournalFlush(tmp_path / "sim")
    location = str(tmp_path / "sim" / "storage")
    engine = await FsStorageEngine.open(
        location,
        cluster_key=KEY,
        num_partitions=2,
        feature_level=journal_level,
        options=NO_CHECKPOINT,
        files=files,
        runner=LoopRunner(),
    )
    try:
        for pid in (0, 1):
            await engine.add_partition(pid)
            await engine.partition(pid).append([make_record(0, pid)])
        files.fail_next = True
        with pytest.raises(PartitionClosedError):
            await engine.partition(0).append([make_record(1, 0)])
        with pytest.raises((PartitionClosedError, StorageError)):
            await engine.partition(1).append([make_record(1, 1)])
    finally:
        await engine.close()
    crashed = tmp_path / "crashed"
    materialize(files.snapshot().state("durable"), crashed)
    reopened = await FsStorageEngine.open(str(crashed / "storage"), options=NO_CHECKPOINT)
    try:
        for pid in (0, 1):
            assert await reopened.partition(pid).read_records(0, 10) == [make_record(0, pid)]
    finally:
        await reopened.close()


async def test_appends_queued_together_beyond_the_journal_are_split_into_rounds(
    tmp_path: Path, journal_level: int
) -> None:
    """Four partitions each queue an append of ~5 KiB at once into a 16 KiB journal: one
    round of all of them would not fit (refused: "does not fit in the journal"), so a
    group takes no more than half the journal and the rest wait for the next round.
    Every append succeeds and reads back, after a reopen too."""
    location = tmp_path / "node"
    engine = await FsStorageEngine.open(
        str(location),
        cluster_key=KEY,
        num_partitions=4,
        feature_level=journal_level,
        options=OPTIONS,
    )
    batches = {pid: [make_record(t, pid, size=1000) for t in range(5)] for pid in range(4)}
    try:
        for pid in range(4):
            await engine.add_partition(pid)
        await asyncio.gather(*(engine.partition(pid).append(batches[pid]) for pid in range(4)))
        for pid in range(4):
            assert await engine.partition(pid).read_records(0, 10, 1 << 20) == batches[pid]
    finally:
        await engine.close()
    engine = await FsStorageEngine.open(str(location), options=OPTIONS)
    try:
        for pid in range(4):
            assert await engine.partition(pid).read_records(0, 10, 1 << 20) == batches[pid]
    finally:
        await engine.close()


async def test_a_round_the_journal_refuses_closes_its_partitions_until_the_restart(
    tmp_path: Path, journal_level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal refuses a round after its records were written to the segments: each
    partition of the round closes (the same ids appended again would not continue a log
    that already holds them); the restart keeps every acknowledged record and takes
    appends again."""
    location = str(tmp_path / "storage")
    engine = await FsStorageEngine.open(
        location,
        cluster_key=KEY,
        num_partitions=2,
        feature_level=journal_level,
        options=NO_CHECKPOINT,
        runner=LoopRunner(),
    )
    original = Journal.append
    refuse = [True]

    def refusing(self: Journal, chunks: Sequence[Chunk]) -> int:
        if refuse[0]:
            refuse[0] = False
            raise StorageError("injected: the journal is full")
        return original(self, chunks)

    try:
        for pid in (0, 1):
            await engine.add_partition(pid)
            await engine.partition(pid).append([make_record(0, pid)])
        monkeypatch.setattr(Journal, "append", refusing)
        with pytest.raises(PartitionClosedError):
            await engine.partition(0).append([make_record(1, 0)])
        with pytest.raises(PartitionClosedError, match="restart the storage node"):
            await engine.partition(0).append([make_record(1, 0)])  # the server's retry
        await engine.partition(1).append([make_record(1, 1)])  # not in the refused round
    finally:
        await engine.close()
    reopened = await FsStorageEngine.open(location, options=NO_CHECKPOINT, runner=LoopRunner())
    try:
        got = await reopened.partition(0).read_records(0, 10)
        assert got[:1] == [make_record(0, 0)] and len(got) <= 2
        await reopened.partition(0).append([make_record(len(got), 0)])
        assert await reopened.partition(1).read_records(0, 10) == [
            make_record(0, 1),
            make_record(1, 1),
        ]
    finally:
        await reopened.close()
