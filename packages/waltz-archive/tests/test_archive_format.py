"""An archive written by format 1 (ranges and manifests) reads forever
(docs/compatibility.md).

``data/archive-v1`` was written by the archiver of range format 1 and manifest format
1: partition 0, ids 0..149 in three ranges, each range's manifest beside the others.
Never regenerate it: it is the proof that an archive of that format still reads, with
the same rows, digests and names. A change of the format fails here and needs a new
format number, a fixture of its own, and this one kept as a read test. (It was written
by ``python test_archive_format.py DIR``.)
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from waltz_api.types import Record
from waltz_archive.archiver import ArchivePolicy, PartitionArchiver
from waltz_archive.manifest import MANIFEST_FORMAT
from waltz_archive.objects import OBJECT_FORMAT, WriteOptions
from waltz_archive.reader import ArchiveReader
from waltz_archive.records import SCHEMA
from waltz_archive.store import ArchiveStore
from waltz_archive.tools import best_manifest, manifest_names, verify_manifest
from waltz_conformance.records import make_record

pytestmark = pytest.mark.timeout(60)

V1 = Path(__file__).parent / "data" / "archive-v1"
RECORDS = 150


def expected() -> list[Record]:
    return [make_record(t, 0, size=20 + t % 50) for t in range(RECORDS)]


def test_an_archive_of_format_1_reads_and_verifies() -> None:
    assert (OBJECT_FORMAT, MANIFEST_FORMAT) == (1, 1), (
        "the archive's format number changed: add a fixture of the new format and keep "
        "this one as a read test (docs/compatibility.md)"
    )
    store = ArchiveStore(str(V1))
    names = manifest_names(store, 0)
    assert [n.mark for n in names] == [149, 99, 49]
    found = best_manifest(store, 0)
    assert found is not None
    manifest, name, passed_over = found
    assert name == names[0].name and passed_over == []
    assert [(r.first, r.last) for r in manifest.ranges] == [(0, 49), (50, 99), (100, 149)]
    verification = verify_manifest(store, manifest)
    assert verification.ok and verification.records == RECORDS
    reader = ArchiveReader(store, 0)
    reader.set_manifest(manifest)
    got: list[Record] = []
    while len(got) < RECORDS:
        chunk = reader.read(len(got), 1000, 1 << 20)
        assert chunk, f"nothing read at {len(got)}"
        got.extend(chunk)
    assert got == expected()
    for archived in manifest.ranges:
        path = V1 / "partition-0" / archived.name
        assert pq.read_schema(path).remove_metadata() == SCHEMA
        footer = pq.read_metadata(path).metadata or {}
        assert (
            footer[b"waltz.format"] == b"1"
            and footer[b"waltz.digest"] == str(archived.digest).encode()
        )


class _Log:
    """The committed log as the archiver sees it; ``high`` moves up by 50."""

    def __init__(self) -> None:
        self.records = [make_record(t, 0, size=20 + t % 50) for t in range(RECORDS + 1)]
        self.high = -1

    def committed(self) -> int:
        return self.high

    async def read(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        return self.records[start : min(start + max_records, self.high + 1)]

    async def local_log(self) -> None:
        return None

    async def prune(self, through: int) -> None:
        pass


async def _write(root: Path) -> None:
    from waltz_conformance.reference.coordination import (
        MemoryCoordination,
        MemoryCoordinationService,
    )
    from waltz_server.cluster_admin import ClusterAdmin

    coordination = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await coordination.start()
    try:
        log = _Log()
        archiver = PartitionArchiver(
            partition_id=0,
            coordination=coordination,
            store=ArchiveStore(str(root)),
            source=log,
            advance=ClusterAdmin(coordination).advance_archive_mark,
            policy=ArchivePolicy(
                min_range_bytes=1,
                max_range_bytes=1 << 20,
                max_local_bytes=0,
                max_local_age=0,
                keep_local_transactions=1,
                write=WriteOptions(row_group_bytes=1024),
            ),
            rng=random.Random(1),
            cluster_key=uuid.UUID(int=1),
        )
        for high in (50, 100, 150):  # ranges 0..49, 50..99, 100..149
            log.high = high
            assert await archiver.round() is not None
    finally:
        await coordination.close()


if __name__ == "__main__":
    asyncio.run(_write(Path(sys.argv[1])))
