"""The fs engine writes the format of the cluster's feature level (waltz_api.features).

At level 1 a directory stays in control file format 2, the format 0.1.0 writes and
reads: a storage node rolled back to 0.1.0 opens it. Raising the level to 2 migrates it,
while the engine runs, to format 3 (each partition's acknowledged end: the lost-tail
check); the level is never lowered. ``data/log-start-v2`` is a format-2 directory of
0.1.0 (one partition, records 19..39, a dropped prefix).
"""

from __future__ import annotations

import errno
import shutil
import uuid
from pathlib import Path

import pytest
from fsutil import CrashStates, copy_of, open_or_fail, preloaded
from test_format_log_start import FIXTURE as V2
from test_format_log_start import KEY as V2_KEY

from waltz_api.errors import StorageError
from waltz_api.types import LOST_SESSION, NO_SESSION, SessionInfo
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import Files
from waltz_storage_fs.powerloss import Snapshot

pytestmark = pytest.mark.timeout(300)

KEY = uuid.UUID("6b0d9e1c-3a2f-4c5b-8e7d-1f2a3b4c5d6e")


def readable_by_0_1_0(location: Path) -> None:
    """What 0.1.0's engine checks when it opens a directory: a control file of version 2
    (it refuses any other), of the size of format 2, its structs valid in format 2; and
    no file a format-2 reader does not expect in the directory itself."""
    raw = (location / fmt.CONTROL_FILE_NAME).read_bytes()
    header = fmt.decode_control_header(raw[: fmt.HEADER_SIZE])
    assert header is not None and header.version == 2
    assert len(raw) == fmt.partition_info_offset(header.num_partitions, 2)
    for pid in range(header.num_partitions):
        offset = fmt.partition_info_offset(pid, 2)
        stored, first, second = fmt.decode_partition_info(
            pid, raw[offset : offset + fmt.partition_info_size(2)], 2
        )
        assert stored == pid and fmt.current_struct(first, second) is not None
    assert not (location / (fmt.CONTROL_FILE_NAME + ".v2")).exists()


async def test_a_format_2_directory_stays_format_2_at_level_1(tmp_path: Path) -> None:
    location = copy_of(V2, tmp_path)
    engine = await FsStorageEngine.open(
        str(location), cluster_key=V2_KEY, num_partitions=1, feature_level=1
    )
    try:
        assert engine.feature_level == 1 and engine.max_feature_level == max(fmt.FORMAT_OF_LEVEL)
        part = engine.partition(0)
        assert part.log_start() == 19 and part.max_transaction_id() == 39
        await part.append([make_record(t, 0) for t in range(40, 45)])
        await part.set_session_info(SessionInfo(4, 42, 42, 4))
        await part.truncate(43)
        await part.append([make_record(44, 0)])
    finally:
        await engine.close()
    readable_by_0_1_0(location)
    report = tools.verify(location)
    assert report.ok, report.problems
    assert any("cannot be told from a torn write" in note for note in report.notes)
    engine = await FsStorageEngine.open(str(location))  # a restart keeps the level
    try:
        assert engine.feature_level == 1
        part = engine.partition(0)
        assert part.session_info() == SessionInfo(4, 42, 42, 4)
        assert [r.transaction_id for r in await part.read_records(40, 10)] == [40, 41, 42, 43, 44]
    finally:
        await engine.close()
    readable_by_0_1_0(location)


async def test_new_directories_take_the_format_of_the_level_given(tmp_path: Path) -> None:
    top = max(fmt.FORMAT_OF_LEVEL)
    for level, version in ((1, 2), (2, 3), (None, fmt.FORMAT_OF_LEVEL[top])):
        location = tmp_path / f"level-{level}"
        engine = await FsStorageEngine.open(
            str(location), cluster_key=KEY, num_partitions=2, feature_level=level
        )
        try:
            await engine.add_partition(1)
            await engine.partition(1).append([make_record(0, 1)])
        finally:
            await engine.close()
        assert tools.read_control_file(location).header.version == version
        if version == 2:
            readable_by_0_1_0(location)
    with pytest.raises(StorageError, match=f"not {top + 1}"):
        await FsStorageEngine.open(
            str(tmp_path / "level-next"), cluster_key=KEY, num_partitions=2, feature_level=top + 1
        )


async def test_at_level_1_a_lost_tail_is_not_seen_the_gap_the_level_closes(
    tmp_path: Path,
) -> None:
    """The documented gap: format 2 keeps no acknowledged end, so a tail lost after it was
    acknowledged reads as a torn write (0.1.0's behaviour); at level 2 it is seen."""
    for level in (1, 2):
        location = tmp_path / f"level-{level}"
        engine = await FsStorageEngine.open(
            str(location), cluster_key=KEY, num_partitions=1, feature_level=level
        )
        try:
            part = await engine.add_partition(0)
            await part.append([make_record(t, 0) for t in range(10)])
        finally:
            await engine.close()
        path, start, _ = tools.find_record(location, 0, 9)
        with path.open("r+b") as f:
            f.truncate(start)  # the last acknowledged record lost
        engine = await FsStorageEngine.open(str(location))
        try:
            marks = engine.partition(0).session_info().low_water_mark_session_id
            assert engine.partition(0).max_transaction_id() == 8
            assert marks == (NO_SESSION if level == 1 else LOST_SESSION)
        finally:
            await engine.close()


async def test_raising_to_level_2_migrates_a_running_engine(tmp_path: Path) -> None:
    location = copy_of(V2, tmp_path)
    old = (location / fmt.CONTROL_FILE_NAME).read_bytes()
    engine = await FsStorageEngine.open(str(location), feature_level=1)
    try:
        part = engine.partition(0)
        await part.append([make_record(40, 0)])
        await engine.raise_feature_level(2)
        assert engine.feature_level == 2
        dump = tools.read_control_file(location)
        assert dump.header.version == 3
        current = dump.partitions[0].current
        assert current is not None and current.acked_end == 41
        await part.append([make_record(41, 0), make_record(42, 0)])
        assert part.max_transaction_id() == 42 and part.log_start() == 19
        await engine.raise_feature_level(2)  # again: nothing to do
        await engine.raise_feature_level(1)  # never lowered
        assert engine.feature_level == 2
        top = engine.max_feature_level
        with pytest.raises(StorageError, match=f"not {top + 1}"):
            await engine.raise_feature_level(top + 1)
    finally:
        await engine.close()
    assert (location / (fmt.CONTROL_FILE_NAME + ".v2")).read_bytes() == old
    dump = tools.read_control_file(location)
    current = dump.partitions[0].current
    assert current is not None and current.acked_end == 43
    engine = await FsStorageEngine.open(str(location), feature_level=1)
    try:
        assert engine.feature_level == 2  # a restart keeps it; opening never lowers it
    finally:
        await engine.close()
    assert tools.verify(location).notes == []


async def test_power_loss_while_the_level_is_raised(tmp_path: Path) -> None:
    """A crash at any step of the migration leaves a directory that opens with every
    record and the session info: in format 2 (the raise did not happen) or 3."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = preloaded(base, V2)
    engine = await FsStorageEngine.open(str(base / "storage"), files=files)
    info = engine.partition(0).session_info()
    files.on_step = snapshots.append  # every step of the raise
    try:
        await engine.raise_feature_level(2)
    finally:
        await engine.close()
    assert any("rename" in s.operation for s in snapshots)
    expected = [make_record(t, 0, size=30 + t) for t in range(19, 40)]
    failures: list[str] = []
    versions: set[int] = set()
    for crash in CrashStates(snapshots, tmp_path):
        opened = await open_or_fail(crash, failures)
        if opened is None:
            continue
        try:
            versions.add(opened.control.version)
            part = opened.partition(0)
            got = await part.read_records(19, 100)
            if got != expected:
                failures.append(f"{crash.where}: reads back {len(got)} records")
            if part.session_info() != info:
                failures.append(f"{crash.where}: {part.session_info()}")
        finally:
            await opened.close()
        shutil.rmtree(crash.directory)
    assert not failures, "\n".join(failures[:5])
    assert versions == {2, 3}


class FailingRename(Files):
    """The real files; the next rename of the control file fails (a full disk, EIO)."""

    def __init__(self) -> None:
        self.fail = False

    def replace(self, source: Path, target: Path) -> None:
        if self.fail and target.name == fmt.CONTROL_FILE_NAME:
            self.fail = False
            raise OSError(errno.EIO, "injected")
        super().replace(source, target)


async def test_a_failed_migration_changes_nothing_and_can_be_retried(tmp_path: Path) -> None:
    location = copy_of(V2, tmp_path)
    files = FailingRename()
    engine = await FsStorageEngine.open(str(location), files=files)
    try:
        part = engine.partition(0)
        files.fail = True
        with pytest.raises(StorageError, match="stays format 2"):
            await engine.raise_feature_level(2)
        assert engine.feature_level == 1
        await part.append([make_record(40, 0)])  # the partition works on, in format 2
        assert tools.read_control_file(location).header.version == 2
        await engine.raise_feature_level(2)
        await part.append([make_record(41, 0)])
    finally:
        await engine.close()
    dump = tools.read_control_file(location)
    current = dump.partitions[0].current
    assert dump.header.version == 3 and current is not None and current.acked_end == 42
