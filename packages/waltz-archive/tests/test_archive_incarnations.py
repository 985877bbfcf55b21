"""An archive outlives the cluster that wrote it (docs/archive.md, "Incarnations").

The scenario of issue 28: an earlier incarnation of the cluster uploads range 100..149
and dies before writing its manifest; the cluster is restored from the archive (the
real `waltz archive restore --url`, manifest at 99) and commits different records
100..169; its archiver must never take the dead cluster's object for its own, and the
archive must serve the new cluster's records. The archiver, the restore and the reader
are the real ones; the coordination is the in-memory one, the archive a local directory.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import crc32c
import pytest

from waltz_api.cluster import ArchiveMark, ClusterMetadata
from waltz_api.errors import ArchiveError
from waltz_api.types import Record, ReqId
from waltz_api.wire import RecordBlock
from waltz_archive import layout
from waltz_archive.archiver import ArchivePolicy, PartitionArchiver
from waltz_archive.manifest import ArchivedRange, Manifest
from waltz_archive.objects import WriteOptions
from waltz_archive.reader import ArchiveReader
from waltz_archive.store import ArchiveStore
from waltz_conformance.records import make_record
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_server.cli.archive import _restore_cluster
from waltz_server.cluster_admin import ClusterAdmin

pytestmark = pytest.mark.timeout(60)

SIZE = 100
"""Bytes of data per record."""
POLICY = ArchivePolicy(
    min_range_bytes=1,
    max_range_bytes=1 << 20,
    max_local_bytes=0,
    max_local_age=0,
    keep_local_transactions=10,
    read_batch_bytes=20 * SIZE,
    interval=0.05,
    timeout=10.0,
    write=WriteOptions(row_group_bytes=15 * SIZE),
)


def record(transaction_id: int, tag: str, client_id: int) -> Record:
    unit = f"{tag}-{transaction_id}|".encode()
    data = (unit * (SIZE // len(unit) + 1))[:SIZE]
    return Record(
        transaction_id,
        ReqId(client_id, 1, 0, transaction_id),
        0,
        data,
        crc32c.crc32c(data),
    )


class Log:
    """A partition's committed log as its owner's archiver sees it."""

    def __init__(self, records: Sequence[Record], high_water_mark: int) -> None:
        self.records = list(records)
        self.high_water_mark = high_water_mark
        self.pruned: list[int] = []
        self.reads = 0

    def committed(self) -> int:
        return self.high_water_mark

    async def read(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        self.reads += 1
        await asyncio.sleep(0)
        chosen: list[Record] = []
        for found in self.records[start : start + max_records]:
            if found.transaction_id > self.high_water_mark:
                break
            if chosen and (len(chosen) + 1) * SIZE > max_bytes:
                break
            chosen.append(found)
        return RecordBlock.of(chosen)

    async def local_log(self) -> None:
        return None

    async def prune(self, through: int) -> None:
        self.pruned.append(through)


class DiesBeforeTheManifest(ArchiveStore):
    """The archive of a server that uploads its range and dies before its manifest."""

    def write_bytes(self, path: str, data: bytes) -> None:
        raise ArchiveError(f"the server died before writing {self.where(path)}")


class Rejections:
    """An archiver's listener: what it set aside."""

    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []

    def archived(self, archived: ArchivedRange, seconds: float, adopted: bool) -> None:
        pass

    def progress(self, mark: int, high_water_mark: int, local_bytes: int) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def rejected(self, name: str, reason: str) -> None:
        self.refused.append((name, reason))


KEY = uuid.UUID("5a1e0000-0000-4000-8000-000000000028")


async def new_cluster(cluster_key: uuid.UUID = KEY) -> MemoryCoordination:
    client = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await client.start()
    await ClusterAdmin(client).create_cluster(
        num_partitions=1, num_replicas=1, storage_nodes=["127.0.0.1:1"], cluster_key=cluster_key
    )
    return client


@pytest.fixture
async def clusters() -> AsyncIterator[tuple[MemoryCoordination, MemoryCoordination]]:
    """Two clusters' coordination: the dead one's, and the one restored from its archive
    (with the same cluster key, as a cluster whose storage nodes keep their key is
    re-created: only the archive incarnation tells the two apart)."""
    made = [await new_cluster(), await new_cluster()]
    yield made[0], made[1]
    for client in made:
        await client.close()


def archiver(
    store: ArchiveStore,
    coordination: MemoryCoordination,
    log: Log,
    listener: Rejections | None = None,
) -> PartitionArchiver:
    return PartitionArchiver(
        partition_id=0,
        coordination=coordination,
        store=store,
        source=log,
        advance=ClusterAdmin(coordination).advance_archive_mark,
        policy=POLICY,
        listener=listener,
        rng=random.Random(1),
    )


def objects(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "partition-0").glob("*.parquet"))


def set_aside(root: Path) -> list[str]:
    directory = root / "partition-0" / layout.SET_ASIDE_DIR
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


async def the_dead_cluster(root: Path, coordination: MemoryCoordination) -> Log:
    """Archives 0..49 and 50..99 (manifest at 99), then uploads 100..149 and dies before
    its manifest (it keeps the newest 10 ids local: a high-water mark of 59 archives up
    to 49)."""
    old = Log([record(t, "OLD-CLUSTER", 7) for t in range(160)], 59)
    arc = archiver(ArchiveStore(str(root)), coordination, old)
    assert await arc.round() is not None
    old.high_water_mark = 109
    assert await arc.round() is not None
    assert (await ClusterMetadata(coordination).archive_mark(0)).value.mark == 99
    old.high_water_mark = 159
    await upload_and_die(root, coordination, old)
    return old


async def upload_and_die(root: Path, coordination: MemoryCoordination, log: Log) -> str:
    """The dead cluster's archiver uploading its range 100..149: the object's name."""
    before = set(objects(root))
    with pytest.raises(ArchiveError, match="died"):
        await archiver(DiesBeforeTheManifest(str(root)), coordination, log).round()
    (uploaded,) = set(objects(root)) - before
    assert uploaded.startswith(layout.range_prefix(100)) and "-00000000000000000149-" in uploaded
    return uploaded


def archived_records(
    store: ArchiveStore, manifest: Manifest, first: int, last: int
) -> list[Record]:
    reader = ArchiveReader(store, 0, cache_bytes=1 << 20)
    reader.set_manifest(manifest)
    got: list[Record] = []
    while first + len(got) <= last:
        chunk = reader.read(first + len(got), last + 1 - first - len(got), 1 << 20)
        assert chunk, f"nothing archived at {first + len(got)}"
        got.extend(chunk)
    reader.close()
    return got


async def archive_the_new_cluster(
    store: ArchiveStore, coordination: MemoryCoordination, new: Log, listener: Rejections | None
) -> Manifest:
    """The restored cluster's archiver, rounds until its mark passes 149."""
    manifests: list[Manifest] = []
    arc = archiver(store, coordination, new, listener)
    arc.on_mark = manifests.append
    for _ in range(10):
        if await arc.round() is None or arc.mark.mark >= 149:
            break
    assert arc.mark.mark >= 149, f"the restored cluster archived only to {arc.mark.mark}"
    return manifests[-1]


def served_from_another_cluster(served: list[Record], expected: list[Record]) -> list[int]:
    return [r.transaction_id for r, e in zip(served, expected, strict=True) if r != e]


async def test_the_restored_cluster_never_adopts_the_dead_clusters_orphan(
    tmp_path: Path, clusters: tuple[MemoryCoordination, MemoryCoordination]
) -> None:
    """Issue 28's scenario, step by step; the archive then serves the new cluster's
    records 100..149 (it served the dead cluster's, all 50 of them, before)."""
    dead, restored = clusters
    root = tmp_path / "archive"
    old = await the_dead_cluster(root, dead)
    (orphan,) = [n for n in objects(root) if n.startswith(layout.range_prefix(100))]

    rows = await _restore_cluster(restored, "", str(root), "")
    assert rows[0]["partition"] == 0 and rows[0]["mark"] == 99

    new = Log(old.records[:100] + [record(t, "NEW-CLUSTER", 9) for t in range(100, 170)], 169)
    store = ArchiveStore(str(root))
    manifest = await archive_the_new_cluster(store, restored, new, None)
    served = archived_records(store, manifest, 100, 149)
    wrong = served_from_another_cluster(served, new.records[100:150])
    assert not wrong, (
        f"{len(wrong)} of 50 ids served the dead cluster's records (id {wrong[0]}: "
        f"{served[wrong[0] - 100].data[:16]!r} where {new.records[wrong[0]].data[:16]!r} "
        "was committed)"
    )
    below = archived_records(store, manifest, 0, 99)
    assert served_from_another_cluster(below, old.records[:100]) == []
    assert max(new.pruned) >= 149
    assert all(r.name != orphan for r in manifest.ranges)
    assert set_aside(root) == [orphan]
    mark = (await ClusterMetadata(restored).archive_mark(0)).value
    assert mark.incarnation == rows[0]["incarnation"] != ""


async def test_a_late_upload_of_the_dead_cluster_is_set_aside_never_adopted(
    tmp_path: Path, clusters: tuple[MemoryCoordination, MemoryCoordination]
) -> None:
    """The dead cluster (same cluster key) uploads its range 100..149 after the restore
    (a server that was still running): another incarnation's object. The restored
    cluster's archiver refuses it without comparing a record, sets it aside, counts it,
    and archives its own records."""
    dead, restored = clusters
    root = tmp_path / "archive"
    old = await the_dead_cluster(root, dead)
    (first,) = [n for n in objects(root) if n.startswith(layout.range_prefix(100))]
    assert (await _restore_cluster(restored, "", str(root), ""))[0]["set_aside"] == [first]
    late = await upload_and_die(root, dead, old)

    new = Log(old.records[:100] + [record(t, "NEW-CLUSTER", 9) for t in range(100, 170)], 169)
    listener = Rejections()
    store = ArchiveStore(str(root))
    manifest = await archive_the_new_cluster(store, restored, new, listener)
    assert [name for name, _ in listener.refused] == [late]
    reason = listener.refused[0][1]
    assert f"cluster {KEY}, incarnation (first)" in reason and "this is" in reason
    assert set_aside(root) == sorted([first, late])
    assert new.reads == 3  # its own range 100..159, read once: nothing compared
    served = archived_records(store, manifest, 100, manifest.mark)
    assert served_from_another_cluster(served, new.records[100 : manifest.mark + 1]) == []


async def test_an_orphan_of_this_incarnation_is_adopted_only_when_it_holds_the_log(
    tmp_path: Path, clusters: tuple[MemoryCoordination, MemoryCoordination]
) -> None:
    """An orphan of the right cluster and incarnation whose records are not the
    replicas' (a log rolled back under the archive: every replica restored from an old
    snapshot) is refused by the content check and set aside; one that holds the log's
    records is adopted with nothing written again."""
    coordination, _ = clusters
    root = tmp_path / "archive"
    old = await the_dead_cluster(root, coordination)  # same cluster: its orphan 100..149
    (orphan,) = [n for n in objects(root) if n.startswith(layout.range_prefix(100))]
    rolled_back = Log(
        old.records[:100] + [record(t, "ROLLED-BACK", 7) for t in range(100, 170)], 169
    )
    listener = Rejections()
    store = ArchiveStore(str(root))
    manifest = await archive_the_new_cluster(store, coordination, rolled_back, listener)
    assert [name for name, _ in listener.refused] == [orphan]
    assert "not the ones the replicas committed" in listener.refused[0][1]
    assert set_aside(root) == [orphan]
    served = archived_records(store, manifest, 100, manifest.mark)
    assert served_from_another_cluster(served, rolled_back.records[100 : manifest.mark + 1]) == []

    # the same again, with the log the orphan holds: adopted as it is
    other = tmp_path / "other"
    again = await new_cluster()
    try:
        await the_dead_cluster(other, again)
        (orphan,) = [n for n in objects(other) if n.startswith(layout.range_prefix(100))]
        before = objects(other)
        listener = Rejections()
        manifest = await archive_the_new_cluster(ArchiveStore(str(other)), again, old, listener)
        assert manifest.ranges[-1].name == orphan and objects(other) == before
        assert listener.refused == [] and old.reads > 0
    finally:
        await again.close()


V1 = Path(__file__).parent / "data" / "archive-v1"
"""An archive written before objects carried an identity (test_archive_format.py)."""


@pytest.mark.parametrize("same_records", [True, False])
async def test_an_orphan_without_identity_is_adopted_only_after_the_content_check(
    tmp_path: Path, same_records: bool
) -> None:
    """The format-1 fixture's object 100..149 (no identity in its footer: written by the
    code before this change) is an orphan above a mark at 99: adopted when the
    replicas hold exactly its records, set aside otherwise."""
    root = tmp_path / "archive"
    shutil.copytree(V1, root)
    for manifest_file in (root / "partition-0" / "manifest").glob("*149-*.json"):
        manifest_file.unlink()  # the round that wrote 100..149 died before its manifest
    (orphan,) = [n for n in objects(root) if n.startswith(layout.range_prefix(100))]
    coordination = await new_cluster()
    try:
        admin = ClusterAdmin(coordination)
        await admin.advance_archive_mark(
            await admin.archive_mark(0),
            ArchiveMark(0, 99, "manifest/00000000000000000099-afe33f60.json", 2, 6742, str(root)),
        )
        committed = [make_record(t, 0, size=20 + t % 50) for t in range(170)]
        if not same_records:
            committed[100:] = [record(t, "NEW-CLUSTER", 9) for t in range(100, 170)]
        log = Log(committed, 169)
        listener = Rejections()
        store = ArchiveStore(str(root))
        manifest = await archive_the_new_cluster(store, coordination, log, listener)
        assert log.reads > 0
        if same_records:
            assert manifest.ranges[2].name == orphan and listener.refused == []
        else:
            assert manifest.ranges[2].name != orphan
            assert [name for name, _ in listener.refused] == [orphan]
            assert set_aside(root) == [orphan]
        served = archived_records(store, manifest, 0, manifest.mark)
        assert served_from_another_cluster(served, committed[: manifest.mark + 1]) == []
    finally:
        await coordination.close()


async def test_a_restore_sets_aside_the_history_above_its_mark(tmp_path: Path) -> None:
    """Every range object starting above the restored mark and every manifest above it
    (one that did not verify) is set aside; a partition with nothing archived still
    gets its incarnation (its mark -1), and a restore run again after an interruption
    keeps it; the incarnation is never changed afterwards."""
    root = tmp_path / "archive"
    dead = await new_cluster()
    try:
        await the_dead_cluster(root, dead)
    finally:
        await dead.close()
    manifests = sorted(p.name for p in (root / "partition-0" / "manifest").iterdir())
    assert len(manifests) == 2
    # a manifest above the rest whose range does not verify (corrupted after upload)
    (orphan,) = [n for n in objects(root) if n.startswith(layout.range_prefix(100))]
    bad = layout.ManifestName(149, "0badc0de").name
    (root / "partition-0" / bad).write_text("{not json")
    restored = await new_cluster(uuid.uuid4())
    try:
        rows = await _restore_cluster(restored, "", str(root), "")
        assert rows[0]["mark"] == 99
        assert sorted(rows[0]["set_aside"]) == sorted([orphan, bad])
        assert set_aside(root) == sorted([orphan, bad])
        assert sorted(p.name for p in (root / "partition-0" / "manifest").iterdir()) == manifests
        admin = ClusterAdmin(restored)
        current = await admin.archive_mark(0)
        with pytest.raises(Exception, match="incarnation never changes"):
            await admin.advance_archive_mark(
                current, ArchiveMark(0, 149, current.value.manifest, incarnation="")
            )
    finally:
        await restored.close()

    empty = tmp_path / "empty"
    (empty / "partition-0").mkdir(parents=True)
    fresh = await new_cluster()
    try:
        rows = await _restore_cluster(fresh, "", str(empty), "")
        assert rows[0]["mark"] == -1 and rows[0]["skipped"] and rows[0]["incarnation"]
        mark = (await ClusterMetadata(fresh).archive_mark(0)).value
        assert (mark.mark, mark.incarnation) == (-1, rows[0]["incarnation"])
        again = await _restore_cluster(fresh, "", str(empty), "")
        assert again[0]["incarnation"] == rows[0]["incarnation"]
    finally:
        await fresh.close()
    assert orphan not in objects(root), "the restore left the dead cluster's orphan in place"


def test_a_fingerprint_is_of_the_records_not_of_their_batches() -> None:
    from waltz_archive.records import Fingerprint, records_to_batch

    committed = [record(t, "LOG", 3) for t in range(40)]
    whole, cut = Fingerprint(), Fingerprint()
    whole.add_batch(records_to_batch(committed)[0])
    for start, end in ((0, 7), (7, 8), (8, 30), (30, 40)):
        batch = records_to_batch(committed)[0].slice(start, end - start)  # offset views
        cut.add_batch(batch)
    assert whole.value == cut.value and whole.records == cut.records == 40
    changed = list(committed)
    data = bytearray(changed[17].data)
    data[5] ^= 1
    changed[17] = Record(17, changed[17].req_id, 0, bytes(data), crc32c.crc32c(bytes(data)))
    other = Fingerprint()
    other.add_batch(records_to_batch(changed)[0])
    assert other.value != whole.value
    moved = Fingerprint()  # the same bytes, one boundary moved between two records
    shifted = list(committed)
    a, b = shifted[3].data + shifted[4].data[:1], shifted[4].data[1:]
    shifted[3] = Record(3, shifted[3].req_id, 0, a, crc32c.crc32c(a))
    shifted[4] = Record(4, shifted[4].req_id, 0, b, crc32c.crc32c(b))
    moved.add_batch(records_to_batch(shifted)[0])
    assert moved.value != whole.value
