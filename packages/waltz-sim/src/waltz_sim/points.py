"""Protocol-timed faults: the simulation's handler of ``waltz_api.faultpoints``.

Every run counts the protocol points its processes hit (``SeedResult.point_hits``,
printed by ``waltz simulate -v`` and summed into a coverage table over the seeds).
In a profile with ``point_strikes`` the striker also acts at a point: with a
probability per hit, it crashes (kill -9), pauses or cuts off (from every process and
the coordination service) the process that hit it, or the storage node of the replica
the point names, exactly there (after the code's current step: it stops at its next
await) or a few milliseconds later; a crashed process is restarted, a paused one
resumed and a cut healed after a while. At a point whose window closes before the
code's next await (:data:`AT_ONCE`) it crashes the process inside the point, with a
power loss half the time. At an archive point it may fail the object
store instead (every call refused for a while, or the next upload's answer lost). The
nemesis's rules hold: at most a minority of the storage nodes and never every server
impaired at once, only in the safety phase, and at most ``MAX_STRIKES`` per run,
``STRIKE_GAP`` seconds apart.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from waltz_api.faultpoints import POINTS
from waltz_sim.fault_kit import ActiveFault
from waltz_sim.loop import CURRENT, WORLD_CONTEXT
from waltz_sim.net import COORDINATION

if TYPE_CHECKING:
    from waltz_sim.faults import Nemesis
    from waltz_sim.world import SimProcess, World

MAX_STRIKES = 8
STRIKE_GAP = 1.5
"""Seconds of virtual time between two strikes."""
DEFAULT_PROBABILITY = 0.25
"""Per hit of a point, once the gap has passed."""
STRIKE_PROBABILITY = {
    "replica.marked_suspect": 0.9,
    "replica.rejoined": 0.4,
    "leader.record_written": 0.1,
    "client.flush_mark_taken": 0.05,
    "archive.object_uploaded": 0.15,
    "archive.mark_advanced": 0.15,
    "storage.journal_round": 0.01,
    "storage.journal_checkpoint": 0.1,
    "storage.journal_replayed": 0.5,
    "storage.journal_direct_written": 0.5,
}
"""Points hit rarely, at the most fragile moments, are struck more often; points hit
often (renewals, flushes, archive rounds) less, so that they leave strikes for the
others."""
AT_ONCE = frozenset({"storage.journal_replayed", "storage.journal_direct_written"})
"""Points whose window closes in the same synchronous step as the point (the fs engine's
checkpoint right after it, with no await between): a strike there crashes the storage
node at once, inside the point (kill -9 or, half the time, a power loss), so that the
rest of the step finds its files refused and never completes; a strike scheduled for
later, or a pause, would land after the window closed."""
CUT_SHARE = 0.4
"""Of the pauses a strike would make, the share that cut the process off instead."""


class PointStriker:
    """Counts point hits and, when ``strike`` is on, faults processes at them."""

    def __init__(self, world: World, rng: random.Random, *, strike: bool) -> None:
        self.world = world
        self.rng = rng
        self.strike = strike
        self.nemesis: Nemesis | None = None
        """Set once the nemesis runs: its rules decide what may be impaired."""
        self.cut_rng = world.rng("points-cut")
        """Which pauses become cuts (a stream of its own: the strikes' draws stay)."""
        self.hits: dict[str, int] = {}
        self.strikes = 0
        self._next_strike = 0.0
        self.strike_until = 0.0
        """Virtual time after which nothing is struck (the end of the safety phase)."""

    def __call__(self, name: str, detail: Mapping[str, object]) -> None:
        if name not in POINTS:
            raise KeyError(f"protocol point {name!r} is not registered in faultpoints.POINTS")
        self.hits[name] = self.hits.get(name, 0) + 1
        if (
            not self.strike
            or self.nemesis is None
            or self.world.ready_at is None  # the cluster is starting: not yet
            or self.strikes >= MAX_STRIKES
        ):
            return
        incarnation = CURRENT.get()
        loop = self.world.loop
        now = loop.time()
        if incarnation is None or now < self._next_strike or now > self.strike_until:
            return
        if self.rng.random() >= STRIKE_PROBABILITY.get(name, DEFAULT_PROBABILITY):
            return
        if name.startswith("archive.") and self.rng.random() < 0.4:
            self._archive_fault(name)
            return
        target = self.world.processes[incarnation.process.name]
        if name in AT_ONCE:
            if target.running and self.nemesis._allowed({target.name}):
                self.strikes += 1
                self._next_strike = now + STRIKE_GAP
                power_loss = self.rng.random() < 0.5
                self._strike(target, "power loss" if power_loss else "crash", name)
            return
        replica = detail.get("replica")
        node = self._storage_process(replica) if isinstance(replica, str) else None
        action = "crash" if self.rng.random() < 0.6 else "pause"
        delay = 0.0 if self.rng.random() < 0.5 else self.rng.uniform(0.001, 0.02)
        widen = False
        if node is not None:
            choice = self.rng.random()
            if choice < 0.5:
                widen = True
                action = "crash"
                delay = self.rng.uniform(0.2, 2.0)
            elif choice < 0.7:
                target = node
        if not target.running or not self.nemesis._allowed({target.name}):
            return
        if widen and node is not None:
            # The window between a rejoin and the end of its catch-up, made wide: the
            # rejoining replica's disk turns slow, another replica falls behind on a slow
            # link from this server only (live, and quick to answer anyone else), and the
            # process that hit the point dies a while later, leaving the next owner a
            # lagging replica that answers at once.
            self._slow_disk(node)
            self._slow_link(target, node)
        self.strikes += 1
        self._next_strike = now + STRIKE_GAP
        loop.call_at(now + delay, self._strike, target, action, name, context=WORLD_CONTEXT)

    def _archive_fault(self, name: str) -> None:
        """At an archive point, the object store fails instead of the process: it refuses
        every call for a while (the manifest's write, the next round), or the next upload
        lands with its answer lost (an orphan for the next round)."""
        store = self.world.object_store
        loop = self.world.loop
        if self.rng.random() < 0.5:
            held = self.rng.uniform(0.2, 3.0)
            store.refuse_until = max(store.refuse_until, loop.time() + held)
            description = f"archive refuses calls at {name} for {held:.1f}s"
        else:
            store.lost_answers += 1
            description = f"archive loses the next upload's answer at {name} for 0.0s"
        self.strikes += 1
        self._next_strike = loop.time() + STRIKE_GAP
        self.world.faults_injected += 1
        self.world.fault_log.append(f"{loop.time() - self.world.started_at:.2f} {description}")
        self.world.trace.add("fault", f"strike: {description}")

    def _storage_process(self, replica: str) -> SimProcess | None:
        """The storage node process whose connect string is ``replica``."""
        for process in self.world.of_kind("storage"):
            if replica.split(":", maxsplit=1)[0] == process.name:
                return process
        return None

    def _slow_link(self, server: SimProcess, spared: SimProcess) -> None:
        """Slow the links between ``server`` and one storage node other than ``spared``."""
        others = [p for p in self.world.of_kind("storage") if p is not spared]
        if not others:
            return
        lagging = self.rng.choice(others)
        extra = self.rng.uniform(0.3, 1.5)
        held = self.rng.uniform(3.0, 8.0)
        network = self.world.network
        network.slow(server.name, lagging.name, extra)
        network.slow(lagging.name, server.name, extra)

        def heal() -> None:
            network.unslow(server.name, lagging.name, extra)
            network.unslow(lagging.name, server.name, extra)

        self._record(
            f"slow link {server.name} <-> {lagging.name} (+{extra * 1000:.0f} ms) (strike)",
            heal,
            held,
        )

    def _slow_disk(self, node: SimProcess) -> None:
        disk = self.world.disks.get(self.world.data_dir(node.name))
        if disk is None:
            return
        extra = self.rng.uniform(0.3, 2.0)
        held = self.rng.uniform(2.0, 6.0)
        disk.extra_fsync.append(extra)

        def heal() -> None:
            if extra in disk.extra_fsync:
                disk.extra_fsync.remove(extra)

        self._record(f"slow fsyncs on {node.name} (+{extra * 1000:.0f} ms) (strike)", heal, held)

    def _record(self, description: str, heal: Callable[[], None], held: float) -> None:
        """A lasting fault of a strike, healed after ``held`` or at the run's heal."""
        assert self.nemesis is not None
        self.nemesis._record(ActiveFault("strike", description, heal), held)

    def _strike(self, target: SimProcess, action: str, name: str) -> None:
        if not target.running:
            return
        loop = self.world.loop
        held = self.rng.uniform(0.3, 3.0)
        if action == "pause" and self.cut_rng.random() < CUT_SHARE:
            action = "cut"  # (a stream of its own: the strikes' own draws stay as they were)
        description = f"{action} {target.name} at {name} for {held:.1f}s"
        self.world.faults_injected += 1
        self.world.fault_log.append(f"{loop.time() - self.world.started_at:.2f} {description}")
        self.world.trace.add("fault", f"strike: {description}")
        if action in ("crash", "power loss"):
            target.crash(power_loss=action == "power loss")
            loop.call_at(loop.time() + held, _restart, target, context=WORLD_CONTEXT)
        elif action == "cut":
            self._isolate(target, description, held)
        else:
            target.pause()
            loop.call_at(loop.time() + held, target.resume, context=WORLD_CONTEXT)

    def _isolate(self, target: SimProcess, description: str, held: float) -> None:
        """Cut ``target`` off from every process and the coordination service, both ways
        (it runs on, alone), impaired for the nemesis's rules until it heals."""
        network = self.world.network
        others = [p for p in self.world.processes if p != target.name] + [COORDINATION]
        for other in others:
            network.cut(target.name, other)
            network.cut(other, target.name)

        def heal() -> None:
            for other in others:
                network.heal(target.name, other)
                network.heal(other, target.name)

        assert self.nemesis is not None
        fault = ActiveFault("strike", description, heal, frozenset({target.name}))
        self.nemesis._record(fault, held)


def _restart(process: SimProcess) -> None:
    if not process.alive and not process.world.stopping:
        process.start()


def coverage_table(hits: list[Mapping[str, int]]) -> list[str]:
    """One line per registered point: its hits over the runs and in how many runs."""
    width = max(len(name) for name in POINTS)
    lines = [f"{'protocol point':<{width}} {'hits':>8} {'runs':>6}  what it marks"]
    for name, what in POINTS.items():
        total = sum(h.get(name, 0) for h in hits)
        runs = sum(1 for h in hits if h.get(name, 0))
        lines.append(f"{name:<{width}} {total:>8} {runs:>6}  {what}")
    missed = [name for name in POINTS if not any(h.get(name, 0) for h in hits)]
    lines.append(f"points never hit: {', '.join(missed)}" if missed else "every point was hit")
    return lines
