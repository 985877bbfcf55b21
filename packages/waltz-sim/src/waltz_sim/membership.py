"""Replica-set changes: a spare storage node replaces a replica during the run.

In a run with ``SimConfig.membership == "replace"`` the cluster has one more storage
node than replicas per partition (``storage-<n>``): known to the cluster
(``add_storage_node``), holding no replica at first. Once, in the safety phase (a
profile with faults), the run *replaces* a replica of one partition, or of every
partition, with the calls an operator makes (``waltz cluster add-replica`` /
``remove-replica``: ``ClusterAdmin``):

1. the spare's replica is added: the owner ends its store session and opens one over the
   larger set, whose recovery takes the new replica in (not a voter: it catches up).
   Half the time the spare's disk is slow meanwhile (a new node catching up on a busy
   disk); or (three runs in ten) the old replicas' fsyncs are a little slow and the
   spare crashes right after that recovery planned it (its ``recovery.voted`` point),
   before its storage holds the session's marks, and restarts 0.3 to 3 s later;
2. another replica is removed (the same node for every partition changed): at once after
   the add (as a script does), as soon as the session over the larger set opened, or 0.5
   to 3 s later. Until the store metadata names a set without it, the removed node counts
   as impaired for the nemesis's rules (the committed records it held may have their only
   other copies on the remaining ones, not yet on the new one); the removal waits until
   the rules allow it, the spare aside (it never acknowledged anything);
3. then, half the time, a while after, the removed replica is put back (added again: a
   replica that left and comes back behind); otherwise, when every partition was changed,
   half the time the removed node is decommissioned: stopped for good right after the
   removal (``SimProcess.retired``: never restarted, not counted as impaired).

What is judged at the end (:meth:`ReplicaChanges.final_sets`): the replicas of each
partition's final set, read back like any other (every one caught up to the committed
log); a removed replica not put back is not, except that no store session from the one
that first recorded a set without it may have raised its fence (``removed-written``). A
recovery that never completes after a change is seen by the liveness checks: the
partition's high-water mark is not answered at the end (``no-high-water-mark``), and the
fault-free throughput falls (``throughput``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import ConfigError, CoordinationError, SessionLostError
from waltz_server.cluster_admin import ClusterAdmin
from waltz_sim.fault_kit import ActiveFault
from waltz_sim.world import SimProcess, World

T = TypeVar("T")

LATEST = 6.0
"""Seconds before the end of the safety phase after which no replacement starts."""
RETRY = 0.25
"""Seconds between two attempts of a metadata call (or two looks at the rules)."""


def storage_count(config_storage_nodes: int, membership: str) -> int:
    """The storage processes of a run: one spare more when replicas are replaced
    (``SimConfig.storage_processes``)."""
    return config_storage_nodes + (1 if membership == "replace" else 0)


class Rules(Protocol):
    """What a replacement needs of the nemesis (``waltz_sim.faults.Nemesis``): its rules
    and its record of the faults."""

    @property
    def damaged_at(self) -> dict[str, float]: ...

    def _record(self, fault: ActiveFault, duration: float) -> None: ...

    def _heal(self, fault: ActiveFault) -> None: ...

    def _impaired(self, kind: str) -> set[str]: ...

    def _allowed(self, impairs: set[str]) -> bool: ...

    def _restartable(self, process: SimProcess, description: str, kind: str) -> ActiveFault: ...


@dataclass
class Removal:
    partition: int
    node: str
    """The storage process whose replica was removed."""
    first_session: int | None = None
    """The first store session over a set without it (None: not seen yet)."""
    put_back: bool = False


class ReplicaChanges:
    """The replacement of one run (see the module docstring), played by the nemesis."""

    def __init__(self, world: World, nemesis: Rules, rng: random.Random) -> None:
        self.world = world
        self.nemesis = nemesis
        self.rng = rng
        self.removals: list[Removal] = []
        self.task: asyncio.Task[None] | None = None
        self._opened = asyncio.Event()
        self._watched: set[int] = set()
        self._crash_at_vote = False
        self._added_at = 0.0
        """When the spare's replica was added."""
        self._client: Coordination | None = None
        self.failure: str | None = None
        """Why the replacement itself failed (a bug of the simulation, not of the code
        under test: ``run_seed`` reports it as the seed's error)."""

    @property
    def spare(self) -> SimProcess:
        return self.world.of_kind("storage")[-1]

    def start(self, safety_end: float) -> None:
        """Play the replacement at a time the seed draws in ``[now + 1, safety_end - LATEST]``,
        as a task of the ``admin`` process (its coordination client crosses the network)."""
        admin = self.world.processes["admin"]
        assert admin.incarnation is not None
        loop = self.world.loop
        at = self.rng.uniform(loop.time() + 1.0, max(loop.time() + 1.0, safety_end - LATEST))
        self.task = loop.create_task(
            self._play(at, safety_end), context=admin.incarnation.context.copy()
        )

    async def _play(self, at: float, safety_end: float) -> None:
        world = self.world
        await asyncio.sleep(max(0.0, at - world.loop.time()))
        try:
            await self._replace(safety_end)
        except _OutOfTime as exc:
            world.trace.add("fault", f"replica change given up: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of the simulation: the seed fails (runner)
            self.failure = f"the replica change failed: {type(exc).__name__}: {exc}"
            world.trace.add("error", self.failure)
        finally:
            if self._client is not None:
                await self._client.close()

    async def _admin(self) -> ClusterAdmin:
        """The admin's cluster metadata, on a coordination session of its own (a new one
        once it was lost: the admin is an operator's shell, it runs the command again)."""
        if self._client is None:
            world = self.world
            client = coordination_from_uri(
                world.coordination_uri, {"session_timeout": world.config.session_timeout}
            )
            try:
                await client.start()
            except BaseException:
                await client.close()
                raise
            self._client = client
        return ClusterAdmin(self._client)

    async def _replace(self, safety_end: float) -> None:
        world = self.world
        loop = world.loop
        rng = self.rng
        spare = self.spare
        spare_name = _node_name(spare)
        partitions = list(range(world.config.partitions))
        if rng.random() < 0.5:
            partitions = [rng.choice(partitions)]
        holders = [p for p in world.of_kind("storage") if p is not spare]
        old = rng.choice(holders)
        when = rng.choice(("at once", "at its session", "later"))
        put_back = rng.random() < 0.5
        which = ", ".join(str(p) for p in partitions)
        self._crash_at_vote = rng.random() < 0.3
        if self._crash_at_vote:  # the old replicas busy: the spare plans before they recover
            self._slow_disks(holders, rng.uniform(0.02, 0.3))
        elif rng.random() < 0.5:  # a new node catching up on a busy disk
            self._slow_disks([spare], rng.uniform(0.3, 2.0))
        self._opened = asyncio.Event()
        self._watched = set(partitions)
        self._added_at = loop.time()
        for partition in partitions:
            await self._retry(partial(_add, partition=partition, node=spare_name), safety_end)
        self._event(f"replica of partition {which} added on {spare.name}")
        if when == "at its session":  # the owner's session over the larger set opened
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._opened.wait(), max(0.0, safety_end - loop.time()))
        elif when == "later":
            await asyncio.sleep(rng.uniform(0.5, 3.0))
        while not self._removable(old):
            if loop.time() >= safety_end:
                raise _OutOfTime(f"{old.name} could not be removed within the rules")
            await asyncio.sleep(RETRY)
        impaired = ActiveFault(
            "replace_replica",
            f"remove the replica of partition {which} on {old.name} (replaced by {spare.name}, "
            f"{when} after the add)",
            lambda: None,
            frozenset({old.name}),
            duration=3600.0,  # healed once a session over the new set recorded it
        )
        self.nemesis._record(impaired, 3600.0)
        removals = [Removal(partition, old.name) for partition in partitions]
        self.removals.extend(removals)
        for partition in partitions:
            await self._retry(
                partial(_remove, partition=partition, node=_node_name(old)), safety_end
            )
        if len(partitions) == world.config.partitions and not put_back and rng.random() < 0.5:
            # it holds no replica any more: the operator stops it for good (a session of
            # the old set still recovering may wait for it for ever)
            old.retired = True
            old.crash()
            self._event(f"{old.name} decommissioned (stopped for good)")
        for removal in removals:
            removal.first_session = await self._retry(
                partial(_first_session_without, partition=removal.partition, node=_node_name(old)),
                None,
            )
        self.nemesis._heal(impaired)
        self._event(f"partitions {which}: a store session over the set without {old.name}")
        if not put_back:
            return
        await asyncio.sleep(rng.uniform(1.0, 4.0))
        if loop.time() >= safety_end - 1.0:
            return
        for removal in removals:
            await self._retry(
                partial(_add, partition=removal.partition, node=_node_name(old)), safety_end
            )
            removal.put_back = True
        self._event(f"replica of partition {which} put back on {old.name}")

    def _removable(self, old: SimProcess) -> bool:
        """The nemesis's rule with ``old`` impaired too (it holds committed records, some
        maybe on one other replica only until a session over the new set recorded it),
        the spare aside: it never acknowledged anything, and until the session after the
        add wrote its marks its storage reads LOST_SESSION (a fenced pristine partition),
        which the rule counts as damage. Only that is excused: a spare a fault impairs
        (down, or damaged since it acknowledged records) counts like any replica."""
        storage = self.nemesis._impaired("storage") | {old.name}
        if self._spare_excused():
            storage.discard(self.spare.name)
        return len(storage) <= (self.world.config.storage_nodes - 1) // 2

    def _spare_excused(self) -> bool:
        """No fault that may cost a node what it acknowledged struck the spare since
        its replica was added (then its damage is real, not a pristine partition's)."""
        return self.nemesis.damaged_at.get(self.spare.name, -1.0) < self._added_at

    def on_point(self, name: str, detail: Mapping[str, object]) -> None:
        """A protocol point was hit: a store session of a partition being changed opened."""
        if name == "store.session_opened" and detail.get("partition") in self._watched:
            self._opened.set()
        elif (
            name == "recovery.voted"
            and self._crash_at_vote
            and detail.get("partition") in self._watched
            and detail.get("replica") == _node_name(self.spare)
        ):
            self._crash_at_vote = False
            self._crash_spare()

    def _crash_spare(self) -> None:
        """The spare dies right after its first recovery planned it (before its marks),
        and restarts a while later."""
        spare = self.spare
        if not spare.running or not self.nemesis._allowed({spare.name}):
            return
        spare.crash()
        held = self.rng.uniform(0.3, 3.0)
        fault = self.nemesis._restartable(
            spare, f"crash {spare.name} at its first vote for {held:.1f}s", "crash"
        )
        self.nemesis._record(fault, held)

    def _slow_disks(self, nodes: list[SimProcess], extra: float) -> None:
        """Slow the fsyncs of ``nodes`` by ``extra`` seconds for a few seconds."""
        for node in nodes:
            disk = self.world.disks.get(self.world.data_dir(node.name))
            if disk is None:
                continue
            disk.extra_fsync.append(extra)
            self.nemesis._record(
                ActiveFault(
                    "slow_fsync",
                    f"slow fsyncs on {node.name} (+{extra * 1000:.0f} ms) while a replica is added",
                    partial(_unslow, disk.extra_fsync, extra),
                ),
                self.rng.uniform(2.0, 6.0),
            )

    def _event(self, text: str) -> None:
        world = self.world
        world.fault_log.append(f"{world.loop.time() - world.started_at:.2f} {text}")
        world.trace.add("fault", text)

    async def _retry(self, call: Callable[[ClusterAdmin], Awaitable[T]], until: float | None) -> T:
        """``call`` until it answers (the coordination service may be down or cut off for a
        while, the admin's session lost); past ``until`` (virtual time), :class:`_OutOfTime`."""
        loop = self.world.loop
        while True:
            try:
                return await call(await self._admin())
            except (CoordinationError, _NotYet, OSError) as exc:
                if until is not None and loop.time() >= until:
                    raise _OutOfTime(f"{type(exc).__name__}: {exc}") from exc
                if self.world.stopping:
                    raise
                if isinstance(exc, SessionLostError) and self._client is not None:
                    client, self._client = self._client, None
                    await client.close()
                await asyncio.sleep(RETRY)

    async def final_sets(self) -> dict[int, list[str]]:
        """Each partition's replica set at the end (storage process names)."""
        world = self.world
        coordination = coordination_from_uri(
            world.coordination_uri, {"session_timeout": world.config.session_timeout}
        )
        await coordination.start()
        try:
            assignments = await ClusterAdmin(coordination).replica_assignments()
        finally:
            await coordination.close()
        return {
            partition: [n.split(":", maxsplit=1)[0] for n in assignments.replicas_of(partition)]
            for partition in range(world.config.partitions)
        }

    def removed(self, partition: int, fences: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """The removed replicas of ``partition`` not put back, whose first session without
        them is known: node -> (the fence its storage holds at the end, that session)."""
        return {
            r.node: (fences[r.node], r.first_session)
            for r in self.removals
            if r.partition == partition
            and not r.put_back
            and r.first_session is not None
            and r.node in fences
        }

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class _OutOfTime(Exception):
    """A replica change could not be made in the safety phase."""


class _NotYet(Exception):
    """No store session over the new replica set yet."""


def _node_name(process: SimProcess) -> str:
    return World.storage_node_name(int(process.name.rsplit("-", maxsplit=1)[1]))


def _unslow(extra_fsync: list[float], extra: float) -> None:
    if extra in extra_fsync:
        extra_fsync.remove(extra)


async def _add(admin: ClusterAdmin, *, partition: int, node: str) -> None:
    await admin.add_replica(partition, node)


async def _remove(admin: ClusterAdmin, *, partition: int, node: str) -> None:
    """Remove ``node``'s replica; done already (an earlier attempt whose answer was lost)
    is done."""
    try:
        await admin.remove_replica(partition, node)
    except ConfigError:
        if node in (await admin.replica_assignments()).replicas_of(partition):
            raise


async def _first_session_without(admin: ClusterAdmin, *, partition: int, node: str) -> int:
    """The store session whose replica states first name a set without ``node``."""
    stored = (await admin.store_metadata(partition)).value
    if any(state.replica_id.storage_node == node for state in stored.replicas):
        raise _NotYet(f"partition {partition}: no store session without {node} yet")
    return stored.session_id


__all__ = ["Removal", "ReplicaChanges", "storage_count"]
