"""Scrubbing an open engine: damage that only a read would find (bytes of a sealed segment
changed under a running engine, whose start-up recovery trusted the flushed index) is
found by ``scrub``, moved aside as start-up recovery would, and becomes a missing range
that reads name and ``repair`` fills; intact records are never lost, and a call reads
no more than its budget."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_api.contracts.storage import ScrubProgress
from waltz_api.errors import CorruptionError
from waltz_conformance.suites.storage import assert_log, make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine, FsStoragePartition

pytestmark = pytest.mark.timeout(120)

KEY = uuid.UUID("0f8e3c52-6a4b-4f0e-9d2c-7b1a5e3f9c11")
OPTIONS = {"segment_size": 600, "index_checkpoint_interval": 4}
LAST = 39


async def open_engine(directory: Path) -> FsStorageEngine:
    return await FsStorageEngine.open(
        str(directory), cluster_key=KEY, num_partitions=2, options=OPTIONS
    )


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[FsStorageEngine]:
    engine = await open_engine(tmp_path / "store")
    part = await engine.add_partition(0)
    for first in range(0, LAST + 1, 2):
        await part.append([make_record(t) for t in (first, first + 1)])
    try:
        yield engine
    finally:
        await engine.close()


def pdir(engine: FsStorageEngine) -> Path:
    return engine.directory / "0"


def flip(engine: FsStorageEngine, txid: int, where: int = fmt.RECORD_HEAD.size + 1) -> Path:
    """Flip a bit of record ``txid`` on disk, under the running engine (``where``: the
    offset in the record; by default a byte of its data)."""
    path, start, _ = tools.find_record(engine.directory, 0, txid)
    with path.open("r+b") as f:
        f.seek(start + where)
        byte = f.read(1)[0]
        f.seek(start + where)
        f.write(bytes([byte ^ 0x20]))
    return path


async def full_pass(part: FsStoragePartition, max_bytes: int = 1 << 20) -> list[ScrubProgress]:
    calls = []
    start: int | None = 0
    while start is not None:
        progress = await part.scrub(start, max_bytes)
        calls.append(progress)
        assert len(calls) < 1000, "the pass does not end"
        start = progress.next_start
    return calls


def sealed_records(part: FsStoragePartition) -> int:
    return sum(e.last - e.first + 1 for e in part.local_extents()[:-1])


async def test_a_pass_over_an_intact_log_reads_every_sealed_record(
    engine: FsStorageEngine,
) -> None:
    part = engine.partition(0)
    calls = await full_pass(part)
    assert sum(c.records for c in calls) == sealed_records(part) > 20
    assert all(not c.damaged for c in calls)
    sealed_bytes = sum(e.size - fmt.HEADER_SIZE for e in part.local_extents()[:-1])
    assert sum(c.bytes_read for c in calls) == sealed_bytes
    assert part.missing_ranges() == []
    assert tools.list_quarantine(engine.directory) == []
    await assert_log(engine, 0, LAST)


async def test_a_flipped_byte_in_a_sealed_segment_becomes_a_missing_range(
    engine: FsStorageEngine,
) -> None:
    part = engine.partition(0)
    firsts = tools.segment_firsts(pdir(engine))
    assert len(firsts) >= 4
    victim = firsts[1] + 1  # a record in the middle of a sealed segment
    path = flip(engine, victim)
    # the running engine serves it as corrupt, but does not know it yet
    with pytest.raises(CorruptionError, match=f"transaction {victim} is corrupt"):
        await part.read_record(victim)
    assert part.missing_ranges() == []

    calls = await full_pass(part)
    assert [c.damaged for c in calls if c.damaged] == [((victim, victim),)]
    assert part.missing_ranges() == [(victim, victim)]
    assert part.max_transaction_id() == LAST
    with pytest.raises(CorruptionError, match=f"transaction {victim} is missing"):
        await part.read_record(victim)
    for t in range(LAST + 1):
        if t != victim:
            assert await part.read_record(t) == make_record(t)
    # the intact records after it moved to a segment of their own; the damaged bytes
    # are in the quarantine, with a README saying what happened
    assert tools.segment_firsts(pdir(engine)) == sorted([*firsts, victim + 1])
    (entry,) = tools.list_quarantine(engine.directory)
    assert entry.files[0].startswith(path.name + "@")
    assert f"a scrub found transactions {victim}..{victim}" in entry.readme
    saved = next(entry.folder.glob(f"{path.name}@*")).read_bytes()
    assert len(saved) == fmt.RECORD_OVERHEAD + len(make_record(victim).data)
    # a second pass finds nothing new
    assert all(not c.damaged for c in await full_pass(part))

    # the hole is durable: a restart finds it (and nothing else)
    directory = engine.directory
    await engine.close()
    engine = await open_engine(directory)
    try:
        part = engine.partition(0)
        assert part.missing_ranges() == [(victim, victim)]
        assert len(tools.list_quarantine(directory)) == 1
        await part.repair([make_record(victim)])
        await assert_log(engine, 0, LAST)
        assert all(not c.damaged for c in await full_pass(part))
    finally:
        await engine.close()


async def test_repair_fills_the_hole_while_the_engine_runs(engine: FsStorageEngine) -> None:
    part = engine.partition(0)
    firsts = tools.segment_firsts(pdir(engine))
    victim = firsts[2]  # the first record of a segment
    flip(engine, victim, where=3)  # in its id
    calls = await full_pass(part)
    assert [c.damaged for c in calls if c.damaged] == [((victim, victim),)]
    await part.repair([make_record(victim)])
    assert part.missing_ranges() == []
    await assert_log(engine, 0, LAST)
    await part.append([make_record(LAST + 1)])
    await assert_log(engine, 0, LAST + 1)


async def test_the_last_record_of_a_sealed_segment_and_several_in_one_pass(
    engine: FsStorageEngine,
) -> None:
    part = engine.partition(0)
    extents = part.local_extents()
    first_victim = extents[0].last  # no intact record after it in its segment
    second_victims = (extents[2].first + 1, extents[2].first + 2)  # two in a row
    for victim in (first_victim, *second_victims):
        flip(engine, victim)
    calls = await full_pass(part, max_bytes=100)
    found = [r for c in calls for r in c.damaged]
    assert found == [(first_victim, first_victim), second_victims]
    assert part.missing_ranges() == [(first_victim, first_victim), second_victims]
    for t in range(LAST + 1):
        if t in (first_victim, *range(second_victims[0], second_victims[1] + 1)):
            with pytest.raises(CorruptionError, match=f"transaction {t} is missing"):
                await part.read_record(t)
        else:
            assert await part.read_record(t) == make_record(t)
    assert len(tools.list_quarantine(engine.directory)) == 2


async def test_the_segment_being_appended_to_is_left_to_reads(engine: FsStorageEngine) -> None:
    part = engine.partition(0)
    victim = part.local_extents()[-1].first
    flip(engine, victim)
    calls = await full_pass(part)
    assert all(not c.damaged for c in calls)
    assert part.missing_ranges() == []
    with pytest.raises(CorruptionError, match=f"transaction {victim} is corrupt"):
        await part.read_record(victim)


async def test_a_call_reads_no_more_than_its_budget(engine: FsStorageEngine) -> None:
    part = engine.partition(0)
    record = max(fmt.RECORD_OVERHEAD + len(make_record(t).data) for t in range(LAST + 1))
    for budget in (1, record, 3 * record + 5, 1000):
        calls = await full_pass(part, max_bytes=budget)
        assert sum(c.records for c in calls) == sealed_records(part)
        for call in calls[:-1]:
            assert call.records >= 1  # always at least one record
            assert call.bytes_read <= max(budget, record)
        assert calls[-1].next_start is None


async def test_an_interrupted_scrub_loses_nothing(
    engine: FsStorageEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the intact records were copied and before the damaged segment was
    cut: the next start keeps the damaged segment whole (the copy is moved aside), no
    record is lost, and the next scrub finds the damage again."""
    part = engine.partition(0)
    victim = tools.segment_firsts(pdir(engine))[1] + 1
    flip(engine, victim)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError(5, "simulated crash before the cut")

    monkeypatch.setattr(engine.files, "ftruncate", crash)
    with pytest.raises(Exception, match="I/O error"):
        await full_pass(part)
    monkeypatch.undo()
    directory = engine.directory
    await engine.close()
    engine = await open_engine(directory)
    try:
        part = engine.partition(0)
        assert part.missing_ranges() == []
        for t in range(LAST + 1):
            if t == victim:
                with pytest.raises(CorruptionError):
                    await part.read_record(t)
            else:
                assert await part.read_record(t) == make_record(t)
        calls = await full_pass(part)
        assert [c.damaged for c in calls if c.damaged] == [((victim, victim),)]
        await part.repair([make_record(victim)])
        await assert_log(engine, 0, LAST)
    finally:
        await engine.close()


async def test_a_damaged_index_entry_is_damage_at_its_record(engine: FsStorageEngine) -> None:
    """An index entry pointing elsewhere makes its record unreadable (and the one before
    it, whose end it is): that record becomes the missing range (its bytes moved aside,
    copied again from a peer); the one before it reads again."""
    part = engine.partition(0)
    extent = part.local_extents()[1]
    victim = extent.first + 1
    index = pdir(engine) / fmt.segment_file_name(extent.first, fmt.INDEX_SUFFIX)
    with index.open("r+b") as f:
        f.seek(fmt.HEADER_SIZE + (victim - extent.first) * fmt.INDEX_ENTRY_SIZE + 6)
        f.write(b"\x7f")
    with pytest.raises(CorruptionError):
        await part.read_record(victim)
    calls = await full_pass(part)
    assert [c.damaged for c in calls if c.damaged] == [((victim, victim),)]
    for t in range(LAST + 1):
        if t != victim:
            assert await part.read_record(t) == make_record(t)
    await part.repair([make_record(victim)])
    await assert_log(engine, 0, LAST)


async def test_a_hole_at_a_segments_first_record_after_a_repaired_one(
    engine: FsStorageEngine,
) -> None:
    """Damage at X (a split: the segment is cut before X, X+1.. move to a new segment),
    X repaired (written where the cut was, the segment now ends at X+1 with room left),
    then damage at X+1, the new segment's first record (it keeps no record): the repair of
    X+1 must land where reads look for it, and survive a restart."""
    part = engine.partition(0)
    victim = part.local_extents()[1].first + 1
    flip(engine, victim)
    calls = await full_pass(part)
    assert [c.damaged for c in calls if c.damaged] == [((victim, victim),)]
    await part.repair([make_record(victim)])
    flip(engine, victim + 1)
    calls = await full_pass(part)
    assert [c.damaged for c in calls if c.damaged] == [((victim + 1, victim + 1),)]
    await part.repair([make_record(victim + 1)])
    await assert_log(engine, 0, LAST)
    for t in range(LAST + 1):
        assert await part.read_record(t) == make_record(t)
    directory = engine.directory
    await engine.close()
    engine = await open_engine(directory)
    try:
        assert engine.partition(0).missing_ranges() == []
        await assert_log(engine, 0, LAST)
    finally:
        await engine.close()
