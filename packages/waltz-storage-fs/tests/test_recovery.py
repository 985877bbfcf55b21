"""Start-up recovery never deletes what may be data: torn tails are cut, damaged bytes and
files that cannot belong to the log are moved to the quarantine, intact records after
damage stay in the log (a hole, repaired from a peer), a damaged tail is LOST, and so is
a log that ends below the acknowledged end the control file keeps (whatever its shape:
the torn-write rule holds only above that end)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fsutil import acked_end

from waltz_api.errors import CorruptionError
from waltz_api.types import LOST_SESSION, NO_SESSION, SessionInfo
from waltz_conformance.suites.storage import assert_log, make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine

pytestmark = pytest.mark.timeout(120)

KEY = uuid.UUID("0f8e3c52-6a4b-4f0e-9d2c-7b1a5e3f9c11")
OPTIONS = {"segment_size": 600, "index_checkpoint_interval": 4}


class Store:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.engine: FsStorageEngine | None = None

    async def open(self, **options: Any) -> FsStorageEngine:
        await self.close()
        self.engine = await FsStorageEngine.open(
            str(self.directory),
            cluster_key=KEY,
            num_partitions=4,
            options={**OPTIONS, **options},
        )
        return self.engine

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
            self.engine = None

    def pdir(self, pid: int = 0) -> Path:
        return self.directory / str(pid)

    def segment(self, first: int, pid: int = 0) -> Path:
        return self.pdir(pid) / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)

    def quarantined(self) -> list[tools.QuarantineEntry]:
        return tools.list_quarantine(self.directory)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = Store(tmp_path / "store")
    engine = await s.open()
    for pid in (0, 1):
        await engine.add_partition(pid)
        for first in range(0, 40, 2):
            await engine.partition(pid).append([make_record(t, pid) for t in (first, first + 1)])
    await s.close()
    yield s
    await s.close()


def set_acked_end(directory: Path, pid: int, end: int) -> None:
    """Write a newer struct with this acknowledged end (as if the control file's flush of
    the round that wrote the records after ``end`` had not completed)."""
    dump = tools.read_control_file(directory)
    info = dump.partitions[pid]
    current, slot = info.current, info.current_slot
    assert current is not None and slot is not None
    newer = dataclasses.replace(current, sequence=current.sequence + 1, acked_end=end)
    with dump.path.open("r+b") as f:
        f.seek(fmt.info_struct_offset(pid, 1 - slot))
        f.write(fmt.encode_info_struct(pid, newer))


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x20]))


async def assert_reads(engine: FsStorageEngine, pid: int, missing: set[int], last: int) -> None:
    part = engine.partition(pid)
    assert part.max_transaction_id() == last
    for t in range(last + 1):
        if t in missing:
            with pytest.raises(CorruptionError, match=f"transaction {t}"):
                await part.read_record(t)
        else:
            assert await part.read_record(t) == make_record(t, pid)


async def test_a_copy_of_a_segment_under_another_name_is_moved_aside(store: Store) -> None:
    firsts = tools.segment_firsts(store.pdir())
    # cp 0/0000000000000000000.seg 0/0000000000000000001.seg
    shutil.copy(store.segment(0), store.segment(1))
    engine = await store.open()
    await assert_log(engine, 0, 39)
    assert engine.partition(0).missing_ranges() == []
    assert tools.segment_firsts(store.pdir()) == firsts
    (entry,) = store.quarantined()
    assert entry.files == (fmt.segment_file_name(1, fmt.SEGMENT_SUFFIX),)
    assert "starts at transaction 0, its name says 1" in entry.readme


async def test_a_segment_of_another_partition_is_moved_aside(store: Store) -> None:
    firsts = tools.segment_firsts(store.pdir())
    for name in (firsts[1], 999):  # between two segments, and past the end
        shutil.copy(store.segment(firsts[1], pid=1), store.segment(name + 1))
    engine = await store.open()
    await assert_log(engine, 0, 39)
    await assert_log(engine, 1, 39)
    assert engine.partition(0).session_info().low_water_mark_session_id == NO_SESSION
    assert sorted(len(e.files) for e in store.quarantined()) == [1, 1]
    assert all("names partition 1" in e.readme for e in store.quarantined())


async def test_a_flipped_bit_in_a_middle_segment_leaves_a_one_record_hole(store: Store) -> None:
    firsts = tools.segment_firsts(store.pdir())
    victim = firsts[1] + 2
    path, start, _ = tools.find_record(store.directory, 0, victim)
    flip(path, start + fmt.RECORD_HEAD.size + 1)  # in its data
    # recovery trusts a flushed index up to its last entry: the damage shows at read time
    engine = await store.open()
    with pytest.raises(CorruptionError, match=f"transaction {victim}"):
        await engine.partition(0).read_record(victim)
    # ... and at start-up once the index needs a rescan
    (path.with_suffix(fmt.INDEX_SUFFIX)).unlink()
    engine = await store.open()
    part = engine.partition(0)
    assert part.missing_ranges() == [(victim, victim)]
    await assert_reads(engine, 0, {victim}, 39)
    assert tools.segment_firsts(store.pdir()) == sorted([*firsts, victim + 1])
    (entry,) = store.quarantined()
    assert entry.files == (f"{path.name}@{start}",)
    await part.repair([make_record(victim)])
    await assert_log(engine, 0, 39)


async def test_damage_in_the_last_segment_keeps_the_records_after_it(store: Store) -> None:
    last = tools.segment_firsts(store.pdir())[-1]
    victim = last + 1
    assert victim < 38
    path, start, end = tools.find_record(store.directory, 0, victim)
    flip(path, start + 5)  # in its head: the length cannot be trusted
    # (a flushed index vouches for the record: a rescan finds the damage at start-up)
    engine = await store.open(verify_on_open=1)
    part = engine.partition(0)
    assert part.missing_ranges() == [(victim, victim)]
    await assert_reads(engine, 0, {victim}, 39)
    assert part.session_info().low_water_mark_session_id == NO_SESSION
    await part.append([make_record(40)])
    await assert_reads(engine, 0, {victim}, 40)
    del end


async def test_a_damaged_last_record_is_a_lost_tail(store: Store) -> None:
    path, start, end = tools.find_record(store.directory, 0, 39)
    original = path.read_bytes()[start:end]
    flip(path, start + fmt.RECORD_HEAD.size + 2)
    engine = await store.open()
    part = engine.partition(0)
    assert part.max_transaction_id() == 38
    assert part.session_info().low_water_mark_session_id == LOST_SESSION
    (entry,) = store.quarantined()
    saved = (entry.folder / entry.files[0]).read_bytes()
    assert len(saved) == len(original) and saved != original
    report = tools.verify(store.directory)
    assert not report.ok and "may be lost" in " ".join(report.problems)
    # a store session's start (SetLowWaterMark) vouches for the marks again
    await part.set_session_info(SessionInfo(7, 38, 38, 7))
    engine = await store.open()
    assert engine.partition(0).session_info() == SessionInfo(7, 38, 38, 7)
    assert tools.verify(store.directory).ok


@pytest.mark.parametrize("how", ["short", "zeros", "zero-sector-then-records"])
async def test_a_torn_write_is_cut_and_nothing_is_lost(store: Store, how: str) -> None:
    engine = await store.open(segment_size=1 << 20)
    await engine.add_partition(2)
    part = engine.partition(2)
    await part.append([make_record(t, 2, data=bytes([65 + t % 26]) * 100) for t in range(20)])
    await part.append([make_record(t, 2, data=bytes([65 + t % 26]) * 100) for t in range(20, 30)])
    await store.close()
    # the power went before the second append was acknowledged: its end is not recorded
    assert acked_end(store.directory, 2) == 30
    set_acked_end(store.directory, 2, 20)
    path, start, _ = tools.find_record(store.directory, 2, 20)
    raw = bytearray(path.read_bytes())
    size = len(raw)
    if how == "short":
        raw = raw[: start + 30]
    elif how == "zeros":
        raw[start + 50 :] = bytes(size - start - 50)
    else:
        # the first pages of the last write never reached the disk, later ones did
        sector = -(-start // 512) * 512
        raw[sector : sector + 512] = bytes(512)
        assert sector + 700 < size
    path.write_bytes(bytes(raw))
    # the index was flushed last at its checkpoint before the write (entries 0..19)
    os.truncate(path.with_suffix(fmt.INDEX_SUFFIX), fmt.HEADER_SIZE + 20 * 8)
    engine = await store.open(segment_size=1 << 20)
    part = engine.partition(2)
    assert part.missing_ranges() == []
    assert part.session_info().low_water_mark_session_id == NO_SESSION
    last = part.max_transaction_id()
    assert 19 <= last < 29
    got = await part.read_records(0, 100)
    assert got == [make_record(t, 2, data=bytes([65 + t % 26]) * 100) for t in range(last + 1)]
    kept = store.quarantined()
    if how == "zero-sector-then-records":
        # the intact records after the zeros are kept aside (it may have been damage)
        (entry,) = kept
        assert "torn-write" in entry.folder.name
        assert f"after transaction {last}: zeros then records from" in entry.readme
    else:
        assert kept == []
    assert acked_end(store.directory, 2) == last + 1  # what recovery kept counts now


def old_record_20(size: int) -> bytes:
    """The first ``size`` bytes of an older, longer version of record 20 (what the disk
    held there before the write that was lost)."""
    return fmt.encode_record(make_record(20, 2, data=b"old" * 2000))[:size]


@pytest.mark.parametrize(
    "how", ["zeros", "older-bytes", "cut-in-a-record", "short-at-a-record", "missing-segment"]
)
async def test_an_acknowledged_tail_lost_after_its_flush_is_a_lost_tail(
    store: Store, how: str
) -> None:
    """The records' bytes are gone after they were flushed and acknowledged (a lost write,
    files cut or removed): whatever the shape, even a torn write's, the log ends below
    the acknowledged end, so the partition is LOST and what is left is moved aside."""
    small = how == "missing-segment"
    engine = await store.open(segment_size=600 if small else 1 << 20)
    part = await engine.add_partition(2)
    written = [make_record(t, 2, data=bytes([65 + t % 26]) * 100) for t in range(30)]
    for first in range(0, 30, 5):
        await part.append(written[first : first + 5])
    await store.close()
    assert acked_end(store.directory, 2) == 30
    path, start, _ = tools.find_record(store.directory, 2, 20)
    raw = bytearray(path.read_bytes())
    size = len(raw)
    if how == "zeros":
        raw[start:] = bytes(size - start)
    elif how == "older-bytes":
        raw[start:] = old_record_20(size - start)
    elif how == "cut-in-a-record":
        raw = raw[: start + 30]
    elif how == "short-at-a-record":
        raw = raw[:start]
    if how == "missing-segment":
        firsts = tools.segment_firsts(store.pdir(2))
        for first in firsts[firsts.index(max(f for f in firsts if f <= 20)) :]:
            store.segment(first, pid=2).unlink()
            store.segment(first, pid=2).with_suffix(fmt.INDEX_SUFFIX).unlink()
    else:
        path.write_bytes(bytes(raw))
    gone = bytes(path.read_bytes()[start:]) if path.exists() else b""
    report = tools.verify(store.directory)
    assert "below the acknowledged end 30" in " ".join(report.problems)
    engine = await store.open(segment_size=600 if small else 1 << 20)
    part = engine.partition(2)
    last = part.max_transaction_id()
    assert last < 20
    assert part.session_info().low_water_mark_session_id == LOST_SESSION
    assert await part.read_records(0, 100) == written[: last + 1]
    (entry,) = store.quarantined()
    assert (
        f"acknowledged end recorded in the control file was 30 and the log ends at {last + 1}"
        in entry.readme
    )
    if gone:
        (name,) = entry.files
        assert (entry.folder / name).read_bytes() == gone  # never deleted
    # the end is lowered once the tail is moved aside: the next open finds nothing new
    assert acked_end(store.directory, 2) == last + 1
    engine = await store.open(segment_size=600 if small else 1 << 20)
    assert engine.partition(2).session_info().low_water_mark_session_id == LOST_SESSION
    assert len(store.quarantined()) == 1
    await engine.partition(2).append([make_record(last + 1, 2)])


async def test_a_stray_index_and_unknown_files(store: Store) -> None:
    (store.pdir() / fmt.segment_file_name(5000, fmt.INDEX_SUFFIX)).write_bytes(b"x" * 200)
    (store.pdir() / "notes.txt").write_text("keep me")
    engine = await store.open()
    await assert_log(engine, 0, 39)
    (entry,) = store.quarantined()
    assert entry.files == (fmt.segment_file_name(5000, fmt.INDEX_SUFFIX),)
    assert (store.pdir() / "notes.txt").read_text() == "keep me"


async def test_a_directory_of_a_partition_not_hosted_is_moved_aside(store: Store) -> None:
    shutil.copytree(store.pdir(1), store.pdir(3))
    engine = await store.open()
    assert engine.partition_ids() == [0, 1]
    assert not store.pdir(3).exists()
    (entry,) = store.quarantined()
    assert entry.partition_id == 3 and "not hosted" in entry.readme


async def test_an_interrupted_split_is_done_again(store: Store) -> None:
    """A crash after the intact records were copied to their new segment file, before
    the damaged one was cut: the next recovery finds the copy and redoes the split."""
    firsts = tools.segment_firsts(store.pdir())
    victim = firsts[1] + 1
    path, start, end = tools.find_record(store.directory, 0, victim)
    flip(path, start + 3)
    path.with_suffix(fmt.INDEX_SUFFIX).unlink()
    copy = store.directory.parent / "copy"
    shutil.copytree(store.directory, copy)
    engine = await store.open()
    await assert_reads(engine, 0, {victim}, 39)
    await store.close()
    # the state just before the cut: the original whole, a partial copy of the tail
    split = store.segment(victim + 1)
    partial = split.read_bytes()[: fmt.HEADER_SIZE + 30]
    shutil.rmtree(store.directory)
    shutil.copytree(copy, store.directory)
    store.segment(victim + 1).write_bytes(partial)
    engine = await store.open()
    await assert_reads(engine, 0, {victim}, 39)
    del end


async def test_availability_is_kept_across_reopen(store: Store) -> None:
    engine = await store.open()
    part = engine.partition(1)
    assert part.available()
    await part.set_available(False)
    await part.set_session_info(SessionInfo(3, 5, 5, 3))
    engine = await store.open()
    assert not engine.partition(1).available() and engine.partition(0).available()
    assert engine.partition(1).session_info() == SessionInfo(3, 5, 5, 3)
    await engine.partition(1).set_available(True)
    engine = await store.open()
    assert engine.partition(1).available()


async def test_the_quarantine_survives_remove_partition(store: Store) -> None:
    flip(tools.find_record(store.directory, 0, 39)[0], tools.find_record(store.directory, 0, 39)[1])
    engine = await store.open()
    await engine.remove_partition(0)
    assert len(store.quarantined()) == 1
    assert (store.directory / fmt.QUARANTINE_DIR_NAME / "0").is_dir()
