"""The offline tools on a real storage directory made by the engine."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from waltz_api.errors import CorruptionError, StorageError
from waltz_api.types import SessionInfo
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine

KEY = uuid.UUID("7d6c5b4a-3f2e-4d1c-8b0a-998877665544")


def make_storage(directory: Path) -> None:
    async def build() -> None:
        engine = await FsStorageEngine.open(
            str(directory), cluster_key=KEY, num_partitions=3, options={"segment_size": 500}
        )
        try:
            for pid in (0, 2):
                part = await engine.add_partition(pid)
                for first in range(0, 24, 4):
                    await part.append([make_record(t, pid) for t in range(first, first + 4)])
            await engine.partition(2).set_session_info(SessionInfo(4, 20, 17))
        finally:
            await engine.close()

    asyncio.run(build())


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    directory = tmp_path / "data"
    make_storage(directory)
    return directory


def test_verify_a_healthy_storage(storage: Path) -> None:
    report = tools.verify(storage)
    assert report.ok, report.problems
    hosted = {p.partition_id: p for p in report.partitions if p.hosted}
    assert sorted(hosted) == [0, 2]
    assert hosted[2].records == 24
    assert hosted[2].max_transaction_id == 23
    assert hosted[2].segments > 1
    assert "session=4 low_water_mark=20" in hosted[2].session_info
    lines = list(tools.format_verify(report))
    assert lines[-1] == "OK"


def test_verify_finds_a_flipped_bit_and_a_torn_struct(storage: Path) -> None:
    path, start, _end = tools.find_record(storage, 0, 10)
    with path.open("r+b") as f:
        f.seek(start + 45)
        byte = f.read(1)[0]
        f.seek(start + 45)
        f.write(bytes([byte ^ 0x10]))
    ctl = storage / fmt.CONTROL_FILE_NAME
    with ctl.open("r+b") as f:
        f.seek(fmt.info_struct_offset(2, 0) + 3)
        f.write(b"\xee")
    report = tools.verify(storage)
    assert not report.ok
    text = "\n".join(report.problems)
    assert "partition 0" in text and "bad bytes after transaction 9" in text
    assert "partition 2: one partition info struct is invalid" in text
    assert list(tools.format_verify(report))[-1].endswith("problem(s) found")


def test_dump_segment(storage: Path) -> None:
    seg = storage / "0" / fmt.segment_file_name(0, fmt.SEGMENT_SUFFIX)
    lines = list(tools.format_segment(seg, show_data=True))
    assert f"cluster_key={KEY}" in lines[1]
    assert "partition=0 first_transaction_id=0" in lines[1]
    assert lines[2].startswith("0 offset=128 ")
    assert "data=" + make_record(0).data.hex() in lines[2]
    assert lines[-1].startswith("records: ")
    limited = list(tools.format_segment(seg, limit=1))
    assert sum(1 for line in limited if "offset=" in line) == 1
    with pytest.raises(StorageError, match="no such segment"):
        list(tools.format_segment(storage / "nope.seg"))


def test_dump_segment_reports_a_torn_tail(storage: Path) -> None:
    seg = storage / "0" / fmt.segment_file_name(0, fmt.SEGMENT_SUFFIX)
    with seg.open("ab") as f:
        f.write(b"\x00" * 17)
    lines = list(tools.format_segment(seg))
    assert lines[-1].startswith("scan stopped: ")


def test_dump_control_file(storage: Path) -> None:
    for path in (storage, storage / fmt.CONTROL_FILE_NAME):
        dump = tools.read_control_file(path)
        assert dump.header.cluster_key == KEY
        assert dump.header.num_partitions == 3
        assert [p.current.assigned for p in dump.partitions if p.current] == [True, False, True]
        assert dump.partitions[2].current is not None
        assert dump.partitions[2].current.session_info == SessionInfo(4, 20, 17)
    lines = list(tools.format_control_file(tools.read_control_file(storage)))
    assert f"cluster key: {KEY}" in lines
    assert "partition 1: not hosted" in lines
    assert any("session=4 low_water_mark=20 local_low_water_mark=17" in line for line in lines)


def test_tools_refuse_what_is_not_storage(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no such control file"):
        tools.read_control_file(tmp_path)
    (tmp_path / fmt.CONTROL_FILE_NAME).write_bytes(b"\x00" * 200)
    with pytest.raises(CorruptionError, match="header"):
        tools.verify(tmp_path)
