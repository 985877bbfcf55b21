"""The scripted-scenario facility (waltz_sim.scenario) and the disk faults it places."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sim_support import elapsed, idle_process, in_world

from waltz_api.errors import StorageError
from waltz_api.types import LOST_SESSION, Record, ReqId, SessionInfo
from waltz_api.wire import checksum
from waltz_sim import SimConfig
from waltz_sim.disk import SimStorageEngine
from waltz_sim.scenario import REJOIN, Scenario, message_is, run_scenario
from waltz_sim.world import SimProcess, World


def _records(start: int, count: int) -> list[Record]:
    out = []
    for tid in range(start, start + count):
        data = b"r%d" % tid
        out.append(Record(tid, ReqId(1, 1, 0, tid + 1), 0, data, checksum(data)))
    return out


async def _engine(world: World, process: SimProcess) -> SimStorageEngine:
    async def open_it() -> SimStorageEngine:
        engine = await SimStorageEngine.open("disk", cluster_key=uuid.UUID(int=1), num_partitions=1)
        if 0 not in engine.partition_ids():
            await engine.add_partition(0)
        return engine

    engine: SimStorageEngine = await world._in(process, open_it())
    return engine


async def _append(world: World, process: SimProcess, records: list[Record]) -> None:
    engine = await _engine(world, process)

    async def append() -> None:
        await engine.partition(0).append(records)

    await world._in(process, append())


def test_a_lost_tail_is_reported_lost_at_the_restart() -> None:
    async def scenario(world: World) -> tuple[int, SessionInfo, str]:
        process = idle_process(world, "storage")
        await _append(world, process, _records(0, 8))
        disk = world.disks["disk"]
        with pytest.raises(StorageError, match="crash the node first") as running:
            disk.lose_tail(0, 3)
        process.crash()
        assert disk.lose_tail(0, 3) == 3
        process.start()
        engine = await _engine(world, process)
        part = engine.partition(0)
        return part.max_transaction_id(), part.session_info(), str(running.value)

    end, info, refused = in_world(scenario)
    assert end == 4
    assert info.low_water_mark_session_id == LOST_SESSION
    assert "while its storage node runs" in refused


def test_a_snapshot_restored_brings_back_the_disk_as_it_was() -> None:
    async def scenario(world: World) -> tuple[int, int]:
        process = idle_process(world, "storage")
        await _append(world, process, _records(0, 4))
        disk = world.disks["disk"]
        snapshot = disk.snapshot()
        await _append(world, process, _records(4, 6))
        process.crash()
        disk.restore(snapshot)
        process.start()
        engine = await _engine(world, process)
        after_restore = engine.partition(0).max_transaction_id()
        await _append(world, process, _records(4, 1))  # the restored copy is not shared
        return after_restore, len(snapshot[0].written)

    after_restore, in_snapshot = in_world(scenario)
    assert after_restore == 3
    assert in_snapshot == 4


def test_a_wiped_disk_has_nothing_for_the_partition() -> None:
    async def scenario(world: World) -> tuple[list[int], int]:
        process = idle_process(world, "storage")
        await _append(world, process, _records(0, 4))
        process.crash()
        world.disks["disk"].wipe()
        process.start()

        async def hosted() -> list[int]:
            engine = await SimStorageEngine.open("disk")
            return engine.partition_ids()

        before = await world._in(process, hosted())
        engine = await _engine(world, process)  # the node's start adds it, empty
        return before, engine.partition(0).max_transaction_id()

    hosted, end = in_world(scenario)
    assert hosted == []
    assert end == -1


def test_stalled_fsyncs_complete_when_released() -> None:
    async def scenario(world: World) -> tuple[bool, float, int]:
        process = idle_process(world, "storage")
        await _append(world, process, _records(0, 1))
        disk = world.disks["disk"]
        disk.stall = asyncio.Event()
        engine = await _engine(world, process)

        async def append() -> None:
            await engine.partition(0).append(_records(1, 1))

        started = elapsed(world)
        task = world.loop.create_task(world._in(process, append()))
        await asyncio.sleep(30.0)
        stuck = not task.done()
        disk.stall.set()
        await task
        return stuck, elapsed(world) - started, engine.partition(0).max_transaction_id()

    stuck, took, end = in_world(scenario)
    assert stuck
    assert 30.0 <= took < 30.1
    assert end == 1


async def _crash_owner_when_storage_0_rejoins(s: Scenario) -> None:
    opened = await s.session_opened(0)
    await s.wait_acknowledged(0, opened.low_water_mark + 10)
    a = s.storage(0)
    s.crash(a)
    hook = s.crash_owner_on_rejoin(0, a)
    s.restart(a)
    await s.wait_fired(hook, "storage-0's rejoin")
    owner = s.process_of(hook.sources[0])
    s.expect(owner.name == opened.server and not owner.alive, "the owner dead")
    s.expect(hook.times[0] == s.world.loop.time(), "the owner killed at the record")


def test_a_script_kills_the_owner_at_a_log_record_and_the_run_is_judged() -> None:
    config = SimConfig(seed=5, faults="none", duration=15.0, partitions=1)
    result = run_scenario(config, _crash_owner_when_storage_0_rejoins, keep_trace=True)
    assert result.error is None, result.error
    assert result.ok, result.violations
    assert "script   crash storage-0" in result.trace_text
    lines = result.trace_text.splitlines()
    rejoin = next(i for i, line in enumerate(lines) if "rejoins at" in line)
    # the owner's crash comes right after its record: nothing of the owner ran between
    assert "crash the owner" in lines[rejoin + 1]
    assert "process  crash server-" in lines[rejoin + 2]
    assert result.outcomes.get("ok", 0) > 20  # the workload went on after the heal


def test_a_scenario_replays_exactly() -> None:
    config = SimConfig(seed=7, faults="none", duration=15.0, partitions=1)
    first = run_scenario(config, _crash_owner_when_storage_0_rejoins)
    second = run_scenario(config, _crash_owner_when_storage_0_rejoins)
    assert first.error is None and second.error is None
    assert first.digest == second.digest


def test_a_step_that_does_not_happen_is_the_runs_error() -> None:
    async def script(s: Scenario) -> None:
        hook = s.on_log(message_is(REJOIN, 0))  # nothing leaves, nothing rejoins
        await s.wait_fired(hook, "a rejoin", timeout=2.0)

    result = run_scenario(SimConfig(seed=1, faults="none", duration=10.0), script)
    assert result.error is not None
    assert "a rejoin was not logged within 2 s" in result.error
