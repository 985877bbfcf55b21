"""The storage faults of the simulated disk: what reads raise and what a restart's
recovery makes of the damage (as the fs engine does), and the nemesis' rule that a
damaged disk stays impaired until the cluster repaired it."""

from __future__ import annotations

import random
import uuid
from dataclasses import replace

import pytest
from sim_support import idle_process, in_world

from waltz_api.errors import CorruptionError, PartitionClosedError, StorageError
from waltz_api.types import LOST_SESSION, Record, ReqId, SessionInfo
from waltz_api.wire import checksum
from waltz_sim.damage import CHECKSUM, HOLDS, STALE, ZEROS
from waltz_sim.disk import PartitionImage, SimStorageEngine
from waltz_sim.faults import PROFILES
from waltz_sim.storage_faults import lose_writes, misdirect
from waltz_sim.world import SimConfig, SimProcess, World

CLEAN = SessionInfo(3, 5, 5, 3)


def _records(start: int, count: int) -> list[Record]:
    out = []
    for tid in range(start, start + count):
        data = b"r%d" % tid
        out.append(Record(tid, ReqId(1, 1, 0, tid + 1), 0, data, checksum(data)))
    return out


def _image(count: int) -> PartitionImage:
    records = _records(0, count)
    return PartitionImage(
        list(records),
        list(records),
        count,
        count,
        written_info=CLEAN,
        durable_info=CLEAN,
        acked_end=count,
    )


async def _engine(world: World, process: SimProcess) -> SimStorageEngine:
    async def open_it() -> SimStorageEngine:
        engine = await SimStorageEngine.open("disk", cluster_key=uuid.UUID(int=1), num_partitions=1)
        await engine.add_partition(0)
        return engine

    return await world._in(process, open_it())


async def _reopen(world: World, process: SimProcess) -> SimStorageEngine:
    """A restart: the engine opens its disk (the partition is hosted already)."""
    return await world._in(process, SimStorageEngine.open("disk"))


# -- start-up recovery of damaged records --------------------------------------------------------


def test_damaged_records_with_intact_ones_after_them_become_a_missing_range() -> None:
    image = _image(10)
    image.corrupt = {3: CHECKSUM, 4: STALE, 7: f"{HOLDS}9"}
    found = image.recover()
    assert image.missing == [(3, 4), (7, 7)]
    assert len(image.written) == 10 and not image.corrupt
    assert image.written_info == CLEAN  # nothing acknowledged is lost for good
    assert found == [
        "transactions 3..4 damaged: missing until repaired",
        "transactions 7..7 damaged: missing until repaired",
    ]


def test_a_damaged_tail_is_cut_and_marks_the_session_lost() -> None:
    image = _image(10)
    image.corrupt = {8: CHECKSUM, 9: CHECKSUM}
    image.recover()
    assert len(image.written) == 8 and len(image.durable) == 8
    assert image.written_info.low_water_mark_session_id == LOST_SESSION
    assert image.durable_info.low_water_mark_session_id == LOST_SESSION
    assert image.unrepaired


def test_zeros_below_the_acknowledged_end_are_cut_and_say_so() -> None:
    tail = _image(10)
    tail.corrupt = {9: ZEROS}
    tail.recover()
    middle = _image(10)
    middle.corrupt = {2: CHECKSUM, 5: ZEROS}
    middle.recover()
    # a lost write at the end: the log is shorter than its acknowledged end
    assert len(tail.written) == 9
    assert tail.written_info.low_water_mark_session_id == LOST_SESSION
    # in the middle: the fs engine cuts at zeros followed by records too; below the
    # acknowledged end that is a loss of acknowledged records as well
    assert len(middle.written) == 5
    assert middle.written_info.low_water_mark_session_id == LOST_SESSION
    assert middle.missing == [(2, 2)]


def test_recovery_reads_only_after_the_index_checkpoint() -> None:
    image = _image(1500)
    image.corrupt = {10: CHECKSUM, 1200: CHECKSUM}
    image.recover()
    assert image.missing == [(1200, 1200)]
    assert image.corrupt == {10: CHECKSUM}  # below the checkpoint: found on read only
    assert image.intact() == image.written[:10]


# -- reads ---------------------------------------------------------------------------------------


def test_reads_raise_for_a_corrupt_or_misdirected_record_and_a_restart_finds_it() -> None:
    async def scenario(
        world: World,
    ) -> tuple[list[str], int, int, list[str], list[tuple[int, int]]]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)
        await world._in(process, engine.partition(0).append(_records(0, 8)))
        disk = world.disks["disk"]
        found = misdirect(disk, random.Random(1))
        assert found is not None
        part = engine.partition(0)
        errors = []
        for start in (0, 7):
            with pytest.raises(CorruptionError) as raised:
                await world._in(process, part.read_records(start, 8))
            errors.append(str(raised.value))
        victim = min(disk.partitions[0].corrupt)
        before = await world._in(process, part.read_records(0, victim))
        process.crash()
        process.start()
        engine = await _reopen(world, process)
        part = engine.partition(0)
        trace = [e.text for e in world.trace.events if e.kind == "disk"]
        return errors, victim, len(before), trace, part.missing_ranges()

    errors, victim, before, trace, missing = in_world(scenario)
    assert "is not transaction" in errors[0] and "(it holds 7: a misdirected write)" in errors[0]
    assert "transaction 7 is corrupt (its bytes read back as zeros)" in errors[1]
    assert before == victim  # the records before the damaged one read back
    # the victim is a hole to repair, the newest write's place (zeros) is cut silently
    assert victim < 6 and missing == [(victim, victim)]
    assert any("zeros at transaction 7" in line for line in trace)


def test_a_read_error_fails_reads_and_a_restart_leaves_the_partition_closed() -> None:
    async def scenario(world: World) -> tuple[str, str, int]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)
        await world._in(process, engine.partition(0).append(_records(0, 6)))
        image = world.disks["disk"].partitions[0]
        image.unreadable = [(2, 3)]
        with pytest.raises(StorageError) as eio:
            await world._in(process, engine.partition(0).read_records(0, 6))
        process.crash()
        process.start()
        engine = await _reopen(world, process)
        with pytest.raises(PartitionClosedError) as closed:
            engine.partition(0)
        image.unreadable = []  # the fault ends: the disk reads again
        process.crash()
        process.start()
        engine = await _reopen(world, process)
        records = await world._in(process, engine.partition(0).read_records(0, 6))
        return str(eio.value), str(closed.value), len(records)

    eio, closed, readable = in_world(scenario)
    assert "reading transactions 2..3 failed: [Errno 5] Input/output error" in eio
    assert "could not be recovered and stays closed" in closed
    assert readable == 6


# -- the nemesis' rule -----------------------------------------------------------------------------


def _world_with_disks() -> World:
    from waltz_sim.disk import SimDisk
    from waltz_sim.loop import SimLoop

    world = World(SimConfig(), SimLoop())
    for name in ("a", "b"):
        disk = world.disks[name] = SimDisk(world, name, uuid.UUID(int=1), 1)
        disk.partitions[0] = _image(10)
    return world


def test_a_wiped_disk_is_impaired_until_caught_up_and_marked_again() -> None:
    world = _world_with_disks()
    disk = world.disks["a"]
    disk.wipe()
    assert disk.lost_records and disk.unrepaired
    disk.partitions[0] = _image(10)  # caught up, but no session took it back yet
    assert disk.lost_records
    disk.marks_written(0, CLEAN, replace(CLEAN, low_water_mark_session_id=LOST_SESSION))
    assert disk.lost_records
    disk.marks_written(0, CLEAN, SessionInfo(4, 9, 9, 4))  # a SetLowWaterMark of session 4
    assert not disk.lost_records and not disk.unrepaired


def test_a_restored_disk_is_impaired_until_it_holds_what_it_held() -> None:
    world = _world_with_disks()
    disk = world.disks["a"]
    disk.backup(0.0)
    disk.partitions[0].written.extend(_records(10, 5))
    disk.partitions[0].sync()
    disk.restore(disk.backups[0][1])
    assert len(disk.partitions[0].written) == 10
    disk.marks_written(0, CLEAN, SessionInfo(4, 9, 9, 4))
    world.disks["b"].partitions[0] = _image(15)
    assert disk.lost_records  # 10 of the 15 it held
    disk.partitions[0] = _image(15)
    assert not disk.lost_records


def test_lost_writes_are_acknowledged_records() -> None:
    world = _world_with_disks()
    disk = world.disks["a"]
    for seed in range(20):
        disk.partitions[0] = _image(10)
        found = lose_writes(disk, random.Random(seed))
        image = disk.partitions[0]
        assert found is not None and image.corrupt
        assert max(image.corrupt) < 10 and set(image.corrupt.values()) <= {ZEROS, STALE}
    assert disk.must_reach == {0: 10}


def test_the_storage_profile_mixes_storage_faults_with_lag_and_owner_crashes() -> None:
    weights = PROFILES["storage"].weights
    storage = {
        "lost_write",
        "corruption",
        "misdirected_write",
        "read_error",
        "wiped_disk",
        "stale_restore",
        "power_loss",
        "damaged_rejoin",
    }
    assert storage <= set(weights)
    assert {"slow_fsync", "owner_crash", "crash", "pause"} <= set(weights)


def test_zeros_below_the_acknowledged_end_are_lost_records_not_a_torn_write() -> None:
    """A lost write at the end of the log (zeros where acknowledged records were): the
    acknowledged end kept apart from the records tells it from a torn unsynced write."""
    world = _world_with_disks()
    disk = world.disks["a"]
    disk.damaged(0)
    image = disk.partitions[0]
    assert image.acked_end == 10
    image.corrupt = {8: ZEROS, 9: ZEROS}
    found = disk.start_up_recovery()
    assert len(image.written) == 8
    assert image.written_info.low_water_mark_session_id == LOST_SESSION, found
    assert image.acked_end == 8
    assert disk.lost_records


def test_zeros_above_the_acknowledged_end_are_a_torn_write_cut_silently() -> None:
    image = _image(10)
    image.written.extend(_records(10, 2))  # written, never synced: never acknowledged
    image.corrupt = {10: ZEROS, 11: ZEROS}
    image.recover()
    assert len(image.written) == 10 and image.written_info == CLEAN


def test_a_truncation_lowers_the_acknowledged_end_before_it_is_synced() -> None:
    image = _image(10)
    image.truncate_written(5)
    assert image.acked_end == 6
    image.lose_unsynced(random.Random(1))  # the truncation reached the disk, or not
    image.recover()
    assert image.written_info == CLEAN and len(image.written) >= 6


def test_a_damaged_tail_found_at_the_restart_marks_the_partition_lost() -> None:
    world = _world_with_disks()
    disk = world.disks["a"]
    disk.damaged(0)
    disk.partitions[0].corrupt = {9: CHECKSUM}
    disk.start_up_recovery()
    assert disk.partitions[0].written_info.low_water_mark_session_id == LOST_SESSION
    assert disk.lost_records


def test_a_restore_marks_every_restored_partition_lost() -> None:
    """A stale restore is what ``waltz storage restore`` does: the restored replica's
    marks read LOST_SESSION, whatever session the snapshot's marks named."""
    world = _world_with_disks()
    disk = world.disks["a"]
    disk.backup(0.0)
    disk.partitions[0].written.extend(_records(10, 4))
    disk.partitions[0].sync()
    disk.restore(disk.backups[0][1])
    image = disk.partitions[0]
    assert len(image.written) == 10
    assert image.written_info.low_water_mark_session_id == LOST_SESSION
    assert disk.lost_records
