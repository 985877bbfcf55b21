"""The simulated world: a whole cluster of real components in one loop, and its end.

A :class:`World` holds the simulated contracts (the network, the coordination
service, the disks), the processes (storage nodes, servers, clients, and an
``admin`` that creates the cluster and reads it back at the end), the history the
clients record, and the trace. :meth:`World.run` plays a whole run:

1. the admin creates the cluster metadata; storage nodes and servers start
   (``waltz_server``'s own ``start_node`` and ``start_server``, on the ``sim``
   plugins); once every partition has an owner, the clients start (``waltz_client``'s
   ``AsyncWaltzClient``, each with a database that survives its crashes) and run the
   workload;
2. the nemesis (:mod:`waltz_sim.faults`) injects the profile's faults, then heals
   everything;
3. in the quiet phase the workload goes on without faults; the submissions stop;
4. the admin reads every partition's high-water mark and log through a client
   (range reads), the replicas are read from the disks, the clients' databases are
   taken, and the checker (:mod:`waltz_sim.checker`) judges the whole run.

Every random choice comes from streams derived from the seed by name
(:meth:`World.rng`), so a component that draws more or fewer numbers does not
shift the others' draws.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import WaltzError
from waltz_api.plugins import get_registry
from waltz_server.cluster_admin import ClusterAdmin
from waltz_sim.access import READER, access_control, refused
from waltz_sim.archive import ObjectStore, read_archive, server_section
from waltz_sim.archive import register as register_archive
from waltz_sim.checker import (
    FAIL,
    ClientSnapshot,
    ClusterSnapshot,
    History,
    PartitionSnapshot,
    StoredRecord,
)
from waltz_sim.config import THROUGHPUT_FLOOR, SimConfig
from waltz_sim.coord import SimCoordinationService
from waltz_sim.disk import Disk
from waltz_sim.history import HistoryRecorder
from waltz_sim.loop import (
    WORLD_CONTEXT,
    Incarnation,
    ProcessState,
    SimLoop,
    SimulationError,
)
from waltz_sim.net import SimNetwork
from waltz_sim.profiles import profile
from waltz_sim.trace import Trace

log = logging.getLogger(__name__)

STORAGE_PORT = 5500
SIM_ENGINES = {"fs": "sim-fs"}
"""``SimConfig.storage_engine`` -> the plugin the storage nodes run: ``fs`` is the real fs
engine on the simulated disks (``waltz_sim.fsdisk``), registered as ``sim-fs``."""
GC_INTERVAL = 5.0
"""Virtual seconds between garbage collections (automatic collection is off)."""
SETTLE = 4.0
"""Virtual seconds after the heal before the throughput is held to its floor again
(crashed processes restart, recoveries run, clients mount again)."""
CATCH_UP = 3.0
"""Virtual seconds between the end of the submissions (or of the drain) and the
read-back: the clients' feeds deliver the last commits."""


@dataclass(eq=False)
class SimProcess:
    """A simulated process: what it runs, and its successive incarnations."""

    world: World
    name: str
    kind: str
    main: Callable[[SimProcess], Awaitable[None]]
    restart_on_exit: bool = True
    incarnation: Incarnation | None = None
    incarnations: int = 0
    handle: Any = None
    """What its main made available (the storage node, the running server, the client)."""
    retired: bool = False
    """Stopped for good (a storage node decommissioned after its replicas were removed):
    never started again, not counted as impaired."""

    @property
    def alive(self) -> bool:
        return self.incarnation is not None and self.incarnation.alive

    @property
    def running(self) -> bool:
        return self.incarnation is not None and self.incarnation.running

    @property
    def paused(self) -> bool:
        return self.incarnation is not None and self.incarnation.state is ProcessState.PAUSED

    def start(self) -> Incarnation | None:
        if self.retired:
            return None
        if self.alive:
            raise SimulationError(f"{self.name} is running already")
        self.incarnations += 1
        incarnation = Incarnation(self, self.incarnations)
        self.incarnation = incarnation
        self.handle = None
        self.world.trace.add("process", f"start {incarnation.name}", source="world")
        self.world.loop.create_task(self._run(incarnation), context=incarnation.context)
        return incarnation

    async def _run(self, incarnation: Incarnation) -> None:
        try:
            await self.main(self)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.world.trace.add("exit", f"{incarnation.name} failed: {type(exc).__name__}: {exc}")
            self.world.exits += 1
            if self.incarnation is incarnation and incarnation.alive:
                self._stop(incarnation, power_loss=False)
                if self.restart_on_exit and not self.world.stopping:
                    self.world.loop.call_at(
                        self.world.loop.time() + 1.0,
                        self._supervise,
                        incarnation,
                        context=WORLD_CONTEXT,
                    )

    def _supervise(self, previous: Incarnation) -> None:
        if self.incarnation is previous and not self.alive and not self.world.stopping:
            self.start()

    def crash(self, *, power_loss: bool = False) -> None:
        """kill -9 (or a power loss): memory, connections and unsynced writes are gone."""
        incarnation = self.incarnation
        if incarnation is None or not incarnation.alive:
            return
        self.world.trace.add(
            "process", f"{'power loss' if power_loss else 'crash'} {incarnation.name}", "world"
        )
        self._stop(incarnation, power_loss)

    def _stop(self, incarnation: Incarnation, power_loss: bool) -> None:
        incarnation.state = ProcessState.DEAD
        incarnation.parked.clear()
        for resource in incarnation.resources:
            resource.on_crash(power_loss)
        if power_loss:
            disk = self.world.disks.get(self.world.data_dir(self.name))
            if disk is not None:
                lost = disk.lose_power()
                if lost:
                    self.world.trace.add("disk", f"{self.name}: {lost}", "world")
        self.world.history_crashed(self.name)
        for task in list(incarnation.tasks):
            task.cancel()

    def pause(self) -> None:
        incarnation = self.incarnation
        if incarnation is None or incarnation.state is not ProcessState.RUNNING:
            return
        self.world.trace.add("process", f"pause {incarnation.name}", "world")
        incarnation.state = ProcessState.PAUSED
        incarnation.pause_epoch += 1
        for resource in incarnation.resources:
            resource.on_pause()

    def resume(self) -> None:
        incarnation = self.incarnation
        if incarnation is None or incarnation.state is not ProcessState.PAUSED:
            return
        self.world.trace.add("process", f"resume {incarnation.name}", "world")
        incarnation.state = ProcessState.RUNNING
        self.world.loop.resume_parked(incarnation)
        for resource in incarnation.resources:
            resource.on_resume()


class PointHandler(Protocol):
    """Hears a protocol point (``waltz_api.faultpoints``): the runner's ``PointStriker``."""

    def __call__(self, name: str, detail: Mapping[str, object]) -> None: ...


def _no_strike(name: str, detail: Mapping[str, object]) -> None:
    return None


class FaultDriver(Protocol):
    """What plays a run's faults (``waltz_sim.faults.Nemesis``, set by the runner)."""

    @property
    def healed_at(self) -> float | None: ...

    async def run(self, until: float) -> None: ...

    def heal_all(self) -> None: ...


class ReplicaSetChanges(Protocol):
    """A run's replica-set changes (``waltz_sim.membership.ReplicaChanges``)."""

    @property
    def failure(self) -> str | None: ...

    def on_point(self, name: str, detail: Mapping[str, object]) -> None: ...

    async def final_sets(self) -> dict[int, list[str]]: ...

    def removed(self, partition: int, fences: Mapping[str, int]) -> dict[str, tuple[int, int]]: ...


class World:
    """See the module docstring."""

    def __init__(self, config: SimConfig, loop: SimLoop) -> None:
        self.config = config
        self.loop = loop
        self.name = f"seed{config.seed}"
        self.trace = Trace(loop)
        self.network = SimNetwork(self, self.rng("network"), config.network)
        self.coordination = SimCoordinationService(self, self.rng("coordination"))
        self.disk_rng = self.rng("disk")
        self.disks: dict[str, Disk] = {}
        self.object_store = ObjectStore(self.rng("archive"))
        """The archive's object store (used in ``archive`` seeds): it outlives the servers."""
        self.processes: dict[str, SimProcess] = {}
        self.history = HistoryRecorder(loop, self.trace)
        self.transport_uids = itertools.count(1)
        self.cluster_key = uuid.UUID(int=self.rng("cluster-key").getrandbits(128), version=4)
        self.stopping = False
        self.exits = 0
        self.loop_errors: list[str] = []
        self.started_at = loop.time()
        self.healed_at: float | None = None
        self.submissions_end = loop.time() + config.duration
        self.run_end = loop.time() + config.duration
        """When the read-back starts (the workload stops submitting ``CATCH_UP`` s before;
        later when the drain of the open ops took longer than a second)."""
        self.drained_at: float | None = None
        self.scripted = False
        self.faults_injected = 0
        self.fault_log: list[str] = []
        self.points: PointHandler = _no_strike
        """Hears every protocol point (after the history): the runner's ``PointStriker``."""
        self.nemesis: FaultDriver | None = None
        """Plays the faults of the run: set before :meth:`run` (the runner's ``Nemesis``)."""
        self.client_databases: dict[str, Any] = {}
        self.snapshot: ClusterSnapshot | None = None
        self.replica_changes: ReplicaSetChanges | None = None
        """The replica set changes of the run (``SimConfig.membership``), set by the nemesis."""
        self.ready_at: float | None = None
        from waltz_sim.workloads import make_workload

        self.workload = make_workload(config.workload, self)
        self.workload.flush_rate = profile(config.faults).client_flushes
        loop.set_exception_handler(self._loop_exception)

    # -- randomness -------------------------------------------------------------------------

    def rng(self, name: str) -> random.Random:
        """An independent random stream for ``name``, derived from the seed."""
        return random.Random(f"waltz-sim:{self.config.seed}:{name}")

    # -- names --------------------------------------------------------------------------------

    @property
    def coordination_uri(self) -> str:
        return f"sim://{self.name}/waltz"

    @staticmethod
    def storage_node_name(index: int) -> str:
        return f"storage-{index}:{STORAGE_PORT}"

    def data_dir(self, process: str) -> str:
        return f"{self.name}/{process}"

    def of_kind(self, kind: str) -> list[SimProcess]:
        return [p for p in self.processes.values() if p.kind == kind]

    # -- hooks from the simulated contracts ---------------------------------------------------

    def coordination_links_changed(self) -> None:
        self.coordination.reevaluate()

    def history_crashed(self, process: str) -> None:
        self.history.crashed(process)

    def on_point(self, name: str, detail: Mapping[str, object]) -> None:
        """The handler of the protocol points (``waltz_api.faultpoints``): the history
        notes the store sessions, the striker counts the point (and may strike)."""
        self.history.point(name, detail)
        self.points(name, detail)
        if self.replica_changes is not None:
            self.replica_changes.on_point(name, detail)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        exc = context.get("exception")
        if "was destroyed but it is pending" in message or "never retrieved" in message:
            return  # garbage of crashed processes; not part of the story
        text = f"{message}: {type(exc).__name__}: {exc}" if exc is not None else message
        self.loop_errors.append(text)
        self.trace.add("error", f"event loop: {text}")

    # -- the processes --------------------------------------------------------------------------

    def add_process(
        self, name: str, kind: str, main: Callable[[SimProcess], Awaitable[None]], **kw: Any
    ) -> SimProcess:
        process = SimProcess(self, name, kind, main, **kw)
        self.processes[name] = process
        return process

    async def _storage_main(self, process: SimProcess) -> None:
        from waltz_storage_node.config import load_storage_config
        from waltz_storage_node.main import start_node

        config = load_storage_config(
            None,
            env={},
            overrides={
                "storage": {
                    "data_dir": self.data_dir(process.name),
                    "engine": SIM_ENGINES.get(
                        self.config.storage_engine, self.config.storage_engine
                    ),
                    "cluster_key": str(self.cluster_key),
                    "num_partitions": self.config.partitions,
                    "partitions": list(range(self.config.partitions)),
                },
                "transport": {
                    "plugin": "sim",
                    "endpoint": f"sim://{process.name}:{STORAGE_PORT}",
                },
            },
        )
        process.handle = await start_node(config)
        await _forever()

    async def _server_main(self, process: SimProcess) -> None:
        from waltz_server.server.config import load_server_config
        from waltz_server.server.main import start_server

        archive_options: dict[str, Any] = {}
        if self.config.archive == "on":
            archive_options["archive"] = server_section(self.name)
        config = load_server_config(
            None,
            env={},
            overrides={
                "coordination": {
                    "uri": self.coordination_uri,
                    "options": {"session_timeout": self.config.session_timeout},
                },
                "transport": {
                    "plugin": "sim",
                    "endpoint": f"sim://{process.name}",
                    "storage_endpoint": "sim://{}",
                },
                "server": {
                    "lock_table": self.config.lock_table,
                    **profile(self.config.faults).server_options,
                    **self.config.server_options,
                    **archive_options,
                },
            },
        )
        assert process.incarnation is not None
        rng = self.rng(f"{process.incarnation.name}")
        process.handle = await start_server(config, rng=rng)
        await _forever()

    # -- the run -----------------------------------------------------------------------------------

    async def run(self, script: Callable[[World], Coroutine[Any, Any, None]] | None = None) -> None:
        """The whole run. With ``script`` (a scripted scenario, :mod:`waltz_sim.scenario`)
        the script places the faults instead of the nemesis: it starts before the cluster
        does (to see every log record), and when it returns everything is healed (as the
        nemesis heals at its end) and the quiet phase follows."""
        config = self.config
        nemesis = self.nemesis
        if nemesis is None:
            raise SimulationError("no fault driver: set World.nemesis first (waltz_sim.runner.arm)")
        _register_plugins()
        admin = self.add_process("admin", "admin", _idle, restart_on_exit=False)
        admin.start()
        scripted = None
        if script is not None:
            self.scripted = True
            self.submissions_end = float("inf")  # until the script is done
            scripted = self.loop.create_task(script(self), context=WORLD_CONTEXT)
        for i in range(config.storage_processes):
            self.add_process(f"storage-{i}", "storage", self._storage_main)
        for i in range(config.servers):
            self.add_process(f"server-{i}", "server", self._server_main)
        for i in range(config.clients):
            self.add_process(f"client-{i}", "client", self.workload.client_main)
        await self._in(admin, self._create_cluster())
        for process in self.of_kind("storage"):
            process.start()
        for process in self.of_kind("server"):
            process.start()
        await self._in(admin, self._wait_assigned())
        self.ready_at = self.loop.time()
        self.trace.add("world", "every partition has an owner: clients start")
        for process in self.of_kind("client"):
            process.start()
        end = self.run_end = self.started_at + config.duration
        if scripted is None:
            self.submissions_end = end - CATCH_UP
        else:
            self.run_end = float("inf")  # until the script is done
        gc_task = self.loop.create_task(self._collect_garbage(), context=WORLD_CONTEXT)
        if scripted is None:
            await nemesis.run(until=end - config.quiet)
            self.healed_at = nemesis.healed_at
        else:
            await scripted
            nemesis.heal_all()
            self.healed_at = self.loop.time()
            self.trace.add("fault", "the script is done: everything healed")
            end = self.run_end = max(end, self.healed_at + config.quiet)
            self.submissions_end = end - CATCH_UP
        await asyncio.sleep(max(0.0, self.submissions_end - self.loop.time()))
        drained_at = await self._drain()
        end = self.run_end = max(end, drained_at + CATCH_UP - 1.0)
        await asyncio.sleep(max(0.0, end - self.loop.time()))
        self.trace.add("world", "end of the run: reading the cluster back")
        self.snapshot = await self._in(admin, self._read_back())
        gc_task.cancel()

    async def _drain(self) -> float:
        """The clients stopped starting ops: wait until every open op is answered, for the
        decision deadline at most (and a second: an answer at its deadline counts)."""
        history = self.history
        opened = len(history.pending)
        if opened:
            bound = self.submissions_end + self.config.liveness.decision_deadline + 1.0
            self.trace.add(
                "world",
                f"drain: the clients stopped submitting; {opened} ops open, waiting for their "
                f"answers until {bound - self.started_at:.1f}",
            )
            if await history.drain(bound):
                self.trace.add("world", "drain: every op is answered")
            else:
                self.trace.add("world", f"drain: {len(history.pending)} ops still open")
        self.drained_at = self.loop.time()
        return self.drained_at

    async def _in(self, process: SimProcess, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` as a task of ``process`` and wait for it."""
        assert process.incarnation is not None

        async def wrapper() -> Any:
            return await coro

        task = self.loop.create_task(wrapper(), context=process.incarnation.context.copy())
        return await task

    async def _create_cluster(self) -> None:
        coordination = coordination_from_uri(
            self.coordination_uri, {"session_timeout": self.config.session_timeout}
        )
        await coordination.start()
        try:
            await ClusterAdmin(coordination).create_cluster(
                num_partitions=self.config.partitions,
                num_replicas=self.config.storage_nodes,
                storage_nodes=[self.storage_node_name(i) for i in range(self.config.storage_nodes)],
                cluster_key=self.cluster_key,
            )
            if self.config.membership == "replace":  # the spare: no replica yet
                spare = self.storage_node_name(self.config.storage_nodes)
                await ClusterAdmin(coordination).add_storage_node(spare)
            if self.config.acl == "on":
                acl = access_control(self.config.clients, self.config.partitions)
                await ClusterAdmin(coordination).change_access_control(lambda _: acl)
        finally:
            await coordination.close()

    async def _wait_assigned(self) -> None:
        coordination = coordination_from_uri(
            self.coordination_uri, {"session_timeout": self.config.session_timeout}
        )
        await coordination.start()
        try:
            metadata = ClusterAdmin(coordination)
            deadline = self.loop.time() + 60.0
            while self.loop.time() < deadline:
                owners = [
                    (await metadata.partition_assignment(p)).value.server_id
                    for p in range(self.config.partitions)
                ]
                if all(owner >= 0 for owner in owners):
                    return
                await asyncio.sleep(0.1)
            raise SimulationError("the partitions got no owner within 60 s of the start")
        finally:
            await coordination.close()

    async def _collect_garbage(self) -> None:
        """The young generations only (cheap); what survives waits for the end of the run."""
        while self.loop.time() < self.run_end:
            await asyncio.sleep(GC_INTERVAL)
            gc.collect(1)

    # -- the end -----------------------------------------------------------------------------------

    async def _read_back(self) -> ClusterSnapshot:
        """The cluster as the end finds it: the committed log of each partition through a
        client (high-water mark, range reads), and every replica read from its disk."""
        from waltz_client import AsyncWaltzClient, ClientConfig
        from waltz_sim.workloads import ReadOnlyCallbacks, stored_record

        served: dict[int, tuple[int | None, list[StoredRecord] | None]] = {}
        client = AsyncWaltzClient(
            ReadOnlyCallbacks(),
            ClientConfig(
                coordination=self.coordination_uri,
                coordination_options={"session_timeout": self.config.session_timeout},
                transport="sim",
                transport_options={"identity": READER},
                request_timeout=self.config.request_timeout,
            ),
            rng=self.rng("read-back"),
        )
        try:
            await asyncio.wait_for(client.start(), 20.0)
            for partition in range(self.config.partitions):
                served[partition] = await self._read_partition(client, partition)
        except (WaltzError, TimeoutError) as exc:
            self.trace.add("world", f"the read-back failed: {type(exc).__name__}: {exc}")
        finally:
            self.stopping = True
            await client.close()
        changes = self.replica_changes
        final = await changes.final_sets() if changes is not None else None
        snapshot = ClusterSnapshot()
        disks = {
            process.name: await self.disks[self.data_dir(process.name)].read_back()
            for process in self.of_kind("storage")
            if self.data_dir(process.name) in self.disks
        }
        for partition in range(self.config.partitions):
            high, records = served.get(partition, (None, None))
            replicas = {
                name: [stored_record(r) for r in contents.get(partition, [])]
                for name, contents in disks.items()
                if final is None or name in final[partition]
            }
            snapshot.partitions[partition] = PartitionSnapshot(partition, high, replicas, records)
            if self.config.archive == "on":
                await self._read_archive(snapshot.partitions[partition])
            if changes is not None:
                fences = {
                    name: self.disks[self.data_dir(name)].fences.get(partition, -1)
                    for name in disks
                }
                snapshot.partitions[partition].removed = changes.removed(partition, fences)
        return snapshot

    async def _read_archive(self, snapshot: PartitionSnapshot) -> None:
        """The partition's archive, as the mark names it, into ``snapshot``."""
        from waltz_sim.workloads import stored_record

        coordination = coordination_from_uri(
            self.coordination_uri, {"session_timeout": self.config.session_timeout}
        )
        await coordination.start()
        try:
            url = server_section(self.name)["url"]
            records = await read_archive(coordination, url, snapshot.partition)
            snapshot.archived = [stored_record(r) for r in records]
        except WaltzError as exc:
            snapshot.archive_error = f"{type(exc).__name__}: {exc}"
        finally:
            await coordination.close()
        self.trace.add(
            "world",
            f"partition {snapshot.partition}: {len(snapshot.archived)} records in the archive"
            + (f" ({snapshot.archive_error})" if snapshot.archive_error else ""),
        )

    async def _read_partition(
        self, client: Any, partition: int
    ) -> tuple[int | None, list[StoredRecord] | None]:
        from waltz_sim.workloads import stored_record

        try:
            high = await client.high_water_mark(partition, timeout=15.0)
        except (WaltzError, TimeoutError) as exc:
            self.trace.add("world", f"partition {partition}: no high-water mark: {exc}")
            return None, None
        records: list[StoredRecord] = []
        try:
            while len(records) <= high:
                _, batch = await client.range_read(partition, len(records), max_records=1000)
                if not batch:
                    break
                records.extend(stored_record(r) for r in batch)
        except (WaltzError, TimeoutError) as exc:
            self.trace.add("world", f"partition {partition}: range read failed: {exc}")
            return high, None
        return high, records[: high + 1]

    def history_snapshot(self) -> History:
        clients = [
            ClientSnapshot(name, partition, db.high_water_marks[partition], db.states[partition])
            for name, db in sorted(self.client_databases.items())
            for partition in sorted(db.states)
        ]
        return History(
            ops=list(self.history.ops),
            feed=list(self.history.feed),
            clients=clients,
            start_time=self.started_at,
            end_time=self.loop.time(),
            healed_at=self.healed_at,
            submissions_end=self.submissions_end,
            drained=self.drained_at is not None,
            lock_failures=list(self.history.lock_failures),
            sessions=list(self.history.sessions.values()),
            lock_table=self.config.lock_table,
            baseline=self._baseline(),
            offered_rate=self._offered_rate(),
            refused=self._refused(),
        )

    def _refused(self) -> frozenset[tuple[str, int]] | None:
        if self.config.acl != "on":
            return None
        return refused(self.config.clients, self.config.partitions)

    def _offered_rate(self) -> float:
        """What the clients offer that the ACL lets them write (ops spread evenly)."""
        config = self.config
        pairs = config.clients * config.partitions
        allowed = pairs - len(self._refused() or ())
        return config.clients * config.ops_per_second * allowed / pairs

    def _baseline(self) -> list[tuple[float, float]]:
        """The fault-free windows where the throughput is held to its floor: from the
        clients' start to the first fault (the warm-up; the whole run without faults),
        and the quiet end once the cluster settled after the heal (``SETTLE``)."""
        if self.ready_at is None:
            return []
        windows = []
        if not self.scripted:  # a script's faults are not in the fault log
            first = min(
                (self.started_at + float(line.split(maxsplit=1)[0]) for line in self.fault_log),
                default=self.submissions_end,
            )
            windows.append((self.ready_at, min(first, self.submissions_end)))
        if self.healed_at is not None:
            windows.append((self.healed_at + SETTLE, self.submissions_end))
        return [(start, end) for start, end in windows if end > start]

    def shutdown(self) -> None:
        """Crash every process (nothing of theirs runs after this)."""
        self.stopping = True
        for process in self.processes.values():
            incarnation = process.incarnation
            if incarnation is not None and incarnation.alive:
                incarnation.state = ProcessState.DEAD
                for resource in incarnation.resources:
                    resource.on_crash(False)


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


async def _idle(process: SimProcess) -> None:
    await _forever()


def _register_plugins() -> None:
    """The ``sim`` plugins, registered by the simulation itself (never by entry point:
    they exist only inside a simulated process, so no user should see them)."""
    from waltz_sim.plugin import PLUGINS

    register_archive()
    registry = get_registry()
    if registry.manager.get_plugin("waltz_sim") is None:
        registry.register(PLUGINS, name="waltz_sim")


__all__ = ["FAIL", "THROUGHPUT_FLOOR", "SimConfig", "SimProcess", "World"]
