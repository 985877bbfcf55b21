"""The archiver, the archive's format and its reader, against a real local directory
(the S3 and real-process tests are in waltz-server's tests)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import itertools
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from waltz_api.cluster import ArchiveMark, ClusterMetadata
from waltz_api.contracts.storage import LogExtent
from waltz_api.errors import ArchiveError, BadVersionError, CoordinationError
from waltz_api.types import Record
from waltz_api.wire import RecordBlock
from waltz_archive import layout
from waltz_archive.archiver import ArchivePolicy, PartitionArchiver, plan_range
from waltz_archive.manifest import Manifest
from waltz_archive.objects import RangeWriter, WriteOptions, verify_object
from waltz_archive.reader import ArchiveReader
from waltz_archive.records import SCHEMA, records_to_batch
from waltz_archive.store import ArchiveStore
from waltz_conformance.records import make_record
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_server.cluster_admin import ClusterAdmin

pytestmark = pytest.mark.timeout(60)


def records(start: int, stop: int, partition: int = 0) -> list[Record]:
    return [make_record(t, partition, size=50 + t % 200) for t in range(start, stop)]


@dataclass
class Log:
    """A partition's committed log as an archiver sees it."""

    records: list[Record] = field(default_factory=list)
    high_water_mark: int = -1
    pruned: list[int] = field(default_factory=list)
    reads: int = 0
    extents: tuple[LogExtent, ...] = ()

    def committed(self) -> int:
        return self.high_water_mark

    async def read(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        self.reads += 1
        await asyncio.sleep(0)
        chosen: list[Record] = []
        size = 0
        for record in self.records[start : start + max_records]:
            if record.transaction_id > self.high_water_mark:
                break
            if chosen and size + len(record.data) > max_bytes:
                break
            size += len(record.data)
            chosen.append(record)
        return RecordBlock.of(chosen)

    async def local_log(self) -> Log:
        return self

    @property
    def log_start(self) -> int:
        return 0

    @property
    def max_transaction_id(self) -> int:
        return self.high_water_mark

    async def prune(self, through: int) -> None:
        self.pruned.append(through)


POLICY = ArchivePolicy(
    min_range_bytes=1,
    max_range_bytes=20_000,
    max_local_bytes=0,
    max_local_age=0,
    keep_local_transactions=10,
    read_batch_bytes=3_000,
    interval=0.05,
    timeout=10.0,
    write=WriteOptions(row_group_bytes=4_000),
)


CLUSTER_KEY = uuid.UUID(int=1)


@pytest.fixture
async def coordination() -> AsyncIterator[MemoryCoordination]:
    client = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await client.start()
    yield client
    await client.close()


def archiver(
    store: ArchiveStore,
    coordination: MemoryCoordination,
    log: Log,
    policy: ArchivePolicy = POLICY,
    manifests: list[Manifest] | None = None,
) -> PartitionArchiver:
    return PartitionArchiver(
        partition_id=0,
        coordination=coordination,
        store=store,
        source=log,
        advance=ClusterAdmin(coordination).advance_archive_mark,
        policy=policy,
        on_mark=(manifests.append if manifests is not None else None),
        rng=random.Random(1),
        cluster_key=CLUSTER_KEY,
    )


def objects(root: Path) -> list[str]:
    directory = root / "partition-0"
    return sorted(p.name for p in directory.glob("*.parquet")) if directory.exists() else []


async def test_ranges_are_archived_verified_and_read_back(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    store = ArchiveStore(f"file://{tmp_path}/archive")
    log = Log(records(0, 400), high_water_mark=399)
    manifests: list[Manifest] = []
    arc = archiver(store, coordination, log, manifests=manifests)
    archived = []
    while (done := await arc.round()) is not None:
        archived.append(done)
    assert archived[0].first == 0 and archived[-1].last == 389  # 10 kept local
    assert all(a.last + 1 == b.first for a, b in itertools.pairwise(archived))
    assert all(a.data_bytes <= 20_000 + 300 for a in archived)
    mark = (await ClusterMetadata(coordination).archive_mark(0)).value
    assert mark.mark == 389 and mark.ranges == len(archived) and mark.url == store.url
    assert manifests[-1].mark == 389 and len(manifests[-1].ranges) == len(archived)
    assert log.pruned[-1] == 389
    assert len(objects(tmp_path / "archive")) == len(archived)
    manifest_files = sorted((tmp_path / "archive" / "partition-0" / "manifest").iterdir())
    assert len(manifest_files) == len(archived)  # one new manifest per range, none rewritten

    reader = ArchiveReader(store, 0, cache_bytes=1 << 20)
    reader.set_manifest(manifests[-1])
    got: list[Record] = []
    while len(got) < 390:
        chunk = reader.read(len(got), 1000, 1 << 20)
        assert chunk, f"nothing read at {len(got)}"
        got.extend(chunk)
    assert got == log.records[:390]
    assert reader.read(390, 10, 1 << 20) == []
    assert reader.read(17, 5, 1 << 20) == log.records[17:22]
    assert reader.cache_hits > 0
    for a in archived:
        assert verify_object(store, 0, a)[0] == a.records


def test_the_plan_follows_retention() -> None:
    mib = 1 << 20
    extents = (
        LogExtent(0, 99, 10 * mib, 1_000),
        LogExtent(100, 199, 10 * mib, 2_000),
        LogExtent(200, 299, 10 * mib, 3_000),
        LogExtent(300, 350, 5 * mib, 4_000),  # the open segment
    )

    class Local:
        log_start = 0
        max_transaction_id = 350

    local = Local()
    local.extents = extents  # type: ignore[attr-defined]
    base = ArchivePolicy(min_range_bytes=15 * mib, max_local_bytes=0, max_local_age=0)
    assert plan_range(base, -1, 350, local, 5_000) is None  # no retention: nothing
    by_bytes = ArchivePolicy(min_range_bytes=64 * mib, max_local_bytes=20 * mib, max_local_age=0)
    assert plan_range(by_bytes, -1, 350, local, 5_000) == 199  # keep the newest 20 MiB
    assert plan_range(by_bytes, 199, 350, local, 5_000) is None
    by_age = ArchivePolicy(max_local_bytes=0, max_local_age=2.5)  # sealed > 2.5 s ago
    assert plan_range(by_age, -1, 350, local, 5_600) == 199  # sealed at 2000 and 3000
    assert plan_range(by_age, -1, 350, local, 7_000) == 299
    assert plan_range(by_age, -1, 150, local, 7_000) == 150  # never above the mark
    by_id = ArchivePolicy(max_local_bytes=0, max_local_age=0, keep_local_transactions=100)
    by_id_small = ArchivePolicy(
        min_range_bytes=15 * mib, max_local_bytes=0, max_local_age=0, keep_local_transactions=100
    )
    assert plan_range(by_id, -1, 350, local, 0) is None  # 250 ids: 25 MiB < 64 MiB
    assert plan_range(by_id_small, -1, 350, local, 0) == 250
    assert plan_range(by_id_small, 249, 350, local, 0) is None


async def test_a_crashed_round_leaves_an_orphan_that_the_next_round_adopts(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    store = ArchiveStore(str(tmp_path / "archive"))
    log = Log(records(0, 200), high_water_mark=199)
    # the object a crashed round wrote for 0..99 (before its manifest and mark)
    writer = RangeWriter(store, 0, 0, WriteOptions(row_group_bytes=3_000))
    batch, heads = records_to_batch(log.records[:100])
    writer.add(batch, heads)
    orphan, _ = writer.finish()
    # ... and a torn one, which must not be taken
    torn = tmp_path / "archive" / "partition-0" / layout.RangeName(0, 150, "deadbeef").name
    torn.write_bytes((tmp_path / "archive" / "partition-0" / orphan.name).read_bytes()[:500])
    arc = archiver(store, coordination, log)
    before = objects(tmp_path / "archive")
    archived = await arc.round()
    assert archived is not None and archived.name == orphan.name
    assert objects(tmp_path / "archive") == before  # nothing written again
    assert log.reads > 0  # its records were compared with the replicas' first
    assert (await ClusterMetadata(coordination).archive_mark(0)).value.mark == 99
    following = await arc.round()
    assert following is not None and following.first == 100


async def test_two_archivers_racing_advance_the_mark_once(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    store = ArchiveStore(str(tmp_path / "archive"))
    log = Log(records(0, 100), high_water_mark=99)
    one, two = archiver(store, coordination, log), archiver(store, coordination, log)
    await one.refresh()
    await two.refresh()
    admin = ClusterAdmin(coordination)
    current = await admin.archive_mark(0)
    first = await admin.advance_archive_mark(current, ArchiveMark(0, 10, "manifest/x.json"))
    with pytest.raises(BadVersionError):
        await admin.advance_archive_mark(current, ArchiveMark(0, 20, "manifest/y.json"))
    with pytest.raises(CoordinationError, match="forward"):
        await admin.advance_archive_mark(first, ArchiveMark(0, 5, "manifest/z.json"))
    assert first.version >= 0 and (await admin.archive_mark(0)).value.mark == 10


async def test_a_corrupted_object_is_reported_with_its_range_and_name(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    store = ArchiveStore(str(tmp_path / "archive"))
    log = Log(records(0, 150), high_water_mark=149)
    manifests: list[Manifest] = []
    arc = archiver(store, coordination, log, manifests=manifests)
    archived = await arc.round()
    assert archived is not None
    path = tmp_path / "archive" / "partition-0" / archived.name
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 3
    raw[middle : middle + 64] = bytes(64)  # zero a run of bytes inside the data
    os.chmod(path, 0o644)
    path.write_bytes(bytes(raw))
    reader = ArchiveReader(store, 0)
    reader.set_manifest(manifests[-1])
    with pytest.raises(ArchiveError) as error:
        for start in range(0, archived.last + 1, 10):
            reader.read(start, 10, 1 << 20)
    message = str(error.value)
    assert f"{archived.first}..{archived.last}" in message and archived.name in message
    with pytest.raises(ArchiveError, match=archived.name):
        verify_object(store, 0, archived)


async def test_an_unusable_archive_fails_the_round_and_deletes_nothing(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"x")
    store = ArchiveStore(str(blocker / "archive"))
    log = Log(records(0, 100), high_water_mark=99)
    arc = archiver(store, coordination, log)
    with pytest.raises(ArchiveError, match="not-a-directory"):
        await arc.round()
    assert (
        log.pruned == [] and (await ClusterMetadata(coordination).archive_mark(0)).value.mark == -1
    )


class CorruptingStore(ArchiveStore):
    """An archive that stores something else than it was given (a faulty gateway)."""

    def put_file(self, local_path: str, path: str) -> None:
        import pyarrow.parquet as pq

        super().put_file(local_path, path)
        target = Path(path)
        # a byte of the records' data (a page's payload: not a page header's statistics,
        # which no record read depends on)
        chunk = pq.read_metadata(target).row_group(0).column(SCHEMA.get_field_index("data"))
        raw = bytearray(target.read_bytes())
        raw[chunk.data_page_offset + chunk.total_compressed_size - 2] ^= 0xFF
        target.write_bytes(bytes(raw))


async def test_a_corrupting_archive_never_moves_the_mark_nor_deletes(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    store = CorruptingStore(str(tmp_path / "archive"))
    log = Log(records(0, 200), high_water_mark=199)
    arc = archiver(store, coordination, log)
    for _ in range(3):
        with pytest.raises(ArchiveError, match="partition 0"):
            await arc.round()
    assert log.pruned == []
    assert (await ClusterMetadata(coordination).archive_mark(0)).value.mark == -1
    # each failed round's object stays as an orphan that is never taken (it reads back
    # wrong), and nothing was written over another
    assert len(objects(tmp_path / "archive")) == 3


async def test_a_range_object_of_a_newer_format_is_refused(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    """An object a newer Waltz wrote (``waltz.format`` above this one's) is refused with
    its range, its name and what to do, never read as if it were this format."""
    import pyarrow.parquet as pq

    store = ArchiveStore(str(tmp_path / "archive"))
    log = Log(records(0, 60), high_water_mark=59)
    arc = archiver(store, coordination, log)
    archived = await arc.round()
    assert archived is not None
    assert verify_object(store, 0, archived)[0] == archived.records
    path = tmp_path / "archive" / "partition-0" / archived.name
    table = pq.read_table(path)
    footer = dict(pq.read_metadata(path).metadata or {})
    footer[b"waltz.format"] = b"2"
    os.chmod(path, 0o644)
    pq.write_table(table.replace_schema_metadata(footer), path)
    with pytest.raises(ArchiveError) as error:
        verify_object(store, 0, archived)
    message = str(error.value)
    assert "format 2" in message and "upgrade" in message and archived.name in message


async def test_the_read_cache_stays_within_its_bound(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    """A feed reading the whole history keeps at most ``cache_bytes`` of row groups (one
    when a single group is larger); what it dropped is read again, never served stale."""
    store = ArchiveStore(str(tmp_path / "archive"))
    log = Log(records(0, 400), high_water_mark=399)
    manifests: list[Manifest] = []
    arc = archiver(store, coordination, log, manifests=manifests)
    while await arc.round() is not None:
        pass
    bound = 12_000  # a few of the ~4 KB row groups
    reader = ArchiveReader(store, 0, cache_bytes=bound)
    reader.set_manifest(manifests[-1])
    got: list[Record] = []
    largest = 0
    while len(got) < 390:
        got.extend(reader.read(len(got), 7, 1 << 20))
        assert reader.cached_bytes <= bound, reader.cached_bytes
        largest = max(largest, reader.cached_bytes)
    assert got == log.records[:390]
    assert largest > bound // 2  # it did cache
    assert reader.cache_hits > 0  # small reads within a row group hit the cache
    reads = reader.reads
    hits = reader.cache_hits
    assert reader.read(0, 5, 1 << 20) == log.records[:5]  # long evicted: read again
    assert reader.reads == reads + 1 and reader.cache_hits == hits
    tiny = ArchiveReader(store, 0, cache_bytes=1)  # smaller than any group: keeps one
    tiny.set_manifest(manifests[-1])
    assert tiny.read(100, 3, 1 << 20) == log.records[100:103]
    assert 1 < tiny.cached_bytes <= largest
    assert tiny.read(101, 2, 1 << 20) == log.records[101:103] and tiny.cache_hits == 1


class FullStore(ArchiveStore):
    """An archive directory on a full file system: a write fails with ENOSPC after the
    first KiB of each file."""

    def _local_durable(self, path: str, write: Any) -> None:
        def full(out: IO[bytes]) -> None:
            out.write(b"x" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")

        super()._local_durable(path, full)


async def test_a_full_archive_fails_the_round_and_deletes_nothing(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    store = FullStore(str(tmp_path / "archive"))
    log = Log(records(0, 100), high_water_mark=99)
    spool = tmp_path / "spool"
    spool.mkdir()
    policy = dataclasses.replace(
        POLICY, write=dataclasses.replace(POLICY.write, spool_dir=str(spool))
    )
    arc = archiver(store, coordination, log, policy)
    for _ in range(2):
        with pytest.raises(ArchiveError, match="No space left"):
            await arc.round()
    assert log.pruned == []
    assert (await ClusterMetadata(coordination).archive_mark(0)).value.mark == -1
    assert objects(tmp_path / "archive") == []
    assert list((tmp_path / "archive" / "partition-0").iterdir()) == []  # no partial file
    assert list(spool.iterdir()) == []  # the spooled ranges were removed


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real file system of 8 KiB (tmpfs, mounted as root), unmounted after the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (the CI runs as root)")
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8k", "waltz-test-archive", str(mountpoint)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False, timeout=30)


async def test_an_archive_on_a_really_full_file_system_fails_then_resumes_when_space_returns(
    tmp_path: Path, coordination: MemoryCoordination, small_filesystem: Path
) -> None:
    """The archive directory on a real 8 KiB file system: the range's object (about 6
    KB) fits, its manifest does not. The round fails with the file system's ENOSPC,
    deletes nothing local, moves no mark and leaves no partial manifest; a second round
    fails the same way and does not add a second object. Once the file system has room
    (grown by a remount) the next round archives the range, and it reads back."""
    store = ArchiveStore(str(small_filesystem / "archive"))
    log = Log(records(0, 100), high_water_mark=99)
    manifests: list[Manifest] = []
    arc = archiver(store, coordination, log, manifests=manifests)
    manifest_dir = small_filesystem / "archive" / "partition-0" / "manifest"
    for _ in range(2):
        with pytest.raises(ArchiveError, match="No space left on device"):
            await arc.round()
        assert log.pruned == []
        assert (await ClusterMetadata(coordination).archive_mark(0)).value.mark == -1
        assert len(objects(small_filesystem / "archive")) <= 1
        assert not manifest_dir.exists() or list(manifest_dir.iterdir()) == []

    await asyncio.to_thread(
        subprocess.run,
        ["mount", "-o", "remount,size=4m", str(small_filesystem)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    done = await arc.round()
    assert done is not None and done.first == 0
    assert objects(small_filesystem / "archive") == [done.name]
    assert verify_object(store, 0, done)[0] == done.records
    mark = (await ClusterMetadata(coordination).archive_mark(0)).value.mark
    assert mark == done.last and manifests[-1].mark == mark
    reader = ArchiveReader(store, 0)
    reader.set_manifest(manifests[-1])
    got: list[Record] = []
    for _ in range(mark + 1):  # a read returns at most a row group
        if len(got) > mark:
            break
        got.extend(reader.read(len(got), mark + 1 - len(got), 1 << 22))
    assert got == log.records[: mark + 1]


async def test_a_cluster_restore_takes_the_highest_manifest_whose_ranges_verify(
    tmp_path: Path, coordination: MemoryCoordination
) -> None:
    """What `waltz archive restore --url` records as a new cluster's mark: the highest
    manifest whose every range reads back and verifies; an unreadable manifest and one
    naming a corrupted range are passed over, each with its reason. Objects no manifest
    names (orphans) are listed."""
    from waltz_archive.tools import best_manifest, orphans, verify_manifest

    store = ArchiveStore(str(tmp_path / "archive"))
    log = Log(records(0, 400), high_water_mark=399)
    manifests: list[Manifest] = []
    arc = archiver(store, coordination, log, manifests=manifests)
    archived = []
    while (done := await arc.round()) is not None:
        archived.append(done)
    assert len(archived) >= 3
    found = best_manifest(store, 0)
    assert found is not None and found[0].mark == 389 and found[2] == []
    assert verify_manifest(store, manifests[-1]).ok

    # the newest range object corrupted: its manifest (the highest) is passed over
    newest = tmp_path / "archive" / "partition-0" / archived[-1].name
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 3 : len(raw) // 3 + 64] = bytes(64)
    os.chmod(newest, 0o644)
    newest.write_bytes(bytes(raw))
    # and a manifest above every other that cannot be read
    (tmp_path / "archive" / "partition-0" / layout.ManifestName(999, "0badc0de").name).write_text(
        "{not json"
    )
    found = best_manifest(store, 0)
    assert found is not None
    manifest, name, passed_over = found
    assert manifest.mark == archived[-2].last and manifest.ranges == manifests[-2].ranges
    parsed = layout.ManifestName.parse(name)
    assert parsed is not None and parsed.mark == archived[-2].last
    assert len(passed_over) == 2
    assert "0badc0de" in passed_over[0]
    assert archived[-1].name in passed_over[1] and f"{archived[-1].first}.." in passed_over[1]
    problems = verify_manifest(store, manifests[-1]).problems
    assert len(problems) == 1 and archived[-1].name in problems[0]

    # an orphan (a crashed round's object) is named by no manifest
    writer = RangeWriter(store, 0, 390, WriteOptions(row_group_bytes=3_000))
    batch, heads = records_to_batch(log.records[390:395])
    writer.add(batch, heads)
    orphan, _ = writer.finish()
    assert orphans(store, manifests[-1]) == [orphan.name]
