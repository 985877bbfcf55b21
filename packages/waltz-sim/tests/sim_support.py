"""Helpers of the waltz-sim tests: a world to run a scenario in, on virtual time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from waltz_sim.loop import WORLD_CONTEXT, SimLoop
from waltz_sim.runner import _dispose
from waltz_sim.world import SimConfig, World, _register_plugins

T = TypeVar("T")


def in_world(scenario: Callable[[World], Awaitable[T]], config: SimConfig | None = None) -> T:
    """Run ``scenario(world)`` in a fresh world (no cluster: the scenario adds processes)."""
    loop = SimLoop()
    world = World(config or SimConfig(), loop)
    _register_plugins()
    try:
        task = loop.create_task(_run(scenario, world), context=WORLD_CONTEXT)
        return loop.run_until_complete(task)
    finally:
        world.shutdown()
        _dispose(loop)


async def _run(scenario: Callable[[World], Awaitable[T]], world: World) -> T:
    return await scenario(world)


def elapsed(world: World) -> float:
    return world.loop.time() - world.started_at


__all__: list[Any] = ["elapsed", "in_world"]


def idle_process(world: World, name: str, kind: str = "test") -> Any:
    """A started process that runs nothing of its own (tests run coroutines in it)."""
    from waltz_sim.world import _idle

    process = world.add_process(name, kind, _idle, restart_on_exit=False)
    process.start()
    return process
