"""The virtual-time loop: time jumps, paused processes run nothing, crashed ones stop."""

from __future__ import annotations

import asyncio
import time

import pytest
from sim_support import elapsed, idle_process, in_world

from waltz_sim.loop import SimLoop, SimulationError
from waltz_sim.net import SimTransport
from waltz_sim.world import World


def test_an_hour_of_timers_passes_at_once() -> None:
    async def scenario(world: World) -> float:
        for _ in range(3600):
            await asyncio.sleep(1.0)
        return elapsed(world)

    wall = time.perf_counter()
    assert in_world(scenario) == pytest.approx(3600.0)
    assert time.perf_counter() - wall < 10.0


async def _ticks(world: World, name: str) -> tuple[list[float], object]:
    ticks: list[float] = []
    process = idle_process(world, name)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(1.0)
            ticks.append(round(elapsed(world), 6))

    world.loop.create_task(ticker(), context=process.incarnation.context.copy())
    return ticks, process


def test_a_paused_process_runs_nothing_until_it_resumes() -> None:
    async def scenario(world: World) -> list[float]:
        ticks, process = await _ticks(world, "ticker")
        await asyncio.sleep(2.5)
        process.pause()  # type: ignore[attr-defined]
        await asyncio.sleep(5.0)
        process.resume()  # type: ignore[attr-defined]
        await asyncio.sleep(1.6)
        return ticks

    # the tick due at 3.0 runs at the resume (7.5), the next one a second later
    assert in_world(scenario) == [1.0, 2.0, 7.5, 8.5]


def test_a_crashed_process_stops_and_its_tasks_end() -> None:
    async def scenario(world: World) -> tuple[list[float], int]:
        ticks, process = await _ticks(world, "ticker")
        await asyncio.sleep(2.5)
        incarnation = process.incarnation  # type: ignore[attr-defined]
        process.crash()  # type: ignore[attr-defined]
        await asyncio.sleep(5.0)
        return ticks, len(incarnation.tasks)

    ticks, tasks_left = in_world(scenario)
    assert ticks == [1.0, 2.0]
    assert tasks_left == 0


def test_a_restarted_process_is_a_new_incarnation() -> None:
    async def scenario(world: World) -> list[str]:
        process = idle_process(world, "p")
        names = [process.incarnation.name]
        process.crash()
        process.start()
        names.append(process.incarnation.name)
        return names

    assert in_world(scenario) == ["p#1", "p#2"]


def test_threads_are_refused() -> None:
    async def scenario(world: World) -> None:
        process = idle_process(world, "p")

        async def use_a_thread() -> None:
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0)

        await world._in(process, use_a_thread())

    with pytest.raises(SimulationError, match="run_in_executor"):
        in_world(scenario)


def test_a_world_waiting_for_nothing_is_reported_stalled() -> None:
    async def scenario(world: World) -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationError, match="stalled"):
        in_world(scenario)


def test_a_simulated_plugin_needs_a_simulated_process() -> None:
    async def scenario(world: World) -> None:
        SimTransport()

    with pytest.raises(SimulationError, match="outside a simulated process"):
        in_world(scenario)


def test_the_clock_starts_where_asked() -> None:
    loop = SimLoop(start=5.0)
    try:
        assert loop.time() == 5.0
        loop.run_until_complete(asyncio.sleep(2.0))
        assert loop.time() == pytest.approx(7.0)
    finally:
        loop.close()
