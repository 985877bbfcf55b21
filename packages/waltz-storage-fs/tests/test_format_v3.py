"""A directory of control file format 3 (feature level 2) opens, whole, forever.

``data/format-v3`` was written by the fs engine of format 3 (the one that keeps each
partition's acknowledged end), before issue 31's storage round: three partitions of
which two are hosted, appends of several records spread over segment rolls (segments of
600 bytes) and index checkpoints (every 4 records) on both at once, a session info
update, a truncation of partition 0 and appends after it, partition 2 marked
unavailable. It is the input of the upgrade from format 3 to the format that follows
(a data directory written by the code before it); never regenerate it. (It was written
by ``python test_format_v3.py DIR``.)
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pytest
from fsutil import copy_of

from waltz_api.types import Record, SessionInfo
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).parent / "data" / "format-v3"
KEY = uuid.UUID("3e1f0a2b-7c4d-4e5f-9a8b-6c7d8e9f0a1b")
OPTIONS = {"segment_size": 600, "index_checkpoint_interval": 4}
SESSION = SessionInfo(5, 12, 12, 5)
TRUNCATED_TO = 30
"""Partition 0 kept ids below this, then had ids 30..34 appended again (epoch 2)."""


def expected(partition_id: int) -> list[Record]:
    if partition_id == 0:
        first = [make_record(t, 0, size=20 + 3 * t) for t in range(TRUNCATED_TO)]
        return first + [make_record(t, 0, size=50 + t) for t in range(TRUNCATED_TO, 35)]
    return [make_record(t, 2, size=20 + 3 * t) for t in range(24)]


async def test_a_format_3_directory_opens_with_its_records_ends_and_infos(
    tmp_path: Path,
) -> None:
    dump = tools.read_control_file(FIXTURE)
    assert dump.header.version == 3 and dump.header.num_partitions == 3
    ends = {p.partition_id: p.current.acked_end for p in dump.partitions if p.current}
    assert ends[0] == 35 and ends[2] == 24
    location = copy_of(FIXTURE, tmp_path)
    report = tools.verify(location)
    assert report.ok, report.problems
    engine = await FsStorageEngine.open(
        str(location), cluster_key=KEY, num_partitions=3, options=OPTIONS
    )
    try:
        assert engine.feature_level == 2
        assert engine.partition_ids() == [0, 2]
        for pid in (0, 2):
            part = engine.partition(pid)
            assert part.missing_ranges() == []
            assert await part.read_records(0, 100, 1 << 20) == expected(pid)
        assert engine.partition(0).session_info() == SESSION
        assert engine.partition(0).available() and not engine.partition(2).available()
        await engine.partition(0).append([make_record(35, 0, size=90)])
    finally:
        await engine.close()
    engine = await FsStorageEngine.open(str(location))
    try:
        assert engine.partition(0).max_transaction_id() == 35
        assert engine.partition(2).max_transaction_id() == 23
    finally:
        await engine.close()
    assert tools.read_control_file(location).partitions[0].current.acked_end == 36  # type: ignore[union-attr]
    assert fmt.FORMAT_VERSION >= 3


async def _write(location: Path) -> None:
    engine = await FsStorageEngine.open(
        str(location), cluster_key=KEY, num_partitions=3, options=OPTIONS, feature_level=2
    )
    try:
        zero, two = await engine.add_partition(0), await engine.add_partition(2)
        for first in range(0, 36, 3):
            await asyncio.gather(
                zero.append([make_record(t, 0, size=20 + 3 * t) for t in range(first, first + 3)]),
                two.append(
                    [make_record(t, 2, size=20 + 3 * t) for t in range(first, first + 3) if t < 24]
                )
                if first < 24
                else asyncio.sleep(0),
            )
        await zero.set_session_info(SESSION)
        await zero.truncate(TRUNCATED_TO - 1)
        await zero.append([make_record(t, 0, size=50 + t) for t in range(TRUNCATED_TO, 35)])
        await two.set_available(False)
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(_write(Path(sys.argv[1])))
