"""The real fs engine on a simulated disk (``--storage-engine fs``): the disk model's
semantics (a kill keeps what was written, a power loss only what a completed flush
covered, an fsync error closes the partition until a restart, damage is found at
start-up), and seeds that replay exactly."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping

import pytest
from sim_support import idle_process, in_world

from waltz_api.errors import CorruptionError, PartitionClosedError
from waltz_api.types import LOST_SESSION, Record, ReqId
from waltz_api.wire import checksum
from waltz_sim import SimConfig, run_seed
from waltz_sim.fsdisk import FsDisk, SimFsEngine
from waltz_sim.world import SimProcess, World
from waltz_storage_fs.powerloss import STATES

pytestmark = pytest.mark.timeout(300)


def _records(start: int, count: int) -> list[Record]:
    out = []
    for tid in range(start, start + count):
        data = b"record %d " % tid * 4
        out.append(Record(tid, ReqId(1, 1, 0, tid + 1), 0, data, checksum(data)))
    return out


async def _engine(world: World, process: SimProcess) -> SimFsEngine:
    async def open_it() -> SimFsEngine:
        engine = await SimFsEngine.open("disk", cluster_key=uuid.UUID(int=1), num_partitions=1)
        if 0 not in engine.partition_ids():
            await engine.add_partition(0)
        assert isinstance(engine, SimFsEngine)
        return engine

    result: SimFsEngine = await world._in(process, open_it())
    return result


def _disk(world: World) -> FsDisk:
    disk = world.disks["disk"]
    assert isinstance(disk, FsDisk)
    return disk


async def _crash_during_a_flush(world: World, process: SimProcess) -> None:
    """Five records acknowledged (durable), three more written and their flush under way
    when the process dies."""
    engine = await _engine(world, process)
    await world._in(process, engine.partition(0).append(_records(0, 5)))
    disk = _disk(world)
    disk.stall = asyncio.Event()  # the flush of the next round does not complete

    async def append_more() -> None:
        await engine.partition(0).append(_records(5, 3))

    task = world.loop.create_task(append_more(), context=process.incarnation.context.copy())  # type: ignore[union-attr]
    await asyncio.sleep(0.5)
    assert not task.done()
    process.crash()
    disk.stall.set()
    disk.stall = None


async def _log_end_after_restart(world: World, process: SimProcess) -> int:
    process.start()
    engine = await _engine(world, process)
    return engine.partition(0).max_transaction_id()


def test_a_kill_keeps_what_was_written() -> None:
    async def scenario(world: World) -> int:
        process = idle_process(world, "storage")
        await _crash_during_a_flush(world, process)
        return await _log_end_after_restart(world, process)

    assert in_world(scenario, SimConfig(storage_engine="fs")) == 7


@pytest.mark.parametrize("state", STATES)
def test_a_power_loss_keeps_every_acknowledged_record(state: str) -> None:
    async def scenario(world: World) -> int:
        process = idle_process(world, "storage")
        await _crash_during_a_flush(world, process)
        _disk(world).files.lose_power(state)
        return await _log_end_after_restart(world, process)

    end = in_world(scenario, SimConfig(storage_engine="fs"))
    if state in ("durable", "entries-only"):
        assert end == 4  # the unflushed writes are gone
    else:
        assert 4 <= end <= 7


def test_an_fsync_error_closes_the_partition_until_a_restart() -> None:
    async def scenario(world: World) -> tuple[str, str, int]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)
        _disk(world).failing_fsyncs = 1

        async def fail() -> tuple[str, str]:
            part = engine.partition(0)
            with pytest.raises(PartitionClosedError, match="fsync failed") as first:
                await part.append(_records(0, 2))
            with pytest.raises(PartitionClosedError) as then:
                part.max_transaction_id()
            return str(first.value), str(then.value)

        failed, closed = await world._in(process, fail())
        process.crash()
        process.start()
        engine = await _engine(world, process)

        async def retry() -> int:
            part = engine.partition(0)
            await part.append(_records(part.max_transaction_id() + 1, 2))
            return part.max_transaction_id()

        return failed, closed, await world._in(process, retry())

    failed, closed, end = in_world(scenario, SimConfig(storage_engine="fs"))
    assert "restart the storage node" in failed and "I/O error" in closed
    assert end in (1, 3)  # the failed append's records are kept or not, never half


def test_damage_is_found_at_start_up_and_repaired_from_a_peer() -> None:
    """Over a few draws: damage below intact records is a missing range until repaired;
    damage of the last records is a lost tail (LOST_SESSION)."""

    async def scenario(world: World) -> set[str]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)
        await world._in(process, engine.partition(0).append(_records(0, 12)))
        seen: set[str] = set()
        disk = _disk(world)
        for _ in range(8):
            process.crash()
            disk.pending_damage = True
            process.start()
            engine = await _engine(world, process)
            assert not disk.pending_damage
            part = engine.partition(0)
            end = part.max_transaction_id()
            assert disk.unrepaired == bool(
                part.missing_ranges()
                or part.session_info().low_water_mark_session_id == LOST_SESSION
            )
            while missing := part.missing_ranges():
                seen.add("hole")
                first, last = missing[0]
                with pytest.raises(CorruptionError, match=f"transaction {first} is missing"):
                    await world._in(process, part.read_records(first, 12))
                await world._in(process, part.repair(_records(first, last - first + 1)))
            if end < 11:
                seen.add("tail")
                assert part.session_info().low_water_mark_session_id == LOST_SESSION
                await world._in(process, part.append(_records(end + 1, 11 - end)))
            records = await world._in(process, part.read_records(0, 12))
            assert [r.data for r in records] == [r.data for r in _records(0, 12)]
        return seen

    assert in_world(scenario, SimConfig(storage_engine="fs", seed=1)) == {"hole", "tail"}


SEED = 2


def test_an_fs_seed_replays_exactly() -> None:
    first = run_seed(SimConfig(seed=SEED, storage_engine="fs", faults="disk"), keep_trace=True)
    second = run_seed(SimConfig(seed=SEED, storage_engine="fs", faults="disk"), keep_trace=True)
    assert first.ok, first.violations or first.error
    assert "waltz_storage_fs" in first.trace_text  # the real engine ran
    assert "power loss" in first.trace_text
    assert first.trace_text == second.trace_text
    assert first.digest == second.digest


def test_an_fs_seed_replays_in_another_process() -> None:
    """Another interpreter, with another hash seed."""
    here = run_seed(SimConfig(seed=SEED, storage_engine="fs", faults="disk", duration=20))
    command = here.replay_command().split()[2:]  # after "waltz simulate"
    assert "--storage-engine fs" in here.replay_command()
    env = {**os.environ, "PYTHONHASHSEED": "4321"}
    out = subprocess.run(
        [sys.executable, "-m", "waltz_sim", *command, "--verbose"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    found = re.search(r"trace digest ([0-9a-f]{64})", out.stdout)
    assert found is not None, out.stdout + out.stderr
    assert found.group(1) == here.digest


class _Always:
    """A striker's random stream that always strikes, at once, with a power loss."""

    def random(self) -> float:
        return 0.0

    def uniform(self, low: float, high: float) -> float:
        return low


class _Allowing:
    def _allowed(self, names: set[str]) -> bool:
        return True


def test_a_strike_after_a_direct_write_lands_before_the_checkpoint_that_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An append larger than half the journal is written to its segments, then a
    checkpoint flushes them in the same synchronous step: the strike at the point between
    (``storage.journal_direct_written``) kills the node inside the point, so that the
    checkpoint never runs; the records acknowledged before are kept."""
    from waltz_api import faultpoints
    from waltz_sim import points
    from waltz_sim.points import PointStriker

    only = "storage.journal_direct_written"  # struck there only, every time
    monkeypatch.setattr(
        points, "STRIKE_PROBABILITY", {name: float(name == only) for name in faultpoints.POINTS}
    )
    hits: list[str] = []
    big = b"a transaction larger than half the journal " * 70  # 3 KiB: the journal has 4

    async def scenario(world: World) -> tuple[list[str], list[str], int]:
        striker = PointStriker(world, _Always(), strike=True)  # type: ignore[arg-type]
        striker.nemesis = _Allowing()  # type: ignore[assignment]
        striker.strike_until = float("inf")
        world.points = striker
        disk = world.disks["disk"] = FsDisk(world, "disk")
        disk.options["journal_size"] = 4096
        process = idle_process(world, "storage")
        engine = await _engine(world, process)
        assert engine.feature_level == 3 and engine.journal is not None
        await world._in(process, engine.partition(0).append(_records(0, 5)))
        world.ready_at = world.loop.time()  # the striker strikes from now on
        first = process.incarnation
        record = Record(5, ReqId(1, 1, 0, 6), 0, big, checksum(big))
        task = world.loop.create_task(
            engine.partition(0).append([record]),
            context=process.incarnation.context.copy(),
        )
        await asyncio.sleep(0.5)  # simulated time (the world's virtual clock): deterministic
        assert task.done() and not first.alive
        seen = list(hits)
        striker.strike_until = 0.0  # no more strikes (the restart's replay is a point)
        await asyncio.sleep(5)  # simulated time: the striker restarts the node meanwhile
        engine = await _engine(world, process)
        return seen, list(world.fault_log), engine.partition(0).max_transaction_id()

    def handler(name: str, detail: Mapping[str, object]) -> None:
        hits.append(name)
        world_of_the_run[0].on_point(name, detail)

    world_of_the_run: list[World] = []

    async def with_world(world: World) -> tuple[list[str], list[str], int]:
        world_of_the_run.append(world)
        return await scenario(world)

    with faultpoints.installed(handler):
        seen, faults, end = in_world(with_world, SimConfig(storage_engine="fs", faults="points"))
    assert "storage.journal_direct_written" in seen, seen
    after = seen[seen.index("storage.journal_direct_written") + 1 :]
    assert "storage.journal_checkpoint" not in after, after  # it never ran
    assert faults == [f"0.00 power loss storage at {only} for 0.3s"], faults
    assert end in (4, 5)  # the big one kept (written whole, then recovered) or not
