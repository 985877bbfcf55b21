"""The acknowledged end: kept in the control file, apart from the records (issue 27).

Each commit round writes the new end of every partition it appended to and flushes
the control file once, after the data's flushes and before any of its appends is
acknowledged; a truncation lowers it before it cuts the files; a fast-forward past the
log's end raises it after the new start; a directory of format 2 gets the end of the
log it holds when the feature level is raised to 2 (and it is migrated). Recovery's side
(a log found shorter than its end is LOST) is in test_recovery.py.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import uuid
from pathlib import Path

import pytest
from fsutil import CrashStates, copy_of, new_engine
from test_format_log_start import FIXTURE as V2
from test_format_log_start import KEY as V2_KEY

from waltz_api.errors import PartitionClosedError
from waltz_api.types import LOST_SESSION, NO_SESSION
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.committer import LoopRunner, ThreadRunner
from waltz_storage_fs.control import ControlFile
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import REAL_FILES, Files
from waltz_storage_fs.powerloss import PowerLossFiles, Snapshot

pytestmark = pytest.mark.timeout(300)

FORMAT_3 = 2
"""The level whose commit round this module tests (control file format 3: the ends
flushed in the control file before an append is acknowledged)."""
KEY = uuid.UUID("3d1b7e2a-5c4f-4a8e-9b6d-2e0f1a7c5b38")
OPTIONS = {"segment_size": 700, "index_checkpoint_interval": 3}


def acked_ends(directory: Path) -> dict[int, int]:
    """Each hosted partition's acknowledged end, as the control file holds it now."""
    dump = tools.read_control_file(directory)
    return {
        p.partition_id: p.current.acked_end
        for p in dump.partitions
        if p.current is not None and p.current.assigned
    }


class Watching(Files):
    """The real files; records each flush, and what the control file holds when the
    control file's flush starts (its fd is set once the engine is open)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.control_fd = -1
        self.events: list[tuple[str, object]] = []
        self.fail_control = False

    def fdatasync(self, fd: int) -> None:
        if fd == self.control_fd:
            self.events.append(("control flush", acked_ends(self.directory)))
            if self.fail_control:
                raise OSError(errno.EIO, "a simulated failed flush of the control file")
            super().fdatasync(fd)
            self.events.append(("control flushed", None))
            return
        super().fdatasync(fd)
        self.events.append(("flushed", fd))


async def open_watched(
    tmp_path: Path, runner: str, partitions: int
) -> tuple[FsStorageEngine, Watching]:
    files = Watching(tmp_path / "storage")
    engine, _ = await new_engine(
        tmp_path / "storage",
        KEY,
        partitions,
        feature_level=FORMAT_3,
        files=files,
        runner=LoopRunner() if runner == "loop" else ThreadRunner(2),
    )
    files.control_fd = engine.control.fd
    files.events.clear()
    return engine, files


@pytest.mark.parametrize("runner", ["thread", "loop"])
async def test_no_append_is_acknowledged_before_its_end_is_flushed(
    tmp_path: Path, runner: str
) -> None:
    engine, files = await open_watched(tmp_path, runner, 1)
    part = engine.partition(0)
    try:
        for first in (0, 3, 4):
            count = 3 if first == 0 else 1
            task = asyncio.ensure_future(
                part.append([make_record(first + i) for i in range(count)])
            )
            task.add_done_callback(lambda _t, n=first + count: files.events.append(("acked", n)))
            await task
        kinds = [kind for kind, _ in files.events]
        assert kinds == ["flushed", "control flush", "control flushed", "acked"] * 3, files.events
        # the control file held the new end when its flush began (written, then flushed)
        ends = [value for kind, value in files.events if kind == "control flush"]
        assert ends == [{0: 3}, {0: 4}, {0: 5}]
    finally:
        await engine.close()
    assert acked_ends(tmp_path / "storage") == {0: 5}


async def test_one_control_flush_per_round_for_all_its_partitions(tmp_path: Path) -> None:
    engine, files = await open_watched(tmp_path, "loop", 3)
    try:
        await asyncio.gather(
            *(
                engine.partition(pid).append([make_record(t, pid) for t in range(pid + 1)])
                for pid in range(3)
            )
        )
        control = [value for kind, value in files.events if kind == "control flush"]
        assert control == [{0: 1, 1: 2, 2: 3}], files.events  # one flush, every new end
        assert [k for k, _ in files.events].count("flushed") == 3  # one per data file
    finally:
        await engine.close()


@pytest.mark.parametrize("runner", ["thread", "loop"])
async def test_a_failed_control_flush_fails_the_rounds_appends(tmp_path: Path, runner: str) -> None:
    engine, files = await open_watched(tmp_path, runner, 2)
    try:
        await engine.partition(0).append([make_record(0)])
        files.fail_control = True
        with pytest.raises(PartitionClosedError, match="I/O error"):
            await engine.partition(0).append([make_record(1)])
        files.fail_control = False
        with pytest.raises(PartitionClosedError):  # closed until a restart's recovery
            await engine.partition(0).append([make_record(2)])
        await engine.partition(1).append([make_record(0, 1)])  # another partition goes on
    finally:
        await engine.close()
    engine = await FsStorageEngine.open(str(tmp_path / "storage"))
    try:
        part = engine.partition(0)
        # the record's data was flushed: recovery keeps it (it may never have been
        # acknowledged: a write that was not, as far as the log's end knows)
        assert part.max_transaction_id() in (0, 1)
        assert part.session_info().low_water_mark_session_id == NO_SESSION
    finally:
        await engine.close()


@pytest.mark.parametrize("journal", [False, True], ids=["format-3", "journal"])
async def test_a_crash_after_a_truncation_is_no_lost_tail(
    tmp_path: Path, journal: bool, request: pytest.FixtureRequest
) -> None:
    """Append, truncate, crash at every step from the truncation on (and after it,
    without a close), reopen: never LOST, and the end never above the log. At level 3
    (``journal``) the truncation follows a checkpoint, and the appends after it are
    journal rounds that the crash states lose or keep."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = PowerLossFiles(base, on_step=snapshots.append)
    location = str(base / "storage")
    level = request.getfixturevalue("journal_level") if journal else FORMAT_3
    options = {**OPTIONS, "journal_size": 4096, "checkpoint_bytes": 1024} if journal else OPTIONS
    _engine, (part,) = await new_engine(  # never closed: the process dies
        location, KEY, 1, options=options, files=files, feature_level=level
    )
    for first in range(0, 30, 3):
        await part.append([make_record(t) for t in range(first, first + 3)])
    truncating = len(snapshots)
    await part.truncate(9)
    truncated = len(snapshots)
    await part.append([make_record(t, data=b"after" * t) for t in range(10, 13)])
    # no close: the process dies here
    assert truncated - truncating > 3
    failures: list[str] = []
    for crash in CrashStates(snapshots, tmp_path, first=truncating):
        opened = await FsStorageEngine.open(str(crash.storage), options=options)
        try:
            p = opened.partition(0)
            end = p.max_transaction_id() + 1
            if p.session_info().low_water_mark_session_id == LOST_SESSION:
                failures.append(f"{crash.where}: LOST after a truncation")
            if crash.number >= truncated and end < 10:
                failures.append(f"{crash.where}: the log ends at {end}")
        finally:
            await opened.close()
        if acked_ends(crash.storage)[0] != end:
            failures.append(f"{crash.where}: the end is not the recovered log's")
        shutil.rmtree(crash.directory)
    assert not failures, "\n".join(failures[:5])


async def test_a_fast_forward_past_the_end_moves_the_end(tmp_path: Path) -> None:
    location = tmp_path / "storage"
    engine, (part,) = await new_engine(location, KEY, 1, feature_level=FORMAT_3, options=OPTIONS)
    await part.append([make_record(t) for t in range(10)])
    assert await part.drop_prefix(20) == 21
    assert acked_ends(location) == {0: 21}
    await part.truncate(15)  # below the start: the (empty) log continues at 16
    assert acked_ends(location) == {0: 16}
    await engine.close()
    engine = await FsStorageEngine.open(str(location), options=OPTIONS)
    try:
        part = engine.partition(0)
        assert part.session_info().low_water_mark_session_id == NO_SESSION
        assert part.log_start() == 16
        await part.append([make_record(16)])
    finally:
        await engine.close()
    assert acked_ends(location) == {0: 17}


def old_control_file() -> bytes:
    return (V2 / fmt.CONTROL_FILE_NAME).read_bytes()


async def test_a_format_2_directory_is_migrated_with_its_log_end(tmp_path: Path) -> None:
    location = copy_of(V2, tmp_path)
    assert tools.read_control_file(location).header.version == 2
    engine = await FsStorageEngine.open(
        str(location), cluster_key=V2_KEY, num_partitions=1, feature_level=1
    )
    try:
        part = engine.partition(0)
        assert part.session_info().low_water_mark_session_id == NO_SESSION
        assert part.max_transaction_id() == 39
        await engine.raise_feature_level(2)
    finally:
        await engine.close()
    dump = tools.read_control_file(location)
    assert dump.header.version == 3
    assert acked_ends(location) == {0: 40}
    assert (location / (fmt.CONTROL_FILE_NAME + ".v2")).read_bytes() == old_control_file()
    # from now on the end is checked: the last record lost is a lost tail
    path, start, _ = tools.find_record(location, 0, 39)
    with path.open("r+b") as f:
        f.truncate(start)
    engine = await FsStorageEngine.open(str(location))
    try:
        assert engine.partition(0).session_info().low_water_mark_session_id == LOST_SESSION
        assert engine.partition(0).max_transaction_id() == 38
    finally:
        await engine.close()


async def test_a_migration_interrupted_before_recovery_sets_the_end_next_time(
    tmp_path: Path,
) -> None:
    location = copy_of(V2, tmp_path)
    # the migration of a raise to level 2, then a crash before the ends were written
    ControlFile.open(location / fmt.CONTROL_FILE_NAME, REAL_FILES).upgrade(3).close()
    assert acked_ends(location) == {0: fmt.ACKED_END_UNKNOWN}
    assert "acknowledged_end=unknown" in "\n".join(
        tools.format_control_file(tools.read_control_file(location))
    )
    engine = await FsStorageEngine.open(str(location))
    try:
        part = engine.partition(0)
        start = part.log_start()
        assert await part.read_records(start, 100) == [
            make_record(t, 0, size=30 + t) for t in range(start, 40)
        ]
        assert engine.partition(0).session_info().low_water_mark_session_id == NO_SESSION
    finally:
        await engine.close()
    assert acked_ends(location) == {0: 40}
