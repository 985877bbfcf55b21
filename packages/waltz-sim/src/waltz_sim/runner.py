"""Running one seed: a fresh loop and world, the run, the check, the verdict."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field, fields, replace
from typing import Any

from waltz_api import faultpoints
from waltz_sim.checker import SAFETY, SEMANTICS, Violation, check
from waltz_sim.faults import Nemesis
from waltz_sim.loop import WORLD_CONTEXT, SimLoop, SimulationError
from waltz_sim.points import PointStriker
from waltz_sim.profiles import profile
from waltz_sim.trace import capture_logs
from waltz_sim.world import SimConfig, World

MIXED = ("lock_table", "storage_nodes", "callbacks", "membership", "archive", "acl")
"""The configuration a seed chooses (:func:`mixed`), unless given."""
EXACT_SHARE = 1 / 3
"""Seeds that run the ``exact`` lock table (lock precision is then checked exactly)."""
FIVE_NODES_SHARE = 1 / 5
"""Seeds that run 5 storage nodes (5 replicas per partition: a quorum of 3)."""
PLAIN_SHARE = 1 / 4
"""Seeds whose clients use plain (synchronous) callbacks on their callback thread."""
REPLACE_SHARE = 1 / 4
"""Seeds with a spare storage node that replaces a replica during the run
(``membership = "replace"``, :mod:`waltz_sim.membership`)."""
ARCHIVE_SHARE = 1 / 4
"""Seeds whose servers archive to the simulated object store (``archive = "on"``,
:mod:`waltz_sim.archive`): ranges, manifests, the mark, reads below it, pruning (with an
engine that can delete a prefix: ``fs``)."""
ACL_SHARE = 1 / 5
"""Seeds with the ACL enforced (``acl = "on"``): one client may not write everywhere."""

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
    throughput: float | None = None
    """The fault-free windows' commits per second, a share of the offered rate."""

    @property
    def ok(self) -> bool:
        return not self.violations and self.error is None

    @property
    def speed(self) -> float:
        return self.sim_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def replay_command(self) -> str:
        return replay_command(self.config)


def mixed(config: SimConfig, pinned: Collection[str] = ()) -> SimConfig:
    """``config`` with what its seed chooses of :data:`MIXED` (except the ``pinned``
    fields): a share of the seeds runs the exact lock table, 5 storage nodes, the
    clients' plain callbacks, a replica replaced during the run. Every draw is made
    whatever is pinned, so pinning one leaves the others as the seed chose them."""
    rng = random.Random(f"waltz-sim:{config.seed}:mix")
    lock_table = "exact" if rng.random() < EXACT_SHARE else "hwm-array"
    storage_nodes = 5 if rng.random() < FIVE_NODES_SHARE else 3
    callbacks = "plain" if rng.random() < PLAIN_SHARE else "async"
    membership = "replace" if rng.random() < REPLACE_SHARE else "none"
    archive = "on" if rng.random() < ARCHIVE_SHARE else "none"
    acl = "on" if rng.random() < ACL_SHARE else "none"
    return replace(
        config,
        lock_table=config.lock_table if "lock_table" in pinned else lock_table,
        storage_nodes=config.storage_nodes if "storage_nodes" in pinned else storage_nodes,
        callbacks=config.callbacks if "callbacks" in pinned else callbacks,
        membership=config.membership if "membership" in pinned else membership,
        archive=config.archive if "archive" in pinned else archive,
        acl=config.acl if "acl" in pinned else acl,
    )


def variant(config: SimConfig) -> str:
    """What of :data:`MIXED` differs from the defaults ("" when nothing does)."""
    defaults = SimConfig()
    parts = [
        f"{config.lock_table} locks" if config.lock_table != defaults.lock_table else "",
        f"{config.storage_nodes} storage nodes"
        if config.storage_nodes != defaults.storage_nodes
        else "",
        f"{config.callbacks} callbacks" if config.callbacks != defaults.callbacks else "",
        "a replica replaced" if config.membership == "replace" else "",
        "archive" if config.archive == "on" else "",
        "ACL" if config.acl == "on" else "",
    ]
    return ", ".join(p for p in parts if p)


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
        "callbacks": "--callbacks",
        "membership": "--membership",
        "archive": "--archive",
        "acl": "--acl",
    }
    always = ("duration", "faults", "workload", *MIXED)  # a seed would choose the mixed ones
    for f in fields(SimConfig):
        flag = options.get(f.name)
        if flag is None:
            continue
        value = getattr(config, f.name)
        if value != getattr(defaults, f.name) or f.name in always:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(parts)


def arm(world: World, *, scripted: bool = False) -> PointStriker:
    """Give ``world`` its nemesis and its point striker (which strikes in a run of the
    nemesis, not in a scripted one); returns the striker."""
    config = world.config
    nemesis = Nemesis(world, world.rng("faults"))
    striker = PointStriker(world, world.rng("points"), strike=profile(config.faults).point_strikes)
    world.nemesis = nemesis
    world.points = striker
    if not scripted:
        striker.nemesis = nemesis
        striker.strike_until = nemesis.safety_end(world.started_at + config.duration - config.quiet)
    return striker


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
    striker = arm(world, scripted=script is not None)
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
    result.point_hits = dict(striker.hits)
    result.fault_log = list(world.fault_log)
    result.loop_errors = list(world.loop_errors)
    changes = world.replica_changes
    if changes is not None and changes.failure is not None and result.error is None:
        result.error = changes.failure
    if snapshot is not None:
        semantics = SEMANTICS[config.workload]()
        checked = check(history, snapshot, semantics, config.liveness)
        result.violations = checked.violations
        result.outcomes = checked.outcomes
        result.committed = checked.committed
        result.throughput = checked.throughput
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
