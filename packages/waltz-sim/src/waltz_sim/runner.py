"""Running one seed: a fresh loop and world, the run, the check, the verdict."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, fields
from typing import Any

from waltz_api import faultpoints
from waltz_sim.checker import SAFETY, SEMANTICS, Violation, check
from waltz_sim.loop import WORLD_CONTEXT, SimLoop, SimulationError
from waltz_sim.trace import capture_logs
from waltz_sim.world import SimConfig, World

EXTRA_TIME = 120.0
"""Virtual seconds a run may take beyond its duration (the read-back) before it is
declared stuck."""


@dataclass
class SeedResult:
    seed: int
    config: SimConfig
    violations: list[Violation] = field(default_factory=list)
    error: str | None = None
    """The simulation itself failed (not an invariant): a stalled world, a bug in it."""
    faults: int = 0
    fault_log: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    committed: dict[int, int] = field(default_factory=dict)
    digest: str = ""
    trace_events: int = 0
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of the run (this process): on a shared machine, the honest measure."""
    loop_errors: list[str] = field(default_factory=list)
    excerpt: str = ""
    """The trace before the first violation (or the error)."""
    trace_text: str = ""
    """The whole trace, when asked for."""
    point_hits: dict[str, int] = field(default_factory=dict)
    """How often each protocol point (waltz_api.faultpoints) was hit."""

    @property
    def ok(self) -> bool:
        return not self.violations and self.error is None

    @property
    def speed(self) -> float:
        return self.sim_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def replay_command(self) -> str:
        return replay_command(self.config)


def replay_command(config: SimConfig) -> str:
    """The ``waltz simulate`` command that runs ``config`` again, event for event."""
    defaults = SimConfig()
    parts = ["waltz simulate", f"--seed {config.seed}"]
    options = {
        "duration": "--duration",
        "faults": "--faults",
        "workload": "--workload",
        "clients": "--clients",
        "servers": "--servers",
        "storage_nodes": "--storage-nodes",
        "partitions": "--partitions",
        "storage_engine": "--storage-engine",
        "lock_table": "--lock-table",
    }
    for f in fields(SimConfig):
        flag = options.get(f.name)
        if flag is None:
            continue
        value = getattr(config, f.name)
        if value != getattr(defaults, f.name) or f.name in ("duration", "faults", "workload"):
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(parts)


def run_seed(
    config: SimConfig,
    *,
    keep_trace: bool = False,
    excerpt_events: int = 80,
    script: Callable[[World], Coroutine[Any, Any, None]] | None = None,
) -> SeedResult:
    """Run ``config`` (its seed) to the end and check it. ``script``: a scripted scenario
    places the faults instead of the nemesis (:mod:`waltz_sim.scenario`)."""
    result = SeedResult(config.seed, config)
    wall = time.perf_counter()
    cpu = time.process_time()
    loop = SimLoop()
    world = World(config, loop)
    gc_enabled = gc.isenabled()
    gc.disable()
    gc.freeze()  # what exists before the run is never collected during it: cheap collections
    try:
        with capture_logs(world.trace, config.trace_level), faultpoints.installed(world.on_point):
            try:
                task = loop.create_task(
                    asyncio.wait_for(world.run(script), config.duration + EXTRA_TIME),
                    context=WORLD_CONTEXT,
                )
                loop.run_until_complete(task)
            except TimeoutError:
                result.error = (
                    f"the run did not end within {config.duration + EXTRA_TIME:.0f} simulated "
                    "seconds (the read-back at the end hangs)"
                )
            except SimulationError as exc:
                result.error = str(exc)
            history = world.history_snapshot()
            snapshot = world.snapshot
            result.sim_seconds = loop.time() - loop.start_time
            world.shutdown()
            _dispose(loop)
    finally:
        gc.unfreeze()
        if gc_enabled:
            gc.enable()
    result.wall_seconds = time.perf_counter() - wall
    result.cpu_seconds = time.process_time() - cpu
    result.faults = world.faults_injected
    result.point_hits = dict(world.points.hits)
    result.fault_log = list(world.fault_log)
    result.loop_errors = list(world.loop_errors)
    if snapshot is not None:
        semantics = SEMANTICS[config.workload]()
        checked = check(history, snapshot, semantics, config.liveness)
        result.violations = checked.violations
        result.outcomes = checked.outcomes
        result.committed = checked.committed
    elif result.error is None:
        result.error = "the run ended without reading the cluster back"
    result.digest = world.trace.digest
    result.trace_events = len(world.trace.events)
    timed = [v for v in result.violations if v.time is not None]
    # a broken safety invariant is the story to tell, before a liveness one
    first = next((v for v in timed if v.invariant in SAFETY), timed[0] if timed else None)
    if result.violations or result.error:
        at = first.time if first is not None and first.time is not None else loop.time()
        trace = world.trace
        marker = f"{'-' * 10} the first violation: {first} {'-' * 10}" if first else ""
        result.excerpt = "\n".join(
            part
            for part in (
                trace.format(trace.before(at, excerpt_events)),
                marker,
                trace.format(trace.after(at, excerpt_events // 3)) if first else "",
            )
            if part
        )
    if keep_trace:
        result.trace_text = world.trace.format()
    return result


def _dispose(loop: SimLoop) -> None:
    """End every task of the run deterministically, then close the loop."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    with contextlib.suppress(Exception):
        loop.run_until_complete(asyncio.sleep(0))
    for task in tasks:
        if not task.done():
            with contextlib.suppress(BaseException):
                task.get_coro().close()
    loop.close()
    gc.collect()
