"""The simulated coordination service (sessions, expiry, outages, watches) and disks
(durability across a kill and a power loss, fsync errors)."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import pytest
from sim_support import elapsed, idle_process, in_world

from waltz_api.contracts.coordination import SessionState, Versioned
from waltz_api.errors import (
    BadVersionError,
    CoordinationUnavailableError,
    CorruptionError,
    NodeExistsError,
    PartitionClosedError,
    SessionLostError,
    StorageAppendError,
    StorageError,
)
from waltz_api.types import LOST_SESSION, Record, ReqId
from waltz_api.wire import checksum
from waltz_sim.coord import SimCoordination, sim_coordination_factory
from waltz_sim.disk import PartitionImage, SimStorageEngine
from waltz_sim.net import COORDINATION
from waltz_sim.world import SimProcess, World

TIMEOUT = 4.0


async def _client(world: World, name: str) -> tuple[SimProcess, SimCoordination]:
    process = idle_process(world, name)

    async def connect() -> SimCoordination:
        client = sim_coordination_factory(world.coordination_uri, {"session_timeout": TIMEOUT})
        await client.start()
        return client

    return process, await world._in(process, connect())


def test_the_tree_keeps_the_contract() -> None:
    async def scenario(world: World) -> None:
        process, client = await _client(world, "a")

        async def work() -> None:
            assert await client.create("/x/y", b"1") == 0
            with pytest.raises(NodeExistsError):
                await client.create("/x/y")
            version = await client.set("/x/y", b"2", expected_version=0)
            with pytest.raises(BadVersionError):
                await client.set("/x/y", b"3", expected_version=0)
            assert await client.get("/x/y") == Versioned(b"2", version)
            assert await client.children("/x") == ["y"]
            assert [await client.increment("/n") for _ in range(3)] == [1, 2, 3]

        await world._in(process, work())

    in_world(scenario)


def test_a_client_cut_off_for_longer_than_its_session_loses_it_and_its_ephemerals() -> None:
    async def scenario(world: World) -> tuple[list[tuple[SessionState, float]], list[list[str]]]:
        process, client = await _client(world, "a")
        watcher_process, watcher = await _client(world, "b")
        states: list[tuple[SessionState, float]] = []
        seen: list[list[str]] = []

        async def setup() -> None:
            await client.create("/live/a", ephemeral=True)
            client.add_session_listener(lambda s: states.append((s, round(elapsed(world), 1))))

        async def watch() -> None:
            await watcher.watch_children("/live", lambda names: seen.append(list(names)))

        await world._in(process, setup())
        await world._in(watcher_process, watch())
        world.network.cut("a", COORDINATION)
        await asyncio.sleep(3 * TIMEOUT)
        return states, seen

    states, seen = in_world(scenario)
    assert [s for s, _ in states] == [SessionState.SUSPENDED, SessionState.LOST]
    suspended_at, lost_at = states[0][1], states[1][1]
    assert lost_at - suspended_at == pytest.approx(TIMEOUT, abs=0.1)
    assert seen[0] == ["a"] and seen[-1] == []


def test_a_short_cut_suspends_and_reconnects_the_same_session() -> None:
    async def scenario(world: World) -> tuple[list[SessionState], Versioned | None, int, int]:
        process, client = await _client(world, "a")
        states: list[SessionState] = []

        async def setup() -> int:
            await client.create("/live/a", ephemeral=True)
            client.add_session_listener(states.append)
            return client.session_id

        before = await world._in(process, setup())
        world.network.cut(COORDINATION, "a")
        await asyncio.sleep(TIMEOUT * 0.75)
        world.network.heal(COORDINATION, "a")
        await asyncio.sleep(1.0)

        async def after() -> tuple[Versioned | None, int]:
            return await client.get("/live/a"), client.session_id

        value, session = await world._in(process, after())
        return states, value, before, session

    states, value, before, after = in_world(scenario)
    assert states == [SessionState.SUSPENDED, SessionState.CONNECTED]
    assert value is not None and before == after


def test_operations_wait_out_an_outage_and_fail_after_a_long_one() -> None:
    async def scenario(world: World) -> tuple[float, str]:
        process, client = await _client(world, "a")
        world.coordination.kill()
        world.loop.call_later(2.0, world.coordination.restart)

        async def short() -> float:
            start = elapsed(world)
            await client.create("/after-outage")
            return elapsed(world) - start

        waited = await world._in(process, short())
        world.coordination.kill()

        async def long() -> str:
            try:
                await client.get("/x")
            except (CoordinationUnavailableError, SessionLostError) as exc:
                return type(exc).__name__
            return "answered"

        return waited, await world._in(process, long())

    waited, outcome = in_world(scenario)
    assert 2.0 <= waited < 2.5
    assert outcome in ("CoordinationUnavailableError", "SessionLostError")


def test_watches_deliver_in_order_and_end_on_the_final_state() -> None:
    async def scenario(world: World) -> list[int]:
        writer_process, writer = await _client(world, "w")
        reader_process, reader = await _client(world, "r")
        versions: list[int] = []
        world.coordination.slow_watches(0.5)

        async def watch() -> None:
            await reader.watch("/v", lambda v: versions.append(-1 if v is None else v.version))

        async def write() -> None:
            await writer.create("/v", b"0")
            for i in range(20):
                await writer.set("/v", b"%d" % i)

        await world._in(reader_process, watch())
        await world._in(writer_process, write())
        await asyncio.sleep(5.0)
        return versions

    versions = in_world(scenario)
    assert versions == sorted(versions)
    assert versions[0] == -1 and versions[-1] == 20


def test_a_change_made_while_a_watch_is_set_up_comes_after_its_first_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service registers the watcher and reads the value, then the node changes while
    that answer travels back: the client gets the first value, then the change (a stale
    first value delivered last once left a server with dead servers registered for ever:
    storage seed 16 with a replaced replica)."""

    async def scenario(world: World) -> list[int]:
        writer_process, writer = await _client(world, "w")
        reader_process, reader = await _client(world, "r")
        await world._in(writer_process, writer.create("/v", b"0"))
        service = world.coordination
        add = service.add_watcher

        def add_then_delete(watcher: Any) -> Any:
            initial = add(watcher)
            service._remove(watcher.path)  # at the service, before the answer leaves
            return initial

        monkeypatch.setattr(service, "add_watcher", add_then_delete)
        # the change's notification is quicker than the answer (latencies are drawn)
        monkeypatch.setattr(service, "watch_delay", lambda process: 0.0)
        versions: list[int] = []

        async def watch() -> None:
            await reader.watch("/v", lambda v: versions.append(-1 if v is None else v.version))

        await world._in(reader_process, watch())
        await asyncio.sleep(2.0)
        return versions

    assert in_world(scenario) == [0, -1]


def _records(start: int, count: int) -> list[Record]:
    out = []
    for tid in range(start, start + count):
        data = b"r%d" % tid
        out.append(Record(tid, ReqId(1, 1, 0, tid + 1), 0, data, checksum(data)))
    return out


async def _engine(world: World, process: SimProcess) -> SimStorageEngine:
    async def open_it() -> SimStorageEngine:
        engine = await SimStorageEngine.open("disk", cluster_key=uuid.UUID(int=1), num_partitions=1)
        await engine.add_partition(0)
        return engine

    return await world._in(process, open_it())


def test_appended_records_survive_a_power_loss_unsynced_writes_may_not() -> None:
    async def scenario(world: World) -> tuple[int, int, int]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)

        async def append_durably() -> None:
            await engine.partition(0).append(_records(0, 5))

        await world._in(process, append_durably())
        # an append killed during its fdatasync: written, not durable
        image = world.disks["disk"].partitions[0]
        image.written.extend(_records(5, 3))
        process.crash()
        after_kill = len(world.disks["disk"].contents()[0])
        process.start()
        kept = []
        for seed in range(20):
            trial = PartitionImage(list(image.written), list(image.durable), image.common)
            trial.lose_unsynced(random.Random(seed))
            kept.append(len(trial.written))
        return after_kill, min(kept), max(kept)

    after_kill, fewest, most = in_world(scenario)
    assert after_kill == 8  # a process crash keeps the page cache
    assert fewest == 5 and most == 8  # a power loss keeps the synced 5, maybe more


def test_an_fsync_error_closes_the_partition_until_a_restart() -> None:
    async def scenario(world: World) -> tuple[str, str, int]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)
        world.disks["disk"].failing_fsyncs = 1

        async def fail() -> tuple[str, str]:
            part = engine.partition(0)
            with pytest.raises(StorageError, match="fdatasync failed") as first:
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

    failed, closed, end = in_world(scenario)
    assert "restarts" in failed and "restart" in closed
    assert end >= 1


def test_damage_found_at_start_up_is_a_missing_range_until_repaired() -> None:
    async def scenario(world: World) -> tuple[list[tuple[int, int]], str, int, bool]:
        process = idle_process(world, "storage")
        engine = await _engine(world, process)

        async def fill() -> None:
            await engine.partition(0).append(_records(0, 8))

        await world._in(process, fill())
        image = world.disks["disk"].partitions[0]
        image.missing = [(2, 4)]  # what PartitionImage.damage leaves for a range
        process.crash()
        process.start()
        engine = await _engine(world, process)

        async def read_and_repair() -> tuple[list[tuple[int, int]], int, str, int, bool]:
            part = engine.partition(0)
            missing = part.missing_ranges()
            before = await part.read_records(0, 8)  # the records before the hole (fs engine)
            with pytest.raises(CorruptionError) as damaged:
                await part.read_records(3, 8)
            with pytest.raises(StorageAppendError):
                await part.repair(_records(3, 2))  # not from the range's start
            await part.repair(_records(2, 3))
            whole = await part.read_records(0, 8)
            return missing, len(before), str(damaged.value), len(whole), not part.missing_ranges()

        return await world._in(process, read_and_repair())

    missing, before, damaged, whole, repaired = in_world(scenario)
    assert missing == [(2, 4)]
    assert before == 2
    assert "transaction 3 was lost to damage" in damaged
    assert whole == 8 and repaired


def test_a_lost_tail_marks_the_session_info_lost() -> None:
    image = PartitionImage(_records(0, 6), _records(0, 6), 6, 6)
    found = None
    rng = random.Random(0)
    while found is None or "tail" not in found:
        image = PartitionImage(_records(0, 6), _records(0, 6), 6, 6)
        found = image.damage(rng)
    assert image.written_info.low_water_mark_session_id == LOST_SESSION
    assert len(image.written) < 6 and image.unrepaired
