"""A partition directory that deleted an archived prefix (tiered storage,
docs/archive.md) opens forever.

``data/log-start-v2`` was written by the fs engine of format version 2: one
partition of 40 records in segments of 600 bytes, whose prefix through id 20
was dropped (``drop_prefix(20)``: its ``log-start`` file, and the whole segments
below it deleted). Never regenerate it: it is the proof that such a directory
still opens, with the same start, and that the deleted prefix is not taken for
a hole. (It was written by ``python test_format_log_start.py DIR``.)
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pytest
from fsutil import copy_of

from waltz_api.errors import RecordsArchivedError
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).parent / "data" / "log-start-v2"
KEY = uuid.UUID("0c6e2f4a-9b1d-4f3e-8a7c-5d2e1f0b3a94")
OPTIONS = {"segment_size": 600}
RECORDS = 40
DROPPED_THROUGH = 20


async def test_a_directory_with_a_dropped_prefix_opens_at_its_log_start(tmp_path: Path) -> None:
    assert (FIXTURE / "0" / fmt.LOG_START_FILE_NAME).exists()
    assert tools.read_control_file(FIXTURE).header.version == 2
    location = copy_of(FIXTURE, tmp_path)
    engine = await FsStorageEngine.open(
        str(location), cluster_key=KEY, num_partitions=1, options=OPTIONS
    )
    try:
        part = engine.partition(0)
        start = part.log_start()
        # whole segments only: the start is at or below the asked id + 1, above 0
        assert 0 < start <= DROPPED_THROUGH + 1
        assert part.max_transaction_id() == RECORDS - 1
        assert part.missing_ranges() == []  # the deleted prefix is no hole
        extents = part.local_extents()
        assert extents[0].first == start and extents[-1].last == RECORDS - 1
        kept = await part.read_records(start, RECORDS, 1 << 20)
        assert kept == [make_record(t, 0, size=30 + t) for t in range(start, RECORDS)]
        with pytest.raises(RecordsArchivedError):
            await part.read_records(start - 1, 1, 1 << 20)
        await part.append([make_record(RECORDS, 0, size=30 + RECORDS)])
    finally:
        await engine.close()
    engine = await FsStorageEngine.open(str(location), cluster_key=KEY, num_partitions=1)
    try:
        assert engine.partition(0).log_start() == start
        assert engine.partition(0).max_transaction_id() == RECORDS
    finally:
        await engine.close()


async def _write(location: Path) -> None:
    engine = await FsStorageEngine.open(
        str(location), cluster_key=KEY, num_partitions=1, options=OPTIONS
    )
    try:
        await engine.add_partition(0)
        part = engine.partition(0)
        for t in range(RECORDS):
            await part.append([make_record(t, 0, size=30 + t)])
        await part.drop_prefix(DROPPED_THROUGH)
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(_write(Path(sys.argv[1])))
