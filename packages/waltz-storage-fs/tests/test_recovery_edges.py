"""Start-up recovery at the edges no other test reached (found by mutation testing,
docs/simulation.md "Mutation score"): a record whose data holds another record's bytes,
a next segment that holds other bytes for the same ids (never deleted), an interrupted
drop of an archived prefix above a damaged segment, an index rebuilt in more than one
piece, and what the quarantine's README says about the damage."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import cast

import pytest
from test_recovery import KEY, Store, flip, set_acked_end, store  # noqa: F401 (the fixture)

from waltz_api.types import LOST_SESSION, NO_SESSION
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.files import Files
from waltz_storage_fs.recovery import Segment, close_segment

pytestmark = pytest.mark.timeout(120)


def fake_of(t: int) -> bytes:
    """An intact record ``t`` other than the one written: what a record's data may hold
    (a log of logs), never a place to resume after damage."""
    return fmt.encode_record(make_record(t, 2, data=b"fake"))


@pytest.mark.parametrize("where", ["data", "head"])
async def test_a_record_holding_another_records_bytes_is_no_place_to_resume(
    store: Store,  # noqa: F811
    where: str,
) -> None:
    """Damage in a record whose data holds an intact image of the next record: recovery
    resumes at the real next record (after the damaged one's own end when only its data
    is damaged, at its index entry when its head is), not at the image inside it."""
    engine = await store.open()
    part = await engine.add_partition(2)
    written = [make_record(t, 2, data=b"x" + fake_of(t + 1)) for t in range(30)]
    for t in range(30):
        await part.append([written[t]])
    await store.close()
    firsts = tools.segment_firsts(store.pdir(2))
    victim = firsts[1] + 1
    assert firsts[0] == 0 and victim + 1 < firsts[2]  # a middle segment, not at its end
    path, start, _ = tools.find_record(store.directory, 2, victim)
    if where == "data":
        flip(path, start + fmt.RECORD_HEAD.size)  # its head intact: resume at its end
        path.with_suffix(fmt.INDEX_SUFFIX).unlink()  # rescanned at start-up
        engine = await store.open()
    else:
        flip(path, start + 5)  # its id: resume at the next entry of the (whole) index
        engine = await store.open(verify_on_open=1)
    part = engine.partition(2)
    assert part.missing_ranges() == [(victim, victim)]
    assert part.max_transaction_id() == 29
    for t in range(30):
        if t != victim:
            assert await part.read_record(t) == written[t]


async def test_a_next_segment_with_other_bytes_for_the_same_ids_is_never_deleted(
    store: Store,  # noqa: F811
) -> None:
    """A segment file starting inside a damaged segment's records, holding other bytes
    for those ids (not the copy an interrupted split leaves): recovery keeps it and
    moves the damaged segment's overlapping bytes to the quarantine."""
    firsts = tools.segment_firsts(store.pdir())
    victim = firsts[2] - 2
    j = victim + 1  # the damaged segment's last record
    path, start, _ = tools.find_record(store.directory, 0, victim)
    flip(path, start + fmt.RECORD_HEAD.size + 1)
    path.with_suffix(fmt.INDEX_SUFFIX).unlink()
    other = make_record(j, 0, data=b"fork")
    assert len(fmt.encode_record(other)) < len(fmt.encode_record(make_record(j, 0)))
    header = fmt.SegmentHeader(fmt.SEGMENT_FORMAT_VERSION, fmt.now_ms(), KEY, 0, j)
    store.segment(j).write_bytes(fmt.encode_segment_header(header) + fmt.encode_record(other))
    engine = await store.open()
    part = engine.partition(0)
    assert await part.read_record(j) == other
    assert part.missing_ranges() == [(victim, victim)]
    (entry,) = store.quarantined()
    assert entry.files == (f"{path.name}@{start}",)
    saved = (entry.folder / entry.files[0]).read_bytes()
    assert saved[-len(fmt.encode_record(make_record(j, 0))) :] == fmt.encode_record(
        make_record(j, 0)
    )


async def test_the_quarantine_readme_names_the_missing_transactions(
    store: Store,  # noqa: F811
) -> None:
    firsts = tools.segment_firsts(store.pdir())
    victim = firsts[2] - 1  # the last record of a middle segment: nothing to resume at
    path, start, _ = tools.find_record(store.directory, 0, victim)
    flip(path, start + fmt.RECORD_HEAD.size + 1)
    path.with_suffix(fmt.INDEX_SUFFIX).unlink()
    engine = await store.open()
    assert engine.partition(0).missing_ranges() == [(victim, victim)]
    (entry,) = store.quarantined()
    assert f"after transaction {victim - 1}, fail their checksums" in entry.readme
    assert (
        f"transactions from {victim} up to the next segment ({victim + 1}) are missing"
        in entry.readme
    )


async def test_an_interrupted_prefix_drop_deletes_the_dropped_segments_unread(
    store: Store,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A crash after ``drop_prefix`` recorded the log's new start, before it deleted the
    segments below: the next recovery deletes them, damaged or not, and reads nothing
    of them (no quarantine folder, no hole)."""
    firsts = tools.segment_firsts(store.pdir())
    kept_from = firsts[3]
    below = store.segment(firsts[2])  # the segment ending right at the new start
    path, start, _ = tools.find_record(store.directory, 0, kept_from - 1)
    assert path == below
    saved = {
        p.name: p.read_bytes()
        for p in store.pdir().iterdir()
        if (parsed := fmt.parse_segment_file_name(p.name)) is not None and parsed[0] < kept_from
    }
    engine = await store.open()
    await engine.partition(0).drop_prefix(kept_from - 1)
    assert engine.partition(0).log_start() == kept_from
    await store.close()
    for name, raw in saved.items():
        (store.pdir() / name).write_bytes(raw)
    flip(below, start + fmt.RECORD_HEAD.size + 1)
    below.with_suffix(fmt.INDEX_SUFFIX).unlink()
    caplog.set_level(logging.WARNING, logger="waltz_storage_fs.recovery")
    engine = await store.open()
    # the first segment kept starts at the log's start: nothing below it is kept
    assert "below the log's start" not in caplog.text
    part = engine.partition(0)
    assert part.log_start() == kept_from
    assert part.missing_ranges() == []
    assert store.quarantined() == []
    assert tools.segment_firsts(store.pdir()) == firsts[3:]
    assert await part.read_records(kept_from, 100, 1 << 20) == [
        make_record(t, 0) for t in range(kept_from, 40)
    ]


async def test_an_index_rebuilt_in_pieces_after_a_checkpoint(
    store: Store,  # noqa: F811
) -> None:
    """A segment with more than 65536 records past its index's last checkpoint: the
    rebuilt index is written in pieces, each at its own place."""
    engine = await store.open()
    await engine.add_partition(2)
    await store.close()
    for p in list(store.pdir(2).iterdir()):
        p.unlink()
    count = 65536 + 100
    header = fmt.encode_segment_header(
        fmt.SegmentHeader(fmt.SEGMENT_FORMAT_VERSION, fmt.now_ms(), KEY, 2, 0)
    )
    raw = [fmt.encode_record(make_record(t, 2, data=b"")) for t in range(count)]
    offsets = []
    position = fmt.HEADER_SIZE
    for r in raw:
        offsets.append(position)
        position += len(r)
    store.segment(0, pid=2).write_bytes(header + b"".join(raw))
    index = store.segment(0, pid=2).with_suffix(fmt.INDEX_SUFFIX)
    # flushed up to a checkpoint (entries 0..7 of an interval of 4), then the power went
    index.write_bytes(header + fmt.struct_pack_offsets(offsets[:8]))
    engine = await store.open(segment_size=1 << 30)
    part = engine.partition(2)
    assert part.max_transaction_id() == count - 1
    assert index.read_bytes() == header + fmt.struct_pack_offsets(offsets)
    for t in (0, 7, 8, 65543, 65544, count - 1):
        assert await part.read_record(t) == make_record(t, 2, data=b"")


async def test_a_damaged_log_start_of_an_empty_partition_starts_the_log_at_0(
    store: Store,  # noqa: F811
) -> None:
    engine = await store.open()
    await engine.add_partition(2)
    await store.close()
    for p in list(store.pdir(2).iterdir()):
        p.unlink()
    (store.pdir(2) / fmt.LOG_START_FILE_NAME).write_bytes(b"\xff" * fmt.LOG_START_SIZE)
    engine = await store.open()
    part = engine.partition(2)
    (entry,) = store.quarantined()
    assert "damaged-log-start" in entry.folder.name
    await part.append([make_record(0, 2)])
    assert part.log_start() == 0
    assert part.missing_ranges() == []
    assert await part.read_record(0) == make_record(0, 2)


def test_closing_a_segment_twice_closes_its_files_once(tmp_path: Path) -> None:
    closed: list[int] = []

    class Recorder:
        def close(self, fd: int) -> None:
            closed.append(fd)

    seg = Segment(tmp_path, 0, 10, 11)
    close_segment(cast(Files, Recorder()), seg)
    close_segment(cast(Files, Recorder()), seg)  # idempotent: no fd closed twice
    assert closed == [10, 11]
    assert (seg.data_fd, seg.index_fd) == (-1, -1)


async def test_a_torn_write_ending_in_a_partial_sector_of_zeros_is_cut(
    store: Store,  # noqa: F811
) -> None:
    """The last write's file size reached the disk, its last (partial) sector did not:
    a record's head then zeros to the end of the file, no whole sector of zeros. Above
    the acknowledged end that is a torn write: cut, nothing LOST, nothing kept aside."""
    engine = await store.open(segment_size=1 << 20)
    part = await engine.add_partition(2)
    written = [make_record(t, 2, data=bytes([65 + t % 26]) * 100) for t in range(30)]
    await part.append(written[:20])
    await part.append(written[20:])
    await store.close()
    # a record whose head ends before the next sector boundary and whose end is past it
    for torn in range(20, 30):
        path, start, end = tools.find_record(store.directory, 2, torn)
        boundary = -(-(start + fmt.RECORD_HEAD.size) // 512) * 512
        if boundary < end:
            break
    else:
        raise AssertionError("no record crosses a sector boundary")
    size = boundary + 100  # the file's last sector, partial, was never written
    raw = path.read_bytes()[:boundary] + bytes(100)
    assert len(raw) == size and end <= size
    path.write_bytes(raw)
    set_acked_end(store.directory, 2, torn)
    os.truncate(path.with_suffix(fmt.INDEX_SUFFIX), fmt.HEADER_SIZE + 20 * 8)
    engine = await store.open(segment_size=1 << 20)
    part = engine.partition(2)
    assert part.max_transaction_id() == torn - 1
    assert part.session_info().low_water_mark_session_id == NO_SESSION
    assert store.quarantined() == []
    assert await part.read_records(0, 100) == written[:torn]


async def test_a_lost_tail_is_recorded_once(
    store: Store,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A damaged tail below the acknowledged end is found twice (the damage, then the
    end below the acknowledged one): LOST is written to the control file once."""
    path, start, _ = tools.find_record(store.directory, 0, 39)
    flip(path, start + fmt.RECORD_HEAD.size + 2)
    caplog.set_level(logging.WARNING, logger="waltz_storage_fs")
    engine = await store.open()
    part = engine.partition(0)
    assert part.session_info().low_water_mark_session_id == LOST_SESSION
    assert caplog.text.count("records it acknowledged may be lost") == 1
