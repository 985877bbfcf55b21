"""Faults, fault profiles, and the nemesis that injects them.

A run has phases that keep it meaningful:

- *warm-up* (2 s): no faults;
- *safety*: faults one after another (they overlap), chosen by the profile's
  weights, under two rules: at most a minority of the storage nodes is impaired
  at once (crashed, paused, cut off from a server, or waiting for a restart after
  an fsync error), and at least one server is unimpaired. Nothing may be lost
  here, and the cluster should keep committing;
- *quorum* (profiles with ``quorum_faults``): one fault that breaks a quorum (a
  majority of the storage nodes down or cut off, a power cut of every storage
  node, every server down, a coordination outage longer than the session
  timeout), held a few seconds: the cluster stops, and must lose nothing;
- *heal*: every fault ends (crashed processes restart, paused ones resume, cuts
  heal); from here the liveness bounds run (:class:`~waltz_sim.checker.LivenessBounds`).

Adding a fault: a method ``_inject_<name>`` on :class:`Nemesis` that applies it
and returns an :class:`ActiveFault` (with what it impairs and how to heal it), a
weight in the profiles that use it, and a line in docs/simulation.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from waltz_sim.archive import ARCHIVE_WEIGHTS, ArchiveFaults
from waltz_sim.fault_kit import ActiveFault, restart
from waltz_sim.loop import WORLD_CONTEXT
from waltz_sim.membership import ReplicaChanges
from waltz_sim.net import COORDINATION
from waltz_sim.profiles import PROFILES, Profile, profile
from waltz_sim.storage_faults import StorageFaults

if TYPE_CHECKING:
    from waltz_sim.world import SimProcess, World

log = logging.getLogger(__name__)

WARM_UP = 2.0
DAMAGE_KINDS = frozenset(
    {"power_loss", "fsync_error", "damage", "damage_lagging", "lost_write", "corruption"}
    | {"read_error", "misdirected_write", "wiped_disk", "stale_restore", "damaged_rejoin"}
)
"""Faults that may cost a storage node what it acknowledged (``Nemesis.damaged_at``)."""
QUORUM_PHASE = 7.0
"""Seconds at the end of the fault phase kept for the quorum fault (held 3 to 6 s)."""


@dataclass
class NemesisStats:
    injected: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class Nemesis(StorageFaults, ArchiveFaults):
    """Injects a profile's faults into a world (see the module docstring)."""

    def __init__(self, world: World, rng: random.Random) -> None:
        self.world = world
        self.rng = rng
        self.profile = profile(world.config.faults)
        self.active: dict[ActiveFault, None] = {}
        self.stats = NemesisStats()
        self.healed_at: float | None = None
        self.object_store = world.object_store
        self.damaged_at: dict[str, float] = {}
        """When a fault of :data:`DAMAGE_KINDS` last struck each storage node."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.world.loop

    # -- the phases ---------------------------------------------------------------------

    def safety_end(self, until: float) -> float:
        """When the safety phase of a run that heals at ``until`` ends."""
        return until - QUORUM_PHASE if self.profile.quorum_faults else until

    async def run(self, until: float) -> None:
        profile = self.profile
        loop = self.loop
        if not profile.weights and not profile.quorum_faults:
            return
        await asyncio.sleep(WARM_UP)
        safety_end = until - QUORUM_PHASE if profile.quorum_faults else until
        if self.world.config.membership == "replace":
            changes = ReplicaChanges(self.world, self, self.world.rng("membership"))
            self.world.replica_changes = changes
            changes.start(safety_end)
        weights = dict(profile.weights)
        if weights and self.world.config.archive == "on":
            weights.update(ARCHIVE_WEIGHTS)
        while weights:
            await asyncio.sleep(self.rng.uniform(*profile.gap))
            if loop.time() >= safety_end:
                break
            if "stale_restore" in weights:
                self._keep_backups()
            self._inject_one(dict(weights))
        if profile.quorum_faults:
            held = self.rng.uniform(3.0, QUORUM_PHASE - 1.0)
            await asyncio.sleep(max(0.0, until - held - loop.time()))
            kind = self.rng.choice(profile.quorum_faults)
            damaged = self._lost_records()
            if kind.startswith("storage") and damaged:
                self.world.trace.add(
                    "fault",
                    f"no quorum fault ({kind}): {', '.join(damaged)} lost records and is not "
                    "repaired yet (with a majority down, beyond the guarantee)",
                )
            else:
                fault = getattr(self, f"_quorum_{kind}")(held)
                self._record(fault, held)
        await asyncio.sleep(max(0.0, until - loop.time()))
        self.heal_all()
        self.healed_at = loop.time()
        self.world.trace.add("fault", f"all faults healed ({self.stats.injected} injected)")

    def _inject_one(self, weights: dict[str, float]) -> None:
        while weights:
            kinds = list(weights)
            kind = self.rng.choices(kinds, [weights[k] for k in kinds])[0]
            duration = self.rng.uniform(0.5, 8.0)
            fault = getattr(self, f"_inject_{kind}")(duration)
            if fault is not None:
                self._record(fault, duration)
                return
            del weights[kind]  # no target fits the rules now: try another kind

    def _record(self, fault: ActiveFault, duration: float) -> None:
        self.stats.injected += 1
        self.stats.by_kind[fault.kind] = self.stats.by_kind.get(fault.kind, 0) + 1
        self.world.faults_injected = self.stats.injected
        self.world.fault_log.append(
            f"{self.loop.time() - self.world.started_at:.2f} {fault.description}"
        )
        self.world.trace.add("fault", f"inject {fault.description}")
        if fault.kind in DAMAGE_KINDS:
            self.damaged_at.update(dict.fromkeys(fault.impairs, self.loop.time()))
        self.active[fault] = None
        if fault.duration is not None:
            duration = fault.duration
        fault.timer = self.loop.call_at(
            self.loop.time() + duration, self._heal, fault, context=WORLD_CONTEXT
        )

    def _heal(self, fault: ActiveFault) -> None:
        if fault not in self.active:
            return
        del self.active[fault]
        if fault.timer is not None:
            fault.timer.cancel()
        self.world.trace.add("fault", f"heal {fault.description}")
        fault.heal()

    def heal_all(self) -> None:
        """End every fault: resume the paused processes, restart the dead ones."""
        for fault in list(self.active):
            self._heal(fault)
        for process in self.world.processes.values():
            if process.paused:
                process.resume()
        for process in self.world.processes.values():
            if not process.alive and process.kind != "admin":
                process.start()

    # -- the rules ------------------------------------------------------------------------

    def _impaired(self, kind: str) -> set[str]:
        names = {p.name for p in self.world.of_kind(kind) if not p.running and not p.retired}
        if kind == "storage":  # a disk whose damage is not repaired yet counts as down
            names |= {
                p.name
                for p in self.world.of_kind(kind)
                if (disk := self.world.disks.get(self.world.data_dir(p.name))) is not None
                and (disk.unrepaired or disk.pending_damage)
            }
        for fault in self.active:
            names |= {n for n in fault.impairs if n.startswith(kind)}
        return names

    def _allowed(self, impairs: set[str]) -> bool:
        """The safety phase's rules hold with ``impairs`` impaired too."""
        config = self.world.config
        storage = self._impaired("storage") | {n for n in impairs if n.startswith("storage")}
        servers = self._impaired("server") | {n for n in impairs if n.startswith("server")}
        return len(storage) <= (config.storage_nodes - 1) // 2 and len(servers) < config.servers

    def _pick(self, kinds: tuple[str, ...], *, running: bool = True) -> SimProcess | None:
        """A random process of ``kinds`` whose impairment the rules allow."""
        candidates = [
            p
            for p in self.world.processes.values()
            if p.kind in kinds and (p.running or not running) and self._allowed({p.name})
        ]
        return self.rng.choice(candidates) if candidates else None

    # -- process faults -------------------------------------------------------------------

    def _restartable(self, process: SimProcess, description: str, kind: str) -> ActiveFault:
        def heal() -> None:
            if process.paused:
                process.resume()
            if not process.alive:
                process.start()

        return ActiveFault(kind, description, heal, frozenset({process.name}))

    def _inject_crash(self, duration: float) -> ActiveFault | None:
        process = self._pick(("server", "storage", "client"))
        if process is None:
            return None
        process.crash()
        return self._restartable(process, f"crash {process.name} for {duration:.1f}s", "crash")

    def _inject_power_loss(self, duration: float) -> ActiveFault | None:
        process = self._pick(("storage",))
        if process is None:
            return None
        process.crash(power_loss=True)
        return self._restartable(
            process, f"power loss of {process.name} for {duration:.1f}s", "power_loss"
        )

    def _inject_pause(self, duration: float) -> ActiveFault | None:
        process = self._pick(("server", "storage", "client"))
        if process is None:
            return None
        process.pause()
        return self._restartable(process, f"pause {process.name} for {duration:.1f}s", "pause")

    # -- network faults ---------------------------------------------------------------------

    def _pair(self) -> tuple[str, str, set[str]] | None:
        """Two ends that talk, and what cutting them impairs."""
        world = self.world
        servers = [p.name for p in world.of_kind("server")]
        storage = [p.name for p in world.of_kind("storage")]
        clients = [p.name for p in world.of_kind("client")]
        choices = [
            ("server-storage", 3.0),
            ("client-server", 2.0),
            ("server-coordination", 1.5),
            ("client-coordination", 1.0),
        ]
        if len(servers) > 1:
            choices.append(("server-server", 0.5))
        kind = self.rng.choices([c for c, _ in choices], [w for _, w in choices])[0]
        if kind == "server-storage":
            a, b = self.rng.choice(servers), self.rng.choice(storage)
            impairs = {b}
        elif kind == "client-server":
            a, b = self.rng.choice(clients), self.rng.choice(servers)
            impairs = {a}
        elif kind == "server-server":
            a, b = self.rng.sample(servers, 2)
            impairs = set()
        elif kind == "server-coordination":
            a, b = self.rng.choice(servers), COORDINATION
            impairs = {a}
        else:
            a, b = self.rng.choice(clients), COORDINATION
            impairs = {a}
        if self.rng.random() < 0.5:
            a, b = b, a
        return (a, b, impairs) if self._allowed(impairs) else None

    def _inject_partition(self, duration: float) -> ActiveFault | None:
        pair = self._pair()
        if pair is None:
            return None
        a, b, impairs = pair
        network = self.world.network
        how = self.rng.choice(("both ways", "one way", "one way"))
        directions = [(a, b), (b, a)] if how == "both ways" else [(a, b)]
        for source, target in directions:
            network.cut(source, target)

        def heal() -> None:
            for source, target in directions:
                network.heal(source, target)

        arrow = "<->" if how == "both ways" else "->"
        return ActiveFault(
            "partition", f"cut {a} {arrow} {b} for {duration:.1f}s", heal, frozenset(impairs)
        )

    def _inject_isolate(self, duration: float) -> ActiveFault | None:
        process = self._pick(("server", "storage", "client"), running=False)
        if process is None:
            return None
        others = [p for p in self.world.processes if p != process.name] + [COORDINATION]
        network = self.world.network
        for other in others:
            network.cut(process.name, other)
            network.cut(other, process.name)

        def heal() -> None:
            for other in others:
                network.heal(process.name, other)
                network.heal(other, process.name)

        return ActiveFault(
            "isolate",
            f"isolate {process.name} for {duration:.1f}s",
            heal,
            frozenset({process.name}),
        )

    def _inject_slow_link(self, duration: float) -> ActiveFault | None:
        a, b, _ = self._pair() or (None, None, None)
        if a is None or b is None:
            return None
        extra = self.rng.uniform(0.02, 0.8)
        network = self.world.network
        network.slow(a, b, extra)
        network.slow(b, a, extra)

        def heal() -> None:
            network.unslow(a, b, extra)
            network.unslow(b, a, extra)

        return ActiveFault(
            "slow_link", f"slow link {a} <-> {b} (+{extra * 1000:.0f} ms) for {duration:.1f}s", heal
        )

    def _inject_reset(self, duration: float) -> ActiveFault | None:
        pairs = list(self.world.network.pairs.values())
        if not pairs:
            return None
        pair = self.rng.choice(pairs)
        self.world.network.reset(pair)
        return ActiveFault(
            "reset",
            f"reset connection {pair.a.process_name} -> {pair.b.process_name}",
            lambda: None,
        )

    def _inject_zombie(self, duration: float) -> ActiveFault | None:
        """A server cut off from coordination (not from storage or clients) for longer
        than its session: its partitions move while it still serves them, and clients
        hear of the move late (slow watches). Only fencing keeps its writes out."""
        process = self._pick(("server",))
        if process is None:
            return None
        world = self.world
        held = world.config.session_timeout * self.rng.uniform(1.3, 2.5)
        lag = self.rng.uniform(0.5, 2.0)
        network = world.network
        network.cut(process.name, COORDINATION)
        network.cut(COORDINATION, process.name)
        clients = [p.name for p in world.of_kind("client")]
        world.coordination.slow_watches(lag, clients)

        def heal() -> None:
            network.heal(process.name, COORDINATION)
            network.heal(COORDINATION, process.name)
            world.coordination.unslow_watches(lag, clients)

        return ActiveFault(
            "zombie",
            f"zombie {process.name}: cut from coordination for {held:.1f}s, clients' watches "
            f"+{lag:.1f}s",
            heal,
            frozenset({process.name}),
            duration=held,
        )

    # -- disk faults --------------------------------------------------------------------------

    def _disk_of(self, process: SimProcess) -> object:
        return self.world.disks.get(self.world.data_dir(process.name))

    def _inject_slow_fsync(self, duration: float) -> ActiveFault | None:
        storage = self.world.of_kind("storage")
        process = self.rng.choice(storage)
        disk = self.world.disks.get(self.world.data_dir(process.name))
        if disk is None:
            return None
        extra = self.rng.uniform(0.05, 2.0)
        disk.extra_fsync.append(extra)

        def heal() -> None:
            if extra in disk.extra_fsync:
                disk.extra_fsync.remove(extra)

        return ActiveFault(
            "slow_fsync",
            f"slow fsyncs on {process.name} (+{extra * 1000:.0f} ms) for {duration:.1f}s",
            heal,
        )

    def _inject_fsync_error(self, duration: float) -> ActiveFault | None:
        process = self._pick(("storage",))
        if process is None:
            return None
        disk = self.world.disks.get(self.world.data_dir(process.name))
        if disk is None:
            return None
        disk.failing_fsyncs += 1
        restart_after = min(duration, 4.0)

        def heal() -> None:
            disk.failing_fsyncs = 0
            # the supervisor restarts the node (a failed partition stays closed until then)
            process.crash()
            process.start()

        fault = ActiveFault(
            "fsync_error",
            f"fsync error on {process.name}, restarted after {restart_after:.1f}s",
            heal,
            frozenset({process.name}),
            duration=restart_after,
        )
        return fault

    def _inject_damage(self, duration: float) -> ActiveFault | None:
        """A storage node restarts and its start-up recovery finds records lost to
        damage: a range below intact records (repaired from a peer), or its tail
        (LOST_SESSION). One disk at a time, and counted as impaired until repaired."""
        process = self._pick(("storage",))
        if process is None:
            return None
        disk = self.world.disks.get(self.world.data_dir(process.name))
        if disk is None:
            return None
        process.crash()
        disk.pending_damage = True
        restart_after = min(duration, 3.0)
        return ActiveFault(
            "damage",
            f"damage on {process.name}'s disk, found at its restart in {restart_after:.1f}s",
            lambda: None if process.alive else restart([process]),
            frozenset({process.name}),
            duration=restart_after,
        )

    def _inject_damage_lagging(self, duration: float) -> ActiveFault | None:
        """Issue 27's interleaving, left to chance to finish: another replica falls behind
        on a slow link from one server (live, and quick to answer any other server), a
        moment later a storage node crashes and its restart finds damage (a lost tail or
        a hole), and the strikes of the ``points`` profile may kill that server when the
        damaged replica rejoins. Counted as one impaired storage node (the damaged one);
        the lagging one is slow, not down."""
        process = self._pick(("storage",))
        servers = self.world.of_kind("server")
        if process is None or not servers:
            return None
        disk = self.world.disks.get(self.world.data_dir(process.name))
        others = [p for p in self.world.of_kind("storage") if p is not process]
        if disk is None or not others:
            return None
        lagging = self.rng.choice(others)
        server = self.rng.choice(servers)
        extra = self.rng.uniform(1.0, 3.0)
        crash_after = self.rng.uniform(0.5, 2.0)
        restart_after = crash_after + min(duration, 3.0)
        network = self.world.network
        network.slow(server.name, lagging.name, extra)
        network.slow(lagging.name, server.name, extra)
        loop = self.loop

        healed: list[bool] = []

        def crash() -> None:
            if healed:  # the run's heal came first (it restarts nothing any more)
                return
            process.crash()
            disk.pending_damage = True

        def heal() -> None:
            healed.append(True)
            if not process.alive:
                restart([process])

        def unslow() -> None:
            network.unslow(server.name, lagging.name, extra)
            network.unslow(lagging.name, server.name, extra)

        loop.call_at(loop.time() + crash_after, crash, context=WORLD_CONTEXT)
        lag = ActiveFault(
            "slow_link",
            f"slow link {server.name} <-> {lagging.name} (+{extra * 1000:.0f} ms), a lagging "
            f"replica while {process.name} is damaged",
            unslow,
            duration=restart_after + self.rng.uniform(3.0, 8.0),
        )
        self._record(lag, restart_after)
        return ActiveFault(
            "damage_lagging",
            f"damage on {process.name}'s disk in {crash_after:.1f}s (beside a lagging "
            f"{lagging.name}), found at its restart in {restart_after:.1f}s",
            heal,
            frozenset({process.name}),
            duration=restart_after,
        )

    # -- coordination faults -------------------------------------------------------------

    def _inject_expire_session(self, duration: float) -> ActiveFault | None:
        process = self._pick(("server", "client"))
        if process is None:
            return None
        sessions = self.world.coordination.session_of(process.name)
        if not sessions:
            return None
        for session_id in sessions:
            self.world.coordination.expire(session_id)
        return ActiveFault(
            "expire_session",
            f"expire the coordination session of {process.name}",
            lambda: None,
            frozenset({process.name}),
        )

    def _inject_coordination_outage(self, duration: float) -> ActiveFault | None:
        service = self.world.coordination
        if not service.available:
            return None
        service.kill()
        return ActiveFault(
            "coordination_outage", f"coordination outage for {duration:.1f}s", service.restart
        )

    def _inject_slow_watches(self, duration: float) -> ActiveFault | None:
        """Watch notifications arrive late: to everyone, or only to the clients (which
        then keep using a partition's old generation while its servers moved on)."""
        service = self.world.coordination
        extra = self.rng.uniform(0.2, 3.0)
        clients = None
        if self.rng.random() < 0.5:
            clients = [p.name for p in self.world.of_kind("client")]
        service.slow_watches(extra, clients)
        who = "the clients'" if clients else "every"
        return ActiveFault(
            "slow_watches",
            f"slow watches for {who} watch (+{extra:.1f}s) for {duration:.1f}s",
            lambda: service.unslow_watches(extra, clients),
        )

    # -- quorum faults -------------------------------------------------------------------

    def _majority(self, kind: str) -> list[SimProcess]:
        members = self.world.of_kind(kind)
        count = len(members) // 2 + 1
        return self.rng.sample(members, count)

    def _crash_all(
        self, kind: str, victims: list[SimProcess], description: str, *, power_loss: bool = False
    ) -> ActiveFault:
        """Crash every one of ``victims`` at once; the heal restarts them."""
        for process in victims:
            process.crash(power_loss=power_loss)
        return ActiveFault(
            kind, description, lambda: restart(victims), frozenset(p.name for p in victims)
        )

    def _quorum_storage_majority_down(self, held: float) -> ActiveFault:
        victims = self._majority("storage")
        power = self.rng.random() < 0.5
        names = ", ".join(p.name for p in victims)
        how = "power loss of" if power else "crash"
        return self._crash_all(
            "storage_majority_down",
            victims,
            f"{how} {names} for {held:.1f}s (quorum lost)",
            power_loss=power,
        )

    def _quorum_storage_power_cut(self, held: float) -> ActiveFault:
        return self._crash_all(
            "storage_power_cut",
            self.world.of_kind("storage"),
            f"power cut of every storage node for {held:.1f}s",
            power_loss=True,
        )

    def _quorum_servers_down(self, held: float) -> ActiveFault:
        victims = [p for p in self.world.of_kind("server") if p.alive]
        return self._crash_all("servers_down", victims, f"every server down for {held:.1f}s")

    def _quorum_long_coordination_outage(self, held: float) -> ActiveFault:
        held = max(held, self.world.config.session_timeout * self.rng.uniform(1.2, 2.0))
        service = self.world.coordination
        service.kill()
        return ActiveFault(
            "long_coordination_outage",
            f"coordination outage of {held:.1f}s (longer than the session timeout)",
            service.restart,
        )

    def _quorum_storage_cut_off(self, held: float) -> ActiveFault:
        victims = self._majority("storage")
        servers = [p.name for p in self.world.of_kind("server")]
        network = self.world.network
        links = [(s, v.name) for s in servers for v in victims]
        for a, b in links:
            network.cut(a, b)
            network.cut(b, a)

        def heal() -> None:
            for a, b in links:
                network.heal(a, b)
                network.heal(b, a)

        return ActiveFault(
            "storage_cut_off",
            f"servers cut off from {', '.join(v.name for v in victims)} for {held:.1f}s",
            heal,
            frozenset(v.name for v in victims),
        )

    def _quorum_storage_majority_paused(self, held: float) -> ActiveFault:
        victims = self._majority("storage")
        for process in victims:
            process.pause()
        return ActiveFault(
            "storage_majority_paused",
            f"pause {', '.join(v.name for v in victims)} for {held:.1f}s",
            lambda: _resume(victims),
            frozenset(v.name for v in victims),
        )


def _resume(processes: list[SimProcess]) -> None:
    for process in processes:
        process.resume()


__all__ = ["PROFILES", "ActiveFault", "Nemesis", "Profile", "profile"]
