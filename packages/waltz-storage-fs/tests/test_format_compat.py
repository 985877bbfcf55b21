"""Storage directories written by earlier formats open forever.

``data/format-v1`` was written by the fs engine of format version 1 (the
original's three session fields; 3 partitions of which 0 and 2 hosted,
partition 0 in four segments). Never regenerate it: it is the proof that a
directory of that format still opens. Opening migrates it to format 2 in place (what
0.1.0 did: the format of cluster feature level 1), keeping the version-1 control file
beside it; raising the feature level to 2 migrates it to format 3.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from fsutil import copy_of

from waltz_api.types import NO_SESSION, SessionInfo
from waltz_conformance.suites.storage import assert_log, make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine

pytestmark = pytest.mark.timeout(60)

V1 = Path(__file__).parent / "data" / "format-v1"
V1_KEY = uuid.UUID("5a1f0c3e-2b7d-4e9a-8c61-0d4f3b2a1e07")


def test_the_offline_tools_read_format_1_without_changing_it() -> None:
    before = {p: p.read_bytes() for p in V1.rglob("*") if p.is_file()}
    dump = tools.read_control_file(V1)
    assert dump.header.version == 1 and dump.header.num_partitions == 3
    assert dump.partitions[0].current is not None
    assert dump.partitions[0].current.session_info == SessionInfo(5, 27, 27, NO_SESSION)
    report = tools.verify(V1)
    assert report.ok, report.problems
    assert [(p.partition_id, p.records) for p in report.partitions if p.hosted] == [(0, 30), (2, 5)]
    assert {p: p.read_bytes() for p in V1.rglob("*") if p.is_file()} == before


async def test_a_format_1_directory_opens_and_is_migrated(tmp_path: Path) -> None:
    location = copy_of(V1, tmp_path)
    engine = await FsStorageEngine.open(
        str(location), cluster_key=V1_KEY, num_partitions=3, options={"segment_size": 600}
    )
    try:
        assert engine.partition_ids() == [0, 2]
        await assert_log(engine, 0, 29)
        await assert_log(engine, 2, 4)
        # the low-water marks' session is unknown: recovery compares the fence, as before
        assert engine.partition(0).session_info() == SessionInfo(5, 27, 27, NO_SESSION)
        assert engine.partition(2).session_info() == SessionInfo(2, 4, 3, NO_SESSION)
        await engine.partition(0).append([make_record(30)])
        await engine.partition(2).set_session_info(SessionInfo(3, 4, 4, 3))
    finally:
        await engine.close()
    assert tools.read_control_file(location).header.version == 2
    backup = location / (fmt.CONTROL_FILE_NAME + ".v1")
    assert backup.read_bytes() == (V1 / fmt.CONTROL_FILE_NAME).read_bytes()
    engine = await FsStorageEngine.open(str(location), cluster_key=V1_KEY, num_partitions=3)
    try:
        assert engine.feature_level == 1
        await assert_log(engine, 0, 30)
        assert engine.partition(2).session_info() == SessionInfo(3, 4, 4, 3)
        assert engine.partition(0).session_info() == SessionInfo(5, 27, 27, NO_SESSION)
        await engine.raise_feature_level(2)
        assert engine.feature_level == 2
    finally:
        await engine.close()
    assert tools.read_control_file(location).header.version == 3
    assert tools.verify(location).ok
    # migrated with the end of the log it held when the level was raised
    dump = tools.read_control_file(location)
    hosted = [p.current for p in dump.partitions if p.current and p.current.assigned]
    assert [s.acked_end for s in hosted] == [31, 5]


async def test_a_newer_format_is_refused_unchanged(tmp_path: Path) -> None:
    location = copy_of(V1, tmp_path)
    ctl = location / fmt.CONTROL_FILE_NAME
    raw = bytearray(ctl.read_bytes())
    header = fmt.decode_control_header(bytes(raw[: fmt.HEADER_SIZE]))
    assert header is not None
    newer = fmt.ControlHeader(99, header.creation_time_ms, header.cluster_key, 3)
    raw[: fmt.HEADER_SIZE] = fmt.encode_control_header(newer)
    ctl.write_bytes(bytes(raw))
    from waltz_api.errors import CorruptionError

    with pytest.raises(CorruptionError, match="format version 99"):
        await FsStorageEngine.open(str(location))
    assert ctl.read_bytes() == bytes(raw)
